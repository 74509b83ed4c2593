// The detach_loss plugin: the leak it prevents (a callback keeping every batch's loss), the leak
// watch's arithmetic, and the watch firing in a real fit.
#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "../checkpoint/checkpoint.h"
#include "detach_loss.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace dl = frugal::detach_loss;

/// The naive history: keeps every batch's l.loss() as it finds it in `when`, and records the
/// live bytes at the end of every batch.
struct LossKeeper : Callback {
  explicit LossKeeper(Event when) : when_(when) {}
  std::string name() const override { return "loss_keeper"; }
  void after_loss(Learner& l) override { keep(l, Event::AfterLoss); }
  void after_backward(Learner& l) override { keep(l, Event::AfterBackward); }
  void after_batch(Learner& l) override {
    keep(l, Event::AfterBatch);
    live.push_back(l.memory().current());
  }
  int64_t held_bytes() const override {
    int64_t n = 0;
    for (const auto& t : kept) n += static_cast<int64_t>(t.nbytes());
    return n;
  }
  /// Mean growth of the live bytes per batch from batch `from` to batch `to`.
  double growth(size_t from, size_t to) const {
    EXPECT_LT(to, live.size());
    return static_cast<double>(live.at(to) - live.at(from)) / static_cast<double>(to - from);
  }
  std::vector<torch::Tensor> kept;
  std::vector<int64_t> live;

 private:
  void keep(Learner& l, Event e) {
    if (e == when_ && l.loss().defined()) kept.push_back(l.loss());
  }
  Event when_;
};

/// A guard that drops every other batch after its loss (a loss-spike or NaN guard): backward
/// never runs on those, so their graph still holds every saved activation.
struct SkipEveryOther : Callback {
  std::string name() const override { return "skip_every_other"; }
  void after_loss(Learner& l) override {
    if (l.batch_index() % 2 == 1) l.skip_batch();
  }
};

std::shared_ptr<spdlog::logger> capture_logger(std::ostringstream& out) {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%n: %v");
  auto log = std::make_shared<spdlog::logger>("detach_loss", sink);
  log->set_level(spdlog::level::debug);
  return log;
}

std::shared_ptr<dl::DetachLoss> make_plugin(std::ostringstream& out, bool detach = true,
                                             int64_t window = 4) {
  dl::DetachLossOptions o;
  o.detach = detach;
  o.window = window;
  return std::make_shared<dl::DetachLoss>(o, PluginContext{"detach_loss", capture_logger(out)});
}

TinySetup leak_setup() {
  TinySetup s;
  s.samples = 32 * 12;  // 12 batches in one epoch
  s.batch_size = 32;
  s.width = 256;
  s.depth = 3;
  s.valid_samples = 0;
  s.optimizer = "sgd";
  return s;
}


/// Runs the model's blocks as checkpointed segments (the checkpoint plugin's forward).
struct CheckpointForward : Callback {
  std::string name() const override { return "checkpoint_forward"; }
  bool wraps_forward() const override { return true; }
  torch::Tensor wrap_forward(Learner& l, const torch::Tensor& x, const ForwardNext& next) override {
    if (!l.training() || !torch::GradMode::is_enabled()) return next(x);
    return checkpoint::checkpointed_forward(
        l.model(), checkpoint::plan_by_count(static_cast<int64_t>(l.model()->size()), 3, true), x);
  }
};

struct KeeperRun {
  double growth;      ///< bytes per batch, batches 2 to 10 (both stepped)
  int64_t activations;  ///< the stage's steady activations, for scale
};

KeeperRun run_keeper(Event when, bool skip, bool plugin, bool checkpointed = false) {
  auto l = make_tiny_learner(leak_setup());
  auto keeper = std::make_shared<LossKeeper>(when);
  l->add_callback(keeper);
  if (skip) l->add_callback(std::make_shared<SkipEveryOther>());
  if (checkpointed) l->add_callback(std::make_shared<CheckpointForward>());
  std::ostringstream log;
  if (plugin) l->add_callback(make_plugin(log));
  l->fit(1);
  EXPECT_EQ(keeper->kept.size(), when == Event::AfterBackward && skip ? 6u : 12u);
  return {keeper->growth(2, 10), l->stage_stats().at(0).steady.activations};
}

TEST(DetachLossLeak, KeptLossesOfSkippedBatchesHoldTheirActivationsWithoutThePlugin) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  // A guard drops every other batch after its loss: backward never frees those graphs. A
  // history keeping l.loss() at after_batch keeps each one's saved activations alive.
  const KeeperRun without = run_keeper(Event::AfterBatch, true, false);
  const KeeperRun with = run_keeper(Event::AfterBatch, true, true);
  std::cout << "[detach_loss] keep l.loss() at after_batch, every other batch skipped: "
            << without.growth << " B/batch without the plugin, " << with.growth
            << " B/batch with it (steady activations of a batch: " << without.activations
            << " B)\n";
  // One skipped batch per two keeps its activations: about half the activations per batch.
  EXPECT_GT(without.growth, 0.4 * static_cast<double>(without.activations));
  EXPECT_LE(with.growth, 8.0) << "only the kept scalars (4 bytes each) remain";
}

TEST(DetachLossLeak, CheckpointedSegmentsKeepTheirStateInTheGraphAfterBackward) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  // A custom autograd Function's saved data (here the RNG state of each checkpointed segment)
  // is not freed by backward: it lives as long as the graph, i.e. as long as the kept loss.
  const KeeperRun without = run_keeper(Event::AfterBackward, false, false, true);
  const KeeperRun with = run_keeper(Event::AfterBackward, false, true, true);
  std::cout << "[detach_loss] keep l.loss() at after_backward, 3 checkpointed segments: "
            << without.growth << " B/batch without the plugin, " << with.growth
            << " B/batch with it\n";
  EXPECT_GT(without.growth, 3 * 5000.0) << "three CPU generator states (5056 B each) per batch";
  EXPECT_LE(with.growth, 8.0);
}

TEST(DetachLossLeak, AfterAPlainBackwardTheGraphHoldsNoTensors) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  // Backward frees the saved tensors of a plain graph: keeping the loss afterwards costs its own
  // 4 bytes (the graph's nodes stay, on the host heap the meter does not count).
  for (Event e : {Event::AfterBackward, Event::AfterBatch}) {
    EXPECT_LE(run_keeper(e, false, false).growth, 8.0) << to_string(e);
    EXPECT_LE(run_keeper(e, false, true).growth, 8.0) << to_string(e);
  }
}

TEST(DetachLossWatch, ArithmeticFindsSteadyGrowthNotJumpsNotWarmup) {
  dl::LeakWatch w(/*warmup=*/2, /*window=*/5, /*threshold=*/1024);
  // Warm-up: a jump in the first two samples is not looked at.
  EXPECT_FALSE(w.add(0));
  EXPECT_FALSE(w.add(1 << 20));
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(w.add(1 << 20)) << "flat";
  EXPECT_EQ(w.windows(), 1);
  EXPECT_EQ(w.last_growth(), 0.0);
  // One jump of 64 KiB inside a window: slope above the threshold, but it grew once.
  for (int64_t b : {0, 0, 65536, 65536, 65536}) EXPECT_FALSE(w.add((1 << 20) + b));
  EXPECT_GT(w.last_growth(), 1024.0);
  // 4 KiB per batch: a leak of exactly that.
  std::optional<double> got;
  for (int i = 0; i < 5; ++i) got = w.add((2 << 20) + i * 4096);
  ASSERT_TRUE(got);
  EXPECT_DOUBLE_EQ(*got, 4096.0);
  // Every other batch +8 KiB (skipped batches kept): still a leak, 4 KiB per batch on average.
  got.reset();
  for (int64_t b : {0, 8192, 8192, 16384, 16384}) got = w.add((3 << 20) + b);
  ASSERT_TRUE(got);
  EXPECT_NEAR(*got, 4096.0, 1024.0);
  // Below the threshold: 512 B per batch is not reported.
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(w.add((4 << 20) + i * 512));
  EXPECT_EQ(w.leaks(), 2);
  EXPECT_EQ(w.windows(), 5);
  EXPECT_DOUBLE_EQ(dl::LeakWatch::slope({10, 20, 30, 40}), 10.0);
}

TEST(DetachLossWatch, WarnsInAFitWithTheBytesPerBatchAndTheHolder) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  for (bool detach : {false, true}) {
    SCOPED_TRACE(detach ? "detach on" : "detach off");
    auto l = make_tiny_learner(leak_setup());
    auto keeper = std::make_shared<LossKeeper>(Event::AfterBatch);
    l->add_callback(keeper);
    l->add_callback(std::make_shared<SkipEveryOther>());
    std::ostringstream log;
    auto plugin = make_plugin(log, detach, /*window=*/8);
    l->add_callback(plugin);
    l->fit(1);
    const std::string text = log.str();
    EXPECT_EQ(plugin->watch().windows(), 1) << "12 batches: 2 of warm-up, one window of 8";
    if (detach) {
      EXPECT_EQ(plugin->watch().leaks(), 0) << text;
      EXPECT_EQ(text.find("grows"), std::string::npos) << text;
      continue;
    }
    ASSERT_EQ(plugin->watch().leaks(), 1) << text;
    const double measured = keeper->growth(2, 9);
    EXPECT_NEAR(plugin->largest_growth(), measured, 0.25 * measured);
    EXPECT_NE(text.find("live memory grows " + format_bytes(static_cast<int64_t>(
                                                   plugin->largest_growth())) + " per batch"),
              std::string::npos) << text;
    EXPECT_NE(text.find("loss_keeper holds"), std::string::npos) << text;
  }
}

TEST(DetachLossPlugin, LaterCallbacksSeeDetachedTensorsAndTrainingIsUnchanged) {
  struct GradProbe : Callback {
    std::string name() const override { return "probe"; }
    void before_fit(Learner& l) override { l.keep_pred(); }  // the loop drops it otherwise
    void after_backward(Learner& l) override {
      grad_after_backward += l.loss().requires_grad() + l.pred().requires_grad();
    }
    int grad_after_backward = 0;
  };
  std::vector<torch::Tensor> with_plugin;
  {
    auto l = make_tiny_learner();
    auto probe = std::make_shared<GradProbe>();
    l->add_callback(probe);
    std::ostringstream log;
    l->add_callback(make_plugin(log));
    torch::manual_seed(3);
    l->fit(2);
    EXPECT_EQ(probe->grad_after_backward, 0) << "every after_backward saw detached tensors";
    with_plugin = clone_params(*l->model());
  }
  auto l = make_tiny_learner();
  auto probe = std::make_shared<GradProbe>();
  l->add_callback(probe);
  torch::manual_seed(3);
  l->fit(2);
  EXPECT_EQ(probe->grad_after_backward, 2 * 2 * 4) << "without it: loss and pred, 8 batches";
  EXPECT_TRUE(params_equal(*l->model(), with_plugin));
}

TEST(DetachLossPlugin, MicroBatchesAndSkippedBatchesTrainAsWithout) {
  auto train = [](bool plugin) {
    auto l = make_tiny_learner(leak_setup());
    l->set_micro_batch_size(12);  // 32 = 12 + 12 + 8
    l->add_callback(std::make_shared<SkipEveryOther>());
    std::ostringstream log;
    if (plugin) l->add_callback(make_plugin(log));
    torch::manual_seed(3);
    l->fit(1);
    return std::make_pair(clone_params(*l->model()), l->stage_stats().at(0).last_epoch_loss);
  };
  const auto [with, loss_with] = train(true);
  const auto [without, loss_without] = train(false);
  for (size_t i = 0; i < with.size(); ++i) EXPECT_TRUE(torch::equal(with[i], without[i])) << i;
  EXPECT_EQ(loss_with, loss_without);
}

TEST(DetachLossPlugin, LoadsFromTomlAndABadThresholdNamesTheKey) {
  PluginHost host;
  auto cbs = host.load(plugins_of("[plugins.detach_loss]\nthreshold = \"4KiB\"\n"), "cfg.toml");
  ASSERT_EQ(cbs.size(), 1u);
  EXPECT_EQ(cbs[0]->order(), 1000);
  try {
    host.load(plugins_of("[plugins.detach_loss]\nthreshold = \"lots\"\n"), "cfg.toml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("threshold"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace frugal::test
