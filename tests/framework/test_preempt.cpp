// Runs that survive their environment: a signal stops a run cleanly (checkpoint, report marked
// "interrupted", exit code 75) and --resume continues it bitwise; --resume auto; one run per
// folder; a checkpoint history. Signals are sent by the test to a `frugal train` it started.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "frugal/callbacks/checkpoint_history.h"
#include "frugal/callbacks/stop.h"
#include "frugal/io/run_folder.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace fs = std::filesystem;

/// 4096 samples in batches of 8, 3 + 2 epochs: long enough that a signal sent at batch 5
/// arrives mid-run. No periodic checkpoint: the stop must write its own.
std::string stoppable_config(const std::string& out_dir, const std::string& extra_run = "",
                             const std::string& progress = "log") {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"" + progress +
         "\"\nlog_every = 1\nthreads = 1\n"
         "seed = 3\n" + extra_run +
         "[data]\ndataset = \"synthetic\"\nsamples = 4096\nimage_size = 8\nclasses = 4\n"
         "batch_size = 8\nvalid_samples = -1\n"
         "[model]\narch = \"mlp\"\nwidth = 32\ndepth = 2\ndropout = 0.25\n"
         "[optimizer]\nname = \"adam\"\nlr = 0.003\n"
         "[[stages]]\nname = \"first\"\nepochs = 3\nfreeze = [\"stem\"]\n"
         "[[stages]]\nname = \"second\"\nepochs = 2\n";
}

/// Starts a run of `config`, sends `sig` once it has logged batch 5, and returns its status.
int interrupt_run(const std::string& config, const std::string& log, int sig,
                  const std::vector<std::string>& more = {}) {
  std::vector<std::string> args = {"train", config};
  args.insert(args.end(), more.begin(), more.end());
  const pid_t pid = start_train(args, log);
  int status = 0;
  if (!wait_for_marker(pid, log, "batch 5/", status)) return status;
  ::kill(pid, sig);
  return wait_child(pid);
}

std::vector<torch::Tensor> preempt_final_params(const std::string& config, const std::string& ckpt) {
  auto l = make_learner(load_config(config));
  l->load(ckpt, /*with_opt=*/true);
  return clone_params(*l->model());
}

nlohmann::json report_of(const std::string& out) {
  return nlohmann::json::parse(read_text(out + "/report.json"));
}

TEST(PreemptCli, SigtermMidEpochCheckpointsThenResumeEqualsTheUninterruptedRun) {
  TempDir dir;
  const std::string ref_out = dir.file("ref"), out = dir.file("run");
  write_text(dir.file("ref.toml"), stoppable_config(ref_out, "", "none"));
  write_text(dir.file("run.toml"), stoppable_config(out));
  // The end-of-fit checkpoint holds the final parameters (checkpoint_epochs may differ on resume).
  const std::string at_end = " --set run.checkpoint_epochs=1000";
  auto ref = run_cli("train " + dir.file("ref.toml") + at_end);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;

  const int status = interrupt_run(dir.file("run.toml"), dir.file("log"), SIGTERM);
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(status)) << log;
  ASSERT_EQ(WEXITSTATUS(status), kExitInterrupted) << log;
  const std::string ckpt = out + "/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::exists(ckpt)) << "checkpoint_every = 0, yet a stop writes one";
  const auto at = Learner::read_checkpoint(ckpt)["position"];
  EXPECT_FALSE(at["done"].get<bool>()) << at.dump();
  EXPECT_LT(at["batch"].get<int64_t>(), 512) << "stopped mid-epoch (512 batches an epoch): " << at.dump();
  const auto report = report_of(out);
  ASSERT_TRUE(report.contains("interrupted")) << report.dump(2);
  EXPECT_EQ(report["interrupted"]["signal"], "SIGTERM");
  EXPECT_EQ(report["interrupted"]["steps"], at["steps"]);
  EXPECT_EQ(report["interrupted"]["batch"], at["batch"]);
  EXPECT_NE(read_text(out + "/report.md").find("interrupted"), std::string::npos);

  auto resumed = run_cli("train " + dir.file("run.toml") + " --resume auto" + at_end);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from " + ckpt), std::string::npos) << resumed.output;
  const auto a = preempt_final_params(dir.file("ref.toml"), ref_out + "/checkpoints/last.ckpt");
  const auto b = preempt_final_params(dir.file("run.toml"), ckpt);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i << " after a stop at " << at.dump();
  EXPECT_FALSE(report_of(out).contains("interrupted"));
  EXPECT_EQ(report_of(out)["fit"]["optimizer_steps"], report_of(ref_out)["fit"]["optimizer_steps"]);
}

TEST(PreemptCli, SigintAndThePreemptSignalStopCleanlyToo) {
  TempDir dir;
  const std::vector<std::pair<int, std::string>> cases = {
      {SIGINT, ""}, {SIGUSR1, ""}, {SIGUSR2, "preempt_signal = \"SIGUSR2\"\n"}};
  for (const auto& [sig, key] : cases) {
    const std::string out = dir.file("run" + std::to_string(sig));
    write_text(dir.file("run.toml"), stoppable_config(out, key));
    const int status = interrupt_run(dir.file("run.toml"), dir.file("log"), sig);
    ASSERT_TRUE(WIFEXITED(status)) << signal_name(sig) << read_text(dir.file("log"));
    EXPECT_EQ(WEXITSTATUS(status), kExitInterrupted) << read_text(dir.file("log"));
    EXPECT_EQ(report_of(out)["interrupted"]["signal"], signal_name(sig));
    EXPECT_TRUE(fs::exists(out + "/checkpoints/last.ckpt"));
  }
  write_text(dir.file("bad.toml"), stoppable_config(dir.file("bad"), "preempt_signal = \"SIGKILL\"\n"));
  auto r = run_cli("train " + dir.file("bad.toml"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("preempt_signal"), std::string::npos) << r.output;
}

TEST(PreemptCli, ASecondSignalStopsAtOnce) {
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("run.toml"), stoppable_config(out));
  const pid_t pid = start_train({"train", dir.file("run.toml")}, dir.file("log"));
  int status = 0;
  ASSERT_TRUE(wait_for_marker(pid, dir.file("log"), "batch 5/", status)) << read_text(dir.file("log"));
  ::kill(pid, SIGTERM);
  ::kill(pid, SIGINT);  // another signal: two SIGTERMs pending at once would merge into one
  status = wait_child(pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit " << WEXITSTATUS(status) << read_text(dir.file("log"));
  EXPECT_TRUE(WTERMSIG(status) == SIGTERM || WTERMSIG(status) == SIGINT) << WTERMSIG(status);
  EXPECT_FALSE(fs::exists(out + "/report.json")) << "stopped at once, before any report";
}

TEST(PreemptCli, ASignalInTheFirstMomentsLeavesNothingOrAResumableRun) {
  // SIGTERM from the exec to the first batches: killed before the handler (nothing written),
  // stopped before the folder is claimed (exit 75, nothing written) or after (exit 75, a
  // checkpoint); either way the same command with --resume auto trains the run to its end.
  TempDir dir;
  for (const int ms : {0, 450, 550, 700, 1000}) {  // LibTorch's load takes ~0.4 s here
    const std::string out = dir.file("run" + std::to_string(ms)), cfg = out + ".toml";
    // 65536 samples: making them takes long enough for a signal to land before the folder's claim.
    std::string text = stoppable_config(out, "max_steps = 1000\n", "none");
    text.replace(text.find("samples = 4096"), 14, "samples = 65536");
    write_text(cfg, text);
    const pid_t pid = start_train({"train", cfg}, dir.file("log"));
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    ::kill(pid, SIGTERM);
    const int status = wait_child(pid);
    const std::string log = read_text(dir.file("log"));
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;  // it ended first: nothing to see
    if (WIFSIGNALED(status)) {
      EXPECT_EQ(WTERMSIG(status), SIGTERM) << ms << " ms: " << log;
      EXPECT_FALSE(fs::exists(out)) << ms << " ms: killed before the handler, yet a folder exists";
    } else {
      ASSERT_TRUE(WIFEXITED(status)) << ms << " ms";
      EXPECT_EQ(WEXITSTATUS(status), kExitInterrupted) << ms << " ms: " << log;
      if (!fs::exists(out))
        EXPECT_NE(log.find("before the run started: nothing was written"), std::string::npos) << log;
      else
        EXPECT_TRUE(fs::exists(out + "/checkpoints/last.ckpt")) << ms << " ms: " << log;
    }
    const CliResult resumed = run_cli("train " + cfg + " --resume auto");
    EXPECT_EQ(resumed.exit_code, 0) << ms << " ms: " << resumed.output;
  }
}

TEST(PreemptCli, ALockedFolderIsRefusedNamingTheHolder) {
  TempDir dir;
  const std::string out = dir.file("run");
  fs::create_directories(out);
  write_text(dir.file("run.toml"), stoppable_config(out, "", "none"));
  {
    const RunLock held(out);  // flock conflicts across open files, even in one process
    auto r = run_cli("train " + dir.file("run.toml"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("in use by another run (process " + std::to_string(::getpid())),
              std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("training mlp"), std::string::npos) << r.output;
  }
  EXPECT_NO_THROW(RunLock again(out)) << "released with its holder";
}

TEST(PreemptCli, ANewRunDoesNotReplaceAnEarlierOneUnlessOverwrite) {
  TempDir dir;
  const std::string out = dir.file("run");
  std::string cfg = stoppable_config(out, "checkpoint_every = 100\n", "none");
  cfg.replace(cfg.find("samples = 4096"), 14, "samples = 64");
  write_text(dir.file("run.toml"), cfg);
  ASSERT_EQ(run_cli("train " + dir.file("run.toml")).exit_code, 0);
  const std::string first = read_text(out + "/report.json");

  auto r = run_cli("train " + dir.file("run.toml"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds an earlier run's results (report.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  EXPECT_EQ(read_text(out + "/report.json"), first) << "refused: nothing replaced";

  r = run_cli("train " + dir.file("run.toml") + " --resume auto");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("has finished"), std::string::npos) << r.output;
  r = run_cli("train " + dir.file("run.toml") + " --resume auto --set optimizer.lr=0.1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("optimizer.lr (checkpoint 0.003"), std::string::npos) << r.output;

  // Resuming another folder's run into this one would replace this one's results.
  const std::string other = dir.file("other");
  ASSERT_EQ(run_cli("train " + dir.file("run.toml") + " --set run.out_dir=\"" + other + "\"").exit_code, 0);
  r = run_cli("train " + dir.file("run.toml") + " --resume " + other);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds another run's results"), std::string::npos) << r.output;

  r = run_cli("train " + dir.file("run.toml") + " --overwrite");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--overwrite: removed the earlier run's report.json"), std::string::npos)
      << r.output;
}

TEST(PreemptCli, ResumeAutoStartsFreshInAnEmptyFolderAlsoFromToml) {
  TempDir dir;
  std::string cfg = stoppable_config(dir.file("run"), "resume = \"auto\"\n", "none");
  cfg.replace(cfg.find("samples = 4096"), 14, "samples = 64");
  write_text(dir.file("run.toml"), cfg);
  auto r = run_cli("train " + dir.file("run.toml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("holds no run yet: starting one"), std::string::npos) << r.output;
}

TEST(Preempt, KeepCheckpointsKeepsTheNewestKAndLinksLastToTheNewest) {
  TempDir dir;
  auto l = make_tiny_learner();
  const std::string last = dir.file("ck/last.ckpt");
  auto w = std::make_shared<CheckpointWriter>(last, 3, 0);
  auto history = std::make_shared<CheckpointHistory>(last, 2);
  w->set_history(history);
  l->add_callback(w);
  l->fit(3);  // 12 steps: at 3, 6, 9, 12 and the end of the fit (12 again)
  const auto files = history->numbered();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(fs::path(files[0]).filename(), numbered_checkpoint_name(9));
  EXPECT_EQ(fs::path(files[1]).filename(), numbered_checkpoint_name(12));
  ASSERT_TRUE(fs::is_symlink(last));
  EXPECT_EQ(fs::read_symlink(last), numbered_checkpoint_name(12));
  EXPECT_TRUE(Learner::read_checkpoint(last)["position"]["done"].get<bool>());
  EXPECT_EQ(Learner::read_checkpoint(files[0])["position"]["steps"].get<int64_t>(), 9);
}

TEST(Preempt, AStopWaitsForAClosedAccumulationGroupThenSealsTheHistory) {
  TempDir dir;
  auto l = make_tiny_learner();
  struct SkipOdd : Callback {
    std::string name() const override { return "skip_odd"; }
    void before_step(Learner& l) override {
      if (l.iteration() % 2 == 0) l.skip_step();  // gradients pending after even batches
    }
  };
  StopRequest stop;
  stop.request();
  auto history = std::make_shared<CheckpointHistory>(dir.file("last.ckpt"));
  auto cb = std::make_shared<StopCallback>(stop, history);
  l->add_callback(std::make_shared<SkipOdd>());
  l->add_callback(cb);
  l->fit(2);
  ASSERT_TRUE(cb->stopped());
  EXPECT_EQ(cb->at().iteration, 2) << "after the second batch, whose step closed the group";
  EXPECT_EQ(cb->at().steps, 1);
  EXPECT_TRUE(history->sealed());
  const auto pos = Learner::read_checkpoint(dir.file("last.ckpt"))["position"];
  EXPECT_FALSE(pos["done"].get<bool>()) << "the stopped fit's end wrote no other checkpoint";
  EXPECT_EQ(pos["iteration"].get<int64_t>(), 2);
}

TEST(Preempt, AResumeFromANumberedCheckpointKeepsTheWritersCadence) {
  TempDir dir;
  const std::string last = dir.file("ck/last.ckpt");
  auto run = [&](const std::string& from) {
    auto l = make_tiny_learner();
    auto w = std::make_shared<CheckpointWriter>(last, 3, 0);
    w->set_history(std::make_shared<CheckpointHistory>(last, 10));
    l->add_callback(w);
    if (!from.empty()) l->load_checkpoint(from);
    l->fit(2);  // 8 steps: at 3, 6 and the end (8)
  };
  auto names = [&] {
    std::vector<std::string> out;
    for (const auto& f : CheckpointHistory(last, 10).numbered()) out.push_back(fs::path(f).filename());
    std::sort(out.begin(), out.end());
    return out;
  };
  run("");
  const std::vector<std::string> want = {numbered_checkpoint_name(3), numbered_checkpoint_name(6),
                                         numbered_checkpoint_name(8)};
  ASSERT_EQ(names(), want);
  run(dir.file("ck/" + numbered_checkpoint_name(3)));
  EXPECT_EQ(names(), want) << "the resumed run writes at 6 and 8 again, not at 4";
}

}  // namespace
}  // namespace frugal::test
