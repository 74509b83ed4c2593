// The optim_swap plugin: its momentum seeding (plugins/optim_swap/optim_swap.h) called directly,
// and the plugin loaded through PluginHost into real fits: the bytes Adam -> SGD frees, each
// trigger, the first SGD step from a seeded buffer, option errors, and resume.
#include <sstream>

#include <gtest/gtest.h>

#include "optim_swap.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"
#include "log_capture.h"

namespace frugal::test {
namespace {

namespace os = frugal::optim_swap;

template <class F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError thrown";
  return "";
}

int64_t numel(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

/// Reads the Learner at before_stage; `order` places it before (< -20) or after optim_swap.
struct StageProbe : Callback {
  explicit StageProbe(int o) : order_(o) {}
  std::string name() const override { return "stage_probe" + std::to_string(order_); }
  int order() const override { return order_; }
  void before_stage(Learner& l) override {
    live.push_back(l.memory().current());
    state.push_back(optimizer_state_bytes(l.optimizer()));
    optimizer.push_back(l.optimizer_options().name);
  }
  int order_;
  std::vector<int64_t> live, state;
  std::vector<std::string> optimizer;
};

/// The optimizer each epoch trains with, and each batch.
struct EpochProbe : Callback {
  std::string name() const override { return "epoch_probe"; }
  void before_train(Learner& l) override { epochs.push_back(l.optimizer_options().name); }
  void before_batch(Learner& l) override { batches.push_back(l.optimizer_options().name); }
  std::vector<std::string> epochs, batches;
};

std::vector<std::shared_ptr<Callback>> load(PluginHost& host, Learner& l, const std::string& toml) {
  auto cbs = host.load(plugins_of(toml), "cfg.toml");
  for (auto& cb : cbs) l.add_callback(cb);
  return cbs;
}

TEST(OptimSwap, AdamToPlainSgdAtAStageFreesAtLeast8BytesPerParameter) {
  auto l = make_tiny_learner();  // Adam, every parameter trains
  PluginHost host;
  load(host, *l, "[plugins.optim_swap]\nat_stage = \"sgd\"\nto = { name = \"sgd\", lr = 0.05 }\n");
  auto before = std::make_shared<StageProbe>(-30), after = std::make_shared<StageProbe>(0);
  l->add_callback(before);
  l->add_callback(after);
  l->fit({make_stage("adam", 1), make_stage("sgd", 1)});

  const int64_t n = numel(*l->model());
  ASSERT_EQ(before->optimizer, (std::vector<std::string>{"adam", "adam"}));
  EXPECT_EQ(after->optimizer, (std::vector<std::string>{"adam", "sgd"}));
  EXPECT_EQ(before->state[1], 8 * n) << "Adam holds exp_avg and exp_avg_sq in float32";
  EXPECT_EQ(after->state[1], 0) << "plain SGD has no state";
  EXPECT_GE(before->live[1] - after->live[1], 8 * n) << "the old optimizer's state is freed";
  EXPECT_EQ(l->optimizer_options().name, "sgd");
  EXPECT_DOUBLE_EQ(l->optimizer_options().lr, 0.05);
  EXPECT_EQ(l->steps(), 8);  // both stages stepped
  l->clear_callbacks();
}

/// Before the swap (order -30): Adam's first moments. After it (order 0): SGD's buffers; then
/// the first SGD step's inputs and result.
struct MomentProbe : Callback {
  int order_;
  explicit MomentProbe(int o) : order_(o) {}
  std::string name() const override { return "probe" + std::to_string(order_); }
  int order() const override { return order_; }
  std::vector<torch::Tensor> read(Learner& l, bool adam) {
    std::vector<torch::Tensor> out;
    for (const auto& p : l.model()->parameters()) {
      auto& st = *l.optimizer().state().at(compat::optimizer_state_key(p));
      out.push_back(adam ? dynamic_cast<torch::optim::AdamParamState&>(st).exp_avg().clone()
                         : dynamic_cast<torch::optim::SGDParamState&>(st).momentum_buffer().clone());
    }
    return out;
  }
  void before_stage(Learner& l) override {
    if (l.stage_index() == 1) moments = read(l, order_ < -20);
  }
  void before_step(Learner& l) override {
    if (l.stage_index() != 1 || l.batch_index() != 0 || order_ < -20) return;
    params = clone_params(*l.model());
    for (const auto& p : l.model()->parameters()) grads.push_back(p.grad().clone());
    buffers = read(l, false);
  }
  void after_step(Learner& l) override {
    if (l.stage_index() == 1 && l.batch_index() == 0 && order_ >= -20) stepped = clone_params(*l.model());
  }
  std::vector<torch::Tensor> moments, params, grads, buffers, stepped;
};

TEST(OptimSwap, SeededMomentumIsAdamsFirstMomentAndTheFirstSgdStepUsesIt) {
  TinySetup s;
  s.shuffle = false;
  auto l = make_tiny_learner(s);
  PluginHost host;
  load(host, *l,
       "[plugins.optim_swap]\nat_stage = \"sgd\"\nseed_momentum = true\n"
       "to = { name = \"sgd\", lr = 0.1, momentum = 0.9 }\n");

  auto adam = std::make_shared<MomentProbe>(-30), sgd = std::make_shared<MomentProbe>(0);
  l->add_callback(adam);
  l->add_callback(sgd);
  l->fit({make_stage("adam", 1), make_stage("sgd", 1)});

  ASSERT_EQ(adam->moments.size(), l->model()->parameters().size());
  ASSERT_EQ(sgd->moments.size(), adam->moments.size());
  ASSERT_EQ(sgd->stepped.size(), adam->moments.size());
  for (size_t i = 0; i < adam->moments.size(); ++i) {
    SCOPED_TRACE("parameter " + std::to_string(i));
    EXPECT_GT(adam->moments[i].abs().sum().item<double>(), 0);
    EXPECT_TRUE(torch::equal(sgd->moments[i], adam->moments[i])) << "buffer = exp_avg after the swap";
    EXPECT_TRUE(torch::equal(sgd->buffers[i], adam->moments[i])) << "untouched until the first step";
    // SGD (dampening 0, no nesterov): buf = 0.9 * exp_avg + g; p -= 0.1 * buf.
    const auto buf = adam->moments[i].mul(0.9).add(sgd->grads[i]);
    const auto expected = sgd->params[i].add(buf, -0.1);
    EXPECT_TRUE(torch::allclose(sgd->stepped[i], expected, 1e-6, 1e-7));
    // ... and not the step an unseeded SGD takes (buf = g).
    EXPECT_FALSE(torch::allclose(sgd->stepped[i], sgd->params[i].add(sgd->grads[i], -0.1), 1e-6, 1e-7));
  }
  l->clear_callbacks();
}

TEST(OptimSwap, FirstMomentsAreSharedNotCopiedAndSeedOnlyTheirParameters) {
  torch::manual_seed(0);
  auto a = torch::randn({3}, torch::requires_grad()), b = torch::randn({2}, torch::requires_grad());
  torch::optim::Adam adam({a, b}, torch::optim::AdamOptions(0.1));
  a.mutable_grad() = torch::ones({3});  // b has no gradient: Adam keeps no state for it
  adam.step();
  auto moments = os::first_moments(adam, {a, b});
  ASSERT_EQ(moments.size(), 1u);
  EXPECT_TRUE(torch::allclose(moments[0].second, torch::full({3}, 0.1)));  // (1 - beta1) * g
  torch::optim::SGD sgd({a, b}, torch::optim::SGDOptions(0.1).momentum(0.5));
  EXPECT_EQ(os::seed_momentum(sgd, moments), 1);
  auto& buf = static_cast<torch::optim::SGDParamState&>(*sgd.state().at(compat::optimizer_state_key(a)));
  EXPECT_EQ(buf.momentum_buffer().data_ptr(), moments[0].second.data_ptr()) << "no second copy";
  EXPECT_EQ(sgd.state().count(compat::optimizer_state_key(b)), 0u);
}

TEST(OptimSwap, AtEpochCountsEpochsAcrossStages) {
  struct S {
    int64_t epochs;
  };
  const std::vector<S> stages = {{2}, {3}};
  EXPECT_EQ(os::fit_epoch(stages, 0, 1), 1);
  EXPECT_EQ(os::fit_epoch(stages, 1, 0), 2);
  EXPECT_EQ(os::fit_epoch(stages, 1, 2), 4);

  auto l = make_tiny_learner();
  PluginHost host;
  load(host, *l, "[plugins.optim_swap]\nat_epoch = 3\n");
  auto probe = std::make_shared<EpochProbe>();
  l->add_callback(probe);
  l->fit({make_stage("a", 2), make_stage("b", 2)});
  EXPECT_EQ(probe->epochs, (std::vector<std::string>{"adam", "adam", "adam", "sgd"}));
  l->clear_callbacks();
}

TEST(OptimSwap, WhenBytesOverSwapsBeforeTheBatchAfterTheThresholdWasPassed) {
  // A run without the plugin gives the stage's peak before the first batch and after it.
  struct PeakProbe : Callback {
    std::string name() const override { return "peak_probe"; }
    void before_batch(Learner& l) override { peaks.push_back(l.stage_peak()); }
    std::vector<int64_t> peaks;
  };
  int64_t threshold = 0;
  {
    auto l = make_tiny_learner();
    auto p = std::make_shared<PeakProbe>();
    l->add_callback(p);
    l->fit(1);
    ASSERT_GE(p->peaks.size(), 2u);
    ASSERT_GT(p->peaks[1], p->peaks[0]);
    threshold = (p->peaks[0] + p->peaks[1]) / 2;
  }
  LogCapture cap;
  auto l = make_tiny_learner();
  PluginHost host;
  load(host, *l, "[plugins.optim_swap]\nwhen_bytes_over = \"" + std::to_string(threshold) + "\"\n");
  auto probe = std::make_shared<EpochProbe>();
  l->add_callback(probe);
  l->fit(1);
  EXPECT_EQ(probe->batches, (std::vector<std::string>{"adam", "sgd", "sgd", "sgd"}));
  EXPECT_TRUE(Has(cap.text(), "optim_swap: live memory reached"));
  l->clear_callbacks();
}

TEST(OptimSwap, OptionErrorsNameTheKeys) {
  PluginHost host;
  auto err = [&](const std::string& toml) {
    return config_error_of([&] { host.load(plugins_of(toml), "cfg.toml"); });
  };
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\n"),
                  "cfg.toml:1:1: optim_swap needs exactly one trigger: "
                  "'plugins.optim_swap.at_stage' (a stage name), 'plugins.optim_swap.at_epoch' "
                  "(epochs >= 1) or 'plugins.optim_swap.when_bytes_over' (a size); none is set"));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nat_stage = \"b\"\nat_epoch = 2\n"),
                  "'plugins.optim_swap.at_stage' and 'plugins.optim_swap.at_epoch' are set"));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nat_epoch = 1\nto = { name = \"sdg\" }\n"),
                  "cfg.toml:3:15: 'plugins.optim_swap.to.name' must be one of adafactor, adagrad, adam, "
                  "adam8bit, adamw, adamw8bit, rmsprop, sgd; got \"sdg\"; did you mean \"sgd\"?"));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nat_epoch = 1\nto = { lr = -1.0 }\n"),
                  "'plugins.optim_swap.to.lr' must be a number > 0, got -1.0"));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nat_epoch = 1\nto = { lf = 0.1 }\n"),
                  "unknown key 'plugins.optim_swap.to.lf'; did you mean 'plugins.optim_swap.to.lr'?"));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nat_epoch = -1\n"),
                  "cfg.toml:2:12: 'plugins.optim_swap.at_epoch' must be an integer >= 0, got -1"));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nwhen_bytes_over = \"2 parsecs\"\n"),
                  "'plugins.optim_swap.when_bytes_over' has an unknown unit \"parsecs\""));
  EXPECT_TRUE(Has(err("[plugins.optim_swap]\nat_epoch = 1\nseed_momentum = true\n"),
                  "'plugins.optim_swap.seed_momentum' seeds SGD's momentum buffers, so it needs "
                  "'plugins.optim_swap.to.name' = \"sgd\" and 'plugins.optim_swap.to.momentum' > 0"));
  EXPECT_TRUE(host.loaded().empty());
}

TEST(OptimSwap, UnknownStageStopsTheFitBeforeAnyBatchAndNamesTheNearest) {
  auto l = make_tiny_learner();
  PluginHost host;
  load(host, *l, "[plugins.optim_swap]\nat_stage = \"finetun\"\n");
  try {
    l->fit({make_stage("head", 1), make_stage("finetune", 1)});
    ADD_FAILURE() << "no error";
  } catch (const CallbackError& e) {
    EXPECT_TRUE(Has(e.what(), "'plugins.optim_swap.at_stage' = \"finetun\" names no stage of this "
                              "fit; did you mean \"finetune\"? The stages: \"head\", \"finetune\""));
  }
  EXPECT_EQ(l->iteration(), 0);
  l->clear_callbacks();
}

TEST(OptimSwap, ResumeSwapsAgainSoTheOptimizerStateLoadsIntoSgd) {
  TempDir dir;
  const std::string toml =
      "[plugins.optim_swap]\nat_stage = \"sgd\"\nto = { name = \"sgd\", lr = 0.1, momentum = 0.9 }\n";
  std::stringstream saved_state;
  std::vector<torch::Tensor> buffers;
  {
    auto l = make_tiny_learner();
    PluginHost host;
    auto cbs = load(host, *l, toml);
    l->fit({make_stage("adam", 1), make_stage("sgd", 1)});
    ASSERT_EQ(l->optimizer_options().name, "sgd");
    torch::serialize::OutputArchive out;
    cbs[0]->save_state(out);
    out.save_to(saved_state);
    l->save(dir.file("ckpt.pt"));
    for (const auto& p : l->model()->parameters())
      buffers.push_back(static_cast<torch::optim::SGDParamState&>(
                            *l->optimizer().state().at(compat::optimizer_state_key(p)))
                            .momentum_buffer()
                            .clone());
    l->clear_callbacks();
  }
  // Without the plugin's state the checkpoint's SGD state does not fit the fresh Adam.
  EXPECT_THROW(make_tiny_learner()->load(dir.file("ckpt.pt")), CheckpointError);

  auto l = make_tiny_learner();
  PluginHost host;
  auto cbs = load(host, *l, toml);
  torch::serialize::InputArchive in;
  in.load_from(saved_state);
  cbs[0]->load_state(*l, in);  // as the resume does: callbacks first, then the optimizer
  EXPECT_EQ(l->optimizer_options().name, "sgd");
  ASSERT_NO_THROW(l->load(dir.file("ckpt.pt")));
  auto params = l->model()->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::equal(static_cast<torch::optim::SGDParamState&>(
                                 *l->optimizer().state().at(compat::optimizer_state_key(params[i])))
                                 .momentum_buffer(),
                             buffers[i]));
  // The resumed fit does not swap again (that would drop the loaded momentum).
  const int64_t changes = l->optimizer_changes();
  l->fit({make_stage("sgd", 1)});
  EXPECT_EQ(l->optimizer_changes(), changes);
  l->clear_callbacks();

  // A run that had not swapped keeps its optimizer on resume.
  auto fresh = make_tiny_learner();
  PluginHost host2;
  auto cbs2 = load(host2, *fresh, toml);
  torch::serialize::OutputArchive out;
  cbs2[0]->save_state(out);
  std::stringstream not_swapped;
  out.save_to(not_swapped);
  torch::serialize::InputArchive in2;
  in2.load_from(not_swapped);
  cbs2[0]->load_state(*fresh, in2);
  EXPECT_EQ(fresh->optimizer_options().name, "adam");
  fresh->clear_callbacks();
}

}  // namespace
}  // namespace frugal::test
