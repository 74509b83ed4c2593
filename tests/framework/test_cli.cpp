// The `frugal` command end to end: a tiny synthetic run writes its report; bad input stops
// with a clear error and exit code before any work.
#include <filesystem>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "support.h"

namespace frugal::test {
namespace {

std::string tiny_config(const std::string& out_dir) {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"log\"\nthreads = 1\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 128\nimage_size = 8\nclasses = 4\nbatch_size = 32\n"
         "[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n"
         "[optimizer]\nlr = 0.01\n"
         "[[stages]]\nname = \"first\"\nepochs = 1\nfreeze = [\"stem\"]\n"
         "[[stages]]\nname = \"second\"\nepochs = 1\n";
}

TEST(Cli, TrainWritesReportResolvedConfigAndPrintsTheMemoryReport) {
  TempDir dir;
  const std::string out = dir.file("out");
  write_text(dir.file("run.toml"), tiny_config(out));
  auto r = run_cli("train " + dir.file("run.toml") + " --set optimizer.lr=0.02");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Peak live memory"), std::string::npos) << r.output;
  auto report = nlohmann::json::parse(read_text(out + "/report.json"));
  EXPECT_EQ(report["fit"]["stages"].size(), 2u);
  EXPECT_GT(report["fit"]["peak_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(report["config"]["optimizer"]["lr"].get<double>(), 0.02);  // --set took effect
  EXPECT_TRUE(report["fit"].contains("valid_accuracy"));
  const std::string resolved = read_text(out + "/config.toml");
  EXPECT_NE(resolved.find("lr = 0.02"), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("batch_size = 32"), std::string::npos) << resolved;
  EXPECT_TRUE(std::filesystem::exists(out + "/report.md"));
}

TEST(Cli, OpenBlassGenericKernelsAreReplacedByTheCpusAndTheReportSaysSo) {
  // Debian's OpenBLAS falls back to "Prescott" on a CPU it does not know; frugal switches to the
  // kernels the CPU has, unless told to keep what OpenBLAS found.
  TempDir dir;
  const std::string out = dir.file("out"), kept = dir.file("kept");
  write_text(dir.file("run.toml"), tiny_config(out));
  auto r = run_cli("train " + dir.file("run.toml"), "env -u OPENBLAS_CORETYPE");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto report = nlohmann::json::parse(read_text(out + "/report.json"));
  if (!report.contains("blas")) GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS";
  const auto& b = report["blas"];
  EXPECT_EQ(b["library"], "OpenBLAS");
  __builtin_cpu_init();
  const bool better = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (b["detected"] != "Prescott" || !better) {
    EXPECT_EQ(b["core"], b["detected"]) << "nothing to change: left as OpenBLAS chose";
    return;
  }
  EXPECT_NE(b["core"], "Prescott");
  EXPECT_NE(b["reason"].get<std::string>().find("OPENBLAS_CORETYPE="), std::string::npos);
  EXPECT_NE(read_text(out + "/report.md").find("(chosen by frugal; it detected Prescott)"),
            std::string::npos);
  write_text(dir.file("kept.toml"), tiny_config(kept));
  auto k = run_cli("train " + dir.file("kept.toml"), "env -u OPENBLAS_CORETYPE FRUGAL_BLAS_AS_FOUND=1");
  ASSERT_EQ(k.exit_code, 0) << k.output;
  EXPECT_EQ(nlohmann::json::parse(read_text(kept + "/report.json"))["blas"]["core"], "Prescott");
}

TEST(Cli, CheckReportsUnknownKeyWithLineAndExitCode2) {
  TempDir dir;
  write_text(dir.file("bad.toml"), "[data]\nbatchsize = 3\n");
  auto r = run_cli("check " + dir.file("bad.toml"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("bad.toml:2:1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("did you mean 'data.batch_size'"), std::string::npos) << r.output;
}

TEST(Cli, ImpossibleSizesAreRefusedBeforeAnyWork) {
  TempDir dir;
  const std::string out = dir.file("out");
  write_text(dir.file("run.toml"), tiny_config(out));
  for (const std::string set : {"data.batch_size=0", "stages.0.image_size=0.5", "stages.1.epochs=-1"}) {
    auto r = run_cli("train " + dir.file("run.toml") + " --set " + set);
    EXPECT_EQ(r.exit_code, 2) << set << "\n" << r.output;
    EXPECT_NE(r.output.find("--set " + set), std::string::npos) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(out)) << "no work may start on bad input";
}

TEST(Cli, ADatasetLargerThanTheMachineIsAConfigErrorNamingTheKeyAndTheBytes) {
  TempDir dir;
  const std::string out = dir.file("out");
  write_text(dir.file("run.toml"), tiny_config(out));
  for (const std::string cmd : {"train", "check"}) {
    auto r = run_cli(cmd + " " + dir.file("run.toml") +
                     " --set data.dataset=\"synthetic\" --set data.samples=99999999999");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("data.samples = 99999999999: the synthetic dataset needs 52.4 TiB"),
              std::string::npos) << r.output;  // 1e11 images of 1x8x8, 9 bytes a pixel
    EXPECT_EQ(r.output.find("frame #"), std::string::npos) << "no allocator trace: " << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(out + "/report.json"));
}

TEST(Cli, UnknownModelNamesTheKeyAndTheNearestModel) {
  TempDir dir;
  write_text(dir.file("run.toml"), tiny_config(dir.file("out")));
  auto r = run_cli("check " + dir.file("run.toml") + " --set model.arch=resnt");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("model.arch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("did you mean 'resnet'"), std::string::npos) << r.output;
}

TEST(Cli, MissingConfigAndMissingDatasetAreClearErrors) {
  TempDir dir;
  auto r = run_cli("check " + dir.file("nope.toml"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("nope.toml"), std::string::npos) << r.output;

  write_text(dir.file("fm.toml"), "[run]\nout_dir = \"" + dir.file("out") +
                                       "\"\n[data]\ndataset = \"fashion-mnist\"\npath = \"" +
                                       dir.file("no-such-dir") + "\"\n");
  r = run_cli("train " + dir.file("fm.toml"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("data.path"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("apt-get install dataset-fashion-mnist"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.file("out"))) << "no work may start on bad input";
}

TEST(Cli, UnwritableOutputFolderIsReportedBeforeTraining) {
  // A path under a regular file can never be a folder, even for root.
  TempDir dir;
  write_text(dir.file("file"), "x");
  write_text(dir.file("run.toml"), tiny_config(dir.file("file") + "/out"));
  auto r = run_cli("train " + dir.file("run.toml"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("output folder"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("training mlp"), std::string::npos) << "training must not start: " << r.output;
}

TEST(Cli, HelpWorksEverywhere) {
  for (const std::string sub : {"", "train ", "check "}) {
    auto r = run_cli(sub + "--help");
    EXPECT_EQ(r.exit_code, 0) << sub;
    EXPECT_NE(r.output.find("Usage"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace frugal::test
