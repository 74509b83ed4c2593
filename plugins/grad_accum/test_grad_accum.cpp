// The grad_accum plugin: its group arithmetic (plugins/grad_accum/grad_accum.h) called directly,
// and the plugin loaded through PluginHost into real fits compared with plain large batches.
#include <gtest/gtest.h>

#include "grad_accum.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace ga = frugal::grad_accum;


TinySetup accum_setup(int64_t samples, int64_t batch) { return exact_setup(samples, batch, 0.5); }

/// Records how many micro-batches each batch ran as.
struct MicroProbe : Callback {
  std::string name() const override { return "micro_probe"; }
  void after_batch(Learner& l) override { micro.push_back(l.micro_count()); }
  std::vector<int64_t> micro;
};

struct FitResult {
  std::vector<torch::Tensor> params;
  int64_t steps = 0, iterations = 0;
  std::vector<int64_t> micro;
};

/// Fits one epoch (or `epochs`) with the [plugins] of `toml` (none when empty).
FitResult fit_with(const std::string& toml, const TinySetup& s, int64_t epochs = 1,
             int64_t max_batches = 0) {
  PluginHost host;
  auto l = make_tiny_learner(s);
  if (!toml.empty())
    for (auto& cb : host.load(plugins_of(toml), "cfg.toml")) l->add_callback(cb);
  auto probe = std::make_shared<MicroProbe>();
  l->add_callback(probe);
  l->set_max_batches(max_batches);
  l->fit(epochs);
  FitResult r{clone_params(*l->model()), l->steps(), l->iteration(), probe->micro};
  l.reset();  // the plugin's callbacks die before the host unloads it
  return r;
}

void expect_close(const FitResult& a, const FitResult& b, double tol = 1e-5) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(torch::allclose(a.params[i], b.params[i], tol, tol))
        << "param " << i << ": max diff " << (a.params[i] - b.params[i]).abs().max().item<double>();
}

TEST(GradAccumMath, GroupsCoverTheEpochAndWeighBatchesBySamples) {
  // 56 samples in batches of 16: 16, 16, 16, 8.
  EXPECT_EQ(ga::batch_samples(3, 16, 56), 8);
  auto g = ga::group_of(1, 3, 4, 16, 56);
  EXPECT_EQ(g.first, 0);
  EXPECT_EQ(g.last, 2);
  EXPECT_EQ(g.samples, 48);
  EXPECT_FALSE(g.closes);
  EXPECT_FALSE(g.partial);
  EXPECT_DOUBLE_EQ(g.weight(), 1.0 / 3.0);
  auto last = ga::group_of(3, 3, 4, 16, 56);
  EXPECT_TRUE(last.closes);
  EXPECT_TRUE(last.partial);
  EXPECT_EQ(last.samples, 8);
  EXPECT_DOUBLE_EQ(last.weight(), 1.0);
  auto uneven = ga::group_of(3, 2, 4, 16, 56);  // 16 + 8
  EXPECT_EQ(uneven.samples, 24);
  EXPECT_DOUBLE_EQ(uneven.weight(), 8.0 / 24.0);
  EXPECT_FALSE(uneven.partial);
  EXPECT_EQ(ga::split_size(64, 4), 16);
  EXPECT_EQ(ga::split_size(10, 4), 3);
  EXPECT_THROW(ga::group_of(4, 2, 4, 16, 56), std::invalid_argument);
  EXPECT_THROW(ga::split_size(8, 0), std::invalid_argument);
}

TEST(GradAccumAccumulate, FourBatchesOf16EqualOneStepOn64) {
  const FitResult acc = fit_with("[plugins.grad_accum]\nsteps = 4\nmode = \"accumulate\"\n", accum_setup(64, 16));
  const FitResult big = fit_with("", accum_setup(64, 64));
  EXPECT_EQ(acc.iterations, 4);
  EXPECT_EQ(acc.steps, 1);
  EXPECT_EQ(big.steps, 1);
  expect_close(acc, big);
  const FitResult plain = fit_with("", accum_setup(64, 16));  // 4 steps: the comparison can fail
  EXPECT_FALSE(torch::allclose(plain.params[0], big.params[0], 1e-5, 1e-5));
}

TEST(GradAccumAccumulate, UnevenLastGroupIsExact) {
  // 56 samples: batches 16, 16, 16, 8.
  const char* two = "[plugins.grad_accum]\nsteps = 2\nmode = \"accumulate\"\n";
  const FitResult acc2 = fit_with(two, accum_setup(56, 16));
  const FitResult big32 = fit_with("", accum_setup(56, 32));  // 32, 24
  EXPECT_EQ(acc2.steps, 2);
  EXPECT_EQ(big32.steps, 2);
  expect_close(acc2, big32);

  const char* four = "[plugins.grad_accum]\nsteps = 4\nmode = \"accumulate\"\n";
  const FitResult acc4 = fit_with(four, accum_setup(56, 16));
  const FitResult big56 = fit_with("", accum_setup(56, 56));
  EXPECT_EQ(acc4.steps, 1);
  expect_close(acc4, big56);
}

TEST(GradAccumAccumulate, OptimizerStepsAreCountedAndPartialGroupsStepOrDrop) {
  const TinySetup s = accum_setup(128, 16);  // 8 batches per epoch
  EXPECT_EQ(fit_with("[plugins.grad_accum]\nsteps = 4\nmode = \"accumulate\"\n", s).steps, 2);
  EXPECT_EQ(fit_with("[plugins.grad_accum]\nsteps = 4\nmode = \"accumulate\"\n", s, 3).steps, 6);
  EXPECT_EQ(fit_with("[plugins.grad_accum]\nsteps = 3\nmode = \"accumulate\"\n", s).steps, 3);
  const char* drop =
      "[plugins.grad_accum]\nsteps = 3\nmode = \"accumulate\"\nstep_last_partial = false\n";
  const FitResult dropped = fit_with(drop, s, 2);
  EXPECT_EQ(dropped.steps, 4);
  EXPECT_EQ(dropped.iterations, 16);
  // The dropped group changes nothing: the same as stopping before it.
  const FitResult stopped = fit_with(drop, s, 1, 6);
  const FitResult one_epoch = fit_with(drop, s, 1);
  EXPECT_EQ(one_epoch.steps, 2);
  expect_close(one_epoch, stopped, 0);
}

TEST(GradAccumSplit, SplitBatchEqualsTheWholeBatch) {
  const FitResult split = fit_with("[plugins.grad_accum]\nsteps = 4\n", accum_setup(64, 32));
  const FitResult whole = fit_with("", accum_setup(64, 32));
  EXPECT_EQ(split.micro, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(whole.micro, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(split.steps, 2);
  expect_close(split, whole);
  // Uneven: 56 samples in batches of 32 (32, 24) as micro-batches of 11.
  const FitResult uneven = fit_with("[plugins.grad_accum]\nsteps = 3\n", accum_setup(56, 32));
  EXPECT_EQ(uneven.micro, (std::vector<int64_t>{3, 3}));
  expect_close(uneven, fit_with("", accum_setup(56, 32)));
}

TEST(GradAccumSplit, MicroBatchSizeIsRestoredAfterTheFit) {
  PluginHost host;
  auto l = make_tiny_learner(accum_setup(64, 16));
  for (auto& cb : host.load(plugins_of("[plugins.grad_accum]\nsteps = 2\n"), "cfg.toml"))
    l->add_callback(cb);
  l->fit(1);
  EXPECT_EQ(l->micro_batch_size(), 0);
  l.reset();
}

TEST(GradAccumOptions, BadOptionsNameTheKey) {
  PluginHost host;
  auto error_of = [&](const std::string& text) {
    try {
      host.load(plugins_of(text), "cfg.toml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string steps = error_of("[plugins.grad_accum]\nsteps = 0\n");
  EXPECT_NE(steps.find("steps"), std::string::npos) << steps;
  const std::string mode = error_of("[plugins.grad_accum]\nmode = \"sum\"\n");
  EXPECT_NE(mode.find("mode"), std::string::npos) << mode;
  EXPECT_NE(mode.find("accumulate"), std::string::npos) << mode;
  const std::string partial = error_of("[plugins.grad_accum]\nstep_last_partial = 1\n");
  EXPECT_NE(partial.find("step_last_partial"), std::string::npos) << partial;
  const std::string typo = error_of("[plugins.grad_accum]\nstep = 2\n");
  EXPECT_NE(typo.find("steps"), std::string::npos) << typo;  // did you mean
}

}  // namespace
}  // namespace frugal::test
