// Checkpoint and resume: a fit stopped right after Learner::save_checkpoint and continued by a
// fresh learner ends with the same parameters, bit for bit on CPU, as one uninterrupted fit
// (dropout, Adam, BatchNorm, stage boundaries, a stage's own optimizer); the periodic
// CheckpointWriter; and `frugal train --resume` after a SIGKILL.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

/// Saves a checkpoint at the n-th firing of `event` and stops the fit there: a run killed
/// right after its last checkpoint.
struct SaveAndStop : Callback {
  SaveAndStop(std::string file, Event at, int batch) : path(std::move(file)), event(at), n(batch) {}
  std::string name() const override { return "save_and_stop"; }
  int order() const override { return -2000; }  // last in after_* events
  void after_batch(Learner& l) override { maybe(l, Event::AfterBatch); }
  void after_epoch(Learner& l) override { maybe(l, Event::AfterEpoch); }
  void after_stage(Learner& l) override { maybe(l, Event::AfterStage); }
  void maybe(Learner& l, Event e) {
    if (e != event || ++seen != n) return;
    l.save_checkpoint(path, {{"note", "test"}});
    l.stop_fit();
  }
  std::string path;
  Event event;
  int n, seen = 0;
};

/// Records the events a fit fires, with the iteration counter at each.
struct ResumeRecorder : Callback {
  std::string name() const override { return "recorder"; }
  void before_fit(Learner& l) override { add("before_fit", l); }
  void before_stage(Learner& l) override { add("before_stage", l); }
  void before_epoch(Learner& l) override { add("before_epoch", l); }
  void before_train(Learner& l) override { add("before_train", l); }
  void before_batch(Learner& l) override { add("before_batch", l); }
  void after_epoch(Learner& l) override { add("after_epoch", l); }
  void after_stage(Learner& l) override { add("after_stage", l); }
  void after_fit(Learner& l) override { add("after_fit", l); }
  void add(const std::string& e, Learner& l) {
    events.push_back(e);
    iterations.push_back(l.iteration());
  }
  std::vector<std::string> events;
  std::vector<int64_t> iterations;
};

struct Outcome {
  std::vector<torch::Tensor> params, buffers;
  std::vector<StageStats> stats;
  int64_t iterations = 0, steps = 0;
  double valid_accuracy = -1;
};

Outcome outcome(Learner& l) {
  Outcome o{clone_params(*l.model()), {}, l.stage_stats(), l.iteration(), l.steps(),
            l.valid_accuracy()};
  for (const auto& b : l.model()->buffers()) o.buffers.push_back(b.clone());
  return o;
}

void expect_same(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(torch::equal(a.params[i], b.params[i]))
        << what << ": parameter " << i << " differs by "
        << (a.params[i] - b.params[i]).abs().max().item<double>();
  ASSERT_EQ(a.buffers.size(), b.buffers.size()) << what;
  for (size_t i = 0; i < a.buffers.size(); ++i)
    EXPECT_TRUE(torch::equal(a.buffers[i], b.buffers[i])) << what << ": buffer " << i;
  EXPECT_EQ(a.iterations, b.iterations) << what;
  EXPECT_EQ(a.steps, b.steps) << what;
  EXPECT_EQ(a.valid_accuracy, b.valid_accuracy) << what;
  ASSERT_EQ(a.stats.size(), b.stats.size()) << what;
  for (size_t i = 0; i < a.stats.size(); ++i) {
    EXPECT_EQ(a.stats[i].samples, b.stats[i].samples) << what << " stage " << i;
    EXPECT_EQ(a.stats[i].step_seconds.size(), b.stats[i].step_seconds.size()) << what;
    EXPECT_EQ(a.stats[i].last_epoch_loss, b.stats[i].last_epoch_loss) << what << " stage " << i;
    EXPECT_EQ(a.stats[i].valid_accuracy, b.stats[i].valid_accuracy) << what << " stage " << i;
  }
}

TinySetup noisy_setup() {
  TinySetup s;  // 64 samples in batches of 16: 4 batches an epoch, shuffled, validated
  s.dropout = 0.3;  // draws from the CPU generator every batch
  s.depth = 2;
  s.optimizer = "adam";
  return s;
}

std::vector<Stage> three_stages() {
  Stage a = make_stage("warmup", 2, {"stem"});
  Stage b = make_stage("main", 2);
  b.has_optimizer = true;  // the second stage switches to SGD with momentum
  b.optimizer.name = "sgd";
  b.optimizer.lr = 0.05;
  b.optimizer.set("momentum", 0.9);
  Stage c = make_stage("tail", 1);  // keeps the second stage's SGD
  return {a, b, c};
}

/// Fits with a stop after the n-th `event` (checkpoint written), then resumes in a learner
/// whose weights started elsewhere; returns the resumed outcome.
Outcome interrupted(const TinySetup& s, const std::vector<Stage>& stages, Event event, int n,
                    const std::string& path) {
  {
    auto first = make_tiny_learner(s);
    first->add_callback(std::make_shared<SaveAndStop>(path, event, n));
    first->fit(stages);
  }
  auto second = make_tiny_learner(s);
  {  // other weights, and the generator elsewhere: all must come back
    torch::NoGradGuard g;
    for (auto& p : second->model()->parameters()) p.uniform_(-1, 1);
  }
  torch::randn({1000});
  EXPECT_EQ(second->load_checkpoint(path), nlohmann::json({{"note", "test"}}));
  second->fit(stages);
  return outcome(*second);
}

TEST(Resume, MidEpochAndAtEveryBoundaryGiveTheUninterruptedParametersBitwise) {
  TempDir dir;
  const TinySetup s = noisy_setup();
  const auto stages = three_stages();
  auto ref_learner = make_tiny_learner(s);
  ref_learner->fit(stages);
  const Outcome ref = outcome(*ref_learner);
  ASSERT_EQ(ref.iterations, 20);

  struct Cut {
    Event event;
    int n;
    const char* what;
  };
  for (const Cut& c : {Cut{Event::AfterBatch, 3, "mid-epoch"},
                       Cut{Event::AfterBatch, 4, "after an epoch's last batch, before validation"},
                       Cut{Event::AfterBatch, 10, "mid-epoch in the second stage"},
                       Cut{Event::AfterEpoch, 1, "after an epoch"},
                       Cut{Event::AfterEpoch, 2, "after a stage's last epoch"},
                       Cut{Event::AfterStage, 1, "between stages"},
                       Cut{Event::AfterStage, 2, "before a stage that keeps the optimizer"},
                       Cut{Event::AfterBatch, 18, "in a stage that keeps the optimizer"}}) {
    expect_same(ref, interrupted(s, stages, c.event, c.n, dir.file("ckpt")), c.what);
  }
}

TEST(Resume, BatchNormBuffersAndAdamStateComeBack) {
  TempDir dir;
  TinySetup s;
  s.arch = "cnn";
  s.width = 4;
  s.dropout = 0.2;
  const std::vector<Stage> stages = {make_stage("train", 3)};
  auto ref_learner = make_tiny_learner(s);
  ref_learner->fit(stages);
  ASSERT_FALSE(ref_learner->model()->buffers().empty());
  expect_same(outcome(*ref_learner), interrupted(s, stages, Event::AfterBatch, 6, dir.file("c")),
              "cnn");
}

TEST(Resume, OnlyTheResumedPositionFiresItsBeforeEvents) {
  TempDir dir;
  const TinySetup s = noisy_setup();
  const auto stages = three_stages();
  {
    auto first = make_tiny_learner(s);
    first->add_callback(std::make_shared<SaveAndStop>(dir.file("c"), Event::AfterBatch, 10));
    first->fit(stages);
  }
  auto second = make_tiny_learner(s);
  auto rec = std::make_shared<ResumeRecorder>();
  second->add_callback(rec);
  second->load_checkpoint(dir.file("c"));
  const FitPosition p = *second->pending_resume();
  EXPECT_EQ(p.stage, 1);
  EXPECT_EQ(p.epoch, 0);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.iteration, 10);
  second->fit(stages);
  EXPECT_FALSE(second->pending_resume());
  const std::vector<std::string> head(rec->events.begin(), rec->events.begin() + 5);
  EXPECT_EQ(head, (std::vector<std::string>{"before_fit", "before_stage", "before_epoch",
                                            "before_train", "before_batch"}));
  EXPECT_EQ(rec->iterations.front(), 10) << "counters hold their saved values in before_fit";
  EXPECT_EQ(std::count(rec->events.begin(), rec->events.end(), "before_batch"), 10);
  EXPECT_EQ(std::count(rec->events.begin(), rec->events.end(), "before_stage"), 2);
  EXPECT_EQ(second->iteration(), 20);
  ASSERT_EQ(second->stage_stats().size(), 3u);
  EXPECT_EQ(second->stage_stats()[0].samples, 128) << "the first stage's statistics came back";
  EXPECT_EQ(second->stage_stats()[1].samples, 128);
}

TEST(Resume, AFinishedFitResumesToNothing) {
  TempDir dir;
  auto a = make_tiny_learner();
  a->fit(2);
  a->save_checkpoint(dir.file("done"));
  const auto after = clone_params(*a->model());
  auto b = make_tiny_learner();
  b->load_checkpoint(dir.file("done"));
  EXPECT_TRUE(b->pending_resume()->done);
  auto rec = std::make_shared<ResumeRecorder>();
  b->add_callback(rec);
  b->fit(2);
  EXPECT_TRUE(params_equal(*b->model(), after));
  EXPECT_EQ(rec->events, (std::vector<std::string>{"before_fit", "after_fit"}));
  EXPECT_EQ(b->iteration(), a->iteration());
}

TEST(Resume, AFinishedFitGoesOnWithMoreEpochsOrStagesAsIfItHadNeverStopped) {
  // A fit of [a: 1 epoch] carried on as [a: 2] and as [a: 2, b: 1] (b with its own SGD) ends
  // bitwise where the longer fit from the start ends: optimizer state, data order, counters.
  TempDir dir;
  const TinySetup s = noisy_setup();  // dropout, shuffled, validated: every generator counts
  Stage b = make_stage("b", 1);
  b.has_optimizer = true;
  b.optimizer.name = "sgd";
  b.optimizer.lr = 0.05;
  {
    auto first = make_tiny_learner(s);
    first->fit(std::vector<Stage>{make_stage("a", 1)});
    first->save_checkpoint(dir.file("done"));
  }
  for (const std::vector<Stage>& longer : {std::vector<Stage>{make_stage("a", 2)},
                                           std::vector<Stage>{make_stage("a", 2), b}}) {
    auto whole = make_tiny_learner(s);
    whole->fit(longer);
    auto more = make_tiny_learner(s);
    more->load_checkpoint(dir.file("done"));
    more->fit(longer);
    expect_same(outcome(*whole), outcome(*more), std::to_string(longer.size()) + " stage(s)");
  }
}

TEST(Resume, AFinishedFitGoesOnOnlyWithTheStagesItRan) {
  TempDir dir;
  {
    auto a = make_tiny_learner();
    a->fit(std::vector<Stage>{make_stage("a", 2), make_stage("b", 1)});
    a->save_checkpoint(dir.file("done"));
  }
  const auto refusal = [&](const std::vector<Stage>& stages) {
    auto l = make_tiny_learner();
    l->load_checkpoint(dir.file("done"));
    try {
      l->fit(stages);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("(none)");
  };
  EXPECT_NE(refusal({make_stage("a", 3), make_stage("b", 1)}).find("stage 'a' ran 2 epochs, this fit gives it 3"),
            std::string::npos);
  EXPECT_NE(refusal({make_stage("a", 2), make_stage("c", 1)}).find("this fit's stage 2 is 'c'"), std::string::npos);
  EXPECT_NE(refusal({make_stage("a", 2), make_stage("b", 0)}).find("ran 1 epochs, more than 0"), std::string::npos);
}

TEST(Resume, MismatchesAreClearCheckpointErrors) {
  TempDir dir;
  const std::string path = dir.file("c");
  {
    auto a = make_tiny_learner();
    a->add_callback(std::make_shared<SaveAndStop>(path, Event::AfterBatch, 2));
    a->fit(std::vector<Stage>{make_stage("one", 2)});
  }
  auto msg = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("no CheckpointError");
  };
  {  // other stages
    auto b = make_tiny_learner();
    b->load_checkpoint(path);
    const auto m = msg([&] { b->fit(std::vector<Stage>{make_stage("two", 2)}); });
    EXPECT_NE(m.find("stages [one]; this fit has [two]"), std::string::npos) << m;
  }
  {  // another optimizer
    TinySetup s;
    s.optimizer = "sgd";
    auto b = make_tiny_learner(s);
    b->load_checkpoint(path);
    const auto m = msg([&] { b->fit(std::vector<Stage>{make_stage("one", 2)}); });
    EXPECT_NE(m.find("optimizer 'adam'"), std::string::npos) << m;
  }
  {  // a file Learner::save wrote has no resume state
    auto b = make_tiny_learner();
    b->save(dir.file("plain"));
    const auto m = msg([&] { b->load_checkpoint(dir.file("plain")); });
    EXPECT_NE(m.find("holds no resume state"), std::string::npos) << m;
    EXPECT_FALSE(b->pending_resume());
  }
  {  // a model of another shape
    TinySetup s;
    s.width = 8;
    auto b = make_tiny_learner(s);
    const auto m = msg([&] { b->load_checkpoint(path); });
    EXPECT_NE(m.find("does not fit this model"), std::string::npos) << m;
  }
}

TEST(Resume, StateOfAMissingCallbackIsRefused) {
  struct Stateful : Callback {
    std::string name() const override { return "stateful"; }
    void save_state(torch::serialize::OutputArchive& a) const override {
      a.write("count", c10::IValue(int64_t{41}));
    }
    void load_state(Learner&, torch::serialize::InputArchive& a) override {
      c10::IValue v;
      a.read("count", v);
      count = v.toInt();
    }
    int64_t count = 0;
  };
  TempDir dir;
  {
    auto a = make_tiny_learner();
    a->add_callback(std::make_shared<Stateful>());
    a->add_callback(std::make_shared<SaveAndStop>(dir.file("c"), Event::AfterBatch, 2));
    a->fit(1);
  }
  auto b = make_tiny_learner();
  b->load_checkpoint(dir.file("c"));
  try {
    b->fit(1);
    FAIL() << "a resume without the callback whose state the checkpoint holds must fail";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("callback 'stateful'"), std::string::npos) << e.what();
  }
  auto c = make_tiny_learner();
  auto st = std::make_shared<Stateful>();
  c->add_callback(st);
  c->load_checkpoint(dir.file("c"));
  c->fit(1);
  EXPECT_EQ(st->count, 41) << "load_state got what save_state wrote";
}

TEST(Resume, AStateMarkedOptionalMayBeLeftUnread) {
  // A callback only rank 0 runs (the metrics history) marks its state: the other ranks, and a
  // run that turned it off, resume without it.
  struct Optional : Callback {
    std::string name() const override { return "optional"; }
    void save_state(torch::serialize::OutputArchive& a) const override {
      a.write(kOptionalState, c10::IValue(true));
      a.write("count", c10::IValue(int64_t{7}));
    }
  };
  TempDir dir;
  {
    auto a = make_tiny_learner();
    a->add_callback(std::make_shared<Optional>());
    a->add_callback(std::make_shared<SaveAndStop>(dir.file("c"), Event::AfterBatch, 2));
    a->fit(1);
  }
  auto b = make_tiny_learner();
  b->load_checkpoint(dir.file("c"));
  EXPECT_NO_THROW(b->fit(1));
}

TEST(Resume, CheckpointWriterWritesEveryNStepsAndAtTheEnd) {
  TempDir dir;
  const TinySetup s = noisy_setup();
  auto l = make_tiny_learner(s);
  auto w = std::make_shared<CheckpointWriter>(dir.file("ck/last.ckpt"), 3, 0);
  l->add_callback(w);
  l->fit(3);  // 12 steps: at 3, 6, 9, 12, and the end of the fit
  EXPECT_EQ(w->written(), 5);
  const auto rec = Learner::read_checkpoint(dir.file("ck/last.ckpt"));
  EXPECT_TRUE(rec["position"]["done"].get<bool>());
  EXPECT_EQ(rec["position"]["steps"].get<int64_t>(), 12);

  auto e = make_tiny_learner(s);
  auto we = std::make_shared<CheckpointWriter>(dir.file("e.ckpt"), 0, 2);
  e->add_callback(we);
  e->fit(5);  // epochs 2 and 4, and the end
  EXPECT_EQ(we->written(), 3);
}

TEST(Resume, AMidEpochCheckpointCarriesTheTimeOfTheSamplesItCounts) {
  TempDir dir;
  const TinySetup s = noisy_setup();
  struct SaveAtBatch3 : Callback {
    std::string path;
    std::string name() const override { return "save_at_batch_3"; }
    void after_batch(Learner& l) override {
      if (l.iteration() == 2) l.save_checkpoint(path);  // mid-epoch: 4 batches an epoch
    }
  };
  auto l = make_tiny_learner(s);
  auto saver = std::make_shared<SaveAtBatch3>();
  saver->path = dir.file("ck.ckpt");
  l->add_callback(saver);
  l->fit(1);
  const auto rec = Learner::read_checkpoint(dir.file("ck.ckpt"));
  ASSERT_EQ(rec["position"]["batch"].get<int64_t>(), 3) << rec["position"].dump();
  const auto& stage = rec["stats"][0];
  EXPECT_GT(stage["samples"].get<int64_t>(), 0);
  // Before: the epoch's samples were saved without its seconds, and a resumed stage's
  // samples/s doubled.
  EXPECT_GT(stage["train_seconds"].get<double>(), 0.0) << stage.dump();
}

// ---- the CLI: SIGKILL mid-run, then `frugal train --resume` --------------------------------

std::string killable_config(const std::string& out_dir) {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"none\"\nthreads = 1\nseed = 3\n"
         "checkpoint_every = 5\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 512\nimage_size = 8\nclasses = 4\n"
         "batch_size = 8\nvalid_samples = -1\n"
         "[model]\narch = \"mlp\"\nwidth = 32\ndepth = 2\ndropout = 0.25\n"
         "[optimizer]\nname = \"adam\"\nlr = 0.003\n"
         "[[stages]]\nname = \"first\"\nepochs = 3\nfreeze = [\"stem\"]\n"
         "[[stages]]\nname = \"second\"\nepochs = 3\n";
}

std::vector<torch::Tensor> final_params(const std::string& config, const std::string& ckpt) {
  auto l = make_learner(load_config(config));
  l->load(ckpt, /*with_opt=*/true);
  return clone_params(*l->model());
}

TEST(ResumeCli, SigkillMidRunThenResumeEqualsTheUninterruptedRun) {
  TempDir dir;
  const std::string ref_out = dir.file("ref"), out = dir.file("killed");
  write_text(dir.file("ref.toml"), killable_config(ref_out));
  write_text(dir.file("run.toml"), killable_config(out));
  auto ref = run_cli("train " + dir.file("ref.toml"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;

  // The run is killed as soon as its first checkpoint exists: 384 batches, one checkpoint
  // every 5 steps, each fsync'd, remain after it.
  const std::string ckpt = out + "/checkpoints/last.ckpt";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string cli = cli_path(), cfg = dir.file("run.toml");
    ::freopen("/dev/null", "w", stderr);
    ::freopen("/dev/null", "w", stdout);
    ::execl(cli.c_str(), cli.c_str(), "train", cfg.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  bool exited = false;
  while (!std::filesystem::exists(ckpt) && std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!exited) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  ASSERT_TRUE(std::filesystem::exists(ckpt)) << "no checkpoint before the kill";
  const auto killed_at = Learner::read_checkpoint(ckpt)["position"];
  EXPECT_FALSE(killed_at["done"].get<bool>()) << "the kill came after the run had ended";
  EXPECT_FALSE(std::filesystem::exists(out + "/report.json")) << "the killed run did not finish";

  auto resumed = run_cli("train " + dir.file("run.toml") + " --resume " + out);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from"), std::string::npos) << resumed.output;

  const auto a = final_params(dir.file("ref.toml"), ref_out + "/checkpoints/last.ckpt");
  const auto b = final_params(dir.file("run.toml"), ckpt);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i << " after resuming at "
                                          << killed_at.dump();
  auto ra = nlohmann::json::parse(read_text(ref_out + "/report.json"));
  auto rb = nlohmann::json::parse(read_text(out + "/report.json"));
  EXPECT_EQ(ra["fit"]["iterations"], rb["fit"]["iterations"]);
  EXPECT_EQ(ra["fit"]["optimizer_steps"], rb["fit"]["optimizer_steps"]);
  EXPECT_EQ(ra["fit"]["final_loss"], rb["fit"]["final_loss"]);
  EXPECT_EQ(rb["resumed_from"].get<std::string>(), ckpt);
}

TEST(ResumeCli, AFinishedRunCarriesOnWithAnAddedStageOrMoreEpochs) {
  // The killable config's two stages, trained as [first] and then carried on as
  // [first, second] (--resume RUN) and with more epochs of second (--resume auto), end where
  // the uninterrupted run of the same stages ends.
  TempDir dir;
  const std::string ref = dir.file("ref"), out = dir.file("run");
  write_text(dir.file("ref.toml"), killable_config(ref));
  std::string two = killable_config(out);
  write_text(dir.file("run.toml"), two);
  std::string one = two.substr(0, two.find("[[stages]]\nname = \"second\""));
  write_text(dir.file("one.toml"), one);
  ASSERT_EQ(run_cli("train " + dir.file("ref.toml") + " --set stages.1.epochs=4").exit_code, 0);
  ASSERT_EQ(run_cli("train " + dir.file("one.toml")).exit_code, 0);
  const auto refused = run_cli("train " + dir.file("one.toml") + " --resume auto");
  EXPECT_NE(refused.exit_code, 0) << "the same config: nothing is left to train";
  EXPECT_NE(refused.output.find("nothing is left to train"), std::string::npos) << refused.output;
  const auto added = run_cli("train " + dir.file("run.toml") + " --resume " + out);
  ASSERT_EQ(added.exit_code, 0) << added.output;
  const auto longer = run_cli("train " + dir.file("run.toml") + " --resume auto --set stages.1.epochs=4");
  ASSERT_EQ(longer.exit_code, 0) << longer.output;
  const auto a = final_params(dir.file("ref.toml"), ref + "/checkpoints/last.ckpt");
  const auto b = final_params(dir.file("run.toml"), out + "/checkpoints/last.ckpt");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
  const auto report = nlohmann::json::parse(read_text(out + "/report.json"));
  EXPECT_EQ(report["fit"]["stages"].size(), 2u);
  EXPECT_EQ(report["fit"]["iterations"],
            nlohmann::json::parse(read_text(ref + "/report.json"))["fit"]["iterations"]);
}

TEST(ResumeCli, ResumeRefusesAnotherConfigAndAMissingCheckpoint) {
  TempDir dir;
  const std::string out = dir.file("run");
  std::string cfg = killable_config(out);
  cfg.replace(cfg.find("samples = 512"), 13, "samples = 64");
  write_text(dir.file("run.toml"), cfg);
  ASSERT_EQ(run_cli("train " + dir.file("run.toml")).exit_code, 0);

  auto r = run_cli("train " + dir.file("run.toml") + " --resume " + out +
                   " --set optimizer.lr=0.1 --set run.threads=2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("optimizer.lr (checkpoint 0.003"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("run.threads"), std::string::npos) << "threads may differ: " << r.output;
  EXPECT_EQ(r.output.find("training mlp"), std::string::npos) << r.output;

  r = run_cli("train " + dir.file("run.toml") + " --resume " + dir.file("nowhere"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("nowhere': no such file or folder"), std::string::npos) << r.output;

  std::filesystem::resize_file(out + "/checkpoints/last.ckpt", 100);
  r = run_cli("train " + dir.file("run.toml") + " --resume " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("last.ckpt' is unreadable"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("training mlp"), std::string::npos) << r.output;
}

// ---- keys marked outside training may differ on --resume; every other key may not ----

/// The ConfigError check_resume_config throws for `now` against a checkpoint of `saved`; ""
/// when it accepts.
std::string resume_error(const std::string& saved, const std::string& now,
                         const std::vector<std::string>& plugin_keys = {}) {
  const Config a = parse_config(saved, "a.toml");
  const Config b = parse_config(now, "b.toml");
  try {
    check_resume_config(b, checkpoint_info(a), "last.ckpt", plugin_keys);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(ResumeConfig, TheMarkedRunKeysAreExactlyTheOnesThatMayDiffer) {
  std::vector<std::string> keys = Config{}.keys_outside_training();
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{
                      "distributed.backend", "distributed.bucket_size", "distributed.overlap", "distributed.timeout",
                      "run.checkpoint_epochs", "run.checkpoint_every", "run.device",
                      "run.keep_checkpoints", "run.log_every", "run.max_steps",
                      "run.memory_budget", "run.metrics", "run.micro_batch", "run.on_oom",
                      "run.oom_retries", "run.out_dir", "run.plots", "run.preempt_signal",
                      "run.progress", "run.resume", "run.tensorboard", "run.threads"}));
}

TEST(ResumeConfig, AKeyMarkedOutsideTrainingMayDifferAnyOtherMayNot) {
  auto config = [](const std::string& run_key) {
    return "[run]\nwarmup = 2\n" + run_key + "\n[optimizer]\nlr = 0.01\n";
  };
  const std::string base = config("log_every = 10");
  EXPECT_EQ(resume_error(base, base), "");
  for (const char* free : {"log_every = 99", "memory_budget = \"1GiB\"", "threads = 3",
                           "out_dir = \"elsewhere\"", "checkpoint_every = 5", "on_oom = \"retry\""})
    EXPECT_EQ(resume_error(base, config(free)), "") << free;
  for (const char* bound : {"seed = 1", "trace = \"t.json\"", "log_every = 10\nwarmup = 3"}) {
    const std::string now = std::string(bound).find("warmup") != std::string::npos
                                ? "[run]\nlog_every = 10\nwarmup = 3\n[optimizer]\nlr = 0.01\n"
                                : config("log_every = 10\n" + std::string(bound));
    EXPECT_NE(resume_error(base, now).find("key(s) that change the training"), std::string::npos)
        << bound;
  }
  EXPECT_NE(resume_error(base, config("log_every = 10\n[data]\nbatch_size = 64"))
                .find("data.batch_size (checkpoint 128, b.toml 64)"),
            std::string::npos);
  EXPECT_NE(resume_error(base, "[run]\nwarmup = 2\nlog_every = 10\n[optimizer]\nlr = 0.02\n")
                .find("optimizer.lr (checkpoint 0.01, b.toml 0.02)"),
            std::string::npos);
}

TEST(ResumeConfig, APluginKeyMayDifferWhenThePluginMarksIt) {
  const std::string a = "[plugins.detach_loss]\nthreshold = \"1KiB\"\n";
  const std::string b = "[plugins.detach_loss]\nthreshold = \"4KiB\"\n";
  EXPECT_NE(resume_error(a, b).find("plugins.detach_loss.threshold"), std::string::npos);
  EXPECT_EQ(resume_error(a, b, {"plugins.detach_loss.threshold"}), "");
  EXPECT_NE(resume_error(a, b + "detach = false\n", {"plugins.detach_loss.threshold"})
                .find("plugins.detach_loss.detach"),
            std::string::npos);
}

}  // namespace
}  // namespace frugal::test
