// `frugal ablate`: the baseline, each technique alone, all together and all but one, each run
// in its own process; results.json, results.csv, report.md, gnuplot plots and Chrome traces.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include "ablation.h"
#include "frugal/base/error.h"
#include "frugal/io/file_writer.h"
#include "frugal/memory/memory.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace frugal::cli {

namespace {

constexpr const char* kPhases[] = {"forward", "backward", "step", "validate"};
constexpr const char* kCategories[] = {"parameters", "gradients", "optimizer_state",
                                       "activations", "data", "callbacks", "other"};

/// One row of the results: a combination's measurements over its repeats.
struct Row {
  ChildRun run;
  std::string dir, trace;
  bool ok = false;
  int exit_code = 0;
  std::string error;
  double wall_seconds = 0;
  int64_t iterations = 0;
  int64_t peak = 0, reserved = -1;
  std::map<std::string, int64_t> phase, steady;  // steady: the first stage's
  struct StageRow {
    std::string name;
    int64_t train_peak = 0;  ///< the highest of the stage's forward, backward and step peaks
    std::map<std::string, int64_t> steady;
  };
  std::vector<StageRow> stages;
  double median = 0, p10 = 0, p90 = 0, samples_per_second = 0, final_loss = 0;
  double accuracy = -1;  ///< -1: not validated
  double valid_loss = -1;  ///< nats per target element (sample or token); -1: not validated
  bool lm = false;         ///< a language model or a regression: its metric is the validation loss
  std::string task = "classification";  ///< the report's fit.task
  // relative to the baseline (when both worked)
  bool relative = false;
  double saved_percent = 0, slowdown = 0, accuracy_change = 0, loss_change = 0;
  bool pareto = false;
};

/// The runs of an ablation: baseline, each alone, all, all but one; duplicates (same set of
/// techniques) are dropped, the first name kept.
std::vector<ChildRun> ablation_runs(const TechniqueSet& t, bool leave_one_out) {
  std::vector<ChildRun> runs;
  std::set<std::vector<std::string>> seen;
  auto add = [&](std::string name, std::vector<std::string> on) {
    auto key = on;
    std::sort(key.begin(), key.end());
    if (seen.insert(key).second) runs.push_back({std::move(name), std::move(on), {}});
  };
  add("baseline", {});
  for (const auto& n : t.techniques) add(n, {n});
  add("all", t.techniques);
  if (leave_one_out)
    for (const auto& n : t.techniques) {
      std::vector<std::string> on;
      for (const auto& m : t.techniques)
        if (m != n) on.push_back(m);
      add("all-but-" + n, on);
    }
  return runs;
}

std::string quoted(const std::string& s) { return json(s).dump(); }

int64_t get_i(const json& j, const char* k) {
  return j.is_object() && j.contains(k) && j[k].is_number() ? j[k].get<int64_t>() : 0;
}
double get_d(const json& j, const char* k, double fallback = 0) {
  return j.is_object() && j.contains(k) && j[k].is_number() ? j[k].get<double>() : fallback;
}

/// Fills a row from its repeats: memory from the first that worked (it is the same on every
/// repeat on CPU), times as the median over repeats.
void summarize(Row& row, const std::vector<ChildResult>& reps) {
  std::vector<double> med, p10, p90, sps;
  for (const auto& r : reps) {
    row.wall_seconds += r.wall_seconds;
    if (r.exit_code != 0 || !r.report.is_object() || !r.report.contains("fit") ||
        !r.report["fit"].is_object()) {
      if (row.error.empty()) {
        row.error = r.error.empty() ? "no report" : r.error;
        row.exit_code = r.exit_code;
      }
      continue;
    }
    const json& fit = r.report["fit"];
    const json& t = fit["step_seconds"];
    med.push_back(get_d(t, "median"));
    p10.push_back(get_d(t, "p10"));
    p90.push_back(get_d(t, "p90"));
    int64_t samples = 0, batches = 0;
    for (const auto& s : fit["stages"]) {
      samples += get_i(s, "samples");
      batches += get_i(s, "batches");
    }
    const double per_batch = batches ? static_cast<double>(samples) / batches : 0;
    // Steady speed: a batch's samples over the median step time (warm-up left out).
    sps.push_back(med.back() > 0 ? per_batch / med.back() : get_d(fit, "samples_per_second"));
    if (row.ok) continue;
    row.ok = true;
    row.iterations = get_i(fit, "iterations");
    row.peak = get_i(fit, "peak_bytes");
    for (const char* key : {"reserved_bytes", "reserved_peak_bytes"})  // the peak when known
      if (r.report.contains(key)) row.reserved = get_i(r.report, key);
    for (const char* p : kPhases) row.phase[p] = get_i(fit["phase_peaks"], p);
    const json steady = fit["stages"].empty() ? json() : fit["stages"][0]["steady"];
    for (const char* c : kCategories) row.steady[c] = get_i(steady, c);
    for (const auto& st : fit["stages"]) {
      Row::StageRow sr;
      sr.name = st.value("name", std::string());
      for (int p = 0; p < 3; ++p)
        sr.train_peak = std::max(sr.train_peak, get_i(st["phase_peaks"], kPhases[p]));
      for (const char* c : kCategories) sr.steady[c] = get_i(st["steady"], c);
      row.stages.push_back(std::move(sr));
    }
    row.final_loss = get_d(fit, "final_loss");
    row.accuracy = get_d(fit, "valid_accuracy", -1);
    row.valid_loss = get_d(fit, "valid_loss", -1);
    row.task = fit.value("task", std::string("classification"));
    row.lm = row.task == "language_model" || row.task == "regression";
  }
  if (row.ok) {
    row.error.clear();
    row.exit_code = 0;
    row.median = median(med);
    row.p10 = median(p10);
    row.p90 = median(p90);
    row.samples_per_second = median(sps);
  }
}

void compare(std::vector<Row>& rows) {
  const Row& base = rows.front();
  for (auto& r : rows) {
    if (!r.ok || !base.ok) continue;
    r.relative = true;
    r.saved_percent = base.peak > 0 ? 100.0 * (1.0 - static_cast<double>(r.peak) / base.peak) : 0;
    r.slowdown = base.median > 0 ? r.median / base.median : 0;
    r.accuracy_change = r.accuracy >= 0 && base.accuracy >= 0 ? 100.0 * (r.accuracy - base.accuracy) : 0;
    r.loss_change = r.valid_loss >= 0 && base.valid_loss >= 0 ? r.valid_loss - base.valid_loss : 0;
  }
  // The memory x speed Pareto front: no other run is at least as small and as fast, and
  // strictly better in one.
  for (auto& r : rows) {
    if (!r.ok) continue;
    r.pareto = std::none_of(rows.begin(), rows.end(), [&](const Row& o) {
      return o.ok && &o != &r && o.peak <= r.peak && o.samples_per_second >= r.samples_per_second &&
             (o.peak < r.peak || o.samples_per_second > r.samples_per_second);
    });
  }
}

std::string fixed(double v, int precision) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << v;
  return os.str();
}
std::string mib(int64_t b) { return fixed(static_cast<double>(b) / (1024.0 * 1024.0), 2); }
std::string signed_fixed(double v, int precision) {
  const std::string digits = fixed(std::fabs(v), precision);
  // -0.0 and values that round to zero print as +0.0, not +-0.0.
  const bool zero = digits.find_first_not_of("0.") == std::string::npos;
  return (zero || v >= 0 ? "+" : "-") + digits;
}

json row_json(const Row& r) {
  json j = {{"name", r.run.name},       {"techniques", r.run.on}, {"ok", r.ok},
            {"exit_code", r.exit_code}, {"dir", r.dir},           {"wall_seconds", r.wall_seconds},
            {"pareto", r.pareto}};
  if (!r.ok) {
    j["error"] = r.error;
    return j;
  }
  j["trace"] = r.trace;
  j["iterations"] = r.iterations;
  j["peak_bytes"] = r.peak;
  if (r.reserved >= 0) j["reserved_bytes"] = r.reserved;
  j["phase_peaks"] = r.phase;
  j["steady"] = r.steady;
  j["step_seconds"] = {{"median", r.median}, {"p10", r.p10}, {"p90", r.p90}};
  j["samples_per_second"] = r.samples_per_second;
  j["final_loss"] = r.final_loss;
  if (r.accuracy >= 0) j["valid_accuracy"] = r.accuracy;
  if (r.valid_loss >= 0) j["valid_loss"] = r.valid_loss;
  j["task"] = r.task;
  if (r.relative) {
    j["memory_saved_percent"] = r.saved_percent;
    j["slowdown"] = r.slowdown;
    if (r.accuracy >= 0) j["accuracy_change_points"] = r.accuracy_change;
    if (r.valid_loss >= 0) j["valid_loss_change"] = r.loss_change;
  }
  return j;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string results_csv(const std::vector<Row>& rows) {
  std::ostringstream os;
  os << "name,techniques,ok,peak_bytes,reserved_bytes";
  for (const char* p : kPhases) os << "," << p << "_peak_bytes";
  for (const char* c : kCategories) os << ",steady_" << c << "_bytes";
  os << ",step_median_s,step_p10_s,step_p90_s,samples_per_second,final_loss,valid_accuracy,"
        "memory_saved_percent,slowdown,accuracy_change_points,valid_loss,valid_loss_change,pareto,"
        "error\n";
  for (const auto& r : rows) {
    os << csv_field(r.run.name) << "," << csv_field(join_on(r.run.on)) << "," << (r.ok ? 1 : 0);
    if (!r.ok) {
      for (int i = 0; i < 2 + 4 + 6 + 6 + 3 + 2; ++i) os << ",";
      os << ",0," << csv_field(r.error) << "\n";
      continue;
    }
    os << "," << r.peak << "," << (r.reserved >= 0 ? std::to_string(r.reserved) : "");
    for (const char* p : kPhases) os << "," << r.phase.at(p);
    for (const char* c : kCategories) os << "," << r.steady.at(c);
    os << std::setprecision(9) << "," << r.median << "," << r.p10 << "," << r.p90 << ","
       << r.samples_per_second << "," << r.final_loss << ","
       << (r.accuracy >= 0 ? fixed(r.accuracy, 6) : "") << ","
       << (r.relative ? fixed(r.saved_percent, 3) : "") << ","
       << (r.relative ? fixed(r.slowdown, 4) : "") << ","
       << (r.relative && r.accuracy >= 0 ? fixed(r.accuracy_change, 3) : "") << ","
       << (r.valid_loss >= 0 ? fixed(r.valid_loss, 6) : "") << ","
       << (r.relative && r.valid_loss >= 0 ? fixed(r.loss_change, 6) : "") << ","
       << (r.pareto ? 1 : 0) << ",\n";
  }
  return os.str();
}

/// The steady-state category that changed most from `base` to `run`, and by how many bytes
/// ("" and 0 when none changed).
std::pair<std::string, int64_t> largest_change(const std::map<std::string, int64_t>& base,
                                               const std::map<std::string, int64_t>& run) {
  std::pair<std::string, int64_t> out{"", 0};
  for (const char* c : kCategories) {
    const int64_t d = run.at(c) - base.at(c);
    if (std::llabs(d) > std::llabs(out.second)) out = {c, d};
  }
  return out;
}

/// Why a technique's row shows the saving it shows: which steady category moved and what
/// bounds the peak.
std::string explain(const Row& r, const Row& base) {
  std::ostringstream os;
  os << "- **" << r.run.name << "**: peak " << format_bytes(base.peak) << " -> "
     << format_bytes(r.peak) << " (" << signed_fixed(-r.saved_percent, 1) << "%).";
  const auto [moved, biggest] = largest_change(base.steady, r.steady);
  if (!moved.empty()) {
    const int64_t b = base.steady.at(moved);
    os << " Steady " << moved << " " << format_bytes(b) << " -> "
       << format_bytes(r.steady.at(moved));
    if (b > 0) os << " (" << signed_fixed(100.0 * static_cast<double>(biggest) / b, 1) << "%)";
    os << ".";
  }
  if (r.saved_percent < 5 && base.peak > 0) {
    const double act_share = 100.0 * static_cast<double>(base.steady.at("activations")) / base.peak;
    const char* top = "forward";
    for (const char* p : kPhases)
      if (r.phase.at(p) > r.phase.at(top)) top = p;
    os << (r.saved_percent < 0 ? " The peak grows" : " The peak barely moves")
       << ": activations are " << fixed(act_share, 0) << "% of the baseline's peak, and this run's "
       << "peak is in its " << top << " phase (" << format_bytes(r.phase.at(top)) << ")";
    const bool saved_forward = r.phase.at("forward") < base.phase.at("forward");
    if (std::string(top) == "backward" && r.phase.at("backward") > r.phase.at("forward") &&
        saved_forward)
      os << ", above its forward phase's (" << format_bytes(r.phase.at("forward"))
         << "): what it saves in the forward is live again in the backward (recomputed "
            "segments, gradient buffers).";
    else if (!saved_forward && r.phase.at(top) >= base.phase.at(top))
      os << ", as the baseline's: the technique does not change what a training step holds "
            "here.";
    else
      os << ", where parameters, gradients, optimizer state and data are held whatever the "
            "technique does to activations.";
  }
  // A technique that acts in a later stage (a purge, an optimizer swap) cannot lower a peak
  // that an earlier stage sets: say what it changed where it acts.
  for (size_t i = 1; i < r.stages.size() && i < base.stages.size(); ++i) {
    const auto& rs = r.stages[i];
    const auto& bs = base.stages[i];
    const std::string cat = largest_change(bs.steady, rs.steady).first;
    if (cat.empty() && rs.train_peak == bs.train_peak) continue;
    os << " In stage '" << rs.name << "': training peak " << format_bytes(bs.train_peak) << " -> "
       << format_bytes(rs.train_peak);
    if (!cat.empty())
      os << ", steady " << cat << " " << format_bytes(bs.steady.at(cat)) << " -> "
         << format_bytes(rs.steady.at(cat));
    os << ".";
    if (rs.train_peak < bs.train_peak && r.peak >= base.peak)
      os << " The fit's peak is set in an earlier stage, which this technique leaves as it is.";
  }
  return os.str();
}

/// The title, command, machine and protocol.
void report_header(std::ostream& md, const json& meta) {
  const json& m = meta["machine"];
  md << "# Ablation of `" << meta["config"].get<std::string>() << "`\n\n";
  md << "Command: `" << meta["command"].get<std::string>() << "`  \n";
  md << "Machine: " << m.value("cpu", std::string("unknown CPU")) << ", "
     << m.value("logical_cores", 0) << " logical cores, " << m.value("os", std::string(""))
     << ", LibTorch " << m.value("libtorch", std::string("")) << "; load average at start "
     << (m.contains("load_average") ? fixed(m["load_average"][0].get<double>(), 2) : "?")
     << ".  \n";
  md << meta["steps"].get<int64_t>() << " training batches per run, the first "
     << meta["warmup"].get<int64_t>() << " left out of the step times; "
     << meta["repeats"].get<int64_t>()
     << " repeat(s), times are the median over repeats. Each run is its own process. Memory is "
        "exact (counted by the tracking allocator); times depend on the machine's load, so "
        "compare them as ratios to the baseline.\n\n";
  md << "Baseline plugins: " << join_on(meta["baseline_plugins"].get<std::vector<std::string>>(), ", ")
     << ". Techniques varied: " << join_on(meta["techniques"].get<std::vector<std::string>>(), ", ")
     << ".\n\n";
}

/// One row per run, by peak live memory (failed runs last), with the Pareto marks.
void runs_table(std::ostream& md, const std::vector<const Row*>& order) {
  // A language model's metric is its validation loss (nats/token), a regression's its MSE; a
  // classifier's, accuracy.
  const bool lm = std::any_of(order.begin(), order.end(), [](const Row* r) { return r->lm; });
  const bool regression =
      std::any_of(order.begin(), order.end(), [](const Row* r) { return r->task == "regression"; });
  md << "| run | techniques | peak live | saved | steady activations | step median (p10-p90) | "
        "samples/s | slowdown | final loss | "
     << (regression ? "valid MSE (change)" : lm ? "valid loss, nats/token (change)" : "valid accuracy (change)")
     << " | Pareto |\n";
  md << "|---|---|---:|---:|---:|---|---:|---:|---:|---|:---:|\n";
  for (const Row* r : order) {
    md << "| " << r->run.name << " | " << join_on(r->run.on, ", ") << " | ";
    if (!r->ok) {
      md << "failed (exit " << r->exit_code << ") | | | | | | | | |\n";
      continue;
    }
    md << mib(r->peak) << " MiB | " << (r->relative ? fixed(r->saved_percent, 1) + "%" : "-")
       << " | " << mib(r->steady.at("activations")) << " MiB | " << fixed(1000 * r->median, 1)
       << " ms (" << fixed(1000 * r->p10, 1) << "-" << fixed(1000 * r->p90, 1) << ") | "
       << fixed(r->samples_per_second, 0) << " | "
       << (r->relative ? fixed(r->slowdown, 2) + "x" : "-") << " | " << fixed(r->final_loss, 4)
       << " | ";
    if (lm && r->valid_loss >= 0)
      md << fixed(r->valid_loss, 4) << (r->relative ? " (" + signed_fixed(r->loss_change, 4) + ")" : "");
    else if (!lm && r->accuracy >= 0)
      md << fixed(100 * r->accuracy, 2) << "%"
         << (r->relative ? " (" + signed_fixed(r->accuracy_change, 2) + ")" : "");
    else
      md << "-";
    md << " | " << (r->pareto ? "★" : "") << " |\n";
  }
  md << "\n★ on the memory x speed Pareto front: no other run has a peak as low and a speed as "
        "high, and one of them strictly better. Sorted by peak live memory.\n";
}

/// The steady state's categories and the phases' peaks of each run that worked.
void memory_table(std::ostream& md, const std::vector<const Row*>& order) {
  md << "\n## Where the memory is\n\nSteady state (a stage's third batch) and the peak of each "
        "phase.\n\n| run | parameters | gradients | optimizer state | activations | data | "
        "held by callbacks | other | forward peak | backward peak | step peak |\n|---|---:|---:|"
        "---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Row* r : order) {
    if (!r->ok) continue;
    md << "| " << r->run.name;
    for (const char* c : kCategories) md << " | " << mib(r->steady.at(c));
    for (int p = 0; p < 3; ++p) md << " | " << mib(r->phase.at(kPhases[p]));
    md << " |\n";
  }
  md << "\n(MiB.)\n";
}

/// What each technique alone changed, failed runs, runs shorter than the cap.
void notes(std::ostream& md, const std::vector<Row>& rows, const json& meta) {
  const Row& base = rows.front();
  md << "\n## Notes\n\n";
  if (base.ok) {
    for (const auto& r : rows)
      if (&r != &base && r.ok && r.run.on.size() == 1) md << explain(r, base) << "\n";
  } else {
    md << "- The baseline failed, so nothing is relative to it.\n";
  }
  std::string short_runs;
  for (const auto& r : rows) {
    if (!r.ok) md << "- Run **" << r.run.name << "** failed (exit " << r.exit_code << "): " << r.error << "\n";
    else if (r.iterations < meta["steps"].get<int64_t>())
      short_runs += (short_runs.empty() ? "" : ", ") + r.run.name + " (" + std::to_string(r.iterations) + ")";
  }
  if (!short_runs.empty())
    md << "- Runs that ended with their epochs before the cap of " << meta["steps"].get<int64_t>()
       << " batches (batches run): " << short_runs << ".\n";
}

std::string report_md(const std::vector<Row>& rows, const json& meta, bool plots) {
  std::ostringstream md;
  report_header(md, meta);
  std::vector<const Row*> order;
  for (const auto& r : rows) order.push_back(&r);
  std::stable_sort(order.begin(), order.end(), [](const Row* a, const Row* b) {
    if (a->ok != b->ok) return a->ok;
    return a->ok && a->peak < b->peak;
  });
  runs_table(md, order);
  memory_table(md, order);
  notes(md, rows, meta);
  if (plots) {
    md << "\n## Plots\n\n![peak live memory per run](plots/peak_memory.svg)\n\n"
          "![live memory over the first steps](plots/live_memory.svg)\n\n"
          "![peak memory against samples/s](plots/tradeoff.svg)\n";
  } else {
    md << "\nNo plots: gnuplot was not found (install gnuplot-nox); the data files and scripts "
          "are in plots/.\n";
  }
  md << "\nEach run's folder (runs/<name>/) holds its report, log and trace.json (open it in "
        "https://ui.perfetto.dev).\n";
  return md.str();
}

/// peak.dat (by peak), tradeoff.dat and pareto.dat (by speed).
void write_peak_data(const std::vector<const Row*>& ok, const std::string& dir) {
  std::ofstream peak(fs::path(dir) / "peak.dat");
  peak << "# run peak_MiB\n";
  for (const Row* r : ok) peak << quoted(r->run.name) << " " << mib(r->peak) << "\n";
  peak.close();

  std::ofstream trade(fs::path(dir) / "tradeoff.dat");
  std::ofstream front(fs::path(dir) / "pareto.dat");
  trade << "# run samples_per_second peak_MiB\n";
  front << "# the Pareto front, by speed\n";
  std::vector<const Row*> by_speed = ok;
  std::sort(by_speed.begin(), by_speed.end(),
            [](const Row* a, const Row* b) { return a->samples_per_second < b->samples_per_second; });
  for (const Row* r : by_speed) {
    trade << quoted(r->run.name) << " " << fixed(r->samples_per_second, 3) << " " << mib(r->peak) << "\n";
    if (r->pareto) front << quoted(r->run.name) << " " << fixed(r->samples_per_second, 3) << " " << mib(r->peak) << "\n";
  }
}

/// live_<i>.dat of each run's first steps; returns the gnuplot `plot` command drawing them.
std::string write_live_data(const std::vector<const Row*>& ok, const std::string& dir,
                            int64_t steps) {
  const int64_t shown = std::min<int64_t>(steps, 4);  // a few steps: the pattern repeats
  std::string live_plot;
  for (size_t i = 0; i < ok.size(); ++i) {
    const std::string file = "live_" + std::to_string(i) + ".dat";
    std::ofstream d(fs::path(dir) / file);
    d << "# " << ok[i]->run.name << ": step (fractional) live_MiB\n";
    for (const auto& [x, y] : timeline(ok[i]->trace))
      if (x <= static_cast<double>(shown)) d << fixed(x, 4) << " " << fixed(y, 3) << "\n";
    live_plot += std::string(live_plot.empty() ? "plot " : ", \\\n     ") + quoted(file) +
                 " using 1:2 with steps lw 1.5 title " + quoted(ok[i]->run.name);
  }
  return live_plot;
}

/// Writes the data files and gnuplot scripts into `dir`; runs gnuplot when there is one.
/// Returns whether the plots were drawn.
bool write_plots(const std::vector<Row>& rows, const std::string& dir, int64_t steps,
                 spdlog::logger& log) {
  fs::create_directories(dir);
  std::vector<const Row*> ok;
  for (const auto& r : rows)
    if (r.ok) ok.push_back(&r);
  std::stable_sort(ok.begin(), ok.end(), [](const Row* a, const Row* b) { return a->peak < b->peak; });
  write_peak_data(ok, dir);
  write_scripts(dir, write_live_data(ok, dir, steps));
  return draw_plots(dir, log);
}

}  // namespace

CLI::App* add_ablate_command(CLI::App& app, AblateArgs& a) {
  auto* c = app.add_subcommand(
      "ablate",
      "measure each technique: the baseline, each alone, all together and all but one, each "
      "run in its own process; writes results.json, results.csv, report.md, plots and traces");
  c->add_option("config", a.config, "the run's TOML file, with an [ablation] table")->required();
  c->add_option("--out", a.out, "folder for the results (default runs/ablation)");
  c->add_option("--repeats", a.repeats, "runs of each combination (default: ablation.repeats)")
      ->check(CLI::PositiveNumber);
  c->add_option("--nproc", a.nproc, "run every combination on N data-parallel ranks")
      ->check(CLI::Range(1, 1024));
  c->add_option("--steps", a.steps, "training batches per run (default: ablation.steps)")
      ->check(CLI::PositiveNumber);
  c->add_option("--set", a.sets, "override a key in every run, e.g. --set data.batch_size=64");
  return c;
}

namespace {

/// What an ablation runs: its techniques, runs, batches and repeats, and the results' header.
struct AblationPlan {
  TechniqueSet t;
  std::vector<ChildRun> runs;
  int64_t steps = 0, repeats = 0, warmup = 0;
  json meta;
};

/// Everything is checked before the first run: the [ablation] table, the plugins it names,
/// and every run's whole configuration.
AblationPlan plan_ablation(const AblateArgs& a) {
  AblationPlan p;
  const Config cfg = load_base_config(a.config, a.sets);
  p.t = resolve_techniques(cfg);
  p.steps = a.steps ? a.steps : cfg.ablation.steps;
  p.repeats = a.repeats ? a.repeats : cfg.ablation.repeats;
  p.warmup = cfg.ablation.warmup;
  if (p.warmup >= p.steps)
    throw_config_error("--steps " + std::to_string(p.steps) + " must be more than 'ablation.warmup' (" +
                       std::to_string(p.warmup) + "): no step would be timed");
  p.runs = ablation_runs(p.t, cfg.ablation.leave_one_out);
  check_runs(a.config, a.sets, p.t, p.runs);
  p.meta = {{"config", a.config},
            {"command", command_line(a, p.steps, p.repeats)},
            {"machine", machine_info()},
            {"steps", p.steps},
            {"warmup", p.warmup},
            {"repeats", p.repeats},
            {"baseline_plugins", p.t.baseline},
            {"techniques", p.t.techniques}};
  return p;
}

/// Runs every run `repeats` times; returns each run's results. Repeats go round the runs, so
/// that a burst of load on the machine hits every run alike. Sets each row's run and folders.
std::vector<std::vector<ChildResult>> run_all(const AblateArgs& a, const AblationPlan& p,
                                              const std::string& exe, std::vector<Row>& rows,
                                              spdlog::logger& log) {
  std::vector<std::vector<ChildResult>> results(p.runs.size());
  size_t done = 0;
  const size_t total = p.runs.size() * static_cast<size_t>(p.repeats);
  for (int64_t rep = 0; rep < p.repeats; ++rep) {
    for (size_t i = 0; i < p.runs.size(); ++i) {
      const ChildRun& r = p.runs[i];
      fs::path dir = fs::path(a.out) / "runs" / r.name;
      if (rep > 0) dir /= "repeat-" + std::to_string(rep + 1);
      const std::string trace = rep == 0 ? (dir / "trace.json").string() : "";
      if (rep == 0) {
        rows[i].run = r;
        rows[i].dir = dir.string();
        rows[i].trace = trace;
      }
      const std::vector<std::string> keys = {
          "run.max_steps=" + std::to_string(p.steps), "run.progress=\"none\"",
          "run.warmup=" + std::to_string(p.warmup), "run.trace=" + quoted(trace)};
      ++done;
      log.info("[{}/{}] {} ({}) ...", done, total, r.name, join_on(r.on, ", "));
      ChildResult res = run_train_child(exe, a.config, a.sets, p.t, r, dir.string(), keys, a.nproc);
      if (res.exit_code == 0 && res.report.is_object()) {
        const json& fit = res.report["fit"];
        log.info("[{}/{}] {}: peak {}, step {:.1f} ms, {:.1f} s", done, total, r.name,
                 format_bytes(get_i(fit, "peak_bytes")),
                 1000 * get_d(fit["step_seconds"], "median"), res.wall_seconds);
      } else {
        log.warn("[{}/{}] {} failed (exit {}): {}", done, total, r.name, res.exit_code, res.error);
      }
      results[i].push_back(std::move(res));
    }
  }
  return results;
}

/// results.json, results.csv, report.md (also printed) and the plots.
void write_results(const AblateArgs& a, const AblationPlan& p, const json& meta,
                   const std::vector<Row>& rows, spdlog::logger& log) {
  const bool plots = write_plots(rows, (fs::path(a.out) / "plots").string(), p.steps, log);
  json out = meta;
  out["plots"] = plots;
  out["runs"] = json::array();
  for (const auto& r : rows) out["runs"].push_back(row_json(r));
  write_file_atomic((fs::path(a.out) / "results.json").string(), out.dump(2) + "\n");
  write_file_atomic((fs::path(a.out) / "results.csv").string(), results_csv(rows));
  const std::string md = report_md(rows, meta, plots);
  write_file_atomic((fs::path(a.out) / "report.md").string(), md);
  std::cout << md << std::flush;
  const size_t failed = std::count_if(rows.begin(), rows.end(), [](const Row& r) { return !r.ok; });
  log.info("ablation done in {:.0f} s: {} run(s), {} failed; {}/report.md, results.json, "
           "results.csv{}", meta["wall_seconds"].get<double>(), rows.size(), failed, a.out,
           plots ? ", plots/" : "");
}

}  // namespace

int run_ablate(const AblateArgs& a, spdlog::logger& log, const char* argv0) {
  const AblationPlan p = plan_ablation(a);
  ensure_writable_dir(a.out);
  const std::string exe = self_exe(argv0);
  log.info("ablation of {}: {} runs x {} repeat(s), {} batches each (warm-up {}); techniques: {}",
           a.config, p.runs.size(), p.repeats, p.steps, p.warmup, join_on(p.t.techniques, ", "));

  const auto t_start = std::chrono::steady_clock::now();
  std::vector<Row> rows(p.runs.size());
  const auto results = run_all(a, p, exe, rows, log);
  for (size_t i = 0; i < p.runs.size(); ++i) summarize(rows[i], results[i]);
  compare(rows);
  json meta = p.meta;
  meta["wall_seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  meta["load_average_at_end"] = machine_info().value("load_average", json());
  write_results(a, p, meta, rows, log);
  // A failed run is a result, not a failure of the ablation; the baseline is needed though.
  return rows.front().ok ? 0 : 1;
}

}  // namespace frugal::cli
