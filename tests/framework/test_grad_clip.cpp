// Gradient clipping (callbacks/grad_clip.h): PyTorch's formula; the gradients the optimizer
// sees are clipped, once per step, after the last micro-batch; a stage's own keys apply to it
// alone; bad values and step_in_backward are refused naming the key.
#include <cmath>

#include "cli_support.h"
#include "frugal/callbacks/grad_clip.h"
#include "frugal/frugal.h"
#include "learner_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

std::vector<torch::Tensor> params_with_grads(uint64_t seed, double grad_scale) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> ps;
  for (auto shape : {std::vector<int64_t>{7, 5}, {5}, {3, 2, 2}}) {
    auto p = torch::randn(shape).requires_grad_();
    p.mutable_grad() = torch::randn(shape) * grad_scale;
    ps.push_back(p);
  }
  auto unused = torch::randn({4}).requires_grad_();  // no gradient: left out
  ps.push_back(unused);
  return ps;
}

double global_norm(const std::vector<torch::Tensor>& ps) {
  double sq = 0;
  for (const auto& p : ps)
    if (p.grad().defined()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  return std::sqrt(sq);
}

TEST(GradClip, TheNormIsLibTorchsAndTheGradientsAreScaledAsItsAre) {
  for (double scale : {0.01, 10.0}) {
    auto ours = params_with_grads(1, scale), theirs = params_with_grads(1, scale);
    const double before = global_norm(ours);
    const double norm = clip_grad_norm(ours, 1.0);
    std::vector<torch::Tensor> with_grads(theirs.begin(), theirs.end() - 1);
    const double ref = torch::nn::utils::clip_grad_norm_(with_grads, 1.0);
    EXPECT_NEAR(norm, before, 1e-5 * before);
    EXPECT_NEAR(norm, ref, 1e-6 * ref);
    for (size_t i = 0; i + 1 < ours.size(); ++i)
      EXPECT_TRUE(torch::allclose(ours[i].grad(), theirs[i].grad(), 1e-6, 0)) << i;
    // Above the limit: scaled to it; below: unchanged (the factor clamps at 1).
    EXPECT_NEAR(global_norm(ours), std::min(before, 1.0), 1e-5);
    EXPECT_FALSE(ours.back().grad().defined());
  }
  auto ps = params_with_grads(2, 1.0);
  clip_grad_value(ps, 0.1);
  for (size_t i = 0; i + 1 < ps.size(); ++i) EXPECT_LE(ps[i].grad().abs().max().item<float>(), 0.1f);
}

/// The global norm of the gradients the optimizer is about to use (after grad_clip).
struct NormProbe : Callback {
  std::string name() const override { return "norm_probe"; }
  int order() const override { return order::kGradientClip + 1; }
  void before_step(Learner& l) override {
    if (!l.step_skipped()) norms.push_back(global_norm(l.model()->parameters()));
  }
  std::vector<double> norms;
};

TEST(GradClip, TheOptimizerSeesClippedGradientsAndMicroBatchesClipAsTheWholeBatch) {
  TinySetup s = exact_setup(64, 16, 0.5);
  auto run = [&](int64_t micro) {
    auto l = make_tiny_learner(s);
    l->set_micro_batch_size(micro);
    OptimizerOptions o = l->optimizer_options();
    o.clip_grad_norm = 0.05;
    l->set_optimizer(o);
    auto clip = std::make_shared<GradClip>();
    auto probe = std::make_shared<NormProbe>();
    l->add_callback(clip);
    l->add_callback(probe);
    l->fit(2);
    EXPECT_EQ(clip->record()["steps"].get<int64_t>(), l->steps());
    EXPECT_GT(clip->record()["scaled_steps"].get<int64_t>(), 0) << clip->record().dump();
    for (double n : probe->norms) EXPECT_LE(n, 0.05 * (1 + 1e-5));
    return clone_params(*l->model());
  };
  const auto whole = run(0);
  const auto split = run(5);  // uneven micro-batches of one 16-sample batch: clipped once, at the end
  ASSERT_EQ(whole.size(), split.size());
  for (size_t i = 0; i < whole.size(); ++i)
    EXPECT_TRUE(torch::allclose(whole[i], split[i], 1e-5, 1e-6)) << i;
  auto plain = make_tiny_learner(s);
  plain->fit(2);
  EXPECT_FALSE(torch::allclose(clone_params(*plain->model())[0], whole[0], 1e-5, 1e-6))
      << "clipping changed nothing: the limit is above every norm";
}

std::string clip_config(const std::string& out, const std::string& optimizer_keys, const std::string& stages) {
  return "[run]\nout_dir = \"" + out + "\"\nprogress = \"none\"\nthreads = 1\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\nbatch_size = 16\n"
         "[model]\narch = \"mlp\"\nwidth = 8\ndepth = 1\n[optimizer]\nname = \"sgd\"\nlr = 0.1\n" +
         optimizer_keys + stages;
}

TEST(GradClipCli, AStagesOwnKeysClipThatStageAloneAndTheReportCountsIt) {
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("c.toml"),
             clip_config(out, "", "[[stages]]\nname = \"free\"\nepochs = 1\n"
                                  "[[stages]]\nname = \"clipped\"\nepochs = 1\n"
                                  "[stages.optimizer]\nclip_grad_norm = 1e-4\n"));
  const CliResult r = run_cli("train " + dir.file("c.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto report = nlohmann::json::parse(read_text(out + "/report.json"));
  const auto& clip = report.at("grad_clip");
  EXPECT_EQ(clip.at("steps").get<int64_t>(), 4) << clip.dump();  // the second stage's 4 steps
  EXPECT_EQ(clip.at("scaled_steps").get<int64_t>(), 4) << clip.dump();

  write_text(dir.file("bad.toml"), clip_config(dir.file("bad"), "clip_grad_norm = -1\n",
                                               "[[stages]]\nname = \"s\"\nepochs = 1\n"));
  const CliResult bad = run_cli("check " + dir.file("bad.toml"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("clip_grad_norm"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace frugal::test
