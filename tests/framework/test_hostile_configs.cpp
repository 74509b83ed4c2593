// The hostile-config corpus (tests/hostile/configs): configs a new user wrote that a run used to
// ignore in part, accept in `check` and refuse in `train`, or refuse only after training. Each
// file's first line says what the refusal must name ("# refused: ..."); `check` and `train` must
// both refuse it with that, and a refused `train` leaves no run folder behind.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cli_support.h"
#include "support.h"

namespace frugal::test {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string replaced(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

/// The files the corpus names under @DATA@: CSVs (one with other columns), an image folder of
/// files that are not images, a text corpus and one shorter than a block.
void write_fixtures(const fs::path& data) {
  fs::create_directories(data / "images" / "a");
  fs::create_directories(data / "images" / "b");
  std::string rows = "x,y,label\n";
  for (int i = 0; i < 16; ++i) rows += std::to_string(i) + "," + std::to_string(i % 3) + "," + std::to_string(i % 2) + "\n";
  write_text((data / "train.csv").string(), rows);
  write_text((data / "valid.csv").string(), rows);
  write_text((data / "other_columns.csv").string(), replaced(rows, "x,y,label", "x,z,label"));
  for (const char* cls : {"a", "b"})
    write_text((data / "images" / cls / "broken.png").string(), "\x89PNG\r\n\x1a\n not an image");
  std::string text;
  while (text.size() < 5000) text += "The quick brown fox jumps over the lazy dog. ";
  write_text((data / "corpus.txt").string(), text);
  write_text((data / "short.txt").string(), "fifty bytes of text are fewer than a block of 128.");
}

struct Case {
  std::string name, config, refusal;
};

std::vector<Case> corpus(const TempDir& dir) {
  std::vector<Case> out;
  for (const auto& e : fs::directory_iterator(fs::path(FRUGAL_TEST_SOURCE_DIR) / "tests" / "hostile" / "configs")) {
    if (e.path().extension() != ".toml") continue;
    std::string text = replaced(replaced(read_file(e.path()), "@DATA@", dir.file("data")), "@OUT@", dir.file("out"));
    const std::string tag = "# refused: ";
    EXPECT_EQ(text.rfind(tag, 0), 0u) << e.path() << " must start with '" << tag << "'";
    const std::string refusal = text.substr(tag.size(), text.find('\n') - tag.size());
    out.push_back({e.path().stem().string(), text, refusal});
  }
  return out;
}

TEST(HostileConfigs, CheckAndTrainRefuseEachNamingTheKeyAndTrainLeavesNoFolder) {
  TempDir dir;
  write_fixtures(dir.file("data"));
  const std::vector<Case> cases = corpus(dir);
  ASSERT_GE(cases.size(), 15u);
  for (const Case& c : cases) {
    const std::string path = dir.file(c.name + ".toml");
    write_text(path, c.config);
    for (const std::string cmd : {"check", "train"}) {
      const CliResult r = run_cli(cmd + " " + path);
      EXPECT_NE(r.exit_code, 0) << c.name << ": " << cmd << " accepted it:\n" << r.output;
      EXPECT_NE(r.output.find(c.refusal), std::string::npos)
          << c.name << ": " << cmd << " must say \"" << c.refusal << "\"; it said:\n" << r.output;
      EXPECT_EQ(r.output.find("frame #"), std::string::npos) << c.name << ": a raw LibTorch trace";
    }
    EXPECT_FALSE(fs::exists(dir.file("out"))) << c.name << ": a refused train left its folder";
    fs::remove_all(dir.file("out"));
  }
}

TEST(HostileConfigs, AConfigThatNeverEndsIsRefusedBeforeItIsRead) {
  const CliResult r = run_cli("check /dev/zero");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("is larger than 4 MiB"), std::string::npos) << r.output;
}

TEST(HostileConfigs, AHugeValueIsShortenedInTheMessage) {
  // 3 MiB: a config is capped at 4 (a 10 MB one is refused as a whole, the test above).
  TempDir dir;
  const std::string huge(3 << 20, 'x');
  write_text(dir.file("huge.toml"), "[run]\nout_dir = \"/proc/" + huge + "\"\n[model]\narch = \"mlp\"\n");
  const CliResult r = run_cli("check " + dir.file("huge.toml"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_LT(r.output.size(), 20000u) << "the 3 MiB value is printed whole";
  EXPECT_NE(r.output.find("bytes left out"), std::string::npos) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find("run.out_dir"), std::string::npos) << r.output.substr(0, 2000);
}

TEST(HostileConfigs, AnErrorAboutAnOverriddenKeyNamesTheSetNotTheFile) {
  TempDir dir;
  write_text(dir.file("run.toml"), "[run]\nout_dir = \"" + dir.file("out") + "\"\n[data]\ndataset = "
             "\"synthetic\"\nsamples = 64\n[model]\narch = \"mlp\"\n");
  const CliResult r = run_cli("check " + dir.file("run.toml") + " --set data.dataset=text --set "
                              "'data.paths=[\"" + dir.file("nowhere.txt") + "\"]' --set data.samples=1024");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--set data.paths=[\"" + dir.file("nowhere.txt") + "\"]: data.paths:"), std::string::npos)
      << r.output;
}

TEST(HostileConfigs, ThreadsBeyondTheMachineAreHeldToItsCores) {
  TempDir dir;
  write_text(dir.file("run.toml"), "[run]\nout_dir = \"" + dir.file("out") + "\"\nthreads = 100000\n"
             "progress = \"none\"\n[data]\ndataset = \"synthetic\"\nsamples = 32\nimage_size = 4\n"
             "batch_size = 16\n[model]\narch = \"mlp\"\nwidth = 4\n");
  const CliResult r = run_cli("train " + dir.file("run.toml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("run.threads = 100000 is more than the"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace frugal::test
