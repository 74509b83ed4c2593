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
//
// Step times of a few batches are noisy (on a shared CPU, more than the differences between
// techniques): each measured median carries its spread, (p90 - p10) / median / sqrt(steady
// batches) and a between-run term (kBetweenRuns), and a combination's prediction the spreads
// of the medians it multiplies. A
// combination is clearly faster than another when the log of their step times' ratio passes twice
// its spread (from the medians the two do not share).
// The proposal starts from the simplest combination that fits (fewest techniques, then smallest
// predicted peak: memory, which is stable) and moves only to clearly faster ones, so noise that
// masks the differences leaves it where memory puts it and two plans of the same config
// propose the same combination; the faster-looking rest is reported as too close to call.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "ablation.h"
#include "frugal/base/error.h"
#include "frugal/app/run.h"
#include "frugal/core/parameter_shards.h"
#include "frugal/io/file_writer.h"
#include "frugal/memory/memory.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace frugal::cli {

namespace {

struct Fit {
  double fixed = 0;  ///< bytes
  double slope = 0;  ///< bytes per sample
  double step = 0;   ///< median step seconds at the configured batch size
  double spread = 0; ///< relative uncertainty of `step`
};

struct Candidate {
  std::vector<std::string> on;
  double peak = 0, step = 0;
  double spread = 0;  ///< relative uncertainty of `step`
  bool fits = false;
  bool measured = false;
  int64_t measured_peak = 0;
  double measured_step = 0;
};

std::string name_of(const std::vector<std::string>& on) { return on.empty() ? "baseline" : join_on(on); }

std::string fixed_digits(double v, int p) {
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
/// How much a process's median step time moves between runs of the same config, beyond what
/// its own steps show: three plans of examples/ablation/mlp.toml on an idle 2-core machine moved
/// each technique's median by 25-33% (the thread tuner's choice, the allocator's layout), while
/// the within-run spreads said 1-8%.
constexpr double kBetweenRuns = 0.15;

/// The relative uncertainty of a run's median step time: the p10-p90 range over the median,
/// shrunk by the square root of the timed batches it was taken from (`steady` when the report
/// does not say: the thread tuner may lengthen the warm-up), and the between-run term.
double spread_of(const ChildResult& r, int64_t steady) {
  const json& t = r.report["fit"]["step_seconds"];
  const double median = t.value("median", 0.0);
  if (median <= 0) return 0;
  const int64_t n = t.value("count", steady);
  const double within = (t.value("p90", median) - t.value("p10", median)) / median /
                        std::sqrt(static_cast<double>(std::max<int64_t>(n, 1)));
  return std::hypot(within, kBetweenRuns);
}

/// Techniques whose effect the plan computes from a formula and the baseline's measured steady
/// state instead of runs of their own. zero (ZeRO stages 1 and 2): on N ranks each rank keeps
/// 1/N of the optimizer state S for the whole run, so the fixed part falls by S (1 - 1/N).
/// Stage 2's gradients are 1/N only from the end of the backward (they are reduced after it),
/// past the backward's peak, so the formula leaves them out; activations and the step time are
/// the baseline's (the sync's extra time is not predicted). Stage 3 also keeps 1/N of the
/// parameters P between uses: the fixed part falls by (S + P) (1 - 1/N) and rises by the units
/// gathered at once (stage3_gathered_bytes); the gradients freed during the backward are left
/// out (the measured check says how far that is).
constexpr const char* kFormulaTechniques[] = {"zero"};

bool by_formula(const std::string& technique) {
  return std::find(std::begin(kFormulaTechniques), std::end(kFormulaTechniques), technique) !=
         std::end(kFormulaTechniques);
}

int64_t steady_bytes(const ChildResult& r, const char* what) {
  const auto& stages = r.report["fit"]["stages"];
  return stages.empty() ? 0 : stages[0]["steady"].value(what, int64_t{0});
}

/// [plugins.zero] stage (1 when absent).
int64_t zero_stage(const Config& c) {
  if (const auto* z = c.plugins["zero"].as_table())
    if (const auto s = (*z)["stage"].value<int64_t>()) return *s;
  return 1;
}

/// Stage 3's gathered parameters at their most: the model's top-level blocks joined into units
/// as zero joins them (unit_bytes; a block without parameters joins the next), a unit and, with
/// prefetch, the next one in memory at once. Built from the config's model, on the CPU.
int64_t stage3_gathered_bytes(const Config& c) {
  int64_t unit_bytes = 0;
  bool prefetch = true;
  if (const auto* z = c.plugins["zero"].as_table()) {
    unit_bytes = (*z)["unit_bytes"].value_or(int64_t{0});
    prefetch = (*z)["prefetch"].value_or(true);
  }
  std::vector<int64_t> blocks;
  for (const auto& block : make_config_model(c)->children()) {  // parameters only: buffers stay
    blocks.push_back(0);
    for (const auto& p : block->parameters()) blocks.back() += static_cast<int64_t>(p.nbytes());
  }
  std::vector<int64_t> units;
  for (const auto& [begin, end] : plan_units(blocks, unit_bytes))
    units.push_back(std::accumulate(blocks.begin() + begin, blocks.begin() + end, int64_t{0}));
  int64_t most = 0;
  for (size_t u = 0; u < units.size(); ++u)
    most = std::max(most, units[u] + (prefetch && u + 1 < units.size() ? units[u + 1] : 0));
  return most;
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
  c->add_option("--nproc", a.nproc, "measure every run on N data-parallel ranks (peaks per rank)")
      ->check(CLI::Range(1, 1024));
  c->add_option("--steps", a.steps, "training batches per measured run (default 6)")
      ->check(CLI::Range(2, 1000000));
  c->add_flag("--check-all", a.check_all,
              "also run every combination and compare each prediction (slow: 2^n runs)");
  c->add_option("--set", a.sets, "override a key in every run, e.g. --set data.batch_size=64");
  return c;
}

namespace {

/// What the plan measures and predicts from: the config, its techniques, the batch sizes and
/// the keys every child run gets.
struct PlanInputs {
  Config cfg;
  TechniqueSet t;
  int64_t budget = 0;
  int64_t b = 0, half = 0;         ///< the batch size and half of it
  std::vector<std::string> keys;   ///< run.* keys of every child run
  std::vector<ChildRun> measure;   ///< the baseline and each technique alone, at b and b / 2
  int64_t steady = 1;              ///< timed batches of a measured run (after warm-up)
};

PlanInputs plan_inputs(const PlanArgs& a) {
  PlanInputs in;
  in.cfg = load_base_config(a.config, a.sets);
  in.t = resolve_techniques(in.cfg);
  in.budget = parse_bytes(a.budget, "--budget");
  const size_t n = in.t.techniques.size();
  if (n > 12)
    throw_config_error(in.cfg.ablation.techniques_at + ": 'ablation.techniques' has " +
                       std::to_string(n) + " plugins; the planner predicts all 2^n combinations "
                       "and allows at most 12");
  in.b = in.cfg.data.batch_size;
  if (in.b < 2)
    throw_config_error(in.cfg.source + ": 'data.batch_size' must be at least 2 for the planner, "
                       "which measures at the batch size and at half of it");
  in.half = in.b / 2;
  const int64_t warmup = std::min<int64_t>(in.cfg.ablation.warmup, a.steps - 1);
  in.steady = a.steps - warmup;
  in.keys = {"run.max_steps=" + std::to_string(a.steps), "run.progress=\"none\"",
             "run.warmup=" + std::to_string(warmup), "run.trace=\"\"",
             // Validation's peak does not follow the training batch: the plan is about training.
             "data.valid_samples=-1"};
  std::vector<std::vector<std::string>> sets = {{}};
  for (const auto& x : in.t.techniques)
    if (!by_formula(x)) sets.push_back({x});
  for (const auto& on : sets)
    for (int64_t size : {in.b, in.half})
      in.measure.push_back({name_of(on) + "-b" + std::to_string(size), on,
                            {"data.batch_size=" + std::to_string(size)}});
  check_runs(a.config, a.sets, in.t, in.measure);
  return in;
}

/// The fits of the measured runs: [0] the baseline, then each technique.
struct Measured {
  std::vector<Fit> fits;
  double invariant = 0;  ///< bytes per sample no technique changes: the loaded batch
  int64_t base_optimizer_state = 0;  ///< the baseline's steady optimizer state (per rank)
  int64_t base_parameters = 0;       ///< the baseline's steady parameter bytes (per rank)
  int64_t gathered = 0;              ///< zero stage 3: the units in memory at once
  json runs = json::array();
};

/// F and A of one technique (or the baseline) from its runs at b and b / 2.
Fit fit_of(const ChildResult& big, const ChildResult& small, int64_t b, int64_t half, int64_t steady) {
  Fit f;
  f.slope = std::max(0.0, static_cast<double>(peak_of(big) - peak_of(small)) /
                              static_cast<double>(b - half));
  f.fixed = static_cast<double>(peak_of(big)) - f.slope * static_cast<double>(b);
  f.step = step_of(big);
  f.spread = spread_of(big, steady);
  return f;
}

/// The formula techniques' fits, each at its place among the measured ones (kFormulaTechniques).
void add_formula_fits(const PlanArgs& a, const PlanInputs& in, Measured& m) {
  const double ranks = std::max(1, a.nproc);
  for (size_t j = 0; j < in.t.techniques.size(); ++j) {
    if (!by_formula(in.t.techniques[j])) continue;
    Fit f = m.fits[0];
    const bool stage3 = zero_stage(in.cfg) == 3;
    const int64_t sharded = m.base_optimizer_state + (stage3 ? m.base_parameters : 0);
    if (stage3) m.gathered = stage3_gathered_bytes(in.cfg);
    const double saved = static_cast<double>(sharded) * (1.0 - 1.0 / ranks) - static_cast<double>(m.gathered);
    f.fixed -= saved;
    m.fits.insert(m.fits.begin() + static_cast<std::ptrdiff_t>(j + 1), f);
    m.runs.push_back({{"name", in.t.techniques[j]}, {"techniques", {in.t.techniques[j]}},
                      {"formula", stage3 ? "baseline - (optimizer_state + parameters) * (1 - 1/ranks) + gathered units"
                                         : "baseline - optimizer_state * (1 - 1/ranks)"},
                      {"ranks", static_cast<int64_t>(ranks)},
                      {"optimizer_state_bytes", m.base_optimizer_state},
                      {"parameter_bytes", stage3 ? m.base_parameters : 0},
                      {"gathered_bytes", m.gathered},
                      {"saved_bytes", static_cast<int64_t>(saved)}});
  }
}

Measured measure_all(const PlanArgs& a, const PlanInputs& in, const std::string& exe,
                     spdlog::logger& log) {
  Measured m;
  for (size_t i = 0; i < in.measure.size(); i += 2) {
    ChildResult big, small;
    for (size_t k = 0; k < 2; ++k) {
      const ChildRun& r = in.measure[i + k];
      log.info("[{}/{}] {} ...", i + k + 1, in.measure.size(), r.name);
      ChildResult res = run_train_child(exe, a.config, a.sets, in.t, r,
                                        (fs::path(a.out) / "measure" / r.name).string(), in.keys,
                                        a.nproc);
      if (res.exit_code != 0 || !res.report.is_object())
        throw Error("measured run '" + r.name + "' failed (exit " + std::to_string(res.exit_code) +
                    "): " + res.error + "; the planner needs the baseline and each technique "
                    "alone to run (see " + a.out + "/measure/" + r.name + "/log.txt)");
      m.runs.push_back({{"name", r.name}, {"techniques", r.on},
                        {"batch_size", k == 0 ? in.b : in.half}, {"peak_bytes", peak_of(res)},
                        {"step_seconds", step_of(res)},
                        {"step_spread", spread_of(res, in.steady)}});
      (k == 0 ? big : small) = std::move(res);
    }
    const Fit f = fit_of(big, small, in.b, in.half, in.steady);
    if (m.fits.empty())
      m.invariant = std::clamp(static_cast<double>(batch_bytes_of(big) - batch_bytes_of(small)) /
                                   static_cast<double>(in.b - in.half),
                               0.0, f.slope);
    m.fits.push_back(f);
    if (m.fits.size() == 1) {
      m.base_optimizer_state = steady_bytes(big, "optimizer_state");
      m.base_parameters = steady_bytes(big, "parameters");
    }
  }
  add_formula_fits(a, in, m);
  return m;
}

/// Every combination's predicted peak and step time, smallest peak first.
std::vector<Candidate> predict_all(const PlanInputs& in, const Measured& m) {
  const Fit& base = m.fits[0];
  const size_t n = in.t.techniques.size();
  std::vector<Candidate> all;
  for (size_t mask = 0; mask < (size_t{1} << n); ++mask) {
    Candidate c;
    // Techniques scale the per-sample bytes above the batch's own.
    double scaled = base.slope - m.invariant, step = base.step, grow = 0, shrink = 0, var = 0;
    for (size_t j = 0; j < n; ++j) {
      if (!(mask & (size_t{1} << j))) continue;
      const Fit& f = m.fits[j + 1];
      c.on.push_back(in.t.techniques[j]);
      const double delta = f.fixed - base.fixed;
      if (delta > 0)
        grow = std::max(grow, delta);
      else
        shrink += delta;
      if (base.slope - m.invariant > 0)
        scaled *= std::max(0.0, f.slope - m.invariant) / (base.slope - m.invariant);
      if (base.step > 0) step *= f.step / base.step;
      var += f.spread * f.spread;
    }
    // step = base * prod(f / base): the baseline's median enters with power 1 - k.
    const double k = static_cast<double>(c.on.size());
    var += (1 - k) * (1 - k) * base.spread * base.spread;
    c.spread = std::sqrt(var);
    c.peak = base.fixed + grow + shrink + (m.invariant + scaled) * static_cast<double>(in.b);
    c.step = step;
    c.fits = c.peak <= static_cast<double>(in.budget);
    all.push_back(std::move(c));
  }
  std::sort(all.begin(), all.end(), [](const Candidate& x, const Candidate& y) { return x.peak < y.peak; });
  return all;
}

/// A clearly faster than B: the log of their predicted step times' ratio passes twice its
/// spread. Both multiply the same measured medians, so only those they do not share count: the
/// techniques on in one of them, and the baseline's, which enters with power 1 - k.
bool clearly_faster(const Candidate& a, const Candidate& b, const PlanInputs& in, const Measured& m) {
  if (a.step <= 0 || b.step <= 0) return false;
  double var = 0;
  for (size_t j = 0; j < in.t.techniques.size(); ++j) {
    const auto on = [&](const Candidate& c) {
      return std::find(c.on.begin(), c.on.end(), in.t.techniques[j]) != c.on.end();
    };
    if (on(a) != on(b)) var += m.fits[j + 1].spread * m.fits[j + 1].spread;
  }
  const double dk = static_cast<double>(a.on.size()) - static_cast<double>(b.on.size());
  var += dk * dk * m.fits[0].spread * m.fits[0].spread;
  return std::log(b.step / a.step) > 2 * std::sqrt(var);
}

/// The proposal among the combinations predicted to fit (null when none does): the simplest
/// (fewest techniques, then smallest predicted peak), replaced by the simplest clearly faster
/// one for as long as there is one. `close` gets the fitting combinations predicted faster than
/// the proposal but not clearly: too close to call.
const Candidate* propose(const std::vector<Candidate>& all, const PlanInputs& in, const Measured& m,
                         std::vector<const Candidate*>& close) {
  const auto simpler = [](const Candidate& x, const Candidate& y) {
    if (x.on.size() != y.on.size()) return x.on.size() < y.on.size();
    if (x.peak != y.peak) return x.peak < y.peak;
    return x.on < y.on;
  };
  const Candidate* best = nullptr;
  for (const auto& c : all)
    if (c.fits && (!best || simpler(c, *best))) best = &c;
  close.clear();
  if (!best) return nullptr;
  for (;;) {  // each move lowers the step time: it ends
    const Candidate* next = nullptr;
    for (const auto& c : all)
      if (c.fits && clearly_faster(c, *best, in, m) && (!next || simpler(c, *next))) next = &c;
    if (!next) break;
    best = next;
  }
  for (const auto& c : all)
    if (c.fits && &c != best && c.step < best->step) close.push_back(&c);
  return best;
}

/// plan.json without the combinations and the proposal: the inputs and the fitted model.
json plan_header(const PlanArgs& a, const PlanInputs& in, const Measured& m) {
  json out = {{"config", a.config},
              {"budget_bytes", in.budget},
              {"batch_size", in.b},
              {"steps", a.steps},
              {"machine", machine_info()},
              {"techniques", in.t.techniques},
              {"baseline_plugins", in.t.baseline},
              {"measured", m.runs}};
  json fitted = json::object();
  for (size_t j = 0; j < m.fits.size(); ++j)
    fitted[j == 0 ? std::string("baseline") : in.t.techniques[j - 1]] = {
        {"fixed_bytes", m.fits[j].fixed}, {"bytes_per_sample", m.fits[j].slope},
        {"step_seconds", m.fits[j].step}, {"step_spread", m.fits[j].spread}};
  fitted["batch_bytes_per_sample"] = m.invariant;
  out["model"] = fitted;
  return out;
}

/// Runs the proposal (or, with --check-all, every combination) at the batch size and records
/// what it measured.
void verify(const PlanArgs& a, const PlanInputs& in, const std::string& exe,
            std::vector<Candidate>& all, const Candidate* best, spdlog::logger& log) {
  std::vector<Candidate*> chosen;
  for (auto& c : all)
    if (a.check_all || (best && &c == best)) chosen.push_back(&c);
  size_t k = 0;
  for (Candidate* c : chosen) {
    ChildRun r{"run-" + name_of(c->on), c->on, {}};
    log.info("[verify {}/{}] {} (predicted peak {}) ...", ++k, chosen.size(), name_of(c->on),
             format_bytes(static_cast<int64_t>(c->peak)));
    ChildResult res = run_train_child(exe, a.config, a.sets, in.t, r,
                                      (fs::path(a.out) / "verify" / name_of(c->on)).string(), in.keys,
                                      a.nproc);
    if (res.exit_code != 0 || !res.report.is_object()) {
      log.warn("run {} failed: {}", name_of(c->on), res.error);
      continue;
    }
    c->measured = true;
    c->measured_peak = peak_of(res);
    c->measured_step = step_of(res);
  }
}

/// plan.md's table (one row per combination, the proposal in bold) and their JSON.
json combinations(const std::vector<Candidate>& all, const Candidate* best, std::ostream& md) {
  json combos = json::array();
  for (const auto& c : all) {
    json j = {{"techniques", c.on}, {"predicted_peak_bytes", static_cast<int64_t>(c.peak)},
              {"predicted_step_seconds", c.step}, {"predicted_step_spread", c.spread},
              {"fits", c.fits}};
    md << "| " << (best == &c ? "**" + name_of(c.on) + "**" : name_of(c.on)) << " | "
       << format_bytes(static_cast<int64_t>(c.peak)) << " | " << (c.fits ? "yes" : "no") << " | "
       << fixed_digits(1000 * c.step, 1) << " ms ± " << fixed_digits(100 * c.spread, 0) << "% | ";
    if (c.measured) {
      const double err = 100.0 * (c.peak - static_cast<double>(c.measured_peak)) / c.measured_peak;
      j["measured_peak_bytes"] = c.measured_peak;
      j["measured_step_seconds"] = c.measured_step;
      j["error_percent"] = err;
      md << format_bytes(c.measured_peak) << " | " << (err >= 0 ? "+" : "") << fixed_digits(err, 1) << "% |\n";
    } else {
      md << "- | - |\n";
    }
    combos.push_back(j);
  }
  return combos;
}

/// No combination fits: the message, in plan.md, plan.json and the log.
void no_proposal(const PlanInputs& in, const Measured& m, const std::vector<Candidate>& all,
                 std::ostream& md, json& out, spdlog::logger& log) {
  const Candidate& smallest = all.front();
  const std::string msg =
      "no combination of " + join_on(in.t.techniques, ", ") + " is predicted to fit " +
      format_bytes(in.budget) + ": the smallest predicted peak is " +
      format_bytes(static_cast<int64_t>(smallest.peak)) + " (" + name_of(smallest.on) +
      "). Raise --budget, lower data.batch_size (each sample adds about " +
      format_bytes(static_cast<int64_t>(std::max(0.0, (smallest.peak - m.fits[0].fixed) / in.b))) +
      " with it), or add a technique";
  md << "\n**No combination fits.** " << msg << ".\n";
  out["proposal"] = nullptr;
  out["error"] = msg;
  log.error("{}", msg);
}

/// The proposal, with what its run measured, in plan.md and plan.json.
void proposal(const PlanInputs& in, const Candidate& best, const std::vector<const Candidate*>& close,
              std::ostream& md, json& out, spdlog::logger& log) {
  json too_close = json::array();
  for (const Candidate* c : close) too_close.push_back(c->on);
  if (close.empty()) {
    md << "\nProposal: **" << name_of(best.on) << "**, the fastest predicted to fit (";
  } else {
    // The simplest of the others first (at most five named; plan.json lists them all).
    std::vector<const Candidate*> others = close;
    std::stable_sort(others.begin(), others.end(),
                     [](const Candidate* x, const Candidate* y) { return x->on.size() < y->on.size(); });
    std::string named;
    for (size_t i = 0; i < others.size() && i < 5; ++i) named += (i ? ", " : "") + name_of(others[i]->on);
    if (others.size() > 5) named += " and " + std::to_string(others.size() - 5) + " more";
    md << "\nProposal: **" << name_of(best.on) << "**, the simplest predicted to fit that nothing "
       << "fitting is clearly faster than. Predicted faster, but within twice the measurements' "
       << "spread (too close to call; more --steps can separate them): " << named << " (";
  }
  md << format_bytes(static_cast<int64_t>(best.peak)) << " of " << format_bytes(in.budget) << ").";
  json p = {{"techniques", best.on}, {"predicted_peak_bytes", static_cast<int64_t>(best.peak)},
            {"predicted_step_seconds", best.step}, {"predicted_step_spread", best.spread},
            {"too_close_to_call", too_close}};
  if (best.measured) {
    const double err = 100.0 * (best.peak - static_cast<double>(best.measured_peak)) / best.measured_peak;
    p["measured_peak_bytes"] = best.measured_peak;
    p["error_percent"] = err;
    md << " Measured: " << format_bytes(best.measured_peak) << " (prediction "
       << (err >= 0 ? "+" : "") << fixed_digits(err, 1) << "%)"
       << (best.measured_peak > in.budget ? "; **over the budget**" : "") << ".";
    if (best.measured_peak > in.budget)
      log.warn("the proposal measured {} > budget {}", format_bytes(best.measured_peak),
               format_bytes(in.budget));
  }
  if (best.on.empty())
    md << "\n\nThe baseline fits: no technique is needed.\n";
  else
    md << "\n\nTo use it: set `enabled = true` in [plugins." << join_on(best.on, "], [plugins.")
       << "] and `enabled = false` for the other techniques.\n";
  out["proposal"] = p;
}

}  // namespace

int run_plan(const PlanArgs& a, spdlog::logger& log, const char* argv0) {
  const PlanInputs in = plan_inputs(a);
  ensure_writable_dir(a.out);
  const std::string exe = self_exe(argv0);
  log.info("plan for {} within {}: measuring the baseline and {} technique(s) at batch sizes "
           "{} and {} ({} runs of {} batches)", a.config, format_bytes(in.budget),
           in.t.techniques.size(), in.b, in.half, in.measure.size(), a.steps);
  const Measured m = measure_all(a, in, exe, log);
  std::vector<Candidate> all = predict_all(in, m);
  std::vector<const Candidate*> close;
  const Candidate* best = propose(all, in, m, close);
  json out = plan_header(a, in, m);
  verify(a, in, exe, all, best, log);

  std::ostringstream md;
  md << "# Plan for `" << a.config << "` within " << format_bytes(in.budget) << "\n\n"
     << "Batch size " << in.b << "; predicted from " << in.measure.size() << " runs of " << a.steps
     << " batches (the baseline and each technique alone at batch sizes " << in.b << " and "
     << in.half << "); training peak, validation off.\n\n";
  for (const auto& t : in.t.techniques)
    if (by_formula(t))
      md << "`" << t << "` is not measured: its peak is the baseline's less "
         << format_bytes(m.base_optimizer_state) << " of optimizer state"
         << (zero_stage(in.cfg) == 3 ? " and " + format_bytes(m.base_parameters) + " of parameters" : "")
         << " x (1 - 1/" << std::max(1, a.nproc) << " ranks) (ZeRO's formula)"
         << (m.gathered > 0 ? ", plus " + format_bytes(m.gathered) + " of units gathered at once" : "")
         << ".\n\n";
  md
     << "| techniques | predicted peak | fits | predicted step time ± spread | measured peak | error |\n"
     << "|---|---:|:---:|---:|---:|---:|\n";
  out["combinations"] = combinations(all, best, md);
  if (best)
    proposal(in, *best, close, md, out, log);
  else
    no_proposal(in, m, all, md, out, log);
  write_file_atomic((fs::path(a.out) / "plan.json").string(), out.dump(2) + "\n");
  write_file_atomic((fs::path(a.out) / "plan.md").string(), md.str());
  std::cout << md.str() << std::flush;
  return best ? 0 : 3;
}

}  // namespace frugal::cli
