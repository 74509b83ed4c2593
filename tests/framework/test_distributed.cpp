// Data parallel: batches sharded across ranks, and `frugal train --nproc 2` (two processes on
// loopback, Gloo) against one process on the same global batches; stops, resumes and failures
// of a rank. Every multi-process run ends on its own (the launcher's and the tests' deadlines).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "frugal/base/error.h"
#include "frugal/callbacks/stop.h"
#include "frugal/core/learner.h"
#include "frugal/data/data.h"
#include "frugal/distributed/distributed.h"
#include "frugal/io/safetensors.h"
#include "support.h"

namespace frugal::test {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------- shards

Dataset numbered(int64_t n) {
  Dataset d;
  d.images = torch::arange(n, torch::kLong).remainder(256).to(torch::kByte).view({n, 1, 1, 1});
  d.labels = torch::arange(n, torch::kLong);  // a sample's label is its index
  d.num_classes = static_cast<int64_t>(n);
  return d;
}

TEST(Shards, EveryBatchSplitsAcrossRanksWithoutOverlapAndInTheSameOrder) {
  const int64_t n = 103, batch = 10;  // the last batch has 3 samples: 1 and 2
  DataLoader whole(numbered(n), batch, /*shuffle=*/true, 7);
  DataLoader r0(numbered(n), batch, true, 7), r1(numbered(n), batch, true, 7);
  r0.set_shard(0, 2);
  r1.set_shard(1, 2);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    for (auto* l : {&whole, &r0, &r1}) l->set_epoch(epoch);
    ASSERT_EQ(r0.num_batches(), whole.num_batches());
    for (int64_t i = 0; i < whole.num_batches(); ++i) {
      const Batch all = whole.batch(i), a = r0.batch(i), b = r1.batch(i);
      EXPECT_TRUE(torch::equal(torch::cat({a.y, b.y}), all.y)) << "epoch " << epoch << " batch " << i;
      EXPECT_LE(std::abs(a.size() - b.size()), 1);
      EXPECT_EQ(a.total_size(), all.size());
      EXPECT_EQ(r0.batch_samples(i), all.size());
    }
  }
  EXPECT_EQ(whole.batch(10).size(), 3);
  EXPECT_EQ(r0.batch(10).size(), 1);
  EXPECT_EQ(r1.batch(10).size(), 2);
}

TEST(Shards, ALastBatchSmallerThanTheWorldIsDroppedAndATooSmallBatchRefused) {
  DataLoader four(numbered(41), 10, false, 0);
  EXPECT_EQ(four.num_batches(), 5);
  four.set_shard(3, 4);
  EXPECT_EQ(four.num_batches(), 4) << "1 sample for 4 ranks: three would get none";
  // Validation keeps it (every_sample): the one sample goes to one rank, the others have no row.
  int64_t rows = 0;
  for (int r = 0; r < 4; ++r) {
    DataLoader v(numbered(41), 10, false, 0);
    v.set_shard(r, 4, /*every_sample=*/true);
    ASSERT_EQ(v.num_batches(), 5);
    rows += v.rows(4);
    if (v.rows(4) == 1) {
      EXPECT_EQ(v.batch(4).y.item<int64_t>(), 40) << "rank " << r;
    }
    int64_t seen = 0;
    for (int64_t i = 0; i < 4; ++i) seen += v.rows(i);
    EXPECT_GE(seen, 8) << "full batches split 2 or 3 per rank";
  }
  EXPECT_EQ(rows, 1) << "every sample once";
  DataLoader tiny(numbered(10), 2, false, 0);
  try {
    tiny.set_shard(0, 4);
    FAIL() << "a batch of 2 cannot feed 4 ranks";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.batch_size = 2"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- the environment

class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v)
        ::setenv(k, v, 1);
      else
        ::unsetenv(k);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(WorldEnv, TorchrunsVariablesAreReadAndABadOneIsNamed) {
  {
    ScopedEnv env{{"WORLD_SIZE", nullptr}, {"RANK", nullptr}};
    EXPECT_FALSE(WorldEnv::from_environment().distributed());
  }
  {
    ScopedEnv env{{"WORLD_SIZE", "4"}, {"RANK", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                  {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}};
    const WorldEnv e = WorldEnv::from_environment();
    EXPECT_EQ(e.world_size, 4);
    EXPECT_EQ(e.rank, 2);
    EXPECT_EQ(e.local_rank, 0);
    EXPECT_EQ(e.local_world_size, 2);
    EXPECT_EQ(e.master_addr, "10.0.0.1");
    EXPECT_EQ(e.master_port, 1234);
  }
  for (const auto& [rank, port, named] :
       {std::tuple<const char*, const char*, const char*>{"2", "29500", "RANK='2'"},
        {"0", "70000", "MASTER_PORT='70000'"},
        {nullptr, "29500", "RANK is not"}}) {
    ScopedEnv env{{"WORLD_SIZE", "2"}, {"RANK", rank}, {"MASTER_PORT", port}};
    try {
      WorldEnv::from_environment();
      FAIL() << named;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------- two ranks on loopback

/// 600 synthetic samples in batches of 50 (12 batches, 2 epochs), or 611 (the last batch of
/// 11 splits 5 + 6); dropout so that each rank's generator matters.
std::string dp_config(const std::string& out, const std::string& extra = "",
                      int64_t samples = 611, const std::string& optimizer = "sgd") {
  return "[run]\nout_dir = \"" + out + "\"\nprogress = \"log\"\nlog_every = 1\nthreads = 1\nseed = 5\n"
         "[data]\ndataset = \"synthetic\"\nsamples = " + std::to_string(samples) +
         "\nimage_size = 8\nclasses = 4\nbatch_size = 50\nvalid_samples = 100\n"
         "[model]\narch = \"mlp\"\nwidth = 32\ndepth = 2\n" +
         "[optimizer]\nname = \"" + optimizer + "\"\nlr = 0.01\n" +
         (optimizer == "sgd" ? "momentum = 0.9\n" : "") + "[[stages]]\nepochs = 2\n" + extra;
}

std::map<std::string, torch::Tensor> weights(const std::string& out) {
  return safetensors::read(out + "/model.safetensors");
}

double max_difference(const std::map<std::string, torch::Tensor>& a,
                      const std::map<std::string, torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [k, t] : a) {
    auto it = b.find(k);
    if (it == b.end()) {
      ADD_FAILURE() << "missing " << k;
      continue;
    }
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

nlohmann::json report(const std::string& out) {
  return nlohmann::json::parse(read_text(out + "/report.json"));
}

struct Pair {
  std::string one, two;
};

/// The same config trained by one process and by two ranks.
Pair train_both(TempDir& dir, const std::string& name, const std::string& extra, int64_t samples,
                const std::string& optimizer) {
  Pair p{dir.file(name + "-1"), dir.file(name + "-2")};
  write_text(dir.file(name + "-1.toml"), dp_config(p.one, extra, samples, optimizer));
  write_text(dir.file(name + "-2.toml"), dp_config(p.two, extra, samples, optimizer));
  const auto one = run_cli("train " + dir.file(name + "-1.toml"));
  EXPECT_EQ(one.exit_code, 0) << one.output;
  const auto two = run_cli("train " + dir.file(name + "-2.toml") + " --nproc 2");
  EXPECT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("rank 0 of 2 (gloo)"), std::string::npos) << two.output;
  return p;
}

// Not bitwise: two half-batch means summed round differently from one mean. SGD (momentum 0.9)
// stays within float rounding; Adam divides by sqrt(v), which magnifies the rounding of
// gradients near zero (measured: 3e-7 on even batches, 2.6e-6 with the uneven last batch).
TEST(DataParallelCli, TwoRanksTrainAsOneProcessDoesWithSgdAndAdam) {
  TempDir dir;
  for (const auto& [opt, tolerance] : {std::pair<std::string, double>{"sgd", 1e-6}, {"adam", 1e-5}}) {
    const Pair p = train_both(dir, opt, "", 611, opt);
    EXPECT_LT(max_difference(weights(p.one), weights(p.two)), tolerance) << opt;
    const auto r1 = report(p.one), r2 = report(p.two);
    EXPECT_EQ(r2["distributed"]["world_size"], 2);
    EXPECT_EQ(r2["distributed"]["batch_per_rank"], 25);
    EXPECT_EQ(r2["fit"]["optimizer_steps"], r1["fit"]["optimizer_steps"]);
    // Validation ran on each rank's half; the reduced sums score all 100 samples.
    EXPECT_EQ(r2["fit"]["valid_samples"], 100);
    EXPECT_EQ(r2["fit"]["valid_metric"]["value"], r1["fit"]["valid_metric"]["value"]);
    EXPECT_EQ(r2["fit"]["stages"][0]["samples"], r1["fit"]["stages"][0]["samples"])
        << "the samples of every rank";
  }
}

TEST(DataParallelCli, GradAccumSyncsOncePerGroupAndAmpComposes) {
  TempDir dir;
  const Pair accum = train_both(dir, "accum", "[plugins.grad_accum]\nsteps = 3\nmode = \"accumulate\"\n",
                                611, "sgd");
  EXPECT_LT(max_difference(weights(accum.one), weights(accum.two)), 1e-6);
  EXPECT_EQ(report(accum.two)["fit"]["optimizer_steps"], report(accum.one)["fit"]["optimizer_steps"]);
  // bf16 autocast: a matmul of 25 rows rounds differently from one of 50 in bf16 (measured
  // 1.5e-4 after 24 steps, weights of order 0.1); the same steps are taken.
  const Pair amp = train_both(dir, "amp", "[plugins.amp]\ndtype = \"bfloat16\"\n", 600, "sgd");
  EXPECT_LT(max_difference(weights(amp.one), weights(amp.two)), 1e-3);
  EXPECT_EQ(report(amp.two)["fit"]["optimizer_steps"], report(amp.one)["fit"]["optimizer_steps"]);
}

// Buckets of 4 KiB: the MLP's gradients make several, launched from backward's hooks as each
// completes. With two ranks a sum is the same whichever bucket carries it: the weights must be
// bitwise those of the all-reduce after backward, with Adam and with activation checkpointing
// (its recompute runs a backward of its own inside the outer one), and with gradients
// accumulated over two batches (the hooks armed on the group's last backward only).
TEST(DataParallelCli, TheAllReduceOverlappedWithBackwardGivesBitwiseTheSameWeights) {
  TempDir dir;
  for (const std::string& extra :
       {std::string(), std::string("[plugins.checkpoint]\n"),
        std::string("[plugins.grad_accum]\nsteps = 2\nmode = \"accumulate\"\n")}) {
    std::map<bool, std::string> out;
    for (const bool overlap : {true, false}) {
      out[overlap] = dir.file("run-" + std::to_string(overlap) + std::to_string(extra.size()));
      write_text(out[overlap] + ".toml",
                 dp_config(out[overlap],
                           std::string("[distributed]\nbucket_size = \"4KiB\"\noverlap = ") +
                               (overlap ? "true\n" : "false\n") + extra,
                           611, "adam"));
      const auto r = run_cli("train " + out[overlap] + ".toml --nproc 2");
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    EXPECT_EQ(max_difference(weights(out[true]), weights(out[false])), 0.0) << extra;
    const auto on = report(out[true])["distributed"], off = report(out[false])["distributed"];
    EXPECT_TRUE(on["overlap"]["on"].get<bool>()) << on.dump();
    EXPECT_GT(on["buckets_per_step"].get<double>(), 2) << on.dump();
    EXPECT_GT(on["overlap"]["buckets_in_backward_per_step"].get<double>(), 1) << on.dump();
    EXPECT_FALSE(off["overlap"]["on"].get<bool>()) << off.dump();
    EXPECT_EQ(off["overlap"]["buckets_in_backward_per_step"].get<double>(), 0) << off.dump();
    EXPECT_EQ(off["overlap"]["why_off"], "distributed.overlap = false") << off.dump();
    EXPECT_EQ(on["gradient_syncs"], off["gradient_syncs"]);
    // micro_batch = "auto" keeps the largest bucket's copy free: a 4 KiB bucket closes past 4 KiB.
    for (const auto* d : {&on, &off}) {
      EXPECT_GT((*d)["sync_reserve_bytes"].get<int64_t>(), 4096) << d->dump();
      EXPECT_LT((*d)["sync_reserve_bytes"].get<int64_t>(), 64 << 10) << d->dump();
    }
  }
  // A backward retried on one rank would put its launched buckets on the wire twice.
  // Validation of 101 samples in batches of 50: the last batch of 1 is scored by rank 1 alone
  // (a training batch that small is dropped: every rank needs a row of it).
  const std::string retry = dir.file("retry");
  std::string cfg = dp_config(retry, "[distributed]\nbucket_size = \"4KiB\"\n", 600);
  cfg.replace(cfg.find("valid_samples = 100"), 19, "valid_samples = 101");
  write_text(retry + ".toml", cfg);
  const auto r = run_cli("train " + retry + ".toml --nproc 2 --set run.on_oom='\"retry\"'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto d = report(retry)["distributed"];
  EXPECT_FALSE(d["overlap"]["on"].get<bool>()) << d.dump();
  EXPECT_NE(d["overlap"]["why_off"].get<std::string>().find("run.on_oom"), std::string::npos) << d.dump();
  EXPECT_EQ(report(retry)["fit"]["valid_samples"], 101) << "every validation sample once";
}

TEST(DataParallelCli, SigtermStopsBothRanksAtOneBatchAndTheResumeIsBitwise) {
  TempDir dir;
  const std::string ref = dir.file("ref"), out = dir.file("run");
  auto cfg = [&](const std::string& o) {
    std::string t = dp_config(o, "", 4000);
    t.replace(t.find("depth = 2\n"), 10, "depth = 2\ndropout = 0.3\n");
    return t;
  };
  write_text(dir.file("ref.toml"), cfg(ref));
  write_text(dir.file("run.toml"), cfg(out));
  const auto whole = run_cli("train " + dir.file("ref.toml") + " --nproc 2");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;

  const pid_t pid = start_train({"train", dir.file("run.toml"), "--nproc", "2"}, dir.file("log"));
  int status = 0;
  ASSERT_TRUE(wait_for_marker(pid, dir.file("log"), "batch 5/", status)) << read_text(dir.file("log"));
  ::kill(pid, SIGTERM);
  status = wait_child(pid);
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(status)) << log;
  ASSERT_EQ(WEXITSTATUS(status), kExitInterrupted) << log;
  const std::string ckpt = out + "/checkpoints/last.ckpt";
  const auto at = Learner::read_checkpoint(ckpt);
  EXPECT_EQ(at["info"]["world_size"], 2);
  EXPECT_FALSE(at["position"]["done"].get<bool>()) << at["position"].dump();

  const auto resumed = run_cli("train " + dir.file("run.toml") + " --nproc 2 --resume auto");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(max_difference(weights(ref), weights(out)), 0.0)
      << "every rank's dropout draws continue where they stopped: " << at["position"].dump();

  // One process continues it too, from the same global batch (not bitwise: one mean instead of
  // two halves', and the dropout masks of one generator over the whole batch).
  const auto one = run_cli("train " + dir.file("run.toml") + " --resume " + ckpt +
                           " --set run.out_dir='\"" + dir.file("other") + "\"'");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("written by 2 process(es); this run has 1"), std::string::npos) << one.output;
  EXPECT_EQ(report(dir.file("other"))["fit"]["optimizer_steps"], report(ref)["fit"]["optimizer_steps"]);
}

std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> out;
  pid_t c = 0;
  while (f >> c) out.push_back(c);
  return out;
}

// A lost rank ends the run; its last checkpoint then resumes in one process (the lost node is
// not needed back): the optimizer state and the data position carry over. Also with zero
// stage 3, whose checkpoints gather the parameters each rank keeps only a share of.
class RankLost : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(DataParallelCli, RankLost, ::testing::Values("", "[plugins.zero]\nstage = 3\n"),
                         [](const auto& p) { return p.param.empty() ? "DataParallel" : "ZeroStage3"; });

TEST_P(RankLost, ARankThatDiesEndsTheWholeRunAndItsCheckpointResumesOnFewerRanks) {
  TempDir dir;
  std::string cfg = dp_config(dir.file("run"), GetParam(), 20000, "adam");
  cfg.replace(cfg.find("seed = 5\n"), 9, "seed = 5\ncheckpoint_every = 2\n");
  write_text(dir.file("run.toml"), cfg);
  const pid_t pid = start_train({"train", dir.file("run.toml"), "--nproc", "2"}, dir.file("log"));
  int status = 0;
  ASSERT_TRUE(wait_for_marker(pid, dir.file("log"), "batch 3/", status)) << read_text(dir.file("log"));
  const auto ranks = children_of(pid);
  ASSERT_EQ(ranks.size(), 2u) << read_text(dir.file("log"));
  ::kill(ranks[1], SIGKILL);
  status = wait_child(pid);
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGKILL) << log;
  EXPECT_NE(log.find("rank 1 ended with exit code 137: stopping the other ranks"), std::string::npos) << log;
  EXPECT_NE(::kill(ranks[0], 0), 0) << "rank 0 is gone too";

  const std::string ckpt = dir.file("run") + "/checkpoints/last.ckpt";
  const auto at = Learner::read_checkpoint(ckpt);
  ASSERT_EQ(at["info"]["world_size"], 2);
  const auto one = run_cli("train " + dir.file("run.toml") + " --resume auto");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("written by 2 process(es); this run has 1"), std::string::npos) << one.output;
  EXPECT_EQ(report(dir.file("run"))["fit"]["optimizer_steps"], 800) << "20000 samples, 2 epochs of 50";
}

/// A port nothing listens on now.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// `frugal train` as rank `rank` of `world`, started by hand (as a launcher would).
pid_t start_rank(int rank, int world, int port, const std::vector<std::string>& args,
                 const std::string& log) {
  const ScopedEnv env{{"RANK", std::to_string(rank).c_str()},
                      {"WORLD_SIZE", std::to_string(world).c_str()},
                      {"MASTER_ADDR", "127.0.0.1"},
                      {"MASTER_PORT", std::to_string(port).c_str()}};
  return start_train(args, log);
}

/// A socket listening on a free port of `address` that never accepts: the port is taken.
struct Listener {
  explicit Listener(in_addr_t address = INADDR_LOOPBACK) : fd(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(address);
    socklen_t len = sizeof(a);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::listen(fd, 8);
    port = ntohs(a.sin_port);
  }
  ~Listener() { ::close(fd); }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int fd = -1, port = 0;
};

TEST(DataParallelFaults, RanksStartedWithDifferentConfigsAreRefusedBeforeTraining) {
  TempDir dir;
  write_text(dir.file("run.toml"), dp_config(dir.file("run")));
  const int port = free_port();
  const pid_t r0 = start_rank(0, 2, port, {"train", dir.file("run.toml")}, dir.file("log0"));
  const pid_t r1 = start_rank(1, 2, port, {"train", dir.file("run.toml"), "--set", "optimizer.lr=0.5"},
                              dir.file("log1"));
  const int s0 = wait_child(r0), s1 = wait_child(r1);
  const std::string log0 = read_text(dir.file("log0")), log1 = read_text(dir.file("log1"));
  ASSERT_TRUE(WIFEXITED(s0) && WIFEXITED(s1)) << log0 << log1;
  EXPECT_EQ(WEXITSTATUS(s0), 2) << log0;
  EXPECT_EQ(WEXITSTATUS(s1), 2) << log1;
  EXPECT_NE(log0.find("rank 1 was started with another config than rank 0"), std::string::npos) << log0;
  EXPECT_FALSE(fs::exists(dir.file("run") + "/report.json")) << "refused before training";
}

TEST(DataParallelFaults, ARankThatNeverArrivesEndsTheRendezvousAtTheTimeout) {
  TempDir dir;
  // 6 s: the store's wait and the rendezvous' once (they were two timeouts in a row: 12 s).
  write_text(dir.file("run.toml"), dp_config(dir.file("run"), "[distributed]\ntimeout = 6\n"));
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t r0 = start_rank(0, 2, free_port(), {"train", dir.file("run.toml")}, dir.file("log"));
  const int s = wait_child(r0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(s)) << log;
  EXPECT_EQ(WEXITSTATUS(s), 1) << log;
  EXPECT_NE(log.find("rank 0 of 2: no rendezvous at 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("rank(s) 1 never arrived"), std::string::npos) << log;
  EXPECT_LT(seconds, 11) << "one distributed.timeout (6 s) and the start-up, not two: " << log;
  EXPECT_FALSE(fs::exists(dir.file("run"))) << "nothing is written before the rendezvous";
}

TEST(DataParallelFaults, ARankPointedAtAPortThatNeverAnswersEndsAtTheTimeout) {
  TempDir dir;
  write_text(dir.file("run.toml"), dp_config(dir.file("run"), "[distributed]\ntimeout = 2\n"));
  // A listening socket nobody reads: the kernel accepts the connection, no answer ever comes.
  const Listener listener;
  ASSERT_GT(listener.port, 0);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t r1 = start_rank(1, 2, listener.port, {"train", dir.file("run.toml")}, dir.file("log"));
  const int s = wait_child(r1);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(s)) << log;
  EXPECT_EQ(WEXITSTATUS(s), 1) << log;
  EXPECT_NE(log.find("rank 1 of 2: no rendezvous at 127.0.0.1:" + std::to_string(listener.port)),
            std::string::npos) << log;
  EXPECT_LT(seconds, 15) << "ended on its own, not after the test's wait: " << log;
}

TEST(DataParallelFaults, APortInUseIsAClearError) {
  TempDir dir;
  write_text(dir.file("run.toml"), dp_config(dir.file("run"), "[distributed]\ntimeout = 2\n"));
  const Listener listener(INADDR_ANY);
  const int port = listener.port;
  ASSERT_GT(port, 0);
  const pid_t r0 = start_rank(0, 2, port, {"train", dir.file("run.toml")}, dir.file("log"));
  const int s = wait_child(r0);
  const std::string log = read_text(dir.file("log"));
  ASSERT_TRUE(WIFEXITED(s)) << log;
  EXPECT_EQ(WEXITSTATUS(s), 1) << log;
  EXPECT_NE(log.find("no rendezvous at 127.0.0.1:" + std::to_string(port)), std::string::npos) << log;
  EXPECT_NE(log.find("Address already in use"), std::string::npos) << log;
}

// Also with zero stage 3, where the survivor waits in a unit's gather (a broadcast from the
// dead rank) rather than in the gradient all-reduce.
class RankKilledMidRun : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(DataParallelFaults, RankKilledMidRun,
                         ::testing::Values("", "[plugins.zero]\nstage = 3\n"),
                         [](const auto& p) { return p.param.empty() ? "DataParallel" : "ZeroStage3"; });

TEST_P(RankKilledMidRun, WithoutTheLauncherARankKilledMidRunEndsTheOther) {
  TempDir dir;
  write_text(dir.file("run.toml"),
             dp_config(dir.file("run"), "[distributed]\ntimeout = 20\n" + GetParam(), 20000));
  const int port = free_port();
  const pid_t r0 = start_rank(0, 2, port, {"train", dir.file("run.toml")}, dir.file("log0"));
  const pid_t r1 = start_rank(1, 2, port, {"train", dir.file("run.toml")}, dir.file("log1"));
  int status = 0;
  ASSERT_TRUE(wait_for_marker(r0, dir.file("log0"), "batch 3/", status)) << read_text(dir.file("log0"));
  ::kill(r1, SIGKILL);
  wait_child(r1);
  const auto t0 = std::chrono::steady_clock::now();
  status = wait_child(r0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = read_text(dir.file("log0"));
  ASSERT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 1) << log;
  EXPECT_NE(log.find("failed"), std::string::npos) << log;
  EXPECT_LT(seconds, 40) << "within distributed.timeout (20 s), never a hang: " << log;
}

TEST(DataParallelCli, NprocInsideALaunchedRankIsRefused) {
  TempDir dir;
  write_text(dir.file("run.toml"), dp_config(dir.file("run")));
  const auto r = run_cli("train " + dir.file("run.toml") + " --nproc 2", "WORLD_SIZE=2 RANK=1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("use torchrun or --nproc, not both"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace frugal::test
