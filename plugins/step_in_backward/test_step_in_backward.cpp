// The step_in_backward plugin: parameters after real fits equal the plain loop's (SGD with
// momentum, Adam, Adafactor; micro-batches; amp bfloat16 with checkpoint's recompute), the
// gradient bytes at the step's peak measured by the memory meter, a scaled loss refused.
#include <iostream>

#include <gtest/gtest.h>

#include "step_in_backward.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"

// Its own namespace: unity builds put several test files in one translation unit.
namespace frugal::test::sib_test {
namespace {

/// At before_step: the bytes of the gradients still alive (none when every parameter stepped
/// in backward).
struct GradProbe : Callback {
  std::string name() const override { return "grad_probe"; }
  void before_step(Learner& l) override { at_step.push_back(gradient_bytes(*l.model())); }
  std::vector<int64_t> at_step;
};

/// The memory meter around each training step: live bytes when backward starts, the highest
/// live bytes from there to the end of the optimizer step, and the live bytes after it.
struct StepPeakProbe : Callback {
  std::string name() const override { return "step_peak_probe"; }
  void before_backward(Learner& l) override {
    window = l.memory().open_window();
  }
  void after_step(Learner& l) override {
    // above what stays after the step (parameters, optimizer state, the batch): what the
    // backward and step held at their peak, gradients and the last activations
    excess.push_back(window.peak() - l.memory().current());
    window.close();
  }
  MemoryWindow window;
  std::vector<int64_t> excess;
};

struct FitResult {
  std::vector<torch::Tensor> params;
  int64_t steps = 0, state_bytes = 0;
  std::vector<int64_t> grads_at_step, step_excess;
};

struct Run {
  std::string plugins;       // [plugins] TOML, "" = none
  OptimizerOptions optimizer;
  int64_t micro = 0;         // > 0: micro-batches of this size
};

/// One epoch of `s` with the run's plugins and optimizer.
FitResult fit_with(const Run& run, const TinySetup& s) {
  PluginHost host;
  auto l = make_tiny_learner(s);
  l->set_optimizer(run.optimizer);
  if (!run.plugins.empty())
    for (auto& cb : host.load(plugins_of(run.plugins), "cfg.toml")) l->add_callback(cb);
  auto grads = std::make_shared<GradProbe>();
  auto peak = std::make_shared<StepPeakProbe>();
  l->add_callback(grads);
  l->add_callback(peak);
  l->set_micro_batch_size(run.micro);
  l->fit(1);
  FitResult r{clone_params(*l->model()), l->steps(), optimizer_state_bytes(l->optimizer()),
              grads->at_step, peak->excess};
  l.reset();  // the plugin's callbacks die before the host unloads it
  return r;
}

double max_diff(const FitResult& a, const FitResult& b) {
  double d = 0;
  for (size_t i = 0; i < a.params.size(); ++i)
    d = std::max(d, (a.params[i] - b.params[i]).abs().max().item<double>());
  return d;
}

OptimizerOptions optimizer(const std::string& name, double lr, double momentum = -1) {
  OptimizerOptions o;
  o.name = name;
  o.lr = lr;
  if (momentum >= 0) o.set("momentum", momentum);
  return o;
}

const std::string kPlugin = "[plugins.step_in_backward]\n";

TEST(StepInBackward, SgdMomentumAdamAndAdafactorMatchThePlainLoop) {
  const TinySetup s = exact_setup(64, 16, 0.05);  // 4 batches, in order
  for (const OptimizerOptions& o :
       {optimizer("sgd", 0.05, 0.9), optimizer("adam", 1e-2), optimizer("adafactor", 1e-2)}) {
    const FitResult plain = fit_with({"", o}, s);
    const FitResult in_backward = fit_with({kPlugin, o}, s);
    ASSERT_EQ(in_backward.steps, 4) << o.name;
    EXPECT_LE(max_diff(plain, in_backward), 1e-6) << o.name;
    FitResult initial;
    initial.params = clone_params(*make_tiny_learner(s)->model());
    EXPECT_GT(max_diff(plain, initial), 1e-3)
        << o.name << ": the parameters moved";
    EXPECT_EQ(plain.state_bytes, in_backward.state_bytes)
        << o.name << ": the state lives in the Learner's optimizer, as in the plain loop";
    for (int64_t b : plain.grads_at_step) EXPECT_GT(b, 0) << o.name;
    for (int64_t b : in_backward.grads_at_step) EXPECT_EQ(b, 0) << o.name << ": all freed";
  }
}

TEST(StepInBackward, MicroBatchesStepOnceOnTheLastOne) {
  const TinySetup s = exact_setup(64, 16, 0.05);
  const OptimizerOptions adam = optimizer("adam", 1e-2);
  const FitResult plain = fit_with({"", adam, 5}, s);  // 5 + 5 + 5 + 1 samples
  const FitResult in_backward = fit_with({kPlugin, adam, 5}, s);
  EXPECT_EQ(in_backward.steps, 4);
  EXPECT_LE(max_diff(plain, in_backward), 1e-6);
  for (int64_t b : in_backward.grads_at_step) EXPECT_EQ(b, 0);
}

TEST(StepInBackward, GradientBytesAtTheStepsPeakFallToAboutTheLargestParameter) {
  // Parameters dominate: an MLP of 256-wide layers on 2 samples of 16 x 16.
  TinySetup s;
  s.samples = 6;
  s.batch_size = 2;
  s.image_size = 16;
  s.width = 256;
  s.depth = 4;
  s.valid_samples = 0;
  const OptimizerOptions sgd = optimizer("sgd", 1e-2);  // no state, no temporaries
  const TrainableBytes p = trainable_bytes(*make_tiny_learner(s)->model());
  const FitResult plain = fit_with({"", sgd}, s);
  const FitResult in_backward = fit_with({kPlugin, sgd}, s);
  ASSERT_EQ(plain.step_excess.size(), 3u);
  ASSERT_EQ(in_backward.step_excess.size(), 3u);
  std::cout << "[step_in_backward] gradients " << p.total << " B, largest parameter " << p.largest
            << " B; backward+step peak above the live bytes after the step: plain "
            << plain.step_excess.back() << " B, step_in_backward " << in_backward.step_excess.back()
            << " B\n";
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_GE(plain.step_excess[i], p.total) << "the plain loop holds every gradient at once";
    EXPECT_LE(in_backward.step_excess[i], p.largest + p.largest / 4)
        << "one gradient (and a few activations) at a time";
    EXPECT_GE(in_backward.step_excess[i], p.largest) << "the largest gradient is alive once";
  }
}

/// Scales the loss as a float16 loss scaler would.
struct LossScaler : Callback {
  std::string name() const override { return "loss_scaler"; }
  void after_loss(Learner& l) override { l.scale_loss(1024.0); }
};

TEST(StepInBackward, AScaledLossIsRefusedNamingBfloat16) {
  PluginHost host;
  auto l = make_tiny_learner(exact_setup(32, 16, 0.05));
  for (auto& cb : host.load(plugins_of(kPlugin), "cfg.toml")) l->add_callback(cb);
  l->add_callback(std::make_shared<LossScaler>());
  const auto before = clone_params(*l->model());
  try {
    l->fit(1);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step_in_backward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dtype = \"bfloat16\""), std::string::npos) << msg;
  }
  EXPECT_TRUE(params_equal(*l->model(), before)) << "refused before any step";
  l.reset();
}

TEST(StepInBackward, ComposesWithAmpBfloat16AndCheckpointsRecompute) {
  TinySetup s = exact_setup(64, 16, 0.05);
  s.depth = 4;
  const std::string others =
      "[plugins.amp]\ndtype = \"bfloat16\"\n[plugins.checkpoint]\nsegments = 2\n";
  const OptimizerOptions adam = optimizer("adam", 1e-2);
  const FitResult plain = fit_with({others, adam}, s);
  const FitResult in_backward = fit_with({others + kPlugin, adam}, s);
  EXPECT_EQ(in_backward.steps, 4);
  EXPECT_LE(max_diff(plain, in_backward), 1e-6);
  for (int64_t b : in_backward.grads_at_step) EXPECT_EQ(b, 0);
}

TEST(StepInBackward, StepOneStepsOnlyThatParameterAndRestoresTheGroups) {
  auto a = torch::ones({3}, torch::requires_grad()), b = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({a, b}, torch::optim::SGDOptions(0.5));
  (a.sum() + b.sum()).backward();
  EXPECT_TRUE(step_in_backward::step_one(opt, a));
  EXPECT_TRUE(torch::equal(a.detach(), torch::full({3}, 0.5)));
  EXPECT_TRUE(torch::equal(b.detach(), torch::ones({2}))) << "b has a gradient but did not step";
  ASSERT_EQ(opt.param_groups()[0].params().size(), 2u);
  EXPECT_TRUE(opt.param_groups()[0].params()[1].is_same(b));
  EXPECT_FALSE(step_in_backward::step_one(opt, torch::ones({1})));
}

}  // namespace
}  // namespace frugal::test::sib_test
