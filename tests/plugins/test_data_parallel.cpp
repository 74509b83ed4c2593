// Data parallel with a plugin that makes one rank run out of memory (fixture_faulty's
// forward_oom): with run.on_oom = "retry" that rank retries its shard in smaller micro-batches
// while the others wait at the all-reduce, and the run still equals one process's; without it
// the failing rank ends the run for all.
#include <filesystem>
#include <map>

#include "cli_support.h"
#include "frugal/io/safetensors.h"
#include "support.h"

namespace frugal::test {
namespace {

std::string oom_config(const std::string& out, const std::string& on_oom, bool faulty) {
  return std::string("[run]\nout_dir = \"") + out + "\"\nprogress = \"log\"\nlog_every = 1\n"
         "threads = 1\nseed = 9\non_oom = \"" + on_oom + "\"\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 400\nimage_size = 8\nclasses = 4\n"
         "batch_size = 40\nvalid_samples = -1\n"
         "[model]\narch = \"mlp\"\nwidth = 32\ndepth = 2\n"
         "[optimizer]\nname = \"sgd\"\nlr = 0.02\nmomentum = 0.9\n[[stages]]\nepochs = 1\n" +
         (faulty ? std::string("[plugins]\npath = \"") + FRUGAL_TEST_FIXTURE_DIR + "\"\n" +
                       "[plugins.fixture_faulty]\nfail_in = \"forward_oom\"\nrank = 1\nafter_steps = 3\n"
                 : std::string());
}

double max_difference(const std::string& a_out, const std::string& b_out) {
  const auto a = safetensors::read(a_out + "/model.safetensors");
  const auto b = safetensors::read(b_out + "/model.safetensors");
  double worst = a.size() == b.size() ? 0.0 : 1e9;
  for (const auto& [k, t] : a)
    worst = std::max(worst, (t - b.at(k)).abs().max().item<double>());
  return worst;
}

TEST(DataParallelOom, OneRanksOutOfMemoryIsRetriedOnThatRankAndTheRunStaysExact) {
  TempDir dir;
  write_text(dir.file("one.toml"), oom_config(dir.file("one"), "fail", false));
  write_text(dir.file("two.toml"), oom_config(dir.file("two"), "retry", true));
  const auto one = run_cli("train " + dir.file("one.toml"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto two = run_cli("train " + dir.file("two.toml") + " --nproc 2");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("[rank 1] [warning] out of memory in forward of batch 3"), std::string::npos)
      << two.output;
  EXPECT_NE(two.output.find("(fixture_faulty: out of memory (forward_oom))"), std::string::npos)
      << two.output;
  const size_t first = two.output.find("out of memory in forward");
  EXPECT_EQ(two.output.find("out of memory in forward", first + 1), std::string::npos)
      << "only rank 1 retried: " << two.output;
  EXPECT_LT(max_difference(dir.file("one"), dir.file("two")), 1e-6)
      << "the retried batch's gradients are the whole batch's on both ranks";
}

TEST(DataParallelOom, WithoutRetryTheFailingRankEndsTheRunForAll) {
  TempDir dir;
  write_text(dir.file("two.toml"), oom_config(dir.file("two"), "fail", true));
  const auto two = run_cli("train " + dir.file("two.toml") + " --nproc 2");
  EXPECT_EQ(two.exit_code, 1) << two.output;
  // Rank 1 fails; rank 0, whose collective lost its peer, may end first.
  EXPECT_NE(two.output.find("ended with exit code 1: stopping the other ranks"), std::string::npos)
      << two.output;
  EXPECT_NE(two.output.find("run.on_oom = \"retry\""), std::string::npos) << two.output;
}

}  // namespace
}  // namespace frugal::test
