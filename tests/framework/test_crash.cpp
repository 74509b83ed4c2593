// Runs that meet a crash or a full disk. A run SIGKILLed while writing resumes (the crash soak,
// scripts/soak.sh, kills one at random moments; these are the states it found). A checkpoint
// write that finds the disk full stops the run with an error naming the file and the cause;
// the previous checkpoint stays intact and a resume, once there is room, finishes. The full
// disk is the file size limit (RLIMIT_FSIZE, what `ulimit -f` sets) of a `frugal train` child,
// and /dev/full (ENOSPC) for the writer itself.
#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>

#include "cli_support.h"
#include "frugal/core/learner.h"
#include "frugal/io/file_writer.h"
#include "frugal/io/safetensors.h"
#include "support.h"

namespace frugal::test {
namespace {

namespace fs = std::filesystem;

/// Stage 1 trains with the stem (256 x 64 weights) frozen, so Adam holds no state for it; stage
/// 2 unfreezes it, and its checkpoints are about twice the size of stage 1's (~130 KiB, ~260
/// KiB). A limit between the two lets stage 1's checkpoints through and stops stage 2's first.
std::string growing_config(const std::string& out_dir) {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"log\"\nlog_every = 1\nthreads = 1\n"
         "seed = 5\ncheckpoint_every = 2\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 16\nclasses = 4\n"
         "batch_size = 8\nvalid_samples = -1\n"
         "[model]\narch = \"mlp\"\nwidth = 64\ndepth = 1\ndropout = 0.1\n"
         "[optimizer]\nname = \"adam\"\nlr = 0.003\n"
         "[[stages]]\nname = \"frozen\"\nepochs = 1\nfreeze = [\"stem\"]\n"
         "[[stages]]\nname = \"all\"\nepochs = 1\n";
}

constexpr rlim_t kLimit = 192 * 1024;

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CrashCli, AKillDuringTheFirstCheckpointWriteLeavesAFolderResumeAutoStartsAfresh) {
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("run.toml"), growing_config(out));
  // What a SIGKILL in the first checkpoint's write leaves: its temporary file, and no checkpoint.
  fs::create_directories(out + "/checkpoints");
  write_text(out + "/checkpoints/last.ckpt.tmp.4242", "PK partial");
  write_text(out + "/checkpoints/last.ckpt.link-tmp", "");
  auto r = run_cli("train " + dir.file("run.toml") + " --resume auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("removed 2 unfinished file(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("holds no run yet: starting one"), std::string::npos) << r.output;
  EXPECT_EQ(files_in(out + "/checkpoints"), std::vector<std::string>{"last.ckpt"});
}

TEST(CrashCli, AKillAfterTheEndOfFitCheckpointResumesToWriteTheResults) {
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("run.toml"), growing_config(out));
  auto r = run_cli("train " + dir.file("run.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string weights = read_text(out + "/model.safetensors");
  // Killed after the end-of-fit checkpoint, before model.pt and the report (an earlier life's
  // report, stopped by a signal, may be there).
  for (const char* f : {"model.pt", "model.safetensors", "report.md"}) fs::remove(out + "/" + f);
  write_text(out + "/report.json", R"({"interrupted": {"signal": "SIGTERM"}})");
  r = run_cli("train " + dir.file("run.toml") + " --resume auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("that fit had ended"), std::string::npos) << r.output;
  EXPECT_EQ(read_text(out + "/model.safetensors"), weights);
  EXPECT_TRUE(fs::exists(out + "/model.pt"));
  // Finished now: another --resume auto is refused.
  r = run_cli("train " + dir.file("run.toml") + " --resume auto");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("has finished"), std::string::npos) << r.output;
}

TEST(CrashCli, AKillBeforeTheFirstCheckpointIsLinkedResumesFromTheNumberedFile) {
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("run.toml"), growing_config(out));
  const std::string keep = " --set run.keep_checkpoints=2 --set run.max_steps=2";
  auto r = run_cli("train " + dir.file("run.toml") + keep);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The state between the first numbered file's rename and the link's: no last.ckpt.
  fs::remove(out + "/checkpoints/last.ckpt");
  for (const char* f : {"model.pt", "model.safetensors", "report.json", "report.md"})
    fs::remove(out + "/" + f);
  ASSERT_EQ(files_in(out + "/checkpoints"), std::vector<std::string>{"step-00000002.ckpt"});
  r = run_cli("train " + dir.file("run.toml") + " --resume auto" + keep);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from " + out + "/checkpoints/step-00000002.ckpt"),
            std::string::npos) << r.output;
}

TEST(DiskFullCli, ACheckpointPastTheFileSizeLimitStopsTheRunAndThePreviousOneResumes) {
  TempDir dir;
  const std::string out = dir.file("run"), ref_out = dir.file("ref");
  write_text(dir.file("run.toml"), growing_config(out));
  write_text(dir.file("ref.toml"), growing_config(ref_out));
  auto ref = run_cli("train " + dir.file("ref.toml"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto ckpt_size = fs::file_size(ref_out + "/checkpoints/last.ckpt");
  ASSERT_GT(ckpt_size, kLimit) << "stage 2's checkpoint must exceed the limit";

  const pid_t pid = start_train({"train", dir.file("run.toml")}, dir.file("log"), kLimit);
  const int status = wait_child(pid);
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status)
                                 << " (SIGXFSZ is 25: frugal must ignore it)\n" << log;
  EXPECT_EQ(WEXITSTATUS(status), 1) << log;
  const std::string ckpt = out + "/checkpoints/last.ckpt";
  EXPECT_NE(log.find("cannot write checkpoint '" + ckpt + "'"), std::string::npos) << log;
  EXPECT_NE(log.find("File too large writing '" + ckpt + ".tmp."), std::string::npos) << log;
  EXPECT_NE(log.find("(the file size limit, RLIMIT_FSIZE or ulimit -f, was reached)"),
            std::string::npos) << log;
  EXPECT_NE(log.find("at step 10 (stage 2, epoch 1, batch 2)"), std::string::npos) << log;
  EXPECT_NE(log.find("the previous checkpoint, '" + ckpt + "' (step 8), is intact"),
            std::string::npos) << log;
  // No partial file is left, and the checkpoint is stage 1's last (step 8), whole.
  EXPECT_EQ(files_in(out + "/checkpoints"), std::vector<std::string>{"last.ckpt"});
  const auto at = Learner::read_checkpoint(ckpt)["position"];
  EXPECT_EQ(at["steps"], 8) << at.dump();
  EXPECT_EQ(at["stage"], 0) << at.dump();
  const auto check = run_cli("check " + dir.file("run.toml") + " --checkpoint " + ckpt);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find(ckpt + ": OK (8 steps; resumes at stage 1 epoch 1 batch 9; written by 1 process)"), std::string::npos)
      << check.output;
  // What the soak relies on: a cut checkpoint fails the check, naming it.
  const std::string bytes = read_text(ckpt);
  write_text(dir.file("cut.ckpt"), bytes.substr(0, bytes.size() / 2));
  const auto cut = run_cli("check " + dir.file("run.toml") + " --checkpoint " + ckpt +
                           " --checkpoint " + dir.file("cut.ckpt"));
  EXPECT_EQ(cut.exit_code, 1) << cut.output;
  EXPECT_NE(cut.output.find(dir.file("cut.ckpt")), std::string::npos) << cut.output;

  // Room again: the same command with --resume auto continues from it and finishes, with the
  // parameters of the run that never hit the limit.
  auto resumed = run_cli("train " + dir.file("run.toml") + " --resume auto");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from " + ckpt), std::string::npos) << resumed.output;
  const auto a = safetensors::read(ref_out + "/model.safetensors");
  const auto b = safetensors::read(out + "/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  }
}

TEST(DiskFull, TheWriterNamesTheFileAndTheCause) {
  // /dev/full: every write fails with ENOSPC, as on a full disk.
  FileWriter f("/dev/full");
  const char bytes[4096] = {};
  EXPECT_FALSE(f.write(bytes, sizeof bytes));
  EXPECT_FALSE(f.write(bytes, 1)) << "the first failure is kept";
  try {
    f.finish();
    FAIL() << "finish() must throw";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "No space left on device writing '/dev/full' (the disk is full: make room, or "
              "write the run elsewhere)");
  }
}

TEST(DiskFull, AFailedAtomicWriteLeavesThePreviousFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("report.json");
  write_file_atomic(path, std::string("previous"));
  EXPECT_THROW(write_file_atomic(path,
                                 [](const std::string& tmp) {
                                   FileWriter f(tmp);
                                   f.write("partial", 7);
                                   throw Error("no room");
                                 }),
               Error);
  EXPECT_EQ(read_text(path), "previous");
  EXPECT_EQ(files_in(dir.path().string()), std::vector<std::string>{"report.json"});
}

}  // namespace
}  // namespace frugal::test
