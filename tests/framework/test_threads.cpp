// CPU threads: run.threads = "auto" (the default) times real training steps with 1 thread and
// with N and keeps the faster; set_threads moves BLAS with LibTorch; a checkpoint keeps the
// choice.
#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <vector>

#include "frugal/base/error.h"
#include "frugal/callbacks/threads.h"
#include "frugal/config/config.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

std::string threads_error(const std::string& text, const std::vector<std::string>& set = {}) {
  try {
    parse_config(text, "cfg.toml", set);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no ConfigError";
}

TEST(ThreadsConfig, AutoIsTheDefaultAndSurvivesTheResolvedConfig) {
  const Config c = parse_config("", "cfg.toml");
  EXPECT_EQ(c.run.threads, Limits::kAuto);
  EXPECT_NE(c.to_toml().find("threads = 'auto'"), std::string::npos) << c.to_toml();
  EXPECT_EQ(parse_config(c.to_toml(), "resolved.toml").run.threads, Limits::kAuto);
  EXPECT_EQ(parse_config("[run]\nthreads = 2\n", "cfg.toml").run.threads, 2);
  EXPECT_EQ(parse_config("[run]\nthreads = 2\n", "cfg.toml", {"run.threads=auto"}).run.threads,
            Limits::kAuto);
}

TEST(ThreadsConfig, AWrongValueNamesTheKeyAndWhatIsAllowed) {
  EXPECT_EQ(threads_error("[run]\nthreads = \"many\"\n"),
            "cfg.toml:2:11: 'run.threads' must be an integer >= 0 or \"auto\", got string \"many\"");
  EXPECT_EQ(threads_error("[run]\nthreads = -1\n"),
            "cfg.toml:2:11: 'run.threads' must be an integer >= 0 or \"auto\", got -1");
}

TEST(Threads, SetThreadsMovesTheBlasLibraryToo) {
  using Get = int (*)();
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (get == nullptr) GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS";
  const int before = at::get_num_threads();
  set_threads(1, 2);
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(get(), 2);
  EXPECT_EQ(blas_threads(), 2);
  set_threads(2, 1);
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(get(), 1);
  // run.threads = N: the BLAS pool stays at 1 beside ATen's N (they spin against each other).
  set_threads(2);
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(get(), 1);
  set_threads(before);
}

// Records the intra-op threads each training forward ran with, and the BLAS library's.
struct ThreadSpy : Callback {
  std::vector<int> seen;
  std::vector<int64_t> blas;
  std::string name() const override { return "thread_spy"; }
  void before_forward(Learner& l) override {
    if (!l.training()) return;
    seen.push_back(at::get_num_threads());
    blas.push_back(blas_threads());
  }
};

TinySetup ten_batches() {
  TinySetup s;
  s.samples = 160;
  s.batch_size = 16;
  return s;
}

TEST(ThreadTuner, TimesTheCandidatesOnRealStepsThenTrainsOnTheChosenOne) {
  auto l = make_tiny_learner(ten_batches());
  auto tuner = std::make_shared<ThreadTuner>(2);
  auto spy = std::make_shared<ThreadSpy>();
  l->add_callback(tuner);
  l->add_callback(spy);
  l->fit(2);  // decided by step 10; the second epoch on the choice
  ASSERT_TRUE(tuner->decided());
  const ThreadChoice& c = tuner->choice();
  ASSERT_EQ(spy->seen.size(), 20u);
  EXPECT_GT(c.one_ms, 0);
  EXPECT_GT(c.samples, 0);
  EXPECT_EQ(spy->seen.back(), c.chosen) << "the last steps train on the choice";
  if (blas_threads() > 0) {
    EXPECT_EQ(spy->blas.back(), c.blas);
  }
  ASSERT_TRUE(last_thread_choice().has_value());
  EXPECT_EQ(last_thread_choice()->chosen, c.chosen);
}

// A clock on which a step takes the time `ms` gives for the threads it ran with.
std::function<double()> fake_clock(std::function<double(int, int64_t)> ms) {
  auto t = std::make_shared<double>(0.0);
  auto started = std::make_shared<bool>(false);
  return [=] {
    if (*started) *t += ms(at::get_num_threads(), blas_threads());
    *started = !*started;
    return *t;
  };
}

struct Timed {
  std::vector<int> aten;
  std::vector<int64_t> blas;
  ThreadChoice choice;
};

Timed tune_on(std::function<double(int, int64_t)> ms) {
  auto l = make_tiny_learner(ten_batches());
  auto tuner = std::make_shared<ThreadTuner>(2);
  tuner->set_clock(fake_clock(std::move(ms)));
  auto spy = std::make_shared<ThreadSpy>();
  l->add_callback(tuner);
  l->add_callback(spy);
  l->fit(1);
  EXPECT_TRUE(tuner->decided());
  return {spy->seen, spy->blas, tuner->choice()};
}

TEST(ThreadTuner, ACandidateFarSlowerAfterOneRoundIsTimedNoMore) {
  const bool pool = blas_threads() > 0;
  // 1 + 1: 100 ms, 2 + 1: 150 ms (> 1.25 x the best after round 1), 1 + 2: 104 ms
  const auto r = tune_on([](int aten, int64_t blas) { return aten > 1 ? 150.0 : blas > 1 ? 104.0 : 100.0; });
  // warm-up on 2 + 1; round 1: all three; rounds 2 and 3 without 2 + 1 (or, with no BLAS pool,
  // 1 + 1 left alone after round 1 and chosen at once)
  std::vector<int> aten = {2, 1, 2};
  if (pool) aten.insert(aten.end(), {1, 1, 1, 1, 1});
  const size_t steps = aten.size();
  aten.resize(10, 1);  // the rest on the choice
  EXPECT_EQ(r.aten, aten);
  if (pool) {
    EXPECT_EQ(r.blas, (std::vector<int64_t>{1, 1, 1, 2, 1, 2, 1, 2, 1, 1}));
  }
  EXPECT_EQ(r.choice.chosen, 1);
  EXPECT_EQ(r.choice.blas, 1);
  EXPECT_DOUBLE_EQ(r.choice.one_ms, 100.0);
  EXPECT_DOUBLE_EQ(r.choice.many_ms, 150.0);
  EXPECT_EQ(r.choice.samples, pool ? 3 : 1);
  EXPECT_EQ(r.choice.timed, pool ? (std::vector<int64_t>{3, 1, 3}) : (std::vector<int64_t>{1, 1}));
  EXPECT_LE(static_cast<int64_t>(steps), ThreadTuner::kSteps);
}

TEST(ThreadTuner, CandidatesWithinTheMarginsRunThreeRoundsAndTheFastestMedianWins) {
  const bool pool = blas_threads() > 0;
  // 1 + 1: 100 ms, 2 + 1: 103 ms, 1 + 2: 98 ms: none is dropped
  const auto r = tune_on([](int aten, int64_t blas) { return aten > 1 ? 103.0 : blas > 1 ? 98.0 : 100.0; });
  std::vector<int> aten = {2};
  for (int k = 0; k < 3; ++k) {
    aten.insert(aten.end(), {1, 2});
    if (pool) aten.push_back(1);
  }
  const int chosen = 1;  // 1 + 2 with a BLAS pool, else 1 + 1
  aten.resize(10, chosen);
  EXPECT_EQ(r.aten, aten);
  EXPECT_EQ(r.choice.chosen, chosen);
  EXPECT_EQ(r.choice.blas, pool ? 2 : 1);
  EXPECT_EQ(r.choice.samples, 3);
  if (pool) {
    EXPECT_DOUBLE_EQ(r.choice.blas_ms, 98.0);
    EXPECT_EQ(r.blas.back(), 2);
  }
}

TEST(ThreadTuner, AfterTheLastRoundTheFastestMedianWinsNotTheFastestStep) {
  if (blas_threads() == 0) GTEST_SKIP() << "needs the third candidate";
  // 1 + 2 steady at 95 ms; 1 + 1 at 100 ms with one 50 ms step in round 3 (its fastest step,
  // not its median); 2 + 1 dropped after round 1
  int seen_one = 0;
  const auto r = tune_on([&](int aten, int64_t blas) {
    if (aten > 1) return 200.0;
    if (blas > 1) return 95.0;
    return ++seen_one == 3 ? 50.0 : 100.0;
  });
  EXPECT_EQ(r.choice.blas, 2) << "1 + 2: median 95 ms against 100";
  EXPECT_EQ(r.choice.samples, 3);
}

TEST(ThreadTuner, ATinyModelsStepsAreAllTimedHoweverTheyCompare) {
  // 2 + 1 twice as slow, but 1 ms: three rounds of it cost less than the kDropMs a drop needs
  const auto r = tune_on([](int aten, int64_t) { return aten > 1 ? 2.0 : 1.0; });
  EXPECT_EQ(r.choice.samples, 3);
  EXPECT_EQ(std::count(r.aten.begin(), r.aten.end(), 2), 4) << "the warm-up and three rounds";
}

TEST(ThreadTuner, ACloseSecondIsDroppedAfterTheSecondRound) {
  if (blas_threads() == 0) GTEST_SKIP() << "two candidates only: no second round to test";
  // 1 + 1: 120 ms (dropped after round 2: > 1.10 x), 2 + 1: 200 (after round 1), 1 + 2: 100
  const auto r = tune_on([](int aten, int64_t blas) { return aten > 1 ? 200.0 : blas > 1 ? 100.0 : 120.0; });
  // warm-up, round 1 (three), round 2 (1 + 1 and 1 + 2): 1 + 2 is left alone and chosen
  EXPECT_EQ(r.blas, (std::vector<int64_t>{1, 1, 1, 2, 1, 2, 2, 2, 2, 2}));
  EXPECT_EQ(r.choice.blas, 2);
  EXPECT_EQ(r.choice.samples, 2);
}

// Saves a checkpoint after the n-th training batch and stops the fit: a run killed there.
struct SaveAtBatch : Callback {
  SaveAtBatch(std::string file, int batch) : path(std::move(file)), n(batch) {}
  std::string name() const override { return "save_at_batch"; }
  int order() const override { return -2000; }  // last in after_* events
  void after_batch(Learner& l) override {
    if (++seen != n) return;
    l.save_checkpoint(path);
    l.stop_fit();
  }
  std::string path;
  int n, seen = 0;
};

// An "auto" run of two epochs of 10 batches, killed after its 12th with a checkpoint at `path`
// (the tuner decided by step 10); returns the thread count it chose.
int64_t auto_run_checkpointed_at_batch_12(const std::string& path) {
  auto l = make_tiny_learner(ten_batches());
  auto tuner = std::make_shared<ThreadTuner>(2);
  l->add_callback(tuner);
  l->add_callback(std::make_shared<SaveAtBatch>(path, 12));
  l->fit(2);
  EXPECT_TRUE(tuner->decided());
  return tuner->choice().chosen;
}

TEST(ThreadTuner, AResumedRunKeepsTheChoiceInsteadOfMeasuringAgain) {
  TempDir dir;
  const std::string path = (dir.path() / "run.ckpt").string();
  const int64_t chosen = auto_run_checkpointed_at_batch_12(path);
  set_threads(chosen == 1 ? 2 : 1);  // the process starts over on the other count
  auto l = make_tiny_learner(ten_batches());
  auto tuner = std::make_shared<ThreadTuner>(2);
  auto spy = std::make_shared<ThreadSpy>();
  l->add_callback(tuner);
  l->add_callback(spy);
  l->load_checkpoint(path);
  l->fit(2);
  EXPECT_TRUE(tuner->decided());
  EXPECT_EQ(tuner->choice().chosen, chosen);
  ASSERT_EQ(spy->seen.size(), 8u) << "the rest of the second epoch";
  for (int t : spy->seen) EXPECT_EQ(t, chosen);
}

TEST(ThreadTuner, ACheckpointOfAnAutoRunResumesWithThreadsSetToANumber) {
  TempDir dir;
  const std::string path = (dir.path() / "run.ckpt").string();
  auto_run_checkpointed_at_batch_12(path);
  set_threads(2);  // run.threads = 2 this time: an inert tuner, as make_learner adds
  auto l = make_tiny_learner(ten_batches());
  auto spy = std::make_shared<ThreadSpy>();
  l->add_callback(std::make_shared<ThreadTuner>(0));
  l->add_callback(spy);
  l->load_checkpoint(path);
  EXPECT_NO_THROW(l->fit(2));
  ASSERT_EQ(spy->seen.size(), 8u);
  for (int t : spy->seen) EXPECT_EQ(t, 2) << "the number set wins over the checkpoint's choice";
}

TEST(ThreadTuner, AFitTooShortToDecideGoesBackToItsThreads) {
  set_threads(2);
  TinySetup s = ten_batches();
  s.samples = 32;  // 2 batches: a warm-up and one step on 1 + 1; nothing timed on the others
  auto l = make_tiny_learner(s);
  auto tuner = std::make_shared<ThreadTuner>(2);
  l->add_callback(tuner);
  l->fit(1);
  EXPECT_FALSE(tuner->decided()) << "no step was timed on 2 threads";
  EXPECT_EQ(at::get_num_threads(), 2) << "batch 1 ran on 1 thread; the fit's end restores 2";
}

}  // namespace
}  // namespace frugal::test
