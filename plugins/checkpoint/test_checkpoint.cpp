// The checkpoint plugin: its segment math (plugins/checkpoint/checkpoint.h) called directly, and
// the plugin loaded through PluginHost into real fits.
#include <cmath>

#include <gtest/gtest.h>

#include "checkpoint.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace ck = frugal::checkpoint;

torch::nn::Sequential make_mlp(int64_t depth, int64_t width, double dropout, int64_t image = 8,
                               uint64_t seed = 0) {
  return make_zoo_model("mlp", depth, width, dropout, seed, image);
}

/// Seeds, runs the forward (checkpointed by `plan`, or plain when empty), backward of a loss,
/// and returns the parameters' gradients (undefined where a parameter got none).
std::vector<torch::Tensor> gradients(torch::nn::Sequential& m, const std::vector<ck::Segment>& plan,
                                     const torch::Tensor& x, bool bf16 = false) {
  m->zero_grad();
  for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
  torch::manual_seed(7);
  if (bf16) compat::set_autocast(torch::kCPU, true, torch::kBFloat16);
  torch::Tensor out = plan.empty() ? m->forward(x) : ck::checkpointed_forward(m, plan, x);
  if (bf16) {
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16) << "autocast was on in the forward";
    compat::set_autocast(torch::kCPU, false, torch::kBFloat16);
    compat::clear_autocast_cache();
  }
  (out.to(torch::kFloat).pow(2).mean() + out.to(torch::kFloat).sum() * 0.1).backward();
  std::vector<torch::Tensor> g;
  for (auto& p : m->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : p.grad());
  return g;
}

TEST(CheckpointSegments, SplitIsContiguousBalancedAndCoversEveryBlock) {
  using S = ck::Segment;
  EXPECT_EQ(ck::split_segments(18, 4),
            (std::vector<S>{{0, 5, true}, {5, 10, true}, {10, 14, true}, {14, 18, true}}));
  EXPECT_EQ(ck::split_segments(3, 5), (std::vector<S>{{0, 1, true}, {1, 2, true}, {2, 3, true}}));
  EXPECT_EQ(ck::split_segments(7, 1), (std::vector<S>{{0, 7, true}}));
  EXPECT_TRUE(ck::split_segments(0, 3).empty());
  EXPECT_THROW(ck::split_segments(4, 0), std::invalid_argument);
  EXPECT_EQ(ck::default_segments(18), 4);
  EXPECT_EQ(ck::default_segments(16), 4);
  EXPECT_EQ(ck::default_segments(1), 1);
  EXPECT_EQ(ck::plan_by_count(18, 0, true).size(), 4u);
  EXPECT_EQ(ck::plan_by_count(18, 6, true).size(), 6u);
  EXPECT_TRUE(ck::plan_by_count(18, 4, true).back().checkpointed);
  EXPECT_FALSE(ck::plan_by_count(18, 4, false).back().checkpointed);
  EXPECT_TRUE(ck::plan_by_count(18, 1, false).back().checkpointed) << "one segment is checkpointed";
}

TEST(CheckpointSegments, NamedBlocksAreOwnSegmentsAndTheRestRunsPlain) {
  using S = ck::Segment;
  const std::vector<std::string> blocks = {"stem", "block1", "block2", "block3", "head"};
  EXPECT_EQ(ck::plan_by_names(blocks, {"block1", "block2"}),
            (std::vector<S>{{0, 1, false}, {1, 2, true}, {2, 3, true}, {3, 5, false}}));
  try {
    ck::plan_by_names(blocks, {"block9"});
    FAIL() << "no error for an unknown block";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'block9'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("stem, block1, block2, block3, head"), std::string::npos)
        << e.what();
  }
}

TEST(CheckpointGradients, BitwiseEqualToPlainWithSeededDropout) {
  auto m = make_mlp(6, 32, 0.5);
  m->train();
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({16, 1, 8, 8});
  const auto plain = gradients(m, {}, x);
  const float after_plain = torch::rand({1}).item<float>();
  const auto ckpt = gradients(m, ck::plan_by_count(m->size(), 3, true), x);
  const float after_ckpt = torch::rand({1}).item<float>();
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(ckpt[i].defined()) << "parameter " << i;
    EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << "parameter " << i;
  }
  EXPECT_EQ(after_plain, after_ckpt) << "the step leaves the RNG where a plain step leaves it";
  // Dropout was really on: another seed gives other gradients.
  m->zero_grad();
  torch::manual_seed(8);
  m->forward(x).pow(2).mean().backward();
  EXPECT_FALSE(torch::equal(m->parameters()[0].grad(), plain[0]));
}

TEST(CheckpointGradients, InputWithoutGradAndFrozenFirstBlocks) {
  auto m = make_mlp(5, 16, 0.2);
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({8, 1, 8, 8});  // plain data: needs no gradient
  // Every block its own segment: the first segment's input needs no gradient.
  const auto plan = ck::plan_by_count(m->size(), m->size(), true);
  auto plain = gradients(m, {}, x);
  auto ckpt = gradients(m, plan, x);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;

  // Freeze the stem and block1: their segments get neither input nor parameter gradients.
  for (auto& np : m->named_parameters())
    if (np.key().rfind("stem", 0) == 0 || np.key().rfind("block1", 0) == 0)
      np.value().requires_grad_(false);
  plain = gradients(m, {}, x);
  ckpt = gradients(m, plan, x);
  size_t frozen = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    if (!plain[i].defined()) {
      ++frozen;
      EXPECT_FALSE(ckpt[i].defined()) << i;
    } else {
      EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
    }
  }
  EXPECT_EQ(frozen, 4u);  // two Linear weights and biases
}

TEST(CheckpointGradients, AutocastBf16CloseToPlainBf16) {
  auto m = make_mlp(4, 64, 0.1);
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({32, 1, 8, 8});
  const auto plain = gradients(m, {}, x, /*bf16=*/true);
  const auto ckpt = gradients(m, ck::plan_by_count(m->size(), 3, true), x, /*bf16=*/true);
  EXPECT_FALSE(compat::autocast_enabled(torch::kCPU)) << "the outer state came back";
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(ckpt[i].defined()) << i;
    EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-2, 1e-3))
        << i << ": max diff " << (plain[i] - ckpt[i]).abs().max().item<float>();
  }
}

TEST(CheckpointGradients, RecomputeDoesNotMoveBatchNormStatisticsTwice) {
  torch::manual_seed(0);
  ModelOptions mo;
  mo.arch = "cnn";
  mo.width = 4;
  ModelInput in;
  in.channels = 1;
  in.image_size = 8;
  in.num_classes = 4;
  in.image_sizes = {8};
  auto plain_model = make_model(mo, in);
  torch::manual_seed(0);
  auto ckpt_model = make_model(mo, in);
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({8, 1, 8, 8});
  const auto g_plain = gradients(plain_model, {}, x);
  const auto g_ckpt = gradients(ckpt_model, ck::plan_by_count(ckpt_model->size(), 2, true), x);
  for (size_t i = 0; i < g_plain.size(); ++i) EXPECT_TRUE(torch::equal(g_plain[i], g_ckpt[i])) << i;
  const auto b_plain = plain_model->buffers(), b_ckpt = ckpt_model->buffers();
  ASSERT_EQ(b_plain.size(), b_ckpt.size());
  ASSERT_FALSE(b_plain.empty());
  for (size_t i = 0; i < b_plain.size(); ++i)
    EXPECT_TRUE(torch::equal(b_plain[i], b_ckpt[i])) << "buffer " << i;
}

/// Bytes the forward adds at its peak (the output kept alive), and the peak of the whole
/// forward + backward.
std::pair<int64_t, int64_t> peaks(torch::nn::Sequential& m, const std::vector<ck::Segment>& plan,
                                  const torch::Tensor& x) {
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t before = mm.current();
  MemoryWindow forward_window = mm.open_window(), step_window = mm.open_window();
  torch::Tensor out = plan.empty() ? m->forward(x) : ck::checkpointed_forward(m, plan, x);
  const int64_t forward = forward_window.peak() - before;
  out.sum().backward();
  const int64_t step = step_window.peak() - before;
  return {forward, step};
}

TEST(CheckpointMemory, ForwardPeakOfADeepMlpDropsBelowTwoOverSqrtBlocks) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  auto m = make_mlp(16, 256, 0.0, 16);
  const auto n = static_cast<int64_t>(m->size());  // 18 blocks: stem, block1..16, head
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({256, 1, 16, 16});
  for (auto& p : m->parameters()) p.mutable_grad() = torch::zeros_like(p);  // grads live first
  const auto plain = peaks(m, {}, x);
  const auto all = ck::plan_by_count(n, 0, /*checkpoint_last=*/true);
  const auto ckpt_all = peaks(m, all, x);
  // The plugin's default, as torch's checkpoint_sequential: the last segment runs plainly.
  const auto ckpt = peaks(m, ck::plan_by_count(n, 0, /*checkpoint_last=*/false), x);
  const double ratio = static_cast<double>(ckpt.first) / static_cast<double>(plain.first);
  const double ratio_all = static_cast<double>(ckpt_all.first) / static_cast<double>(plain.first);
  const double target = 2 / std::sqrt(static_cast<double>(n));
  std::cout << "[checkpoint] forward peak / step peak: plain " << format_bytes(plain.first)
            << " / " << format_bytes(plain.second) << "; " << all.size()
            << " segments, last plain " << format_bytes(ckpt.first) << " / "
            << format_bytes(ckpt.second) << "; all checkpointed " << format_bytes(ckpt_all.first)
            << " / " << format_bytes(ckpt_all.second) << ". Forward ratios " << ratio << ", "
            << ratio_all << "; target 2/sqrt(" << n << ") = " << target << "\n";
  EXPECT_GT(plain.first, 0);
  EXPECT_LE(ratio, target);
  EXPECT_LT(ratio_all, ratio) << "checkpointing the last segment too lowers the forward peak";
  EXPECT_LT(ckpt.second, 0.7 * plain.second) << "the step's peak drops too";
  EXPECT_LT(ckpt_all.second, 0.7 * plain.second);
}

// ---- the plugin through PluginHost -------------------------------------------------------------


std::unique_ptr<Learner> deep_learner() {
  TinySetup s;
  s.depth = 5;
  s.dropout = 0.3;
  s.shuffle = true;
  return make_tiny_learner(s);
}

TEST(CheckpointPlugin, LoadedFromTomlTrainsExactlyAsWithout) {
  PluginHost host;
  std::vector<torch::Tensor> with_plugin;
  double loss_with = 0;
  {
    auto cbs = host.load(plugins_of("[plugins.checkpoint]\nsegments = 3\n"), "cfg.toml");
    ASSERT_EQ(cbs.size(), 1u);
    EXPECT_EQ(cbs[0]->order(), 100);
    auto l = deep_learner();
    for (auto& cb : cbs) l->add_callback(cb);
    cbs.clear();
    torch::manual_seed(11);
    l->fit({make_stage("one", 2)});
    EXPECT_GT(l->steps(), 0);
    with_plugin = clone_params(*l->model());
    loss_with = l->stage_stats().at(0).last_epoch_loss;
  }
  auto plain = deep_learner();
  torch::manual_seed(11);
  plain->fit({make_stage("one", 2)});
  EXPECT_TRUE(params_equal(*plain->model(), with_plugin)) << "same seed, same parameters";
  EXPECT_EQ(plain->stage_stats().at(0).last_epoch_loss, loss_with);
}

TEST(CheckpointPlugin, SegmentsWithModulesIsAConfigErrorNamingBoth) {
  PluginHost host;
  try {
    host.load(plugins_of("[plugins.checkpoint]\nsegments = 2\nmodules = [\"block1\"]\n"),
              "cfg.toml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("segments"), std::string::npos) << msg;
    EXPECT_NE(msg.find("modules"), std::string::npos) << msg;
  }
  EXPECT_THROW(host.load(plugins_of("[plugins.checkpoint]\nsegments = -1\n"), "cfg.toml"),
               ConfigError);
}

TEST(CheckpointPlugin, UnknownModuleStopsTheFitNamingTheBlockAndListingTheModels) {
  PluginHost host;
  auto l = deep_learner();
  for (auto& cb : host.load(plugins_of("[plugins.checkpoint]\nmodules = [\"block2\", \"blok3\"]\n"),
                            "cfg.toml"))
    l->add_callback(cb);
  try {
    l->fit(1);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'blok3'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("stem, block1, block2, block3, block4, block5, head"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("before_fit"), std::string::npos) << msg;
  }
  EXPECT_EQ(l->steps(), 0);
}

TEST(CheckpointPlugin, NamedModulesTrainExactlyAsWithout) {
  PluginHost host;
  std::vector<torch::Tensor> with_plugin;
  {
    auto l = deep_learner();
    for (auto& cb : host.load(plugins_of("[plugins.checkpoint]\nmodules = [\"block2\", \"block4\"]\n"),
                              "cfg.toml"))
      l->add_callback(cb);
    torch::manual_seed(11);
    l->fit(1);
    with_plugin = clone_params(*l->model());
  }
  auto plain = deep_learner();
  torch::manual_seed(11);
  plain->fit(1);
  EXPECT_TRUE(params_equal(*plain->model(), with_plugin));
}

}  // namespace
}  // namespace frugal::test
