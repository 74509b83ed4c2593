// frugal's gpt2 against an independent GPT-2 (tests/framework/hf_gpt2_reference.py): a Hugging
// Face folder loads as it is (one file or shards, with or without "transformer.", old mask
// buffers), computes the same logits, trains to the same weights, and is written back in the
// same layout.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "frugal/app/model_export.h"
#include "frugal/base/error.h"
#include "frugal/io/safetensors.h"
#include "frugal/optim/optimizers.h"
#include "hf_gpt2_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

constexpr int64_t kHfVocab = 61, kHfBatch = 2, kHfTokens = 12;  // 24 positions: make_folder

std::string make_folder(const std::string& py, const std::string& dir, const std::string& flags = "") {
  EXPECT_TRUE(hf::run(py + "make " + dir + " --n_layer 2 --n_head 2 --n_embd 32 --vocab 61 --n_positions 24 " + flags));
  return dir;
}

torch::Tensor logits_of(torch::nn::Sequential& m, const torch::Tensor& x) {
  m->eval();
  torch::NoGradGuard g;
  return m->forward(x).to(torch::kDouble);
}

double loss_of(torch::nn::Sequential& m, const torch::Tensor& x, const torch::Tensor& y) {
  auto logits = m->forward(x);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kHfVocab}), y.reshape({-1})).item<double>();
}

TEST(HfGpt2, EveryLayoutOfAHuggingFaceFolderGivesTheReferenceLogits) {
  FRUGAL_SKIP_WITHOUT_HF_REFERENCE(py);
  TempDir dir;
  const auto [x, y] = hf::write_batch(dir.file("batch.json"), kHfBatch, kHfTokens, kHfVocab, 3);
  const std::string plain = make_folder(py, dir.file("plain"));
  ASSERT_TRUE(hf::run(py + "forward " + plain + " " + dir.file("batch.json") + " " + dir.file("want.json")));
  const auto want = hf::read_logits(dir.file("want.json"));
  for (const std::string flags : {"", "--shards 3", "--no_prefix --mask_buffers"}) {
    const std::string folder = flags.empty() ? plain : make_folder(py, dir.file("v" + std::to_string(flags.size())), flags);
    auto m = hf::load(folder, kHfVocab, kHfTokens);
    EXPECT_LE((logits_of(m, x) - want).abs().max().item<double>(), 1e-5) << flags;
  }
  // The head is tied: one tensor, stepped once.
  auto m = hf::load(plain, kHfVocab, kHfTokens);
  EXPECT_EQ(m->named_parameters().find("head.weight"), nullptr);
}

TEST(HfGpt2, ThreeStepsOfSgdAndAdamwReachTheReferenceWeights) {
  FRUGAL_SKIP_WITHOUT_HF_REFERENCE(py);
  TempDir dir;
  const auto [x, y] = hf::write_batch(dir.file("batch.json"), kHfBatch, kHfTokens, kHfVocab, 4);
  const std::string folder = make_folder(py, dir.file("base"));
  for (const std::string opt : {"sgd", "adamw"}) {
    const double lr = opt == "sgd" ? 0.05 : 0.01;
    const std::string out = dir.file("trained-" + opt);
    ASSERT_TRUE(hf::run(py + "train " + folder + " " + dir.file("batch.json") + " " + out + " --steps 3 --lr " +
                        std::to_string(lr) + " --optimizer " + opt));
    auto m = hf::load(folder, kHfVocab, kHfTokens);
    m->train();
    OptimizerOptions o;
    o.name = opt;
    o.lr = lr;
    o.weight_decay = 0.0;
    auto optimizer = make_optimizer(o, m->parameters());
    std::vector<double> losses;
    for (int step = 0; step < 3; ++step) {
      optimizer->zero_grad();
      auto logits = m->forward(x);
      auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, kHfVocab}), y.reshape({-1}));
      losses.push_back(loss.item<double>());
      loss.backward();
      optimizer->step();
    }
    losses.push_back(loss_of(m, x, y));
    std::ifstream in(out + "/losses.json");
    const auto want = nlohmann::json::parse(in).at("losses").get<std::vector<double>>();
    ASSERT_EQ(want.size(), losses.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(losses[i], want[i], 1e-5) << opt << " step " << i;
    auto trained = hf::load(out, kHfVocab, kHfTokens);
    const auto mine = m->named_parameters();
    for (const auto& p : trained->named_parameters()) {
      auto a = mine[p.key()], b = p.value();
      // The keys' bias has no gradient (it adds q.b_k to every score of a row: softmax ignores
      // it); its float noise, ~1e-9, Adam divides by its own size into steps of +-lr.
      if (opt == "adamw" && p.key().find("c_attn.bias") != std::string::npos)
        a = torch::cat({a.narrow(0, 0, 32), a.narrow(0, 64, 32)}), b = torch::cat({b.narrow(0, 0, 32), b.narrow(0, 64, 32)});
      EXPECT_LE((a - b).abs().max().item<double>(), 1e-5) << opt << " " << p.key();
    }
  }
}

TEST(HfGpt2, ARunWritesAHuggingFaceFolderTheReferenceReads) {
  FRUGAL_SKIP_WITHOUT_HF_REFERENCE(py);
  TempDir dir;
  hf::write_batch(dir.file("batch.json"), kHfBatch, kHfTokens, kHfVocab, 5);
  const std::string folder = make_folder(py, dir.file("base"));
  auto m = hf::load(folder, kHfVocab, kHfTokens);
  const std::string out = dir.file("run");
  std::filesystem::create_directories(out);
  export_model(*m, out + "/model.pt", {{"frugal.model.arch", "gpt2"}}, nlohmann::json::object());
  const auto names = safetensors::read(out + "/model.safetensors");
  EXPECT_EQ(names.count("transformer.h.1.attn.c_attn.weight"), 1u);
  EXPECT_EQ(names.at("transformer.h.1.attn.c_attn.weight").sizes(), (std::vector<int64_t>{32, 96}));  // [in, out]
  EXPECT_EQ(names.count("lm_head.weight"), 0u);
  ASSERT_TRUE(hf::run(py + "forward " + folder + " " + dir.file("batch.json") + " " + dir.file("a.json")));
  ASSERT_TRUE(hf::run(py + "forward " + out + " " + dir.file("batch.json") + " " + dir.file("b.json")));
  EXPECT_LE((hf::read_logits(dir.file("a.json")) - hf::read_logits(dir.file("b.json"))).abs().max().item<double>(), 1e-9);
}

TEST(HfGpt2, AFolderThatIsNotTheModelIsRefusedListingWhat) {
  FRUGAL_SKIP_WITHOUT_HF_REFERENCE(py);
  TempDir dir;
  const std::string folder = make_folder(py, dir.file("base"));
  auto tensors = safetensors::read(folder + "/model.safetensors");
  tensors.erase("transformer.h.1.mlp.c_fc.bias");
  tensors["lm_head.weight"] = torch::zeros({kHfVocab, 32});  // a head that is not tied
  std::vector<std::pair<std::string, torch::Tensor>> list(tensors.begin(), tensors.end());
  safetensors::write(folder + "/model.safetensors", list);
  try {
    hf::load(folder, kHfVocab, kHfTokens);
    ADD_FAILURE() << "loaded a folder that is not the model";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
  tensors.erase("lm_head.weight");
  list.assign(tensors.begin(), tensors.end());
  safetensors::write(folder + "/model.safetensors", list);
  try {
    hf::load(folder, kHfVocab, kHfTokens);
    ADD_FAILURE() << "loaded a folder without a tensor";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("block1.mlp.c_fc.bias"), std::string::npos) << e.what();
  }
  // The config decides the shape: a [model] key that disagrees is named.
  ModelOptions o;
  o.arch = "gpt2";
  o.init_from = folder;
  o.n_layer = 6;
  ModelInput in;
  in.num_classes = kHfVocab;
  in.block_size = kHfTokens;
  try {
    make_model(o, in);
    ADD_FAILURE() << "n_layer disagreeing with config.json was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_layer = 6"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace frugal::test
