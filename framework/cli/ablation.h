#pragma once
// `frugal ablate` and `frugal plan`: what both commands share (the techniques of a config,
// runs of `frugal train` in their own processes, reading their reports). CLI-internal.
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "frugal/config/config.h"

namespace frugal::cli {

/// The config `frugal ablate` or `plan` reads in its own process: the plugins it turns on
/// register first (the config may name an optimizer one adds), no callback is made.
Config load_base_config(const std::string& config, const std::vector<std::string>& sets);

/// The plugins an ablation varies and the ones always on, checked against the installed
/// plugins (a ConfigError naming the key and file:line when one is not installed).
struct TechniqueSet {
  std::vector<std::string> baseline;
  std::vector<std::string> techniques;
};
TechniqueSet resolve_techniques(const Config& cfg);

/// One `frugal train` run in its own process, so that allocator caches and peaks do not carry
/// over: the config, the overrides every run gets, then `plugins.<t>.enabled` for each
/// technique (on when listed in `on`) and the run's own `run.*` keys.
struct ChildRun {
  std::string name;                ///< "baseline", "amp", "all", "all-but-amp", ...
  std::vector<std::string> on;     ///< techniques on (baseline plugins are always on)
  std::vector<std::string> extra;  ///< further overrides of this run (e.g. data.batch_size)
};

/// What a finished run gave.
struct ChildResult {
  int exit_code = -1;
  std::string error;    ///< the report's error or the log's last line; "" when it worked
  double wall_seconds = 0;
  nlohmann::json report;  ///< report.json, null when the run wrote none
};

/// The overrides of a run: every technique on or off, baseline plugins on, then `extra`.
std::vector<std::string> run_overrides(const TechniqueSet& t, const ChildRun& r);

/// Checks every run's configuration in this process (plugin options, conflicts, the names the
/// config uses) before any run starts; errors name the run.
void check_runs(const std::string& config, const std::vector<std::string>& sets,
                const TechniqueSet& t, const std::vector<ChildRun>& runs);

/// This executable: /proc/self/exe, else argv[0].
std::string self_exe(const char* argv0);

/// Runs `exe args...` with stdout and stderr into `log_path`; waits; returns the exit code
/// (128 + signal when killed, -1 when it could not start). `cwd` empty = this one's.
int spawn_wait(const std::string& exe, const std::vector<std::string>& args,
               const std::string& log_path, const std::string& cwd = "");

/// Runs `frugal train` for `r` with its output in `dir` and reads its report.
ChildResult run_train_child(const std::string& exe, const std::string& config,
                            const std::vector<std::string>& sets, const TechniqueSet& t,
                            const ChildRun& r, const std::string& dir,
                            const std::vector<std::string>& run_keys, int nproc = 0);

/// "amp+checkpoint", or "none".
std::string join_on(const std::vector<std::string>& on, const char* sep = "+");
/// The CPU model, cores, load average, host: what a benchmark table must name.
nlohmann::json machine_info();
/// The full path of `name` in PATH, "" when absent.
std::string find_in_path(const std::string& name);
/// Median of values (0 for none).
double median(std::vector<double> v);

// ---- the commands ----
struct AblateArgs {
  std::string config, out = "runs/ablation";
  int64_t repeats = 0, steps = 0;  ///< 0 = from [ablation]
  std::vector<std::string> sets;
  int nproc = 0;  ///< each run on N data-parallel ranks (`frugal train --nproc N`)
};
CLI::App* add_ablate_command(CLI::App& app, AblateArgs& a);
int run_ablate(const AblateArgs& a, spdlog::logger& log, const char* argv0);

struct PlanArgs {
  std::string config, out = "runs/plan", budget;
  int64_t steps = 6;
  bool check_all = false;
  std::vector<std::string> sets;
  int nproc = 0;  ///< each run on N data-parallel ranks (`frugal train --nproc N`)
};
CLI::App* add_plan_command(CLI::App& app, PlanArgs& a);
int run_plan(const PlanArgs& a, spdlog::logger& log, const char* argv0);

/// ablate's plots (ablate_plots.cpp). A run's live bytes against its fractional step, from its
/// Chrome trace: (step, MiB) pairs.
std::vector<std::pair<double, double>> timeline(const std::string& trace_path);
/// peak_memory.gp, tradeoff.gp and live_memory.gp in `dir` (`live_plot`: the live curves).
void write_scripts(const std::string& dir, const std::string& live_plot);
/// Runs gnuplot on the three scripts; false when it is absent or one fails.
bool draw_plots(const std::string& dir, spdlog::logger& log);
/// The command that reproduces an ablation, for its report.
std::string command_line(const AblateArgs& a, int64_t steps, int64_t repeats);

}  // namespace frugal::cli
