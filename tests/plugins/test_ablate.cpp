// `frugal ablate` and `frugal plan` end to end on a tiny synthetic config: every combination
// runs in its own process and lands in the results; a failing run is recorded, not fatal;
// bad input is refused before any run; the planner's predictions match what it measures.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "support.h"

namespace frugal::test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

/// 3 batches of 64 per run (the epoch ends before the cap of 4, so each run validates).
std::string tiny(const std::string& ablation, const std::string& plugins) {
  return "[run]\nthreads = 1\nprogress = \"none\"\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 192\nimage_size = 8\nclasses = 4\n"
         "batch_size = 64\n"
         "[model]\narch = \"mlp\"\nwidth = 64\ndepth = 4\n"
         "[optimizer]\nname = \"sgd\"\nlr = 0.05\n"
         "[ablation]\nsteps = 4\nwarmup = 1\n" + ablation + "\n" + plugins;
}

const char* kThree =
    "[plugins.amp]\nenabled = false\ndtype = \"bfloat16\"\n"
    "[plugins.grad_accum]\nenabled = false\nsteps = 2\nmode = \"split\"\n"
    "[plugins.checkpoint]\nenabled = false\nsegments = 2\n";

std::set<std::string> run_names(const json& results) {
  std::set<std::string> out;
  for (const auto& r : results["runs"]) out.insert(r["name"].get<std::string>());
  return out;
}

const json& run_named(const json& results, const std::string& name) {
  for (const auto& r : results["runs"])
    if (r["name"] == name) return r;
  throw std::runtime_error("no run " + name);
}

TEST(Ablate, RunsEveryCombinationAndWritesTablesPlotsAndTraces) {
  TempDir dir;
  const std::string out = dir.file("abl");
  write_text(dir.file("a.toml"), tiny("", kThree));
  auto r = run_cli("ablate " + dir.file("a.toml") + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[8/8]"), std::string::npos) << "progress is shown\n" << r.output;

  const json res = json::parse(read_text(out + "/results.json"));
  EXPECT_EQ(run_names(res),
            (std::set<std::string>{"baseline", "amp", "grad_accum", "checkpoint", "all",
                                   "all-but-amp", "all-but-grad_accum", "all-but-checkpoint"}));
  for (const auto& run : res["runs"]) {
    ASSERT_TRUE(run["ok"].get<bool>()) << run.dump(2);
    EXPECT_GT(run["peak_bytes"].get<int64_t>(), 0);
    EXPECT_GT(run["step_seconds"]["median"].get<double>(), 0);
    EXPECT_TRUE(run.contains("valid_accuracy"));
    EXPECT_TRUE(fs::exists(run["trace"].get<std::string>())) << run["trace"];
    // Each run had exactly its techniques on: the child's resolved config says so.
    const json report = json::parse(read_text(run["dir"].get<std::string>() + "/report.json"));
    std::set<std::string> on(run["techniques"].begin(), run["techniques"].end());
    std::set<std::string> loaded(report["plugins"].begin(), report["plugins"].end());
    EXPECT_EQ(on, loaded) << run["name"];
  }
  const json& base = run_named(res, "baseline");
  const json& split = run_named(res, "grad_accum");
  EXPECT_LT(split["steady"]["activations"].get<int64_t>(),
            base["steady"]["activations"].get<int64_t>())
      << "a split batch has fewer activations live";
  EXPECT_NEAR(split["memory_saved_percent"].get<double>(),
              100.0 * (1.0 - split["peak_bytes"].get<double>() / base["peak_bytes"].get<double>()), 1e-6);
  EXPECT_DOUBLE_EQ(base["slowdown"].get<double>(), 1.0);

  // The Pareto marks: a marked run is dominated by none; an unmarked one by some run.
  auto dominates = [](const json& a, const json& b) {
    const auto pa = a["peak_bytes"].get<int64_t>(), pb = b["peak_bytes"].get<int64_t>();
    const auto sa = a["samples_per_second"].get<double>(), sb = b["samples_per_second"].get<double>();
    return pa <= pb && sa >= sb && (pa < pb || sa > sb);
  };
  size_t marked = 0;
  for (const auto& x : res["runs"]) {
    bool dominated = false;
    for (const auto& y : res["runs"]) dominated = dominated || (&x != &y && dominates(y, x));
    EXPECT_EQ(x["pareto"].get<bool>(), !dominated) << x["name"];
    marked += x["pareto"].get<bool>();
  }
  EXPECT_GE(marked, 1u);

  const std::string csv = read_text(out + "/results.csv");
  EXPECT_EQ(csv.rfind("name,techniques,ok,peak_bytes,reserved_bytes,forward_peak_bytes", 0), 0u) << csv;
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 9) << csv;
  const std::string md = read_text(out + "/report.md");
  EXPECT_NE(md.find("| all-but-amp | checkpoint, grad_accum |"), std::string::npos) << md;
  EXPECT_NE(md.find("★"), std::string::npos) << md;
  if (res["plots"].get<bool>()) {
    for (const char* p : {"peak_memory", "live_memory", "tradeoff"}) {
      EXPECT_GT(fs::file_size(out + "/plots/" + p + ".svg"), 1000u) << p;
      EXPECT_GT(fs::file_size(out + "/plots/" + p + ".png"), 1000u) << p;
    }
  } else {
    EXPECT_NE(r.output.find("gnuplot not found"), std::string::npos) << r.output;
  }
}

TEST(Ablate, AFailingRunIsRecordedAndTheOthersGoOn) {
  TempDir dir;
  const std::string out = dir.file("abl");
  write_text(dir.file("a.toml"),
             tiny("techniques = [\"grad_accum\", \"fixture_faulty\"]",
                  std::string("[plugins]\npath = \"") + FRUGAL_TEST_FIXTURE_DIR + "\"\n" +
                      "[plugins.grad_accum]\nenabled = false\nsteps = 2\n"
                      "[plugins.fixture_faulty]\nenabled = false\nfail_in = \"before_step\"\n"
                      "after_steps = 1\n"));
  auto r = run_cli("ablate " + dir.file("a.toml") + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json res = json::parse(read_text(out + "/results.json"));
  // With two techniques, all-but-one repeats the single ones: four distinct runs.
  EXPECT_EQ(run_names(res), (std::set<std::string>{"baseline", "grad_accum", "fixture_faulty", "all"}));
  for (const char* failed : {"fixture_faulty", "all"}) {
    const json& f = run_named(res, failed);
    EXPECT_FALSE(f["ok"].get<bool>()) << failed;
    EXPECT_EQ(f["exit_code"].get<int>(), 1);
    EXPECT_NE(f["error"].get<std::string>().find("boom after 1 steps"), std::string::npos) << f.dump();
  }
  EXPECT_TRUE(run_named(res, "grad_accum")["ok"].get<bool>());
  EXPECT_FALSE(run_named(res, "all")["pareto"].get<bool>());
  const std::string md = read_text(out + "/report.md");
  EXPECT_NE(md.find("Run **all** failed (exit 1): "), std::string::npos) << md;
  const std::string csv = read_text(out + "/results.csv");
  EXPECT_NE(csv.find("boom after 1 steps"), std::string::npos) << csv;
}

TEST(Ablate, AnUnknownTechniqueIsRefusedBeforeAnyRun) {
  TempDir dir;
  const std::string out = dir.file("abl");
  write_text(dir.file("a.toml"), tiny("techniques = [\"amp\", \"grad_acum\"]", kThree));
  auto r = run_cli("ablate " + dir.file("a.toml") + " --out " + out);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("a.toml:20:14: 'ablation.techniques' names plugin 'grad_acum', which is "
                          "not installed; did you mean 'grad_accum'?"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(out)) << "no run may start on bad input";

  // A bad option of one run's plugin is found before the first run, too.
  write_text(dir.file("b.toml"), tiny("", "[plugins.grad_accum]\nenabled = false\nsteps = 0\n"));
  r = run_cli("ablate " + dir.file("b.toml") + " --out " + out);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("plugins.grad_accum.steps"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
}

TEST(Ablate, CheckAcceptsAnAblationTableAndNamesItsBadKeys) {
  TempDir dir;
  write_text(dir.file("a.toml"), tiny("repeats = 2", kThree));
  auto r = run_cli("check " + dir.file("a.toml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  write_text(dir.file("b.toml"), tiny("repeat = 2", kThree));
  r = run_cli("check " + dir.file("b.toml"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("b.toml:20:1: unknown key 'ablation.repeat'; did you mean 'ablation.repeats'?"),
            std::string::npos)
      << r.output;
  write_text(dir.file("c.toml"), tiny("techniques = [\"amp\"]\nbaseline = [\"amp\"]", kThree));
  r = run_cli("check " + dir.file("c.toml"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("in both 'ablation.baseline' and 'ablation.techniques'"), std::string::npos)
      << r.output;
}

TEST(Plan, PredictsEveryCombinationWithinFifteenPercent) {
  TempDir dir;
  const std::string out = dir.file("plan");
  write_text(dir.file("a.toml"), tiny("", kThree));
  auto r = run_cli("plan " + dir.file("a.toml") + " --budget 1GiB --steps 3 --check-all --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json plan = json::parse(read_text(out + "/plan.json"));
  ASSERT_EQ(plan["combinations"].size(), 8u);
  for (const auto& c : plan["combinations"]) {
    ASSERT_TRUE(c.contains("measured_peak_bytes")) << c.dump();
    EXPECT_LE(std::abs(c["error_percent"].get<double>()), 15.0) << c.dump();
  }
  ASSERT_TRUE(plan["proposal"].is_object());
  EXPECT_TRUE(plan["proposal"].contains("error_percent"));
  // Noise cannot flip the proposal: no fitting combination is clearly faster (the log of the
  // step times' ratio past twice its spread, from the measured medians the two do not share);
  // those predicted faster but not clearly are listed as too close to call.
  const json& p = plan["proposal"];
  const json& model = plan["model"];
  const double p_step = p["predicted_step_seconds"].get<double>();
  const json& close = p["too_close_to_call"];
  const auto spread = [&](const std::string& name) { return model[name]["step_spread"].get<double>(); };
  for (const auto& c : plan["combinations"]) {
    const double step = c["predicted_step_seconds"].get<double>();
    EXPECT_GE(c["predicted_step_spread"].get<double>(), 0.0);
    if (!c["fits"].get<bool>()) continue;
    double var = 0;
    for (const auto& t : plan["techniques"]) {
      const bool in_c = std::find(c["techniques"].begin(), c["techniques"].end(), t) != c["techniques"].end();
      const bool in_p = std::find(p["techniques"].begin(), p["techniques"].end(), t) != p["techniques"].end();
      if (in_c != in_p) var += std::pow(spread(t.get<std::string>()), 2);
    }
    const double dk = static_cast<double>(c["techniques"].size()) - static_cast<double>(p["techniques"].size());
    var += dk * dk * std::pow(spread("baseline"), 2);
    EXPECT_LE(std::log(p_step / step), 2 * std::sqrt(var) + 1e-12) << c.dump();
    const bool listed = std::find(close.begin(), close.end(), c["techniques"]) != close.end();
    EXPECT_EQ(listed, step < p_step && c["techniques"] != p["techniques"]) << c.dump();
  }
}

TEST(Plan, ABudgetTooSmallForAnythingSaysSo) {
  TempDir dir;
  write_text(dir.file("a.toml"),
             tiny("techniques = [\"grad_accum\"]", "[plugins.grad_accum]\nenabled = false\nsteps = 2\n"));
  auto r = run_cli("plan " + dir.file("a.toml") + " --budget 10KiB --steps 3 --out " + dir.file("plan"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("no combination of grad_accum is predicted to fit 10.0 KiB: the smallest "
                          "predicted peak is"),
            std::string::npos)
      << r.output;
}

TEST(Ablate, ALanguageModelIsScoredByItsValidationLoss) {
  TempDir dir;
  std::string corpus;
  for (int i = 0; corpus.size() < 6000; ++i) corpus += "line " + std::to_string(i % 37) + " of text\n";
  write_text(dir.file("corpus.txt"), corpus);
  write_text(dir.file("g.toml"),
             "[run]\nthreads = 1\nprogress = \"none\"\n"
             "[data]\ndataset = \"text\"\npaths = [\"" + dir.file("corpus.txt") + "\"]\n"
             "block_size = 32\nwindows_per_epoch = 48\nbatch_size = 16\nvalid_batch_size = 4\n"
             "valid_samples = 8\n"
             "[model]\narch = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 16\n"
             "[ablation]\nsteps = 4\nwarmup = 1\nleave_one_out = false\n"
             "[plugins.checkpoint]\nenabled = false\nsegments = 2\n");
  const std::string out = dir.file("abl");
  auto r = run_cli("ablate " + dir.file("g.toml") + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json res = json::parse(read_text(out + "/results.json"));
  const json& base = run_named(res, "baseline");
  const json& ck = run_named(res, "checkpoint");
  ASSERT_TRUE(ck["ok"].get<bool>()) << ck.dump(2);
  EXPECT_EQ(base["task"], "language_model");
  EXPECT_LT(ck["peak_bytes"].get<int64_t>(), base["peak_bytes"].get<int64_t>());
  // Checkpointing recomputes the same forward: the same loss after the same steps.
  EXPECT_NEAR(ck["valid_loss"].get<double>(), base["valid_loss"].get<double>(), 1e-4);
  EXPECT_NEAR(ck["valid_loss_change"].get<double>(),
              ck["valid_loss"].get<double>() - base["valid_loss"].get<double>(), 1e-12);
  EXPECT_NE(read_text(out + "/report.md").find("valid loss, nats/token (change)"), std::string::npos);
}

}  // namespace
}  // namespace frugal::test
