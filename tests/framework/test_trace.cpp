// The trace callback: a Chrome-trace JSON with a span per phase and a live-memory counter
// that rises during the forward and falls after the step; written also when the fit fails.
#include <filesystem>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

TinySetup traced_setup() {
  TinySetup s;
  s.samples = 96;
  s.batch_size = 32;
  s.width = 64;
  s.depth = 3;
  s.optimizer = "sgd";
  return s;
}

struct Failing : Callback {
  std::string name() const override { return "failing"; }
  void before_step(Learner& l) override {
    if (l.steps() >= 1) throw std::runtime_error("stop here");
  }
};

TEST(Trace, SpansForEachPhaseAndCountersThatRiseInForwardAndFallAfterStep) {
  TempDir dir;
  const std::string path = dir.file("sub/trace.json");
  auto l = make_tiny_learner(traced_setup());
  l->add_callback(std::make_shared<TraceCallback>(path));
  l->fit(1);  // 3 batches, then validation
  ASSERT_TRUE(std::filesystem::exists(path));
  const auto t = nlohmann::json::parse(read_text(path));
  std::map<std::string, std::vector<nlohmann::json>> spans;
  std::map<double, int64_t> live;  // counter samples by timestamp
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] == "X") spans[e["name"].get<std::string>()].push_back(e);
    if (e["ph"] == "C") live[e["ts"].get<double>()] = e["args"]["live_bytes"].get<int64_t>();
  }
  EXPECT_EQ(spans["batch"].size(), 3u);
  EXPECT_EQ(spans["forward"].size(), 3u);
  EXPECT_EQ(spans["backward"].size(), 3u);
  EXPECT_EQ(spans["step"].size(), 3u);
  EXPECT_EQ(spans["validate"].size(), 1u);
  for (size_t i = 0; i < 3; ++i) {
    const auto& f = spans["forward"][i];
    const auto& s = spans["step"][i];
    const double f0 = f["ts"].get<double>(), f1 = f0 + f["dur"].get<double>();
    const double s1 = s["ts"].get<double>() + s["dur"].get<double>();
    // A counter sample at each span edge (ts + dur is rounded to the printed nanosecond).
    auto live_at = [&](double ts) {
      auto it = live.lower_bound(ts - 0.0015);
      EXPECT_TRUE(it != live.end() && it->first <= ts + 0.0015) << "no counter at " << ts;
      return it == live.end() ? int64_t{-1} : it->second;
    };
    const int64_t start = live_at(f0), end = live_at(f1), after_step = live_at(s1);
    EXPECT_GT(end, start) << "activations are live at the forward's end, batch " << i;
    EXPECT_LT(after_step, end) << "activations and gradients are freed after the step, batch " << i;
    EXPECT_GE(f["args"]["peak_bytes"].get<int64_t>(), end);
    EXPECT_EQ(f["args"]["step"].get<int64_t>(), static_cast<int64_t>(i));
    EXPECT_LE(f0 + f["dur"].get<double>(), spans["batch"][i]["ts"].get<double>() +
                                               spans["batch"][i]["dur"].get<double>());
  }
}

TEST(Trace, IsWrittenWhenTheFitFails) {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  auto l = make_tiny_learner(traced_setup());
  l->add_callback(std::make_shared<TraceCallback>(path));
  l->add_callback(std::make_shared<Failing>());
  EXPECT_THROW(l->fit(1), CallbackError);
  EXPECT_FALSE(std::filesystem::exists(path)) << "written at after_fit or when dropped";
  l.reset();
  ASSERT_TRUE(std::filesystem::exists(path));
  const auto t = nlohmann::json::parse(read_text(path));
  size_t forwards = 0;
  for (const auto& e : t["traceEvents"]) forwards += e["ph"] == "X" && e["name"] == "forward";
  EXPECT_EQ(forwards, 2u);  // the second batch failed in before_step
}

TEST(Trace, WarmupBatchesAreLeftOutOfTheStepTimes) {
  for (int64_t warmup : {0, 1, 2}) {
    auto l = make_tiny_learner(traced_setup());
    l->set_warmup_batches(warmup);
    l->fit(1);
    const int64_t batches = l->train_data().num_batches();
    ASSERT_GT(batches, warmup);
    EXPECT_EQ(l->report()["step_seconds"]["count"].get<int64_t>(), batches - warmup)
        << "the first " << warmup << " batch(es) are warm-up, the others timed";
  }
}

TEST(Trace, RunTraceKeyWritesTheTraceFromTheCli) {
  TempDir dir;
  write_text(dir.file("run.toml"),
             "[run]\nout_dir = \"" + dir.file("out") + "\"\nprogress = \"none\"\nthreads = 1\n"
             "trace = \"" + dir.file("t/trace.json") + "\"\nwarmup = 1\n"
             "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\nbatch_size = 32\n"
             "[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n");
  auto r = run_cli("train " + dir.file("run.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto t = nlohmann::json::parse(read_text(dir.file("t/trace.json")));
  EXPECT_GT(t["traceEvents"].size(), 10u);
}

}  // namespace
}  // namespace frugal::test
