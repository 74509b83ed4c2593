// `frugal ablate`'s plots (gnuplot scripts over the data files the runs give) and its
// command line: the parts of ablate.cpp that need none of its rows.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include "ablation.h"

namespace frugal::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
const char* kTerminals =
    "svg_out(name) = sprintf('set terminal svg size 900,520 dynamic font \"sans,11\"; set output \"%s.svg\"', name)\n"
    "png_term = strstrt(GPVAL_TERMINALS, 'pngcairo') > 0 ? 'pngcairo' : 'png'\n"
    "png_out(name) = sprintf('set terminal %s size 900,520; set output \"%s.png\"', png_term, name)\n";

}  // namespace

/// A run's live bytes against its fractional step (step + position within the batch), from
/// its trace: (x, MiB) pairs.
std::vector<std::pair<double, double>> timeline(const std::string& trace_path) {
  std::vector<std::pair<double, double>> out;
  std::ifstream f(trace_path);
  if (!f) return out;
  json t;
  try {
    t = json::parse(f);
  } catch (const std::exception&) {
    return out;
  }
  struct Span { double ts, dur; int64_t step; };
  std::vector<Span> batches;
  std::vector<std::pair<double, int64_t>> counters;
  for (const auto& e : t["traceEvents"]) {
    const std::string ph = e.value("ph", "");
    if (ph == "X" && e.value("name", "") == "batch")
      batches.push_back({e["ts"].get<double>(), e["dur"].get<double>(), e["args"]["step"].get<int64_t>()});
    else if (ph == "C")
      counters.emplace_back(e["ts"].get<double>(), e["args"]["live_bytes"].get<int64_t>());
  }
  std::sort(batches.begin(), batches.end(), [](const Span& a, const Span& b) { return a.ts < b.ts; });
  for (const auto& [ts, bytes] : counters) {
    auto it = std::upper_bound(batches.begin(), batches.end(), ts,
                               [](double v, const Span& s) { return v < s.ts; });
    if (it == batches.begin()) continue;
    --it;
    if (ts > it->ts + it->dur + 1e-3) continue;  // between batches (validation)
    const double frac = it->dur > 0 ? (ts - it->ts) / it->dur : 0;
    out.emplace_back(static_cast<double>(it->step) + std::min(1.0, frac),
                     static_cast<double>(bytes) / (1024.0 * 1024.0));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_scripts(const std::string& dir, const std::string& live_plot) {
  auto script = [&](const std::string& name, const std::string& body) {
    std::ofstream gp(fs::path(dir) / (name + ".gp"));
    gp << "# gnuplot " << name << ".gp (run in this folder) draws " << name << ".svg and .png\n"
       << kTerminals << "do for [k = 1:2] {\n  eval(k == 1 ? svg_out('" << name << "') : png_out('"
       << name << "'))\n" << body << "}\n";
  };
  script("peak_memory",
         "  set title 'Peak live memory per run'\n  set ylabel 'MiB'\n  set style data histograms\n"
         "  set style fill solid 0.8 border -1\n  set boxwidth 0.7\n  set xtics rotate by -30 noenhanced\n"
         "  set key off\n  set yrange [0:*]\n  set grid ytics\n"
         "  plot 'peak.dat' using 2:xtic(1) linecolor rgb '#4477aa'\n");
  script("tradeoff",
         "  set title 'Peak memory against speed (red: the Pareto front)'\n  set xlabel 'samples/s'\n"
         "  set ylabel 'peak live MiB'\n  set grid\n  set key off\n  set yrange [0:*]\n"
         "  plot 'pareto.dat' using 2:3 with linespoints lw 2 pt 7 ps 1.6 linecolor rgb '#cc6677', \\\n"
         "       'tradeoff.dat' using 2:3 with points pt 7 ps 1.2 linecolor rgb '#4477aa', \\\n"
         "       'tradeoff.dat' using 2:3:1 with labels offset 0,0.9 noenhanced font ',9'\n");
  script("live_memory",
         "  set title 'Live memory over the first steps (from each run''s trace)'\n"
         "  set xlabel 'training step'\n  set ylabel 'live MiB'\n  set grid\n"
         "  set key outside right noenhanced\n  set yrange [0:*]\n  " +
             (live_plot.empty() ? std::string("plot 0 notitle") : live_plot) + "\n");
}

/// Runs gnuplot on the three scripts; false when it is absent or one fails.
bool draw_plots(const std::string& dir, spdlog::logger& log) {
  const std::string gnuplot = find_in_path("gnuplot");
  if (gnuplot.empty()) {
    log.warn("gnuplot not found (install gnuplot-nox): no plots drawn; the data files and "
             "scripts are in {}", dir);
    return false;
  }
  const std::string abs = fs::absolute(dir).string();
  bool all = true;
  for (const char* name : {"peak_memory", "tradeoff", "live_memory"}) {
    const int rc = spawn_wait(gnuplot, {std::string(name) + ".gp"},
                              (fs::path(abs) / (std::string(name) + ".log")).string(), abs);
    if (rc != 0) {
      log.warn("gnuplot {}.gp failed (exit {}); see {}/{}.log", name, rc, dir, name);
      all = false;
    }
  }
  return all;
}

std::string command_line(const AblateArgs& a, int64_t steps, int64_t repeats) {
  std::string c = "frugal ablate " + a.config + " --out " + a.out;
  if (a.steps) c += " --steps " + std::to_string(steps);
  if (a.repeats) c += " --repeats " + std::to_string(repeats);
  for (const auto& s : a.sets) c += " --set " + s;
  return c;
}

}  // namespace frugal::cli
