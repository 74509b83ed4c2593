// `frugal plan`: predicts the peak of every combination of techniques from short measured
// runs, proposes the fastest combination that fits a budget, then runs it and compares.
//
// The model: a run's peak is F + A * b for batch size b (activations grow linearly with the
// samples of a forward pass; parameters, gradients, optimizer state and data do not). The
// baseline and each technique alone are measured at b and b/2, which gives each its F and A.
// A combination multiplies the slopes above the loaded batch's own bytes per sample (which
// every technique keeps: measured from the baseline's steady "other" at b and b/2), since a
// technique scales what is saved per sample (halves it, keeps a quarter of the blocks'
// outputs, runs a quarter of the batch), and
// combines the fixed parts' changes: reductions (optimizer state moved away) add up, while
// increases overlap, so the largest counts (the peak is one moment: gradients a split batch
// accumulates and a checkpoint's recompute buffers are both live then; on the tiny test
// config adding them over-predicted by up to 12%, the largest alone by up to 10%).
// Its step time multiplies the techniques' slowdowns.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include "ablation.h"
#include "frugal/error.h"
#include "frugal/memory.h"
#include "frugal/report.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace frugal::cli {

namespace {

struct Fit {
  double fixed = 0;  ///< bytes
  double slope = 0;  ///< bytes per sample
  double step = 0;   ///< median step seconds at the configured batch size
};

struct Candidate {
  std::vector<std::string> on;
  double peak = 0, step = 0;
  bool fits = false;
  bool measured = false;
  int64_t measured_peak = 0;
  double measured_step = 0;
};

std::string name_of(const std::vector<std::string>& on) { return on.empty() ? "baseline" : join_on(on); }

std::string fixed(double v, int p) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(p) << v;
  return os.str();
}

int64_t peak_of(const ChildResult& r) { return r.report["fit"].value("peak_bytes", int64_t{0}); }
/// Live bytes before the forward that are none of parameters, optimizer state and data: the
/// batch itself, which every technique keeps whole.
int64_t batch_bytes_of(const ChildResult& r) {
  const auto& stages = r.report["fit"]["stages"];
  return stages.empty() ? 0 : stages[0]["steady"].value("other", int64_t{0});
}
double step_of(const ChildResult& r) {
  return r.report["fit"]["step_seconds"].value("median", 0.0);
}

}  // namespace

CLI::App* add_plan_command(CLI::App& app, PlanArgs& a) {
  auto* c = app.add_subcommand(
      "plan",
      "predict each combination of techniques' peak from short measured runs, propose the "
      "fastest one that fits --budget, then run it and compare predicted with measured");
  c->add_option("config", a.config, "the run's TOML file; [ablation] names the techniques")->required();
  c->add_option("--budget", a.budget, "peak live memory allowed, e.g. 2GiB, 512MiB")->required();
  c->add_option("--out", a.out, "folder for plan.json, plan.md and the runs (default runs/plan)");
  c->add_option("--steps", a.steps, "training batches per measured run (default 6)")
      ->check(CLI::Range(2, 1000000));
  c->add_flag("--check-all", a.check_all,
              "also run every combination and compare each prediction (slow: 2^n runs)");
  c->add_option("--set", a.sets, "override a key in every run, e.g. --set data.batch_size=64");
  return c;
}

int run_plan(const PlanArgs& a, spdlog::logger& log, const char* argv0) {
  Config cfg = load_config(a.config, a.sets);
  const TechniqueSet t = resolve_techniques(cfg);
  const int64_t budget = parse_bytes(a.budget, "--budget");
  const size_t n = t.techniques.size();
  if (n > 12)
    throw_config_error(cfg.ablation.techniques_at + ": 'ablation.techniques' has " +
                       std::to_string(n) + " plugins; the planner predicts all 2^n combinations "
                       "and allows at most 12");
  const int64_t b = cfg.data.batch_size;
  if (b < 2)
    throw_config_error(cfg.source + ": 'data.batch_size' must be at least 2 for the planner, "
                       "which measures at the batch size and at half of it");
  const int64_t half = b / 2;
  const int64_t warmup = std::min<int64_t>(cfg.ablation.warmup, a.steps - 1);
  const std::vector<std::string> keys = {
      "run.max_steps=" + std::to_string(a.steps), "run.progress=\"none\"",
      "run.warmup=" + std::to_string(warmup), "run.trace=\"\"",
      // Validation's peak does not follow the training batch: the plan is about training.
      "data.valid_samples=-1"};

  // The measured runs: the baseline and each technique alone, at b and b / 2.
  std::vector<ChildRun> measure;
  std::vector<std::vector<std::string>> sets = {{}};
  for (const auto& x : t.techniques) sets.push_back({x});
  for (const auto& on : sets)
    for (int64_t size : {b, half})
      measure.push_back({name_of(on) + "-b" + std::to_string(size), on,
                         {"data.batch_size=" + std::to_string(size)}});
  check_runs(a.config, a.sets, t, measure);
  ensure_writable_dir(a.out);
  const std::string exe = self_exe(argv0);
  log.info("plan for {} within {}: measuring the baseline and {} technique(s) at batch sizes "
           "{} and {} ({} runs of {} batches)", a.config, format_bytes(budget), n, b, half,
           measure.size(), a.steps);

  std::vector<Fit> fits;  // [0] baseline, then each technique
  double invariant = 0;   // bytes per sample no technique changes: the loaded batch
  json measured = json::array();
  for (size_t i = 0; i < measure.size(); i += 2) {
    ChildResult big, small;
    for (size_t k = 0; k < 2; ++k) {
      const ChildRun& r = measure[i + k];
      log.info("[{}/{}] {} ...", i + k + 1, measure.size(), r.name);
      ChildResult res = run_train_child(exe, a.config, a.sets, t, r,
                                        (fs::path(a.out) / "measure" / r.name).string(), keys);
      if (res.exit_code != 0 || !res.report.is_object())
        throw Error("measured run '" + r.name + "' failed (exit " + std::to_string(res.exit_code) +
                    "): " + res.error + "; the planner needs the baseline and each technique "
                    "alone to run (see " + a.out + "/measure/" + r.name + "/log.txt)");
      measured.push_back({{"name", r.name}, {"techniques", r.on},
                          {"batch_size", k == 0 ? b : half}, {"peak_bytes", peak_of(res)},
                          {"step_seconds", step_of(res)}});
      (k == 0 ? big : small) = std::move(res);
    }
    Fit f;
    f.slope = std::max(0.0, static_cast<double>(peak_of(big) - peak_of(small)) /
                                static_cast<double>(b - half));
    f.fixed = static_cast<double>(peak_of(big)) - f.slope * static_cast<double>(b);
    f.step = step_of(big);
    if (fits.empty())
      invariant = std::clamp(static_cast<double>(batch_bytes_of(big) - batch_bytes_of(small)) /
                                 static_cast<double>(b - half),
                             0.0, f.slope);
    fits.push_back(f);
  }

  // Every combination.
  const Fit& base = fits[0];
  std::vector<Candidate> all;
  for (size_t mask = 0; mask < (size_t{1} << n); ++mask) {
    Candidate c;
    // Techniques scale the per-sample bytes above the batch's own.
    double scaled = base.slope - invariant, step = base.step, grow = 0, shrink = 0;
    for (size_t j = 0; j < n; ++j) {
      if (!(mask & (size_t{1} << j))) continue;
      const Fit& f = fits[j + 1];
      c.on.push_back(t.techniques[j]);
      const double delta = f.fixed - base.fixed;
      if (delta > 0)
        grow = std::max(grow, delta);
      else
        shrink += delta;
      if (base.slope - invariant > 0)
        scaled *= std::max(0.0, f.slope - invariant) / (base.slope - invariant);
      if (base.step > 0) step *= f.step / base.step;
    }
    c.peak = base.fixed + grow + shrink + (invariant + scaled) * static_cast<double>(b);
    c.step = step;
    c.fits = c.peak <= static_cast<double>(budget);
    all.push_back(std::move(c));
  }
  std::sort(all.begin(), all.end(), [](const Candidate& x, const Candidate& y) { return x.peak < y.peak; });
  const Candidate* best = nullptr;
  for (const auto& c : all)
    if (c.fits && (!best || c.step < best->step)) best = &c;

  json out = {{"config", a.config},
              {"budget_bytes", budget},
              {"batch_size", b},
              {"steps", a.steps},
              {"machine", machine_info()},
              {"techniques", t.techniques},
              {"baseline_plugins", t.baseline},
              {"measured", measured}};
  json fitted = json::object();
  for (size_t j = 0; j < fits.size(); ++j)
    fitted[j == 0 ? std::string("baseline") : t.techniques[j - 1]] = {
        {"fixed_bytes", fits[j].fixed}, {"bytes_per_sample", fits[j].slope},
        {"step_seconds", fits[j].step}};
  fitted["batch_bytes_per_sample"] = invariant;
  out["model"] = fitted;

  // Verify: the proposal (or, with --check-all, every combination) runs at the batch size.
  std::vector<Candidate*> verify;
  for (auto& c : all)
    if (a.check_all || (best && &c == best)) verify.push_back(&c);
  size_t k = 0;
  for (Candidate* c : verify) {
    ChildRun r{"run-" + name_of(c->on), c->on, {}};
    log.info("[verify {}/{}] {} (predicted peak {}) ...", ++k, verify.size(), name_of(c->on),
             format_bytes(static_cast<int64_t>(c->peak)));
    ChildResult res = run_train_child(exe, a.config, a.sets, t, r,
                                      (fs::path(a.out) / "verify" / name_of(c->on)).string(), keys);
    if (res.exit_code != 0 || !res.report.is_object()) {
      log.warn("run {} failed: {}", name_of(c->on), res.error);
      continue;
    }
    c->measured = true;
    c->measured_peak = peak_of(res);
    c->measured_step = step_of(res);
  }

  std::ostringstream md;
  md << "# Plan for `" << a.config << "` within " << format_bytes(budget) << "\n\n"
     << "Batch size " << b << "; predicted from " << measure.size() << " runs of " << a.steps
     << " batches (the baseline and each technique alone at batch sizes " << b << " and " << half
     << "); training peak, validation off.\n\n"
     << "| techniques | predicted peak | fits | predicted step time | measured peak | error |\n"
     << "|---|---:|:---:|---:|---:|---:|\n";
  json combos = json::array();
  for (const auto& c : all) {
    json j = {{"techniques", c.on}, {"predicted_peak_bytes", static_cast<int64_t>(c.peak)},
              {"predicted_step_seconds", c.step}, {"fits", c.fits}};
    md << "| " << (best == &c ? "**" + name_of(c.on) + "**" : name_of(c.on)) << " | "
       << format_bytes(static_cast<int64_t>(c.peak)) << " | " << (c.fits ? "yes" : "no") << " | "
       << fixed(1000 * c.step, 1) << " ms | ";
    if (c.measured) {
      const double err = 100.0 * (c.peak - static_cast<double>(c.measured_peak)) / c.measured_peak;
      j["measured_peak_bytes"] = c.measured_peak;
      j["measured_step_seconds"] = c.measured_step;
      j["error_percent"] = err;
      md << format_bytes(c.measured_peak) << " | " << (err >= 0 ? "+" : "") << fixed(err, 1) << "% |\n";
    } else {
      md << "- | - |\n";
    }
    combos.push_back(j);
  }
  out["combinations"] = combos;
  int rc = 0;
  if (!best) {
    const Candidate& smallest = all.front();
    const std::string msg =
        "no combination of " + join_on(t.techniques, ", ") + " is predicted to fit " +
        format_bytes(budget) + ": the smallest predicted peak is " +
        format_bytes(static_cast<int64_t>(smallest.peak)) + " (" + name_of(smallest.on) +
        "). Raise --budget, lower data.batch_size (each sample adds about " +
        format_bytes(static_cast<int64_t>(std::max(0.0, (smallest.peak - fits[0].fixed) / b))) +
        " with it), or add a technique";
    md << "\n**No combination fits.** " << msg << ".\n";
    out["proposal"] = nullptr;
    out["error"] = msg;
    log.error("{}", msg);
    rc = 3;
  } else {
    md << "\nProposal: **" << name_of(best->on) << "**, the fastest predicted to fit ("
       << format_bytes(static_cast<int64_t>(best->peak)) << " of " << format_bytes(budget) << ").";
    json p = {{"techniques", best->on}, {"predicted_peak_bytes", static_cast<int64_t>(best->peak)},
              {"predicted_step_seconds", best->step}};
    if (best->measured) {
      const double err = 100.0 * (best->peak - static_cast<double>(best->measured_peak)) / best->measured_peak;
      p["measured_peak_bytes"] = best->measured_peak;
      p["error_percent"] = err;
      md << " Measured: " << format_bytes(best->measured_peak) << " (prediction "
         << (err >= 0 ? "+" : "") << fixed(err, 1) << "%)"
         << (best->measured_peak > budget ? "; **over the budget**" : "") << ".";
      if (best->measured_peak > budget)
        log.warn("the proposal measured {} > budget {}", format_bytes(best->measured_peak),
                 format_bytes(budget));
    }
    if (best->on.empty())
      md << "\n\nThe baseline fits: no technique is needed.\n";
    else
      md << "\n\nTo use it: set `enabled = true` in [plugins." << join_on(best->on, "], [plugins.")
         << "] and `enabled = false` for the other techniques.\n";
    out["proposal"] = p;
  }
  write_file_atomic((fs::path(a.out) / "plan.json").string(), out.dump(2) + "\n");
  write_file_atomic((fs::path(a.out) / "plan.md").string(), md.str());
  std::cout << md.str() << std::flush;
  return rc;
}

}  // namespace frugal::cli
