// lora: what the method promises (the adapted model starts as the base model, only the adapters
// train, merged equals unmerged), quantized weights in their bytes, and PEFT's layout read by
// an independent implementation (tests/framework/hf_gpt2_reference.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "frugal/base/error.h"
#include "frugal/models/linear.h"
#include "frugal/optim/optimizers.h"
#include "gpt_fixture.h"
#include "hf_gpt2_fixture.h"
#include "learner_fixture.h"
#include "lora.h"
#include "support.h"

namespace frugal::test {
namespace {

std::shared_ptr<spdlog::logger> lora_logger() { return std::make_shared<spdlog::logger>("lora-test"); }

std::shared_ptr<lora::Lora> lora_plugin(const lora::LoraOptions& o) {
  return std::make_shared<lora::Lora>(o, PluginContext{"lora", lora_logger()});
}

torch::Tensor lora_logits(torch::nn::Module& m, const torch::Tensor& x) {
  torch::NoGradGuard g;
  m.eval();
  return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

std::map<std::string, torch::Tensor> named_clone(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

torch::Tensor some_tokens() { return torch::randint(256, {2, 16}, torch::kLong); }

TEST(Lora, TheAdaptedModelStartsAsTheBaseOneAndOnlyTheAdaptersTrain) {
  lora::LoraOptions o;
  o.targets = {"c_attn", "mlp.c_fc"};
  auto l = make_tiny_gpt_learner();
  const auto x = some_tokens();
  const auto before = lora_logits(*l->model(), x);
  auto plugin = lora_plugin(o);
  l->add_callback(plugin);
  EXPECT_EQ(plugin->adapted().layers, (std::vector<std::string>{"block0.attn.c_attn", "block0.mlp.c_fc",
                                                                 "block1.attn.c_attn", "block1.mlp.c_fc"}));
  EXPECT_TRUE(torch::equal(lora_logits(*l->model(), x), before));  // lora_B = 0
  const auto base = named_clone(*l->model());
  l->fit(1);
  int64_t changed = 0;
  for (const auto& p : l->model()->named_parameters()) {
    const bool adapter = p.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), adapter) << p.key();
    if (!adapter) {
      EXPECT_FALSE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::equal(p.value(), base.at(p.key()))) << p.key() << " trained";
    } else if (p.key().find("lora_B") != std::string::npos) {
      changed += !torch::equal(p.value(), torch::zeros_like(p.value()));
    }
  }
  EXPECT_EQ(changed, 4);  // every lora_B left zero
  EXPECT_LT(optimizer_state_bytes(l->optimizer()), 2 * 4 * plugin->adapted().trainable + 4096);  // Adam: 2 per trained element
}

TEST(Lora, MergedAndUnmergedForwardsAgreeAndAStageChangeKeepsTheBaseFrozen) {
  for (const std::string quantize : {"none", "int8", "nf4"}) {
    lora::LoraOptions o;
    o.targets = {"c_attn", "c_proj", "c_fc"};
    o.quantize = quantize;
    o.block = 32;
    auto l = make_tiny_gpt_learner();
    l->add_callback(lora_plugin(o));
    Stage a, b;
    a.name = "a";
    b.name = "b";
    a.epochs = b.epochs = 1;
    l->fit({a, b});  // each stage unfreezes what its freeze froze: not the base weights
    for (const auto& p : l->model()->named_parameters())
      EXPECT_EQ(p.value().requires_grad(), p.key().find(".lora_") != std::string::npos) << quantize << " " << p.key();
    const auto x = some_tokens();
    const auto adapted = lora_logits(*l->model(), x);
    {
      AdaptersMerged plain(*l->model());
      EXPECT_EQ(plain.size(), 8u);  // c_proj: attn's and mlp's
      EXPECT_LE((lora_logits(*l->model(), x) - adapted).abs().max().item<double>(), 1e-5) << quantize;
      for (const auto& p : l->model()->named_parameters()) EXPECT_EQ(p.key().find(".lora_"), std::string::npos);
    }
    EXPECT_TRUE(torch::equal(lora_logits(*l->model(), x), adapted)) << quantize << ": not put back";
  }
}

TEST(Lora, QuantizedBaseWeightsTakeTheirBytesAndStayCloseToTheFloatModel) {
  TinyGpt s;
  s.n_embd = 64;
  auto l = make_tiny_gpt_learner(s);
  const auto x = some_tokens();
  const auto base = lora_logits(*l->model(), x);
  lora::LoraOptions o;
  o.targets = {"c_attn", "c_proj", "c_fc"};
  o.quantize = "nf4";
  auto plugin = lora_plugin(o);
  l->add_callback(plugin);
  const auto& a = plugin->adapted();
  const double per_param = static_cast<double>(a.stored_bytes) / static_cast<double>(a.base_bytes / 4);
  EXPECT_NEAR(per_param, 0.5 + 1.0 / 64 + 4.0 / (64 * 256), 0.01);  // 4 bits + the double-quantized scales
  for (const auto& m : l->model()->modules(false)) {
    if (auto* layer = dynamic_cast<AdaptableLinearImpl*>(m.get()); layer && layer->adapter()) {
      EXPECT_EQ(layer->weight.numel(), 0);  // the float weight is gone
    }
  }
  const double rel = ((lora_logits(*l->model(), x) - base).norm() / base.norm()).item<double>();
  EXPECT_LT(rel, 0.1) << "nf4 changed the logits by " << rel;
  EXPECT_GT(rel, 0.0);
  l->fit(1);  // gradients reach the adapters through the dequantized matmul
  EXPECT_GT(l->steps(), 0);
}

TEST(Lora, AModelWithoutTheTargetsIsRefusedNamingItsLayers) {
  lora::LoraOptions o;
  o.targets = {"q_proj"};
  auto l = make_tiny_gpt_learner();
  try {
    l->add_callback(lora_plugin(o));
    ADD_FAILURE() << "no layer matched, and no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("plugins.lora.targets: no linear layer of the model matches"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("block0.attn.c_attn"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(l->callbacks().empty() || l->callbacks().back()->name() != "lora");
}

TEST(Lora, ThePeftExportGivesAPeftUserTheAdaptedLogits) {
  FRUGAL_SKIP_WITHOUT_HF_REFERENCE(py);
  TempDir dir;
  ASSERT_TRUE(hf::run(py + "make " + dir.file("base") + " --n_layer 2 --n_head 2 --n_embd 32 --vocab 61 --n_positions 24"));
  const auto [x, y] = hf::write_batch(dir.file("batch.json"), 2, 12, 61, 6);
  auto m = hf::load(dir.file("base"), 61, 12);
  lora::LoraOptions o;
  o.targets = {"c_attn", "c_proj"};
  o.rank = 4;
  o.alpha = 8;
  lora::adapt(*m, o);
  {
    torch::NoGradGuard g;  // an adapter as training leaves it: B no longer zero
    for (auto& p : m->named_parameters())
      if (p.key().find("lora_") != std::string::npos) p.value().normal_(0.0, 0.05);
  }
  lora::export_peft(*m, o, "gpt2", dir.file("adapter"));
  ASSERT_TRUE(hf::run(py + "peft " + dir.file("base") + " " + dir.file("adapter") + " " + dir.file("batch.json") +
                      " " + dir.file("peft.json")));
  const auto want = hf::read_logits(dir.file("peft.json"));
  EXPECT_LE((lora_logits(*m, x).to(torch::kDouble) - want).abs().max().item<double>(), 1e-5);
}

}  // namespace
}  // namespace frugal::test
