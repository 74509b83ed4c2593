// The amp plugin: its GradScaler (plugins/amp/amp.h) called directly, and the plugin loaded
// through PluginHost into real fits (an injected inf, the scale's growth, grad_accum, bfloat16).
#include <cmath>

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include "amp.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace amp = frugal::amp;


TinySetup setup(int64_t samples, int64_t batch) { return exact_setup(samples, batch, 0.1); }

/// Sets one gradient element to inf after the backward of the chosen batches. Order 100: in
/// after_* events it runs before amp (50), as a real overflow would.
struct InjectInf : Callback {
  std::vector<int64_t> at;
  std::string name() const override { return "inject_inf"; }
  int order() const override { return 100; }
  void after_backward(Learner& l) override {
    if (std::find(at.begin(), at.end(), l.iteration()) == at.end()) return;
    auto g = l.model()->parameters()[0].grad();
    torch::NoGradGuard no_grad;
    g.view(-1)[0] = std::numeric_limits<float>::infinity();
  }
};

/// Order 0: in after_* events it runs after amp, so it reads the loss scale amp applied.
struct Probe : Callback {
  std::string name() const override { return "probe"; }
  void after_forward(Learner& l) override { pred_dtype = l.pred().scalar_type(); }
  void after_loss(Learner& l) override {
    scales.push_back(l.loss_scale());
    loss_dtype = l.loss().scalar_type();
  }
  void before_step(Learner& l) override {
    if (l.step_skipped()) return;
    double sq = 0;
    for (const auto& p : l.model()->parameters())
      if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
    grad_norms.push_back(std::sqrt(sq));
  }
  void after_batch(Learner& l) override { params.push_back(clone_params(*l.model())); }
  std::vector<double> scales, grad_norms;
  std::vector<std::vector<torch::Tensor>> params;
  at::ScalarType pred_dtype = at::kFloat, loss_dtype = at::kFloat;
};

std::shared_ptr<spdlog::logger> quiet_logger() {
  return std::make_shared<spdlog::logger>("amp-test");  // no sinks
}

TEST(AmpGradScaler, UnscaleDividesAndFindsInfAndNan) {
  amp::GradScaler s({1024.0, 2.0, 0.5, 2000});
  std::vector<torch::Tensor> g = {torch::full({3}, 2048.0), torch::Tensor(), torch::full({2}, 512.0)};
  EXPECT_FALSE(s.unscale(g));
  EXPECT_TRUE(torch::equal(g[0], torch::full({3}, 2.0)));
  EXPECT_TRUE(torch::equal(g[2], torch::full({2}, 0.5)));
  EXPECT_EQ(s.unscale_calls(), 1);
  EXPECT_TRUE(amp::unscale_and_check({torch::tensor({1.0f, INFINITY})}, 0.5));
  EXPECT_TRUE(amp::unscale_and_check({torch::tensor({NAN, 1.0f})}, 0.5));
  EXPECT_FALSE(amp::unscale_and_check({}, 0.5));
}

TEST(AmpGradScaler, UpdateBacksOffAndGrowsLikePyTorch) {
  amp::GradScaler s({65536.0, 2.0, 0.5, 3});
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.growth_tracker(), 2);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.update(false);
  s.update(true);  // an overflow resets the tracker
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_EQ(s.skipped_steps(), 1);
  s.update(false);
  const amp::ScalerState saved = s.state();
  amp::GradScaler resumed({65536.0, 2.0, 0.5, 3});
  resumed.load_state(saved);
  EXPECT_EQ(resumed.scale(), 65536.0);
  EXPECT_EQ(resumed.growth_tracker(), 1);
  EXPECT_THROW(amp::GradScaler({0.0, 2.0, 0.5, 1}), std::invalid_argument);
  EXPECT_THROW(amp::GradScaler({1.0, 1.0, 0.5, 1}), std::invalid_argument);
  EXPECT_THROW(amp::GradScaler({1.0, 2.0, 1.0, 1}), std::invalid_argument);
}

TEST(AmpPlugin, InfGradientSkipsTheStepHalvesTheScaleAndKeepsParameters) {
  PluginHost host;
  auto l = make_tiny_learner(setup(64, 16));
  for (auto& cb : host.load(plugins_of("[plugins.amp]\nscaler = \"on\"\ninit_scale = 1024\n"),
                            "cfg.toml"))
    l->add_callback(cb);
  auto inject = std::make_shared<InjectInf>();
  inject->at = {0};
  auto probe = std::make_shared<Probe>();
  l->add_callback(inject);
  l->add_callback(probe);
  const auto before = clone_params(*l->model());
  l->fit(1);
  EXPECT_EQ(probe->scales, (std::vector<double>{1024, 512, 512, 512}));
  EXPECT_EQ(l->steps(), 3);  // the first batch's step was dropped
  EXPECT_TRUE(params_equal(*l->model(), before) == false);
  // After the first batch nothing moved: the step was skipped and its gradients dropped.
  for (size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(torch::equal(probe->params[0][i], before[i])) << "param " << i;
  EXPECT_FALSE(compat::autocast_enabled(torch::kCPU));
  l.reset();
}

TEST(AmpPlugin, ScaleGrowsAfterGrowthIntervalGoodSteps) {
  PluginHost host;
  auto l = make_tiny_learner(setup(112, 16));  // 7 batches
  for (auto& cb : host.load(plugins_of("[plugins.amp]\nscaler = \"on\"\ninit_scale = 1024\n"
                                       "growth_interval = 3\n"),
                            "cfg.toml"))
    l->add_callback(cb);
  auto probe = std::make_shared<Probe>();
  l->add_callback(probe);
  l->fit(1);
  EXPECT_EQ(probe->scales, (std::vector<double>{1024, 1024, 1024, 2048, 2048, 2048, 4096}));
  EXPECT_EQ(l->steps(), 7);
  l.reset();
}

TEST(AmpPlugin, Bfloat16FitLowersTheLossOnCpu) {
  PluginHost host;
  TinySetup s = setup(256, 32);
  s.optimizer = "adam";
  s.lr = 1e-2;
  s.valid_samples = 32;
  auto l = make_tiny_learner(s);
  for (auto& cb : host.load(plugins_of("[plugins.amp]\n"), "cfg.toml")) l->add_callback(cb);
  auto probe = std::make_shared<Probe>();
  l->add_callback(probe);
  l->fit({make_stage("first", 1), make_stage("more", 4)});
  EXPECT_EQ(probe->pred_dtype, at::kBFloat16) << "the forward ran under autocast";
  EXPECT_EQ(probe->scales.back(), 1.0) << "bfloat16 needs no loss scaling";
  const auto& st = l->stage_stats();
  EXPECT_TRUE(std::isfinite(st[1].last_epoch_loss));
  EXPECT_LT(st[1].last_epoch_loss, st[0].last_epoch_loss * 0.9)
      << st[0].last_epoch_loss << " -> " << st[1].last_epoch_loss;
  EXPECT_GE(st[1].valid_accuracy, 0.0);
  EXPECT_FALSE(compat::autocast_enabled(torch::kCPU)) << "autocast is off after the fit";
  l.reset();
}

TEST(AmpPlugin, Float16OnCpuIsAClearError) {
  PluginHost host;
  auto l = make_tiny_learner(setup(32, 16));
  for (auto& cb : host.load(plugins_of("[plugins.amp]\ndtype = \"float16\"\n"), "cfg.toml"))
    l->add_callback(cb);
  try {
    l->fit(1);
    FAIL() << "float16 on cpu did not stop the fit";
  } catch (const CallbackError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("amp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float16"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dtype = \"bfloat16\""), std::string::npos) << msg;
  }
  EXPECT_EQ(l->iteration(), 0);
  EXPECT_FALSE(compat::autocast_enabled(torch::kCPU));
  l.reset();
}

TEST(AmpPlugin, BadOptionsNameTheKey) {
  PluginHost host;
  auto error_of = [&](const std::string& text) {
    try {
      host.load(plugins_of(text), "cfg.toml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const char* key : {"backoff_factor = 1.5", "growth_factor = 1.0", "growth_interval = 0",
                          "init_scale = 0.0", "dtype = \"fp16\"", "scaler = \"yes\""}) {
    const std::string text = std::string("[plugins.amp]\n") + key + "\n";
    const std::string msg = error_of(text);
    const std::string name = std::string(key).substr(0, std::string(key).find(' '));
    EXPECT_NE(msg.find(name), std::string::npos) << key << ": " << msg;
  }
}

TEST(AmpWithGradAccum, GradAccumRunsFirstWhenBothAreLoaded) {
  PluginHost host;
  auto cbs = host.load(plugins_of("[plugins.amp]\n[plugins.grad_accum]\n"), "cfg.toml");
  ASSERT_EQ(cbs.size(), 2u);
  int amp_order = 0, accum_order = 0;
  for (const auto& cb : cbs) (cb->name() == "amp" ? amp_order : accum_order) = cb->order();
  EXPECT_LT(accum_order, amp_order);
  auto l = make_tiny_learner(setup(64, 16));
  for (auto& cb : cbs) l->add_callback(cb);
  cbs.clear();
  l->fit(1);
  EXPECT_EQ(l->steps(), 4);
  l.reset();
}

/// grad_accum (loaded) + an Amp built here (to read its scaler) with the scaler on.
struct AccumRun {
  int64_t unscales = 0, steps = 0;
  std::vector<double> grad_norms;
  std::vector<torch::Tensor> params;
};
AccumRun accum_run(const std::string& mode, bool with_amp) {
  PluginHost host;
  auto l = make_tiny_learner(setup(128, 16));  // 8 batches
  for (auto& cb : host.load(plugins_of("[plugins.grad_accum]\nsteps = 4\nmode = \"" + mode + "\"\n"),
                            "cfg.toml"))
    l->add_callback(cb);
  amp::AmpOptions o;
  o.scaler = "on";
  auto a = std::make_shared<amp::Amp>(o, PluginContext{"amp", quiet_logger()});
  if (with_amp) l->add_callback(a);
  auto probe = std::make_shared<Probe>();
  l->add_callback(probe);
  l->fit(1);
  AccumRun r{a->scaler().unscale_calls(), l->steps(), probe->grad_norms, clone_params(*l->model())};
  l.reset();
  return r;
}

TEST(AmpWithGradAccum, UnscalesOncePerOptimizerStep) {
  const AccumRun acc = accum_run("accumulate", true);
  const AccumRun ref = accum_run("accumulate", false);
  EXPECT_EQ(acc.steps, 2);
  EXPECT_EQ(acc.unscales, 2);
  ASSERT_EQ(acc.grad_norms.size(), 2u);
  ASSERT_EQ(ref.grad_norms.size(), 2u);
  // The stepped gradients are the true ones (bfloat16 rounding only), not 65536 times them.
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(acc.grad_norms[i] / ref.grad_norms[i], 1.0, 0.05)
        << acc.grad_norms[i] << " vs " << ref.grad_norms[i];

  const AccumRun split = accum_run("split", true);
  EXPECT_EQ(split.steps, 8);
  EXPECT_EQ(split.unscales, 8);  // once per batch, not once per micro-batch
  const AccumRun split_ref = accum_run("split", false);
  for (size_t i = 0; i < split.grad_norms.size(); ++i)
    EXPECT_NEAR(split.grad_norms[i] / split_ref.grad_norms[i], 1.0, 0.05);
}

/// Throws at the n-th batch: a run that dies mid accumulation group.
struct Crash : Callback {
  explicit Crash(int64_t batch) : at(batch) {}
  std::string name() const override { return "crash"; }
  void before_batch(Learner& l) override {
    if (l.iteration() == at) throw std::runtime_error("killed");
  }
  int64_t at;
};

struct ResumeRun {
  std::vector<torch::Tensor> params;
  amp::ScalerState scaler;
  int64_t steps = 0;
};

/// grad_accum (accumulate, 2 batches a step) and amp with a scaler that grows every 2 good
/// steps and backs off at an injected inf; checkpoints after every step. With `crash_at`, the
/// run dies there and a fresh learner resumes from the last checkpoint.
ResumeRun accum_amp_run(const std::string& ckpt, int64_t crash_at) {
  PluginHost host;
  auto build = [&](bool crash) {
    auto l = make_tiny_learner(setup(96, 16));  // 6 batches an epoch: 3 groups
    for (auto& cb : host.load(plugins_of("[plugins.grad_accum]\nsteps = 2\nmode = \"accumulate\"\n"),
                              "cfg.toml"))
      l->add_callback(cb);
    amp::AmpOptions o;
    o.scaler = "on";
    o.init_scale = 1024;
    o.growth_interval = 2;
    auto a = std::make_shared<amp::Amp>(o, PluginContext{"amp", quiet_logger()});
    l->add_callback(a);
    auto inject = std::make_shared<InjectInf>();
    inject->at = {7};
    l->add_callback(inject);
    l->add_callback(std::make_shared<CheckpointWriter>(ckpt, 1, 0));
    if (crash) l->add_callback(std::make_shared<Crash>(crash_at));
    return std::make_pair(std::move(l), a);
  };
  auto [l, a] = build(crash_at > 0);
  if (crash_at > 0) {
    EXPECT_THROW(l->fit(3), CallbackError);
    l.reset();
    auto resumed = build(false);
    l = std::move(resumed.first);
    a = resumed.second;
    l->load_checkpoint(ckpt);
    EXPECT_EQ(l->pending_resume()->batch % 2, 0) << "checkpoints fall between groups";
  }
  l->fit(3);
  ResumeRun r{clone_params(*l->model()), a->scaler().state(), l->steps()};
  l.reset();
  return r;
}

TEST(AmpWithGradAccum, ResumeMidGroupContinuesBitwiseWithTheScalerState) {
  TempDir dir;
  const ResumeRun ref = accum_amp_run(dir.file("ref.ckpt"), 0);
  EXPECT_EQ(ref.steps, 8) << "9 groups, one skipped for the injected inf";
  EXPECT_NE(ref.scaler.scale, 1024.0) << "the scale moved, so its state matters";
  for (int64_t crash : {3, 8, 11}) {  // mid-group, after the inf, in the last epoch
    const ResumeRun r = accum_amp_run(dir.file("run" + std::to_string(crash) + ".ckpt"), crash);
    EXPECT_EQ(r.steps, ref.steps) << crash;
    EXPECT_EQ(r.scaler.scale, ref.scaler.scale) << crash;
    EXPECT_EQ(r.scaler.growth_tracker, ref.scaler.growth_tracker) << crash;
    for (size_t i = 0; i < ref.params.size(); ++i)
      EXPECT_TRUE(torch::equal(r.params[i], ref.params[i])) << "crash at " << crash << ", parameter " << i;
  }
}

TEST(AmpPlugin, SaveStateLoadStateRoundTripsTheScaler) {
  amp::AmpOptions o;
  o.scaler = "on";
  amp::Amp a(o, PluginContext{"amp", quiet_logger()});
  a.scaler().load_state({256.0, 7});
  torch::serialize::OutputArchive out;
  a.save_state(out);
  TempDir dir;
  out.save_to(dir.file("s"));
  torch::serialize::InputArchive in;
  in.load_from(dir.file("s"));
  amp::Amp b(o, PluginContext{"amp", quiet_logger()});
  auto l = make_tiny_learner(setup(32, 16));
  b.load_state(*l, in);
  EXPECT_EQ(b.scaler().scale(), 256.0);
  EXPECT_EQ(b.scaler().growth_tracker(), 7);
  torch::serialize::InputArchive empty;
  EXPECT_THROW(b.load_state(*l, empty), std::runtime_error);
}

}  // namespace
}  // namespace frugal::test
