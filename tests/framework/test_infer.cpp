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
  const CliResult text = run_cli("evaluate " + run);
  EXPECT_NE(text.output.find("nats/token (perplexity"), std::string::npos) << text.output;
}

TEST_F(Infer, GenerateContinuesThePromptAndTheSameSeedGivesTheSameText) {
  // The text alone (stdout; the log's rate line, on stderr, differs from run to run).
  const std::string cmd = "--log-level warn generate " + run + " --prompt 'the cat' --tokens 40 --seed 3";
  const CliResult a = run_cli(cmd);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.rfind("the cat", 0), 0u) << a.output;
  EXPECT_GE(a.output.size(), 7u + 40u);
  EXPECT_EQ(run_cli(cmd).output, a.output);
  EXPECT_NE(run_cli("generate " + run + " --tokens 5").output.find("bytes/s, keys and values cached"),
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

  {  // a flipped byte in the middle of the weights' file
    std::fstream f(run + "/model.pt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64);
    f.put('\x7f');
    f.seekp(200);
    f.write("garbage!", 8);
  }
  std::filesystem::resize_file(run + "/model.pt", std::filesystem::file_size(run + "/model.pt") / 2);
  const CliResult bad = run_cli("evaluate " + run);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find(run + "/model.pt"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace frugal::test
