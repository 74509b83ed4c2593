// The zero plugin: its partition and buckets called directly, and `frugal train --nproc 2` (two
// processes on loopback, Gloo) with [plugins.zero] against plain data parallel on the same
// config: the same weights, half the optimizer state (stage 1) and gradients (stage 2) per rank,
// a bitwise resume. Every run ends on its own: distributed.timeout and the shell's `timeout`.
#include <gtest/gtest.h>

#include <map>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "frugal/core/learner.h"
#include "frugal/io/safetensors.h"
#include "support.h"
#include "zero.h"

namespace frugal::test {
namespace {

namespace z = frugal::zero;

TEST(ZeroMath, WholeParametersGoLargestFirstToTheLightestRank) {
  //                                      0    1    2   3   4   5
  const auto owners = z::partition_by_bytes({400, 16, 400, 16, 40, 4}, 2);
  // 400 -> 0, 400 -> 1, 40 -> 0 (a tie: the lower rank), then 16, 16 and 4 to rank 1 (416 <
  // 440, 432 < 440, 436 < 440): rank 0 holds 440 bytes, rank 1 436.
  EXPECT_EQ(owners, (std::vector<int>{0, 1, 1, 1, 0, 1}));
  EXPECT_EQ(z::partition_by_bytes({5, 5, 5}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(z::partition_by_bytes({8, 4}, 3), (std::vector<int>{0, 1})) << "a rank may own none";
  EXPECT_THROW(z::partition_by_bytes({1}, 0), std::invalid_argument);
}

TEST(ZeroMath, BucketsHoldOneOwnersTrainableParametersUpToTheCap) {
  std::vector<torch::Tensor> ps = {torch::zeros({10}), torch::zeros({10}), torch::zeros({10}),
                                   torch::zeros({10}, torch::kDouble), torch::zeros({10})};
  const std::vector<int> owners = {0, 1, 0, 0, 0};
  const std::vector<bool> take = {true, true, true, true, false};
  const auto fwd = z::owner_buckets(ps, owners, take, 80, false);
  ASSERT_EQ(fwd.size(), 3u);  // rank 0: {0, 2} (80 bytes: the cap), {3} (double); rank 1: {1}
  EXPECT_EQ(fwd[0].params, (std::vector<size_t>{0, 2}));
  EXPECT_EQ(fwd[0].bytes, 80);
  EXPECT_EQ(fwd[1].params, (std::vector<size_t>{3}));
  EXPECT_EQ(fwd[2].owner, 1);
  const auto rev = z::owner_buckets(ps, owners, take, 1 << 20, true);
  ASSERT_EQ(rev.size(), 3u);
  EXPECT_EQ(rev[0].params, (std::vector<size_t>{3}));
  EXPECT_EQ(rev[1].params, (std::vector<size_t>{2, 0})) << "backward's order";
}

TEST(ZeroMath, Stage3UnitsCloseOnceTheirBlocksReachTheBytes) {
  using Units = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(plan_units({10, 20, 30, 5}, 0), (Units{{0, 1}, {1, 2}, {2, 3}, {3, 4}})) << "each block";
  EXPECT_EQ(plan_units({10, 0, 30, 5}, 0), (Units{{0, 1}, {1, 3}, {3, 4}}))
      << "a block without parameters joins the next";
  EXPECT_EQ(plan_units({10, 0, 30, 5}, 35), (Units{{0, 3}, {3, 4}}));
  EXPECT_EQ(plan_units({10, 0, 30, 5}, 1000), (Units{{0, 4}})) << "one unit: the whole model";
  EXPECT_TRUE(plan_units({}, 0).empty());
}

// ---------------------------------------------------------------- two ranks on loopback

/// 240 samples in batches of 40 (6 steps); an MLP whose two 64x64 layers split evenly (rank 0:
/// the stem and the head, 51% of the bytes; rank 1: block1 and the biases).
std::string config(const std::string& out, const std::string& optimizer, const std::string& extra) {
  return "[run]\nout_dir = \"" + out + "\"\nprogress = \"log\"\nlog_every = 1\nthreads = 1\n"
         "seed = 3\nwarmup = 0\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 240\nimage_size = 8\nclasses = 4\n"
         "batch_size = 40\nvalid_samples = -1\n"
         "[model]\narch = \"mlp\"\nwidth = 64\ndepth = 1\n"
         "[optimizer]\nname = \"" + optimizer + "\"\nlr = 0.01\n" +
         (optimizer == "sgd" ? "momentum = 0.9\n" : "") +
         "[distributed]\ntimeout = 30\n[[stages]]\nepochs = 1\n" + extra;
}

/// `frugal train --nproc 2` of `toml` (written to dir/name.toml), ended after 90 s at most.
CliResult train2(TempDir& dir, const std::string& name, const std::string& toml,
                 const std::string& more = "") {
  write_text(dir.file(name + ".toml"), toml);
  return run_cli("train " + dir.file(name + ".toml") + " --nproc 2" + more, "timeout -k 5 90");
}

std::string run(TempDir& dir, const std::string& name, const std::string& optimizer,
                const std::string& extra) {
  const std::string out = dir.file(name);
  const auto r = train2(dir, name, config(out, optimizer, extra));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

double max_difference(const std::string& a_out, const std::string& b_out,
                      const std::string& file = "model.safetensors") {
  const auto a = safetensors::read(a_out + "/" + file);
  const auto b = safetensors::read(b_out + "/" + file);
  double worst = a.size() == b.size() && !a.empty() ? 0.0 : 1e9;
  for (const auto& [k, t] : a)
    worst = std::max(worst, (t.to(torch::kDouble) - b.at(k).to(torch::kDouble)).abs().max().item<double>());
  return worst;
}

/// Each rank's steady gradients and optimizer state, from rank 0's report.
std::vector<std::pair<int64_t, int64_t>> rank_bytes(const std::string& out) {
  const auto j = nlohmann::json::parse(read_text(out + "/report.json"));
  std::vector<std::pair<int64_t, int64_t>> v;
  for (const auto& r : j["distributed"]["ranks"])
    v.emplace_back(r["steady_gradients"].get<int64_t>(), r["steady_optimizer_state"].get<int64_t>());
  return v;
}

const std::string kStage1 = "[plugins.zero]\nstage = 1\n", kStage2 = "[plugins.zero]\nstage = 2\n",
                  kStage3 = "[plugins.zero]\nstage = 3\n";

/// Each rank's steady parameter bytes (after a step), from rank 0's report.
std::vector<int64_t> rank_parameters(const std::string& out) {
  const auto j = nlohmann::json::parse(read_text(out + "/report.json"));
  std::vector<int64_t> v;
  for (const auto& r : j["distributed"]["ranks"]) v.push_back(r["steady_parameters"].get<int64_t>());
  return v;
}

// Exact, not only close: each rank steps its parameters with the same averaged gradients plain
// data parallel computes (a sum of two halves is the same either way), and broadcasts copy bits.
TEST(ZeroCli, StagesOneAndTwoTrainAsPlainDataParallelWithAdamAndSgdMomentum) {
  TempDir dir;
  for (const std::string opt : {"adam", "sgd"}) {
    const std::string dp = run(dir, opt + "-dp", opt, "");
    const std::string z1 = run(dir, opt + "-z1", opt, kStage1);
    const std::string z2 = run(dir, opt + "-z2", opt, kStage2);
    EXPECT_LT(max_difference(dp, z1), 1e-6) << opt;
    EXPECT_LT(max_difference(dp, z2), 1e-6) << opt;

    const auto plain = rank_bytes(dp), one = rank_bytes(z1), two = rank_bytes(z2);
    ASSERT_EQ(plain.size(), 2u);
    ASSERT_EQ(one.size(), 2u);
    ASSERT_EQ(two.size(), 2u);
    ASSERT_GT(plain[0].second, 0) << opt;
    for (int r = 0; r < 2; ++r) {
      // Stage 1: the state is split, not lost; each rank holds about half (the partition is
      // by whole parameters), and the gradients stay whole.
      EXPECT_EQ(one[0].second + one[1].second, plain[r].second) << opt;
      EXPECT_LT(one[r].second, plain[r].second * 0.6) << opt << " rank " << r;
      EXPECT_EQ(one[r].first, plain[r].first) << opt;
      // Stage 2: the reduced gradients split the same way as the state.
      EXPECT_EQ(two[0].first + two[1].first, plain[r].first) << opt;
      EXPECT_LT(two[r].first, plain[r].first * 0.6) << opt << " rank " << r;
      EXPECT_EQ(two[r].second, one[r].second) << opt;
    }
  }
}

// Stage 2 shards the gradients: the global norm for clipping sums each rank's share, and
// adamw's decay on matrices only makes two parameter groups that each shard keeps, in order.
TEST(ZeroCli, Stage2ClipsByTheGlobalNormAndKeepsTheDecayGroupsAsDataParallel) {
  TempDir dir;
  const std::string keys = " --set optimizer.weight_decay=0.1 --set optimizer.clip_grad_norm=0.05";
  std::vector<std::string> outs;
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::string>>{
           {"dp", ""}, {"z2", kStage2}}) {
    outs.push_back(dir.file(name));
    const auto r = train2(dir, name, config(outs.back(), "adamw", extra), keys);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto report = nlohmann::json::parse(read_text(outs.back() + "/report.json"));
    EXPECT_GT(report["grad_clip"]["scaled_steps"].get<int64_t>(), 0) << name << report["grad_clip"].dump();
  }
  EXPECT_LT(max_difference(outs[0], outs[1]), 1e-6);
}

// bf16 autocast and two batches per step (the reduce at the group's last batch only), together:
// one pair of runs for both.
TEST(ZeroCli, Stage2ComposesWithAmpBf16AndGradAccum) {
  TempDir dir;
  const std::string both = "[plugins.amp]\ndtype = \"bfloat16\"\n"
                           "[plugins.grad_accum]\nsteps = 2\nmode = \"accumulate\"\n";
  const std::string dp = run(dir, "dp", "adam", both), z2 = run(dir, "z2", "adam", both + kStage2);
  EXPECT_LT(max_difference(dp, z2), 1e-6);
  const auto j = nlohmann::json::parse(read_text(z2 + "/report.json"));
  EXPECT_EQ(j["fit"]["optimizer_steps"], 3) << "6 batches, 2 per step";
}

// A checkpoint holds every rank's optimizer shard (gathered on rank 0), the sharding and each
// shard's layout. Resumed with 2 ranks it continues bitwise; in one process (zero a no-op there)
// both shards go into the one optimizer, and the halves' sum and the whole batch's mean round
// differently (Adam: within 1e-5, as DataParallelCli measures). Losing the moments would move
// Adam's first resumed step by the order of lr (1e-2).
TEST(ZeroCli, CheckpointResumesBitwiseAndReshardsOntoAnotherWorldSize) {
  TempDir dir;
  auto cfg = [&](const std::string& out, const std::string& extra) {
    std::string t = config(out, "adam", extra);
    t.replace(t.find("warmup = 0\n"), 11, "warmup = 0\ncheckpoint_every = 2\nkeep_checkpoints = 3\n");
    return t;
  };
  const std::string whole = dir.file("whole");
  ASSERT_EQ(train2(dir, "whole", cfg(whole, kStage2)).exit_code, 0);
  const std::string ckpt = whole + "/checkpoints/step-00000002.ckpt";
  const auto saved = Learner::read_checkpoint(ckpt);
  EXPECT_TRUE(saved["info"].value("optimizer_per_rank", false)) << saved.dump();
  EXPECT_EQ(saved["optimizer_layout"].size(), 2u) << saved.dump();

  const std::string resumed = dir.file("resumed");
  const auto r = train2(dir, "resumed", cfg(resumed, kStage2), " --resume " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(max_difference(whole, resumed), 0.0) << "each rank's Adam moments continue";

  const std::string one = dir.file("one");
  write_text(dir.file("one.toml"), cfg(one, kStage2));
  const auto o = run_cli("train " + dir.file("one.toml") + " --resume " + ckpt, "timeout -k 5 90");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("written by 2 process(es); this run has 1: the optimizer state re-sharded"),
            std::string::npos) << o.output;
  EXPECT_LT(max_difference(whole, one), 1e-5);
  const auto report = nlohmann::json::parse(read_text(one + "/report.json"));
  EXPECT_EQ(report["fit"]["optimizer_steps"], 6) << "the 4 steps left after step 2, on top of them";

  const auto check = run_cli("check " + dir.file("one.toml") + " --checkpoint " + ckpt);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find("written by 2 processes, the optimizer sharded per rank"), std::string::npos)
      << check.output;
}

// A checkpoint of one process resumes on 2 ranks with zero stage 1: each rank takes the state of
// the parameters it steps from the one optimizer saved. With offload on (its keys change no
// number): each rank's loaded shard goes to disk after the first batch and is stepped there.
TEST(ZeroCli, AOneProcessCheckpointResumesShardedOnTwoRanks) {
  TempDir dir;
  std::string t = config(dir.file("single"), "adam", kStage1);
  t.replace(t.find("warmup = 0\n"), 11, "warmup = 0\ncheckpoint_every = 3\nkeep_checkpoints = 2\n");
  write_text(dir.file("single.toml"), t);
  const auto single = run_cli("train " + dir.file("single.toml"), "timeout -k 5 90");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const std::string ckpt = dir.file("single") + "/checkpoints/step-00000003.ckpt";
  EXPECT_EQ(Learner::read_checkpoint(ckpt)["info"].value("world_size", 1), 1);

  const std::string two = dir.file("two");
  const auto r = train2(dir, "two", t + "[plugins.offload]\n",
                        " --resume " + ckpt + " --set run.out_dir='\"" + two + "\"'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("written by 1 process(es); this run has 2"), std::string::npos) << r.output;
  EXPECT_LT(max_difference(dir.file("single"), two), 1e-5);
  EXPECT_NE(r.output.find("in memory-mapped files in " + two + "/offload, 0 B in memory"), std::string::npos)
      << r.output;
}

// Stage 3: between uses each rank holds only the parameters it owns (the steady bytes, read
// after a step, split as the state does), yet trains exactly as plain data parallel: every
// forward and backward sees its owners' values, and each owner steps the averaged gradient.
TEST(ZeroStage3Cli, HoldsItsShareOfTheParametersAndTrainsAsPlainDataParallel) {
  TempDir dir;
  for (const std::string opt : {"adam", "sgd"}) {
    const std::string dp = run(dir, opt + "-dp", opt, "");
    const std::string z3 = run(dir, opt + "-z3", opt, kStage3);
    EXPECT_EQ(max_difference(dp, z3), 0.0) << opt;
    const auto whole = rank_parameters(dp), shard = rank_parameters(z3);
    ASSERT_EQ(whole.size(), 2u);
    ASSERT_EQ(shard.size(), 2u);
    EXPECT_EQ(shard[0] + shard[1], whole[0]) << opt << ": split, not lost";
    for (int r = 0; r < 2; ++r) EXPECT_LT(shard[r], whole[r] * 0.6) << opt << " rank " << r;
    const auto state = rank_bytes(z3), plain = rank_bytes(dp);
    for (int r = 0; r < 2; ++r) EXPECT_LT(state[r].first, plain[r].first * 0.6) << "gradients, rank " << r;
  }
  // With offload's parameters = true each owner's share and state live on disk: nothing of
  // either is counted in memory between uses, and the numbers do not move.
  const std::string dp = dir.file("adam-dp"), off = run(dir, "adam-z3-off", "adam",
                                                         kStage3 + "[plugins.offload]\nparameters = true\n");
  EXPECT_EQ(max_difference(dp, off), 0.0);
  for (const auto bytes : rank_parameters(off)) EXPECT_EQ(bytes, 0);
  for (const auto& [grads, state] : rank_bytes(off)) EXPECT_EQ(state, 0);
}

// A language model whose head is tied to the token embedding (gathered by both units that read
// it, its gradient sent once both backwards ran), with bf16 autocast and two batches per step,
// blocks joined into units of at least 4 KiB, a validation whose last batch has a row for rank
// 0 only (rank 1 takes part in the gathers without a forward), the best model kept (gathered on
// every rank, written by rank 0), and a checkpoint written mid-fit (gathered for the write) that
// resumes on one process as plain data parallel's does.
TEST(ZeroStage3Cli, TrainsATiedGptWithAmpAndGradAccumAndItsCheckpointResumes) {
  TempDir dir;
  std::string corpus;
  for (int i = 0; corpus.size() < 6000; ++i) corpus += "line " + std::to_string(i % 37) + " of text\n";
  write_text(dir.file("corpus.txt"), corpus);
  auto gpt = [&](const std::string& out, const std::string& extra) {
    return "[run]\nout_dir = \"" + out + "\"\nprogress = \"log\"\nthreads = 1\nseed = 3\nwarmup = 0\n"
           "checkpoint_every = 2\nkeep_checkpoints = 3\nsave_best = \"valid_loss\"\n"
           "[data]\ndataset = \"text\"\npaths = [\"" + dir.file("corpus.txt") + "\"]\n"
           "block_size = 32\nwindows_per_epoch = 64\nbatch_size = 8\nvalid_samples = 9\n"
           "valid_batch_size = 4\n"
           "[model]\narch = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 16\n"
           "[optimizer]\nname = \"adamw\"\nlr = 0.01\n[distributed]\ntimeout = 30\n"
           "[plugins.amp]\ndtype = \"bfloat16\"\n"
           "[plugins.grad_accum]\nsteps = 2\nmode = \"accumulate\"\n[[stages]]\nepochs = 1\n" + extra;
  };
  const std::string dp = dir.file("dp"), z3 = dir.file("z3");
  ASSERT_EQ(train2(dir, "dp", gpt(dp, "")).exit_code, 0);
  const std::string stage3 = kStage3 + "unit_bytes = 4096\n";
  const auto r = train2(dir, "z3", gpt(z3, stage3));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("stage 3: "), std::string::npos) << r.output;
  EXPECT_LT(max_difference(dp, z3), 1e-6);
  EXPECT_LT(max_difference(dp, z3, "best.safetensors"), 1e-6);
  const auto j = nlohmann::json::parse(read_text(z3 + "/report.json"));
  EXPECT_EQ(j["fit"]["optimizer_steps"], 4) << "8 batches, 2 per step";

  // Resumed in one process, stage 3's checkpoint (the parameters gathered for the write, each
  // rank's optimizer shard) continues as plain data parallel's does. (Not as the 2-rank run:
  // bf16 rounds two half-batch gradients differently from one whole-batch gradient.)
  std::vector<std::string> resumed;
  for (const auto& [from, extra] : {std::pair{z3, stage3}, std::pair{dp, std::string()}}) {
    resumed.push_back(from + "-one");
    write_text(from + "-one.toml", gpt(resumed.back(), extra));
    const auto o = run_cli("train " + from + "-one.toml --resume " + from +
                               "/checkpoints/step-00000002.ckpt", "timeout -k 5 90");
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_NE(o.output.find("written by 2 process(es); this run has 1"), std::string::npos) << o.output;
  }
  EXPECT_LT(max_difference(resumed[0], resumed[1]), 1e-6);
}

// frugal plan predicts stage 3 by formula (the baseline less its share of the state and the
// parameters, plus the units gathered at once) and checks itself: the measured run lands near
// the prediction (without the gathered units it was 28% under).
TEST(ZeroStage3Cli, PlanPredictsItsPeakFromTheShardedStateAndParameters) {
  TempDir dir;
  std::string t = config(dir.file("run"), "adam", kStage3);
  t.replace(t.find("width = 64"), 10, "width = 512");
  write_text(dir.file("p.toml"), t);
  const std::string out = dir.file("plan");
  const auto r = run_cli("plan " + dir.file("p.toml") + " --budget 1GiB --nproc 2 --steps 3 --check-all --out " + out,
                         "timeout -k 5 300");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto plan = nlohmann::json::parse(read_text(out + "/plan.json"));
  bool found = false;
  for (const auto& m : plan["measured"]) {
    if (m.value("name", "") != "zero") continue;
    found = true;
    EXPECT_NE(m["formula"].get<std::string>().find("parameters"), std::string::npos) << m.dump();
    const int64_t state = m["optimizer_state_bytes"], params = m["parameter_bytes"];
    EXPECT_GT(params, 0) << m.dump();
    const int64_t gathered = m["gathered_bytes"];
    EXPECT_GT(gathered, 0) << m.dump();
    EXPECT_EQ(m["saved_bytes"].get<int64_t>(), (state + params) / 2 - gathered) << m.dump();
  }
  EXPECT_TRUE(found) << plan.dump(1);
  for (const auto& c : plan["combinations"])
    if (c["techniques"] == nlohmann::json::array({"zero"})) {
      ASSERT_TRUE(c.contains("measured_peak_bytes")) << c.dump();
      EXPECT_LE(std::abs(c["error_percent"].get<double>()), 20.0) << c.dump();
    }
}

TEST(ZeroStage3Cli, RefusesCheckpointingTheMicroBatchProbeAndStage3KeysElsewhere) {
  TempDir dir;
  const auto both = train2(dir, "ck", config(dir.file("ck"), "adam", kStage3 + "[plugins.checkpoint]\n"));
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.output.find("checkpoint"), std::string::npos) << both.output;
  EXPECT_NE(both.output.find("zero"), std::string::npos) << both.output;
  std::string t = config(dir.file("auto"), "adam", kStage3);
  t.replace(t.find("warmup = 0\n"), 11, "warmup = 0\nmemory_budget = \"1GiB\"\nmicro_batch = \"auto\"\n");
  const auto probe = train2(dir, "auto", t);
  EXPECT_NE(probe.exit_code, 0);
  EXPECT_NE(probe.output.find("plugins.zero.stage = 3 cannot run with run.micro_batch = \"auto\""),
            std::string::npos) << probe.output;
  write_text(dir.file("k.toml"), config(dir.file("k"), "adam", kStage2 + "unit_bytes = 100\n"));
  const auto key = run_cli("check " + dir.file("k.toml"));
  EXPECT_NE(key.exit_code, 0);
  EXPECT_NE(key.output.find("plugins.zero.unit_bytes applies to stage = 3 only"), std::string::npos)
      << key.output;
}

}  // namespace
}  // namespace frugal::test
