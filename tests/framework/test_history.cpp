// Learning-rate schedules, the metrics history (metrics.csv, metrics.jsonl), TensorBoard event
// files, lr_find's valley and the "held by callbacks" column of the steady-state breakdown.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../../framework/cli/lr_find.h"  // the valley's arithmetic is inline there
#include "cli_support.h"
#include "frugal/frugal.h"
#include "learner_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

constexpr double kPiTest = 3.14159265358979323846;

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) out.push_back(line);
  return out;
}

std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string f; std::getline(ss, f, ',');) out.push_back(f);
  if (!line.empty() && line.back() == ',') out.emplace_back();
  return out;
}

ScheduleOptions schedule_named(const std::string& name) {
  ScheduleOptions s;
  s.name = name;
  return s;
}

/// Records the optimizer's learning rate and momentum (Adam's beta1) at every step.
struct LrProbe : Callback {
  std::string name() const override { return "lr_probe"; }
  void before_step(Learner& l) override {
    lrs.push_back(learning_rate(l.optimizer()));
    auto& o = static_cast<torch::optim::AdamOptions&>(l.optimizer().param_groups()[0].options());
    moms.push_back(std::get<0>(o.betas()));
  }
  std::vector<double> lrs, moms;
};

/// Saves a checkpoint after the n-th batch and stops the fit.
struct HistSaveAndStop : Callback {
  HistSaveAndStop(std::string file, int batch) : path(std::move(file)), n(batch) {}
  std::string name() const override { return "hist_save_and_stop"; }
  int order() const override { return -2000; }  // last in after_* events
  void after_batch(Learner& l) override {
    if (++seen != n) return;
    l.save_checkpoint(path, {{"note", "test"}});
    l.stop_fit();
  }
  std::string path;
  int n, seen = 0;
};

/// Keeps a tensor alive across the fit and says so.
struct Holder : Callback {
  std::string name() const override { return "holder"; }
  void before_fit(Learner&) override { kept = torch::zeros({4096}); }  // 16 KiB of floats
  int64_t held_bytes() const override { return kept.defined() ? static_cast<int64_t>(kept.nbytes()) : 0; }
  torch::Tensor kept;
};

TinySetup history_setup() {
  TinySetup s;  // 64 samples in batches of 16: 4 batches an epoch, validation on 32
  s.shuffle = false;
  return s;
}

MetricsHistoryOptions history_in(const std::string& dir, int64_t log_every) {
  MetricsHistoryOptions h;
  h.dir = dir;
  h.log_every = log_every;
  h.plots = false;
  return h;
}

/// Makes the inputs of chosen iterations NaN: their losses are not finite.
struct NanInputAtIterations : Callback {
  explicit NanInputAtIterations(std::vector<int64_t> at) : iterations(std::move(at)) {}
  std::string name() const override { return "nan_input_at_iterations"; }
  void before_batch(Learner& l) override {
    if (std::find(iterations.begin(), iterations.end(), l.iteration()) != iterations.end())
      l.x() = l.x() * std::numeric_limits<float>::quiet_NaN();
  }
  std::vector<int64_t> iterations;
};

/// Every event of every event file in `dir`, oldest file first (by its first event's time: the
/// names of one process's files in one second differ by a counter, which sorts as text).
std::vector<std::vector<DecodedEvent>> event_files_in(const std::string& dir) {
  std::vector<std::vector<DecodedEvent>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(read_event_file(e.path().string()));
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {  // each starts with its file version
    return a.at(0).wall_time < b.at(0).wall_time;
  });
  return out;
}

}  // namespace

// ---- schedules: each formula, per batch ---------------------------------------------------

TEST(Schedule, EachScheduleFollowsItsFormula) {
  const double lr = 0.01;
  const int64_t n = 20;
  for (int64_t i = 0; i < n; ++i) EXPECT_DOUBLE_EQ(schedule_lr(schedule_named("constant"), lr, i, n), lr);

  ScheduleOptions warm = schedule_named("linear_warmup");
  warm.warmup_steps = 4;
  for (int64_t i = 0; i < n; ++i)
    EXPECT_DOUBLE_EQ(schedule_lr(warm, lr, i, n), i < 4 ? lr * (i + 1) / 4.0 : lr) << i;

  ScheduleOptions cos = schedule_named("cosine");
  cos.warmup_steps = 4;
  cos.min_lr = 1e-4;
  for (int64_t i = 0; i < n; ++i) {
    const double t = (i - 4) / 16.0;
    const double want = i < 4 ? lr * (i + 1) / 4.0 : 1e-4 + (lr - 1e-4) * 0.5 * (1 + std::cos(kPiTest * t));
    EXPECT_NEAR(schedule_lr(cos, lr, i, n), want, 1e-15) << i;
  }
  EXPECT_DOUBLE_EQ(schedule_lr(cos, lr, 4, n), lr);                        // the peak after warm-up
  EXPECT_NEAR(schedule_lr(cos, lr, 12, n), (lr + 1e-4) / 2, 1e-15);        // half-way down

  ScheduleOptions step = schedule_named("step");
  step.step_size = 6;
  step.gamma = 0.5;
  for (int64_t i = 0; i < n; ++i) EXPECT_DOUBLE_EQ(schedule_lr(step, lr, i, n), lr * std::pow(0.5, i / 6)) << i;
}

TEST(Schedule, OneCycleIsFastaisCombinedCosine) {
  ScheduleOptions s = schedule_named("one_cycle");  // pct_start 0.25, div 25, div_final 1e5
  const double lr = 0.004;
  const int64_t n = 40;  // the peak at batch 10
  auto ramp = [](double a, double b, double q) { return a + (1 + std::cos(kPiTest * (1 - q))) * (b - a) / 2; };
  for (int64_t i = 0; i < n; ++i) {
    const double p = static_cast<double>(i) / n;
    const double want = p < 0.25 ? ramp(lr / 25, lr, p / 0.25) : ramp(lr, lr / 1e5, (p - 0.25) / 0.75);
    EXPECT_NEAR(schedule_lr(s, lr, i, n), want, 1e-15) << i;
    const double mom = p < 0.25 ? ramp(0.95, 0.85, p / 0.25) : ramp(0.85, 0.95, (p - 0.25) / 0.75);
    EXPECT_NEAR(*schedule_momentum(s, i, n), mom, 1e-15) << i;
  }
  // Its shape: starts at lr/div, rises to lr at pct_start, falls towards lr/div_final.
  EXPECT_DOUBLE_EQ(schedule_lr(s, lr, 0, n), lr / 25);
  EXPECT_DOUBLE_EQ(schedule_lr(s, lr, 10, n), lr);
  for (int64_t i = 1; i <= 10; ++i) EXPECT_GT(schedule_lr(s, lr, i, n), schedule_lr(s, lr, i - 1, n));
  for (int64_t i = 11; i < n; ++i) EXPECT_LT(schedule_lr(s, lr, i, n), schedule_lr(s, lr, i - 1, n));
  EXPECT_LT(schedule_lr(s, lr, n - 1, n), lr / 25 / 10);
  s.cycle_momentum = false;
  EXPECT_FALSE(schedule_momentum(s, 3, n).has_value());
}

TEST(Schedule, TheLearnerStepsWithTheStagesScheduleOverItsBatches) {
  auto l = make_tiny_learner(history_setup());  // adam, lr 1e-2, 4 batches an epoch
  auto probe = std::make_shared<LrProbe>();
  l->add_callback(std::make_shared<ScheduleCallback>());
  l->add_callback(probe);
  Stage cycle = make_stage("cycle", 2);  // 8 batches
  cycle.schedule = schedule_named("one_cycle");
  Stage after = make_stage("after", 1);  // constant: the optimizer's own lr and beta1 again
  l->fit(std::vector<Stage>{cycle, after});
  ASSERT_EQ(probe->lrs.size(), 12u);
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_DOUBLE_EQ(probe->lrs[i], schedule_lr(cycle.schedule, 1e-2, i, 8)) << i;
    EXPECT_DOUBLE_EQ(probe->moms[i], *schedule_momentum(cycle.schedule, i, 8)) << i;
  }
  for (size_t i = 8; i < 12; ++i) {
    EXPECT_DOUBLE_EQ(probe->lrs[i], 1e-2);
    EXPECT_DOUBLE_EQ(probe->moms[i], 0.9);
  }
}

// span = "fit": one warmup and one cosine over every stage's batches, not a restart per stage.
TEST(Schedule, AFitSpanningScheduleIsOneCurveAcrossTheStages) {
  auto l = make_tiny_learner(history_setup());  // adam, lr 1e-2, 4 batches an epoch
  auto probe = std::make_shared<LrProbe>();
  l->add_callback(std::make_shared<ScheduleCallback>());
  l->add_callback(probe);
  ScheduleOptions cosine = schedule_named("cosine");
  cosine.warmup_steps = 3;
  cosine.span = "fit";
  Stage first = make_stage("first", 1), second = make_stage("second", 2);  // 4 + 8 batches
  first.schedule = second.schedule = cosine;
  l->fit(std::vector<Stage>{first, second});
  ASSERT_EQ(probe->lrs.size(), 12u);
  for (int64_t i = 0; i < 12; ++i) EXPECT_DOUBLE_EQ(probe->lrs[i], schedule_lr(cosine, 1e-2, i, 12)) << i;
  EXPECT_GT(probe->lrs[3], probe->lrs[4]);  // past the warmup, falling on across the boundary
  EXPECT_GT(probe->lrs[4], probe->lrs[5]);
}

TEST(Schedule, StagesInheritTheTopLevelScheduleAndOverrideItsKeys) {
  const Config c = parse_config(
      "[schedule]\nname = \"cosine\"\nwarmup_steps = 5\nspan = \"fit\"\n"
      "[[stages]]\nname = \"a\"\n[[stages]]\nname = \"b\"\n[stages.schedule]\nwarmup_steps = 0\n",
      "cfg.toml");
  ASSERT_EQ(c.stages.size(), 2u);
  EXPECT_EQ(c.stages[0].schedule.name, "cosine");
  EXPECT_EQ(c.stages[0].schedule.span, "fit");
  EXPECT_EQ(c.stages[0].schedule.warmup_steps, 5);
  EXPECT_EQ(c.stages[1].schedule.name, "cosine");
  EXPECT_EQ(c.stages[1].schedule.warmup_steps, 0);
  EXPECT_NE(c.to_toml().find("[schedule]"), std::string::npos);
}

TEST(Schedule, AResumedFitContinuesTheScheduleExactly) {
  TempDir dir;
  Stage cos = make_stage("cos", 3);  // 12 batches
  cos.schedule = schedule_named("cosine");
  cos.schedule.warmup_steps = 3;
  const std::vector<Stage> stages{cos};
  auto ref = make_tiny_learner(history_setup());
  auto ref_probe = std::make_shared<LrProbe>();
  ref->add_callback(std::make_shared<ScheduleCallback>());
  ref->add_callback(ref_probe);
  ref->fit(stages);
  ASSERT_EQ(ref_probe->lrs.size(), 12u);

  auto probe = std::make_shared<LrProbe>();
  {
    auto first = make_tiny_learner(history_setup());
    first->add_callback(std::make_shared<ScheduleCallback>());
    first->add_callback(probe);
    first->add_callback(std::make_shared<HistSaveAndStop>(dir.file("ck"), 6));  // mid-epoch 2
    first->fit(stages);
  }
  auto second = make_tiny_learner(history_setup());
  second->add_callback(std::make_shared<ScheduleCallback>());
  second->add_callback(probe);
  second->load_checkpoint(dir.file("ck"));
  second->fit(stages);
  ASSERT_EQ(probe->lrs.size(), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(probe->lrs[i], ref_probe->lrs[i]) << "batch " << i;
}

TEST(Schedule, BadKeysNameTheFileLineAndKey) {
  auto error_of = [](const std::string& schedule) {
    const std::string text = "[optimizer]\nlr = 0.001\n[[stages]]\nname = \"a\"\n[stages.schedule]\n" + schedule;
    try {
      parse_config(text, "s.toml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string typo = error_of("name = \"cosin\"\n");
  EXPECT_NE(typo.find("s.toml:6"), std::string::npos) << typo;
  EXPECT_NE(typo.find("one_cycle"), std::string::npos) << typo;  // what is allowed
  const std::string step = error_of("name = \"step\"\n");
  EXPECT_NE(step.find("s.toml"), std::string::npos) << step;
  EXPECT_NE(step.find("step_size"), std::string::npos) << step;
  const std::string min_lr = error_of("name = \"cosine\"\nmin_lr = 0.01\n");
  EXPECT_NE(min_lr.find("min_lr"), std::string::npos) << min_lr;
  EXPECT_NE(min_lr.find("s.toml"), std::string::npos) << min_lr;
  const std::string unknown = error_of("name = \"cosine\"\nwarmup = 3\n");
  EXPECT_NE(unknown.find("warmup_steps"), std::string::npos) << unknown;  // the nearest key
  const Config ok = parse_config("[[stages]]\nname = \"a\"\n[stages.schedule]\nname = \"one_cycle\"\n", "s.toml");
  EXPECT_EQ(ok.stages[0].schedule.name, "one_cycle");
}

// ---- the metrics history ------------------------------------------------------------------

TEST(MetricsHistory, WritesARowEveryLogEveryBatchesAndPerEpoch) {
  TempDir dir;
  auto l = make_tiny_learner(history_setup());
  l->add_callback(std::make_shared<ScheduleCallback>());
  l->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 2)));
  Stage s = make_stage("train", 2);  // 8 batches
  s.schedule = schedule_named("linear_warmup");
  s.schedule.warmup_steps = 8;
  l->fit(std::vector<Stage>{s});

  const auto csv = lines_of(read_all(dir.file("run/metrics.csv")));
  ASSERT_EQ(csv.size(), 1u + 4u + 2u) << read_all(dir.file("run/metrics.csv"));  // header, 4 step rows, 2 epoch rows
  EXPECT_EQ(csv[0] + "\n", metrics_csv_header());
  const auto header = csv_fields(csv[0]);
  auto col = [&](const std::string& name) {
    return static_cast<size_t>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  const std::vector<std::string> kinds = {"step", "step", "epoch", "step", "step", "epoch"};
  const std::vector<int64_t> iterations = {2, 4, 4, 6, 8, 8};
  const std::vector<int64_t> epochs = {1, 1, 1, 2, 2, 2};  // 1-based, as the log and the report
  for (size_t r = 0; r < kinds.size(); ++r) {
    const auto f = csv_fields(csv[r + 1]);
    ASSERT_EQ(f.size(), header.size()) << csv[r + 1];
    EXPECT_EQ(f[col("kind")], kinds[r]);
    EXPECT_EQ(std::stoll(f[col("iteration")]), iterations[r]);
    EXPECT_EQ(std::stoll(f[col("epoch")]), epochs[r]) << csv[r + 1];
    // The row's lr is the warm-up's at the row's last batch.
    EXPECT_DOUBLE_EQ(std::stod(f[col("lr")]), 1e-2 * std::min<int64_t>(iterations[r], 8) / 8.0) << csv[r + 1];
    EXPECT_GT(std::stod(f[col("loss")]), 0.0);
    EXPECT_GT(std::stod(f[col("samples_per_second")]), 0.0);
    EXPECT_GT(std::stod(f[col("step_seconds")]), 0.0);
    EXPECT_GE(std::stoll(f[col("peak_bytes")]), std::stoll(f[col("live_bytes")]));
    EXPECT_GT(std::stoll(f[col("live_bytes")]), 0);
    EXPECT_EQ(f[col("valid_metric")].empty(), kinds[r] == "step") << csv[r + 1];
  }
  // The epoch row's loss is the epoch's mean, the same number the stage statistics keep.
  EXPECT_NEAR(std::stod(csv_fields(csv[6])[col("loss")]), l->stage_stats()[0].last_epoch_loss, 1e-6);
  EXPECT_NEAR(std::stod(csv_fields(csv[6])[col("valid_metric")]), l->valid_accuracy(), 1e-9);

  const auto jsonl = lines_of(read_all(dir.file("run/metrics.jsonl")));
  ASSERT_EQ(jsonl.size(), 6u);
  for (size_t r = 0; r < jsonl.size(); ++r) {
    const auto j = nlohmann::json::parse(jsonl[r]);
    EXPECT_EQ(j["kind"], kinds[r]);
    EXPECT_EQ(j["iteration"], iterations[r]);
    EXPECT_EQ(j["epoch"], epochs[r]);
    EXPECT_EQ(j["stage"], "train");
    EXPECT_EQ(j.contains("valid_metric"), kinds[r] == "epoch");
    if (kinds[r] == "epoch") {
      EXPECT_EQ(j["valid_metric_name"], "accuracy");
    }
  }
}

TEST(MetricsHistory, AResumedFitKeepsTheRowsBeforeItsPositionAndWritesTheRest) {
  TempDir dir;
  Stage s = make_stage("train", 2);
  s.schedule = schedule_named("one_cycle");
  const std::vector<Stage> stages{s};
  {
    auto ref = make_tiny_learner(history_setup());
    ref->add_callback(std::make_shared<ScheduleCallback>());
    ref->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("ref"), 1)));
    ref->fit(stages);
  }
  {
    auto first = make_tiny_learner(history_setup());
    first->add_callback(std::make_shared<ScheduleCallback>());
    first->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 1)));
    first->add_callback(std::make_shared<HistSaveAndStop>(dir.file("ck"), 3));
    first->fit(stages);
  }
  // What a killed run leaves after its checkpoint: more rows and half a line.
  {
    std::ofstream more(dir.file("run/metrics.csv"), std::ios::app);
    more << "step,0,1,4,4,4,train,9,9,9,9,9,9,,\nstep,0,1,5";
  }
  auto second = make_tiny_learner(history_setup());
  second->add_callback(std::make_shared<ScheduleCallback>());
  second->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 1)));
  second->load_checkpoint(dir.file("ck"));
  second->fit(stages);

  // Every column but the timings and memory equals the uninterrupted run's.
  auto comparable = [](const std::string& path) {
    std::vector<std::string> out;
    for (const auto& line : lines_of(read_all(path))) {
      auto f = csv_fields(line);
      out.push_back(f[0] + "," + f[1] + "," + f[2] + "," + f[3] + "," + f[4] + "," + f[5] + "," +
                    f[6] + "," + f[7] + "," + f[8] + "," + f[13] + "," + f[14]);
    }
    return out;
  };
  const auto want = comparable(dir.file("ref/metrics.csv")), got = comparable(dir.file("run/metrics.csv"));
  ASSERT_EQ(want.size(), 1u + 8u + 2u);
  EXPECT_EQ(got, want);
  EXPECT_EQ(lines_of(read_all(dir.file("run/metrics.jsonl"))).size(), 10u);
  // TensorBoard: each fit's file starts with a SessionLog START at its first step; the resumed
  // one's is one past the resumed step (3): TensorBoard keeps the events below it, the rows the
  // CSV kept, row 3 included.
  const auto files = event_files_in(dir.file("run/tensorboard"));
  ASSERT_EQ(files.size(), 2u);
  std::vector<int64_t> starts;
  for (const auto& events : files) {
    ASSERT_GE(events.size(), 2u);
    EXPECT_TRUE(events[1].session_start);
    for (const auto& ev : events)
      if (ev.session_start) starts.push_back(ev.step);
  }
  EXPECT_EQ(starts, (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(files[1][1].session_msg, "fit resumed after iteration 3");
}

TEST(MetricsHistory, ARowSpanningAResumeAveragesEveryBatchOfItsWindow) {
  // Rows every 3 batches, 4 batches an epoch: the first step row (iteration 3) covers batches
  // 1-3; the run is stopped after batch 2 and resumed. Its row must average all three, as the
  // uninterrupted run's, not only batch 3.
  TempDir dir;
  const std::vector<Stage> stages{make_stage("train", 2)};
  {
    auto ref = make_tiny_learner(history_setup());
    ref->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("ref"), 3)));
    ref->fit(stages);
  }
  {
    auto first = make_tiny_learner(history_setup());
    first->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 3)));
    first->add_callback(std::make_shared<HistSaveAndStop>(dir.file("ck"), 2));
    first->fit(stages);
  }
  auto second = make_tiny_learner(history_setup());
  second->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 3)));
  second->load_checkpoint(dir.file("ck"));
  second->fit(stages);

  const auto want = lines_of(read_all(dir.file("ref/metrics.csv")));
  const auto got = lines_of(read_all(dir.file("run/metrics.csv")));
  ASSERT_EQ(want.size(), 1u + 2u + 2u) << read_all(dir.file("ref/metrics.csv"));  // steps 3, 6; epochs
  ASSERT_EQ(got.size(), want.size()) << read_all(dir.file("run/metrics.csv"));
  for (size_t r = 1; r < want.size(); ++r) {
    const auto w = csv_fields(want[r]), g = csv_fields(got[r]);
    for (size_t c : {0u, 2u, 4u, 7u, 13u, 14u})  // kind, epoch, iteration, loss, validation
      EXPECT_EQ(g[c], w[c]) << "row " << r << " column " << c << "\nwant " << want[r] << "\ngot  " << got[r];
    // The resumed row's timing covers its three batches too.
    EXPECT_GT(std::stod(g[9]), 0.0) << got[r];
  }
  const auto jw = nlohmann::json::parse(lines_of(read_all(dir.file("ref/metrics.jsonl")))[0]);
  const auto jg = nlohmann::json::parse(lines_of(read_all(dir.file("run/metrics.jsonl")))[0]);
  EXPECT_EQ(jg["loss"], jw["loss"]);
}

TEST(MetricsHistory, AWindowOfOnlySkippedStepsHasNoLoss) {
  // run.on_nonfinite = "skip" with NaN inputs in batches 3 and 4: the row of batches 3-4 has no
  // loss (an empty cell, null, no TensorBoard scalar), not a 0 that reads as a perfect fit.
  TempDir dir;
  auto l = make_tiny_learner(history_setup());
  l->add_callback(std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Skip));
  l->add_callback(std::make_shared<NanInputAtIterations>(std::vector<int64_t>{2, 3}));
  l->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 2)));
  l->fit(1);  // step rows at 2 and 4, the epoch row at 4

  const auto csv = lines_of(read_all(dir.file("run/metrics.csv")));
  ASSERT_EQ(csv.size(), 4u) << read_all(dir.file("run/metrics.csv"));
  EXPECT_GT(std::stod(csv_fields(csv[1])[7]), 0.0) << csv[1];
  EXPECT_EQ(csv_fields(csv[2])[4], "4");
  EXPECT_EQ(csv_fields(csv[2])[7], "") << csv[2];
  EXPECT_GT(std::stod(csv_fields(csv[3])[7]), 0.0) << csv[3];  // the epoch's batches 1-2
  const auto jsonl = lines_of(read_all(dir.file("run/metrics.jsonl")));
  ASSERT_EQ(jsonl.size(), 3u);
  EXPECT_TRUE(nlohmann::json::parse(jsonl[1])["loss"].is_null()) << jsonl[1];
  EXPECT_TRUE(nlohmann::json::parse(jsonl[0])["loss"].is_number()) << jsonl[0];
  const auto files = event_files_in(dir.file("run/tensorboard"));
  ASSERT_EQ(files.size(), 1u);
  ASSERT_EQ(files[0].size(), 5u);  // file version, START, the three rows
  std::map<std::string, float> skipped(files[0][3].scalars.begin(), files[0][3].scalars.end());
  EXPECT_EQ(files[0][3].step, 4);
  EXPECT_EQ(skipped.count("train/loss"), 0u);
  EXPECT_EQ(skipped.count("train/lr"), 1u);
}

// ---- TensorBoard --------------------------------------------------------------------------

TEST(TensorBoard, Crc32cAndTheEventEncodingMatchTheirSpecifications) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(check.data(), check.size()), 0xE3069283u);  // the CRC-32C check value
  // Event{wall_time: 1.0, step: 3, summary{value{tag: "a", simple_value: 1.0}}}, by hand.
  const std::string want("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f"  // field 1, fixed64 1.0
                         "\x10\x03"                              // field 2, varint 3
                         "\x2a\x0a"                              // field 5, 10 bytes
                         "\x0a\x08"                              //   value, 8 bytes
                         "\x0a\x01" "a"                          //     tag "a"
                         "\x15\x00\x00\x80\x3f",                 //     simple_value 1.0f
                         23);
  EXPECT_EQ(scalars_event(1.0, 3, {{"a", 1.0f}}), want);
  const std::string rec = tf_record(want);
  ASSERT_EQ(rec.size(), 8u + 4u + want.size() + 4u);
  uint64_t len;
  std::memcpy(&len, rec.data(), 8);
  EXPECT_EQ(len, want.size());
}

TEST(TensorBoard, ASessionStartIsASessionLogInEventField7) {
  // event.proto: Event.session_log = 7 (6 is the deprecated log_message, on which TensorBoard
  // purges nothing); SessionLog.status = 1 with START = 1, msg = 3. By hand:
  // Event{wall_time: 1.0, step: 4, session_log{status: START, msg: "m"}}.
  const std::string want("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f"  // field 1, fixed64 1.0
                         "\x10\x04"                              // field 2, varint 4
                         "\x3a\x05"                              // field 7, 5 bytes
                         "\x08\x01"                              //   status: START
                         "\x1a\x01" "m",                         //   msg "m"
                         18);
  EXPECT_EQ(session_start_event(1.0, 4, "m"), want);
  EXPECT_EQ(session_start_event(1.0, 4), want.substr(0, 11) + "\x3a\x02\x08\x01");
  TempDir dir;
  const std::string path = dir.file("events");
  std::ofstream(path, std::ios::binary) << tf_record(file_version_event(2.0)) << tf_record(want);
  const auto events = read_event_file(path);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_FALSE(events[0].session_start);
  EXPECT_TRUE(events[1].session_start);
  EXPECT_EQ(events[1].step, 4);
  EXPECT_DOUBLE_EQ(events[1].wall_time, 1.0);
  EXPECT_EQ(events[1].session_msg, "m");
}

TEST(TensorBoard, TheRunsEventFileReadsBackWithTheHistorysScalars) {
  TempDir dir;
  auto l = make_tiny_learner(history_setup());
  l->add_callback(std::make_shared<MetricsHistory>(history_in(dir.file("run"), 2)));
  l->fit(1);  // 4 batches: step rows at 2 and 4, an epoch row at 4
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir.file("run/tensorboard"))) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].filename().string().rfind("events.out.tfevents.", 0), 0u);
  const auto events = read_event_file(files[0].string());
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  // A fresh fit starts with a SessionLog START at its first step, the first batch (1).
  EXPECT_TRUE(events[1].session_start);
  EXPECT_EQ(events[1].step, 1);
  EXPECT_GT(events[1].wall_time, 1.6e9);  // seconds since 1970, now
  EXPECT_EQ(events[1].session_msg, "fit started");
  const auto csv = lines_of(read_all(dir.file("run/metrics.csv")));
  for (size_t r = 1; r < 4; ++r) {
    const auto f = csv_fields(csv[r]);
    const DecodedEvent& e = events[r + 1];
    EXPECT_FALSE(e.session_start);
    EXPECT_EQ(e.step, std::stoll(f[4]));
    std::map<std::string, float> v(e.scalars.begin(), e.scalars.end());
    const std::string prefix = f[0] == "epoch" ? "epoch/" : "train/";
    EXPECT_FLOAT_EQ(v.at(prefix + "loss"), static_cast<float>(std::stod(f[7])));
    EXPECT_FLOAT_EQ(v.at(prefix + "lr"), static_cast<float>(std::stod(f[8])));
    EXPECT_NEAR(v.at("memory/live_MiB"), std::stod(f[11]) / 1048576.0, 1e-3);
    EXPECT_EQ(v.count("valid/accuracy"), f[0] == "epoch" ? 1u : 0u);
  }
  // A flipped byte is caught by its CRC32C, naming the file and the record.
  std::string bytes = read_all(files[0].string());
  bytes[bytes.size() - 10] ^= 0x01;
  const std::string bad = dir.file("bad.tfevents");
  std::ofstream(bad, std::ios::binary) << bytes;
  try {
    read_event_file(bad);
    ADD_FAILURE() << "a flipped byte was not noticed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CRC32C"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("record 4"), std::string::npos) << e.what();
  }
}

// ---- a run from a config: the files in its folder, plots ----------------------------------

TEST(MetricsHistory, ARunFromAConfigWritesItsHistoryTensorBoardAndPlots) {
  TempDir dir;
  const std::string out = dir.file("run");
  const Config c = parse_config(
      "[run]\nout_dir = \"" + out + "\"\nprogress = \"none\"\nthreads = 1\nlog_every = 2\n"
      "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\nbatch_size = 16\n"
      "valid_samples = 32\n[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n"
      "[[stages]]\nname = \"a\"\nepochs = 2\n[stages.schedule]\nname = \"one_cycle\"\n",
      "run.toml");
  auto l = make_learner(c);
  l->fit(c.stages);
  EXPECT_EQ(lines_of(read_all(out + "/metrics.csv")).size(), 1u + 4u + 2u);
  EXPECT_EQ(lines_of(read_all(out + "/metrics.jsonl")).size(), 6u);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(out + "/tensorboard"),
                          std::filesystem::directory_iterator{}), 1);
  ASSERT_TRUE(std::filesystem::exists(out + "/metrics.gp"));
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) GTEST_SKIP() << "gnuplot absent";
  EXPECT_GT(std::filesystem::file_size(out + "/metrics.svg"), 1000u) << read_all(out + "/metrics.gp.log");
  EXPECT_GT(std::filesystem::file_size(out + "/metrics.png"), 1000u) << read_all(out + "/metrics.gp.log");
}

// ---- lr_find ------------------------------------------------------------------------------

TEST(LrFind, SweepsTheLrExponentiallyAndSuggestsOneOfIt) {
  TempDir dir;
  write_text(dir.file("f.toml"),
             "[run]\nprogress = \"none\"\nthreads = 1\nout_dir = \"" + dir.file("run") + "\"\n"
             "[data]\ndataset = \"synthetic\"\nsamples = 128\nimage_size = 8\nclasses = 4\n"
             "batch_size = 16\nvalid_samples = -1\n[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n");
  const auto r = run_cli("lr_find " + dir.file("f.toml") + " --num-it 30 --start-lr 1e-5 --end-lr 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto csv = lines_of(read_text(dir.file("run/lr_find/lr_find.csv")));
  ASSERT_GE(csv.size(), 2u) << r.output;
  EXPECT_EQ(csv[0], "lr,loss");
  ASSERT_LE(csv.size(), 31u);
  for (size_t i = 1; i < csv.size(); ++i) {  // 30 batches: 8 an epoch, the sweep crosses epochs
    const double want = 1e-5 * std::pow(1e5, static_cast<double>(i - 1) / 29.0);
    EXPECT_NEAR(std::stod(csv_fields(csv[i])[0]) / want, 1.0, 1e-7) << csv[i];
  }
  const auto at = r.output.find("suggested lr (valley): ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double suggested = std::stod(r.output.substr(at + 23));
  EXPECT_GE(suggested, 1e-5 * 0.999);
  EXPECT_LE(suggested, 1.0);
  EXPECT_FALSE(std::filesystem::exists(dir.file("run/metrics.csv")));  // a sweep is not a run
}

// fastai's lr_find hands `valley` the points [num_it // 10 : -5] (cut before the first NaN), and
// valley (fastai/callback/schedule.py) takes, over them, lds[i] = the longest decreasing run
// ending at i; max_end = the first i with the largest lds, max_start = max_end - lds[max_end];
// idx = max_start + int(len / 3) + int(len / 3 / 2) with len = max_end - max_start.
TEST(LrFindValley, SkipsTheFirstTenthAndTheLastFivePointsAsFastai) {
  const std::vector<double> losses = {3.0, 2.9, 2.8, 2.85, 2.7, 2.6,  2.5,  2.55, 2.4, 2.3,
                                      2.2, 2.1, 2.5, 2.9,  3.5, 0.1, 0.05, 0.02, 5.0, 9.0};
  // num_it = 20: points 2 .. 14, the losses 2.8 2.85 2.7 2.6 2.5 2.55 2.4 2.3 2.2 2.1 2.5 2.9
  // 3.5 (the dip to 0.02 is in the last five). Their lds: 1 1 2 3 4 4 5 6 7 8 5 1 1, so
  // max_end = 9 (2.1), max_start = 9 - 8 = 1, len 8: idx = 1 + int(2.67) + int(1.33) = 4,
  // point 2 + 4 = 6 of the sweep (loss 2.5). (Over points 0 .. 14, as before: the run 3.0 .. 2.1
  // of 10 ends at 11, max_start 1, idx = 1 + 3 + 1 = 5.)
  const cli::SuggestionPoints p = cli::suggestion_points(losses, 20);
  EXPECT_EQ(p.begin, 2u);
  EXPECT_EQ(p.end, 15u);
  EXPECT_EQ(cli::suggested_index(losses, 20), std::optional<size_t>(6));
  EXPECT_EQ(cli::valley_index(std::vector<double>(losses.begin(), losses.end() - 5)), 5u);
}

TEST(LrFindValley, MatchesFastaisIndexArithmeticAtTheEdges) {
  // A valley of the first two points only: max_start = 1 - 2 = -1, len 2, idx = -1 + 0 + 0:
  // Python's lrs[-1], the last point.
  EXPECT_EQ(cli::valley_index({2.0, 1.0}), 1u);
  EXPECT_EQ(cli::valley_index({2.0, 1.0, 3.0, 4.0}), 3u);
  // Three falling points: max_start -1, len 3, idx = -1 + 1 + 0 = 0.
  EXPECT_EQ(cli::valley_index({3.0, 2.0, 1.0}), 0u);
  EXPECT_EQ(cli::valley_index({1.0, 2.0, 3.0}), 0u);  // no valley: lds all 1, idx 0
  EXPECT_EQ(cli::valley_index({5.0}), 0u);
  // num_it = 10: points 1 .. 9 (of 15), cut before the NaN at 5: 2.9 2.8 2.7 2.6, lds 1 2 3 4,
  // max_end 3, max_start -1, len 4: idx = -1 + 1 + 0 = 0, point 1. Without the cut the fall on
  // to 0.2 would make a longer valley.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> with_nan = {3.0, 2.9, 2.8, 2.7, 2.6, nan, 2.0, 1.0,
                                        0.5, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1};
  EXPECT_EQ(cli::suggestion_points(with_nan, 10).end, 5u);
  EXPECT_EQ(cli::suggested_index(with_nan, 10), std::optional<size_t>(1));
  // Too short a sweep for fastai's points (it fails there): none.
  EXPECT_FALSE(cli::suggested_index({3.0, 2.0, 1.0, 0.5, 0.4, 0.3}, 20).has_value());
  EXPECT_FALSE(cli::suggested_index({3.0, 2.0}, 2).has_value());
}

// ---- held by callbacks --------------------------------------------------------------------

TEST(HeldByCallbacks, TheSteadyBreakdownHasAColumnForWhatCallbacksHold) {
  BatchMemory b;
  b.live_before_forward = 1000;
  b.forward_peak = 1500;
  const MemoryBreakdown m = steady_breakdown(b, 300, 200, 100, 150);
  EXPECT_EQ(m.callbacks, 150);
  EXPECT_EQ(m.other, 1000 - 300 - 200 - 100 - 150);  // no longer hidden in "other"

  auto l = make_tiny_learner(history_setup());
  auto holder = std::make_shared<Holder>();
  l->add_callback(holder);
  l->fit(1);
  const MemoryBreakdown& s = l->stage_stats()[0].steady;
  EXPECT_EQ(s.callbacks, holder->held_bytes());
  EXPECT_EQ(s.callbacks, 16384);
  const nlohmann::json j = s;
  EXPECT_EQ(j["callbacks"], 16384);
  EXPECT_EQ(j["total"], s.total());
  const std::string md = report_markdown(nlohmann::json{{"fit", l->report()}});
  const auto at = md.find("held by callbacks");
  ASSERT_NE(at, std::string::npos) << md;
  EXPECT_NE(md.find(format_bytes(16384), at), std::string::npos) << md;
}

}  // namespace frugal::test
