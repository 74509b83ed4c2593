// `frugal generate` and `frugal evaluate` on run folders, as a user runs them: a tiny gpt
// trained through the CLI on a corpus the test writes; refusals name the folder and why.
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "gpt_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

std::string gpt_config(const std::string& corpus, const std::string& out) {
  return "[run]\nout_dir = \"" + out + "\"\nprogress = \"none\"\nthreads = 1\n"
         "[data]\ndataset = \"text\"\npaths = [\"" + corpus + "\"]\nblock_size = 16\n"
         "windows_per_epoch = 64\nbatch_size = 16\nvalid_batch_size = 8\nvalid_samples = 12\n"
         "[model]\narch = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\n"
         "[optimizer]\nlr = 0.01\n"
         "[[stages]]\nname = \"short\"\nepochs = 1\nseq_len = 8\n"
         "[[stages]]\nname = \"full\"\nepochs = 2\n";
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text(path)); }

class Infer : public ::testing::Test {
 protected:
  void SetUp() override {
    corpus = dir.file("corpus.txt");
    std::ofstream(corpus, std::ios::binary) << tiny_corpus(8000);
    run = dir.file("gpt-run");
    write_text(dir.file("gpt.toml"), gpt_config(corpus, run));
    const CliResult r = run_cli("train " + dir.file("gpt.toml"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("valid loss"), std::string::npos) << r.output;
  }
  TempDir dir;
  std::string corpus, run;
};

// A run with the lora plugin (QLoRA: nf4 base weights) exports the model with its adapters
// folded in: evaluate scores it as the fit validated it, generate samples from it, and the
// adapter is kept in PEFT's layout.
TEST_F(Infer, ALoraRunIsEvaluatedAndSampledWithItsAdaptersMerged) {
  const std::string lora_run = dir.file("lora-run");
  write_text(dir.file("lora.toml"), gpt_config(corpus, lora_run) +
                                        "[plugins.lora]\nrank = 4\ntargets = [\"c_attn\", \"c_fc\"]\n"
                                        "quantize = \"nf4\"\nblock = 16\n");
  const CliResult train = run_cli("train " + dir.file("lora.toml"));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const nlohmann::json report = read_json(lora_run + "/report.json");
  const CliResult r = run_cli("evaluate " + lora_run + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_NEAR(j["valid_loss"].get<double>(), report["fit"]["valid_loss"].get<double>(), 1e-5);
  const CliResult gen = run_cli("generate " + lora_run + " --prompt 'the ' --tokens 8");
  EXPECT_EQ(gen.exit_code, 0) << gen.output;
  EXPECT_TRUE(std::filesystem::exists(lora_run + "/adapter/adapter_model.safetensors"));
  const nlohmann::json peft = read_json(lora_run + "/adapter/adapter_config.json");
  EXPECT_EQ(peft["peft_type"], "LORA");
  EXPECT_EQ(peft["r"], 4);
  // The model file holds no adapter tensor: it is the plain model.
  EXPECT_EQ(read_text(lora_run + "/model.safetensors").find("lora_A"), std::string::npos);
}

TEST_F(Infer, EvaluateGivesTheReportsValidationLossFromTheExportedModelAlone) {
  const nlohmann::json report = read_json(run + "/report.json");
  ASSERT_EQ(report["fit"]["task"], "language_model");
  std::filesystem::remove_all(run + "/checkpoints");  // the model alone: no optimizer state
  const CliResult r = run_cli("evaluate " + run + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["task"], "language_model");
  EXPECT_EQ(j["valid_tokens"], 12 * 16);
  EXPECT_NEAR(j["valid_loss"].get<double>(), report["fit"]["valid_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(j["valid_loss"].get<double>()), 1e-9);
  // Byte tokens: bits per byte is the loss in bits, in the report and in evaluate.
  EXPECT_NEAR(j["bits_per_byte"].get<double>(), j["valid_loss"].get<double>() / std::log(2.0), 1e-9);
  EXPECT_NEAR(report["fit"]["bits_per_byte"].get<double>(), report["fit"]["valid_loss"].get<double>() / std::log(2.0),
              1e-9);
  const CliResult text = run_cli("evaluate " + run);
  EXPECT_NE(text.output.find("nats/token (perplexity"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find(" bits/byte)"), std::string::npos) << text.output;
}

TEST_F(Infer, EvaluateDataScoresEveryWindowOfAnotherFile) {
  // 161 bytes: 10 whole windows of 16 tokens (the last window's targets need one byte more).
  const std::string other = dir.file("other.txt");
  std::ofstream(other, std::ios::binary) << tiny_corpus(161, 99);
  const CliResult r = run_cli("evaluate " + run + " --data " + other + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["samples"], 10);
  EXPECT_EQ(j["valid_tokens"], 160);
  const double split_loss = read_json(run + "/report.json")["fit"]["valid_loss"].get<double>();
  EXPECT_NE(j["valid_loss"].get<double>(), split_loss);
  // The corpus' last tenth as a file, its first 12 windows: the split the run validated on.
  const std::string tenth = dir.file("tenth.txt");
  std::ofstream(tenth, std::ios::binary) << tiny_corpus(8000).substr(7200);
  const CliResult same = run_cli("evaluate " + run + " --data " + tenth + " --samples 12 --json");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NEAR(nlohmann::json::parse(same.output.substr(same.output.find('{')))["valid_loss"].get<double>(), split_loss,
              1e-5);
  const CliResult missing = run_cli("evaluate " + run + " --data " + dir.file("nowhere.txt"));
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find(dir.file("nowhere.txt")), std::string::npos) << missing.output;
}

// A subword run: the sentencepiece tokenizer trained on the corpus is kept in the run folder
// and evaluate and generate read it there (not trained again); bits per byte compare it with
// a byte model.
TEST_F(Infer, ASentencePieceRunKeepsItsTokenizerForEvaluateAndGenerate) {
  const std::string spm = dir.file("spm-run");
  write_text(dir.file("spm.toml"), gpt_config(corpus, spm));
  const CliResult r = run_cli("train " + dir.file("spm.toml") +
                              " --set 'data.tokenizer=\"sentencepiece\"' --set data.vocab_size=300"
                              " --set run.checkpoint_epochs=1");
  if (r.output.find("AddressSanitizer build") != std::string::npos) GTEST_SKIP() << "no sentencepiece under ASan";
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(std::filesystem::exists(spm + "/tokenizer.model"));
  const nlohmann::json data = read_json(spm + "/data.json");
  EXPECT_EQ(data["tokenizer"]["kind"], "sentencepiece");
  EXPECT_EQ(data["tokenizer"]["vocab_size"], 300);
  EXPECT_EQ(data["input"]["num_classes"], 300);
  const nlohmann::json fit = read_json(spm + "/report.json")["fit"];
  // Pieces of several bytes: fewer bits per byte than the loss per token in bits.
  EXPECT_LT(fit["bits_per_byte"].get<double>(), 0.8 * fit["valid_loss"].get<double>() / std::log(2.0));
  const CliResult e = run_cli("evaluate " + spm + " --json");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const auto j = nlohmann::json::parse(e.output.substr(e.output.find('{')));
  EXPECT_NEAR(j["valid_loss"].get<double>(), fit["valid_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(j["bits_per_byte"].get<double>(), fit["bits_per_byte"].get<double>(), 1e-5);
  const CliResult other = run_cli("evaluate " + spm + " --data " + corpus);
  EXPECT_EQ(other.exit_code, 0) << other.output;
  const CliResult g = run_cli("--log-level warn generate " + spm + " --prompt 'the cat' --tokens 6 --samples 2 --seed 4");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_NE(g.output.find("--- sample 2 of 2 ---\nthe cat"), std::string::npos) << g.output;
  // A resume whose corpus changed would train another tokenizer: its ids would mean other text.
  std::ofstream(corpus, std::ios::binary | std::ios::app) << "zebra quokka axolotl\n";
  const CliResult resumed = run_cli("train " + dir.file("spm.toml") + " --set 'data.tokenizer=\"sentencepiece\"' " +
                                    "--set data.vocab_size=300 --set run.checkpoint_epochs=1 --set stages.1.epochs=3 --resume " + spm);
  EXPECT_NE(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("tokenizer.model: the tokenizer built for this resume differs"), std::string::npos)
      << resumed.output;
  std::filesystem::remove(spm + "/tokenizer.model");
  const CliResult lost = run_cli("evaluate " + spm);
  EXPECT_NE(lost.exit_code, 0);
  EXPECT_NE(lost.output.find("tokenizer.model"), std::string::npos) << lost.output;
}

TEST_F(Infer, GenerateContinuesThePromptAndTheSameSeedGivesTheSameText) {
  // The text alone (stdout; the log's rate line, on stderr, differs from run to run).
  const std::string cmd = "--log-level warn generate " + run + " --prompt 'the cat' --tokens 40 --seed 3";
  const CliResult a = run_cli(cmd);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.rfind("the cat", 0), 0u) << a.output;
  EXPECT_GE(a.output.size(), 7u + 40u);
  EXPECT_EQ(run_cli(cmd).output, a.output);
  EXPECT_NE(run_cli("generate " + run + " --tokens 5").output.find("tokens/s, keys and values cached"),
            std::string::npos);
  const CliResult greedy = run_cli("generate " + run + " --prompt 'the ' --tokens 30 --temperature 0");
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
}

TEST_F(Infer, RefusesAFolderWithoutAModelOrOfAnImageModelOrACorruptFile) {
  const CliResult none = run_cli("generate " + dir.file("nowhere"));
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find(dir.file("nowhere")), std::string::npos) << none.output;

  const std::string img = dir.file("mlp-run");
  write_text(dir.file("mlp.toml"),
             "[run]\nout_dir = \"" + img + "\"\nprogress = \"none\"\n[data]\ndataset = \"synthetic\"\n"
             "samples = 32\nimage_size = 8\nclasses = 4\n[model]\narch = \"mlp\"\nwidth = 8\n");
  ASSERT_EQ(run_cli("train " + dir.file("mlp.toml")).exit_code, 0);
  const CliResult gen = run_cli("generate " + img);
  EXPECT_EQ(gen.exit_code, 2) << gen.output;
  EXPECT_NE(gen.output.find("language model"), std::string::npos) << gen.output;
  const CliResult ev = run_cli("evaluate " + img + " --json");
  ASSERT_EQ(ev.exit_code, 0) << ev.output;
  EXPECT_NE(ev.output.find("\"accuracy\""), std::string::npos) << ev.output;

  // The weights are read from model.safetensors (each tensor's CRC checked).
  const std::string weights = run + "/model.safetensors";
  {  // a changed byte at the end of the weights' file (a tensor's bytes)
    std::fstream f(weights, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(weights)) - 3);
    f.put('\x7f');
  }
  const CliResult changed = run_cli("evaluate " + run);
  EXPECT_NE(changed.exit_code, 0) << changed.output;
  EXPECT_NE(changed.output.find(weights + "' is damaged"), std::string::npos) << changed.output;
  std::filesystem::resize_file(weights, std::filesystem::file_size(weights) / 2);
  const CliResult bad = run_cli("evaluate " + run);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find(weights), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace frugal::test
