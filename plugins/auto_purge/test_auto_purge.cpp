// The auto_purge plugin through real fits: a two-stage fit (frozen features at 14 px, then
// everything at 28 px) with Adam returns to its pre-fit memory at the stage change with the
// plugin and does not without it; the contract warning names what holds memory; clear_opt,
// defrag, the fit-end purge and a swapped optimizer.
#include <gtest/gtest.h>

#include "auto_purge.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"
#include "log_capture.h"

namespace frugal::test {
namespace {

namespace ap = frugal::auto_purge;

/// A small CNN on 28 px synthetic data, Adam; valid data too (it stays in memory).
std::unique_ptr<Learner> cnn_learner() {
  TinySetup s;
  s.arch = "cnn";
  s.width = 4;
  s.image_size = 28;
  s.samples = 64;
  s.valid_samples = 32;
  s.optimizer = "adam";
  s.lr = 1e-3;
  return make_tiny_learner(s);
}

std::vector<Stage> frozen_then_unfrozen() {
  Stage head = make_stage("head", 1, {"features"});
  head.image_size = 14;
  Stage all = make_stage("finetune", 1);
  all.image_size = 28;
  return {head, all};
}

/// Live bytes at each stage's start, read after auto_purge (order 0 > -10), and after the fit.
struct StageStart : Callback {
  std::string name() const override { return "stage_start"; }
  void before_stage(Learner& l) override {
    live.push_back(l.memory().current());
    state.push_back(optimizer_state_bytes(l.optimizer()));
  }
  std::vector<int64_t> live, state;
};

/// Keeps a tensor alive across the fit and says so (held_bytes).
struct Hoarder : Callback {
  std::string name() const override { return "hoarder"; }
  void before_fit(Learner&) override { kept = torch::zeros({64 * 1024}); }  // 256 KiB
  int64_t held_bytes() const override { return kept.defined() ? kept.nbytes() : 0; }
  torch::Tensor kept;
};

int64_t head_params(Learner& l) {
  int64_t n = 0;
  for (const auto& np : l.model()->named_parameters())
    if (np.key().rfind("head", 0) == 0) n += np.value().numel();
  return n;
}

struct Fit {
  int64_t baseline = 0;  ///< live bytes right before fit: parameters + data
  std::shared_ptr<StageStart> probe = std::make_shared<StageStart>();
  int64_t after_fit = 0;
  int64_t head = 0;
};

Fit two_stage_fit(const std::string& plugins, const std::vector<std::shared_ptr<Callback>>& extra = {}) {
  Fit f;
  auto l = cnn_learner();
  PluginHost host;
  if (!plugins.empty())
    for (auto& cb : host.load(plugins_of(plugins), "cfg.toml")) l->add_callback(cb);
  l->add_callback(f.probe);
  for (auto& cb : extra) l->add_callback(cb);
  f.head = head_params(*l);
  f.baseline = l->memory().current();
  l->fit(frozen_then_unfrozen());
  f.after_fit = l->memory().current();
  l->clear_callbacks();
  return f;
}

constexpr int64_t kTolerance = 1024;

TEST(AutoPurge, SecondStageStartsFromThePreFitBaselineWithThePluginAndNotWithout) {
  const Fit with = two_stage_fit("[plugins.auto_purge]\ntolerance = \"1KiB\"\n");
  const Fit without = two_stage_fit("");
  ASSERT_EQ(with.probe->live.size(), 2u);
  ASSERT_EQ(without.probe->live.size(), 2u);
  EXPECT_EQ(with.baseline, without.baseline);
  // Stage 1 trained only the head: Adam holds 8 bytes per head parameter at the change.
  const int64_t adam_head = 8 * with.head;
  EXPECT_EQ(without.probe->state[1], adam_head);
  EXPECT_GE(without.probe->live[1] - without.baseline, adam_head) << "without: above by Adam's state";
  EXPECT_EQ(with.probe->state[1], 0);
  EXPECT_LE(std::abs(with.probe->live[1] - with.baseline), kTolerance) << "with: back to the baseline";
  // The fit-end purge (fit -> predict/export) does the same for the whole model's Adam state.
  EXPECT_LE(std::abs(with.after_fit - with.baseline), kTolerance);
  EXPECT_GE(without.after_fit - without.baseline, 8 * (without.head));
}

TEST(AutoPurge, ContractWarningNamesTheCallbackThatHoldsMemoryAndKeepSilencesIt) {
  {
    LogCapture cap;
    two_stage_fit("[plugins.auto_purge]\ntolerance = \"1KiB\"\n", {std::make_shared<Hoarder>()});
    const std::string log = cap.text();
    EXPECT_TRUE(Has(log, "auto_purge: after the purge at the start of stage 'finetune', live memory is "));
    EXPECT_TRUE(Has(log, "over the stage baseline"));
    EXPECT_TRUE(Has(log, "Still held: callback 'hoarder' 256.0 KiB"));
  }
  {
    LogCapture cap;
    two_stage_fit("[plugins.auto_purge]\ntolerance = \"1KiB\"\nkeep = \"256KiB\"\n",
                  {std::make_shared<Hoarder>()});
    EXPECT_FALSE(Has(cap.text(), "over the stage baseline"));
    EXPECT_TRUE(Has(cap.text(), "auto_purge: purge at the start of stage 'finetune': released "));
  }
}

TEST(AutoPurge, ClearOptFalseKeepsTheOptimizerStateAndCountsItAsAllowed) {
  LogCapture cap;
  const Fit f = two_stage_fit("[plugins.auto_purge]\nclear_opt = false\ntolerance = \"1KiB\"\n");
  EXPECT_EQ(f.probe->state[1], 8 * f.head);
  EXPECT_GE(f.probe->live[1] - f.baseline, 8 * f.head);
  EXPECT_FALSE(Has(cap.text(), "over the stage baseline"));
  EXPECT_TRUE(Has(cap.text(), "+ kept optimizer state"));
}

/// Defrag: the parameters before auto_purge's before_stage (order -30) at stage 1...
struct DefragBefore : Callback {
  std::string name() const override { return "before"; }
  int order() const override { return -30; }
  void before_stage(Learner& l) override {
    if (l.stage_index() != 1) return;
    values = clone_params(*l.model());
    for (const auto& p : l.model()->parameters()) {
      impls.push_back(p.unsafeGetTensorImpl());
      data.push_back(p.data_ptr());
    }
  }
  std::vector<torch::Tensor> values;
  std::vector<const void*> impls, data;
};
/// ... and after it.
struct DefragAfter : Callback {
  std::string name() const override { return "after"; }
  void before_stage(Learner& l) override {
    if (l.stage_index() != 1) return;
    same_values = params_equal(*l.model(), before->values);
    for (const auto& p : l.model()->parameters()) {
      impls.push_back(p.unsafeGetTensorImpl());
      data.push_back(p.data_ptr());
    }
    files = std::distance(std::filesystem::directory_iterator(dir), {});
  }
  std::shared_ptr<DefragBefore> before;
  std::filesystem::path dir;
  bool same_values = false;
  std::vector<const void*> impls, data;
  long files = -1;
};

TEST(AutoPurge, DefragReloadsTheParametersIntoFreshMemoryAndRemovesItsFile) {
  TempDir dir;
  auto before = std::make_shared<DefragBefore>();
  auto after = std::make_shared<DefragAfter>();
  after->before = before;
  after->dir = dir.path();
  std::vector<torch::Tensor> at_end;
  {
    auto l = cnn_learner();
    PluginHost host;
    for (auto& cb : host.load(plugins_of("[plugins.auto_purge]\ndefrag = true\ndefrag_dir = \"" +
                                         dir.path().string() + "\"\n"),
                              "cfg.toml"))
      l->add_callback(cb);
    l->add_callback(before);
    l->add_callback(after);
    l->fit(frozen_then_unfrozen());
    at_end = clone_params(*l->model());
    l->clear_callbacks();
  }
  ASSERT_FALSE(before->values.empty());
  EXPECT_TRUE(after->same_values) << "the reload gives back the same values";
  EXPECT_EQ(after->impls, before->impls) << "the same parameters: the optimizer still has them";
  EXPECT_NE(after->data, before->data) << "in fresh allocations";
  EXPECT_EQ(after->files, 0) << "the temp file is removed";
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 0);
  // The optimizer still trains the reloaded parameters: stage 2 changed the features.
  bool changed = false;
  for (size_t i = 0; i < at_end.size(); ++i) changed |= !torch::equal(at_end[i], before->values[i]);
  EXPECT_TRUE(changed);
}

TEST(AutoPurge, PurgesAfterOptimSwapReplacesTheOptimizerAtAnEpoch) {
  LogCapture cap;
  auto l = make_tiny_learner();
  PluginHost host;
  auto cbs = host.load(plugins_of("[plugins.auto_purge]\n[plugins.optim_swap]\nat_epoch = 1\n"),
                       "cfg.toml");
  ASSERT_EQ(cbs.size(), 2u);
  EXPECT_EQ(cbs[0]->name(), "optim_swap") << "swaps first, then auto_purge sees the new optimizer";
  for (auto& cb : cbs) l->add_callback(cb);
  l->fit(2);
  const std::string log = cap.text();
  const auto swap = log.find("optim_swap: 1 epochs done: optimizer adam -> sgd");
  const auto purge = log.find("auto_purge: purge at epoch 1 of stage 'fit' (new optimizer)");
  ASSERT_NE(swap, std::string::npos) << log;
  ASSERT_NE(purge, std::string::npos) << log;
  EXPECT_LT(swap, purge);
  l->clear_callbacks();
}

TEST(AutoPurge, ResidualAttributesWhatIsOverTheBaseline) {
  ap::Residual r;
  r.live = 10'000;
  r.parameters = 6'000;
  r.data = 2'000;
  r.tolerance = 100;
  r.gradients = 1'000;
  r.optimizer_state = 500;
  r.callbacks = {{"history", 300}};
  EXPECT_EQ(r.allowed(), 8'000);
  EXPECT_EQ(r.over(), 2'000);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.other(), 200);
  const std::string w = ap::explain(r, "the start of stage 'b'");
  EXPECT_TRUE(Has(w, "Still held: gradients 1000 B, optimizer state 500 B, callback 'history' 300 B, "
                     "other (not attributed"));
  r.keep = 1'950;
  EXPECT_TRUE(r.ok());
}

TEST(AutoPurge, BadSizesNameTheKey) {
  PluginHost host;
  try {
    host.load(plugins_of("[plugins.auto_purge]\nkeep = \"lots\"\n"), "cfg.toml");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(Has(e.what(), "cfg.toml:2:8: 'plugins.auto_purge.keep' must be a size such as"));
  }
}

}  // namespace
}  // namespace frugal::test
