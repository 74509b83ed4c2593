// The example plugin grad_clip, its code called directly (through the object library
// frugal_plugin_grad_clip_objects): after a backward with a large loss, before_step leaves the
// gradients' global L2 norm at max_norm, in the same direction; below max_norm, or when the
// step is skipped, it leaves them bitwise as they were. Then in a real fit, and its option read
// from TOML. Only frugal's installed headers are used, so this file builds into frugal's own
// test binary and out of tree (CMakeLists.txt, -DGRAD_CLIP_TESTS=ON).
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <frugal/frugal.h>

#include "grad_clip.h"

// Its own namespace: unity builds put several test files in one translation unit.
namespace grad_clip_test {
namespace {

std::shared_ptr<spdlog::logger> quiet_logger() {
  return std::make_shared<spdlog::logger>("grad_clip-test");  // no sinks
}

std::shared_ptr<GradClip> make_clip(double max_norm) {
  GradClipOptions o;
  o.max_norm = max_norm;
  return std::make_shared<GradClip>(o, frugal::PluginContext{"grad_clip", quiet_logger()});
}

/// An MLP (2 hidden blocks of width 16) on 64 synthetic 8x8 images of 4 classes, batches of 16
/// in order, plain SGD, no validation.
std::unique_ptr<frugal::Learner> make_learner() {
  torch::manual_seed(0);
  frugal::ModelOptions mo;
  mo.arch = "mlp";
  mo.width = 16;
  mo.depth = 2;
  frugal::ModelInput in;
  in.channels = 1;
  in.image_size = 8;
  in.num_classes = 4;
  in.image_sizes = {8};
  frugal::OptimizerOptions oo;
  oo.name = "sgd";
  oo.lr = 0.1;
  frugal::DataLoader train(frugal::make_synthetic(64, 1, 8, 8, 4, 1), 16, false, 0);
  return std::make_unique<frugal::Learner>(frugal::make_model(mo, in), std::move(train),
                                           std::nullopt, oo,
                                           frugal::make_loss(frugal::LossOptions{}));
}

/// The global L2 norm of the model's gradients (torch.nn.utils.clip_grad_norm_'s total_norm).
double grad_norm(frugal::Learner& l) {
  double sq = 0;
  for (const auto& p : l.model()->parameters())
    if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
  return std::sqrt(sq);
}

std::vector<torch::Tensor> clone_grads(frugal::Learner& l) {
  std::vector<torch::Tensor> out;
  for (const auto& p : l.model()->parameters()) out.push_back(p.grad().clone());
  return out;
}

/// A forward and backward of the first batch, outside a fit, with the loss times `scale`.
void backward_first_batch(frugal::Learner& l, double scale) {
  for (auto& p : l.model()->parameters()) p.mutable_grad() = torch::Tensor();
  l.train_data().set_epoch(0);
  frugal::Batch b = l.train_data().batch(0);
  torch::Tensor loss = l.loss_fn()(l.model()->forward(b.x), b.y) * scale;
  loss.backward();
}

TEST(GradClipPlugin, ALargeLossLeavesTheGradientNormAtMaxNormInTheSameDirection) {
  auto l = make_learner();
  backward_first_batch(*l, 1000.0);
  const double max_norm = 0.5;
  const double before = grad_norm(*l);
  ASSERT_GT(before, 10 * max_norm) << "the test needs gradients far above max_norm";
  const auto grads_before = clone_grads(*l);

  make_clip(max_norm)->before_step(*l);

  const double after = grad_norm(*l);
  EXPECT_LE(after, max_norm * (1 + 1e-5)) << "norm " << before << " -> " << after;
  EXPECT_NEAR(after, max_norm, 1e-4 * max_norm);
  // Scaled, not cut: every gradient is the old one times max_norm / norm.
  const auto params = l->model()->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::allclose(params[i].grad(), grads_before[i] * (max_norm / before), 1e-4,
                                1e-7))
        << "parameter " << i;
}

TEST(GradClipPlugin, GradientsBelowMaxNormOrOfASkippedStepStayBitwiseTheSame) {
  auto l = make_learner();
  backward_first_batch(*l, 1.0);
  const double below = 10 * grad_norm(*l);  // max_norm well above the norm
  ASSERT_GT(below, 0.0);
  const auto grads_before = clone_grads(*l);
  make_clip(below)->before_step(*l);
  const auto params = l->model()->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::equal(params[i].grad(), grads_before[i])) << "parameter " << i;

  // A step a callback skipped (gradient accumulation) is not clipped, however large.
  backward_first_batch(*l, 1000.0);
  const auto large = clone_grads(*l);
  l->skip_step();
  make_clip(1e-3)->before_step(*l);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::equal(params[i].grad(), large[i])) << "parameter " << i;
}

/// The gradient norm in before_step: order -1 runs before grad_clip (order 0), order 1 after.
struct NormProbe : frugal::Callback {
  explicit NormProbe(int o) : order_(o) {}
  std::string name() const override { return order_ < 0 ? "norm_before_clip" : "norm_after_clip"; }
  int order() const override { return order_; }
  void before_step(frugal::Learner& l) override {
    if (!l.step_skipped()) norms.push_back(grad_norm(l));
  }
  std::vector<double> norms;

 private:
  int order_;
};

TEST(GradClipPlugin, InAFitEveryStepIsTakenWithTheNormAtMostMaxNorm) {
  const double max_norm = 1e-3;
  auto l = make_learner();
  auto before = std::make_shared<NormProbe>(-1);
  auto after = std::make_shared<NormProbe>(1);
  l->add_callback(before);
  l->add_callback(make_clip(max_norm));
  l->add_callback(after);
  l->fit(1);
  EXPECT_EQ(l->steps(), 4);  // 64 samples in batches of 16
  ASSERT_EQ(before->norms.size(), 4u);
  ASSERT_EQ(after->norms.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_GT(before->norms[i], max_norm) << "step " << i << ": nothing to clip";
    EXPECT_LE(after->norms[i], max_norm * (1 + 1e-5)) << "step " << i;
  }
  l.reset();  // callbacks die with the learner
}

TEST(GradClipOptions, MaxNormIsReadFromTomlAndABadValueOrKeyNamesIt) {
  const std::string source = "cfg.toml";
  const std::string good = "max_norm = 0.25\n";
  GradClipOptions o;
  frugal::read_options(toml::parse(good, source), o, "plugins.grad_clip", source);
  EXPECT_DOUBLE_EQ(o.max_norm, 0.25);
  const std::vector<std::string> bad_tables = {"max_norm = 0.0\n", "max_norm = -1.0\n",
                                               "max_nrom = 1.0\n"};
  for (const std::string& bad : bad_tables) {
    GradClipOptions b;
    try {
      frugal::read_options(toml::parse(bad, source), b, "plugins.grad_clip", source);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const frugal::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("max_n"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace grad_clip_test
