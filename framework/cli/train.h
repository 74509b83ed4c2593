#pragma once
// `frugal train`: a run in its folder (lock, earlier results, --resume, --resume auto), the
// fit, a clean stop on a signal, the report. CLI-internal.
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/logger.h>

namespace frugal::cli {

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  std::string resume;  ///< "", "auto", or a run folder or checkpoint file
  bool overwrite = false;
  int nproc = 0;                  ///< --nproc N: start N local ranks (0 = this process alone)
  std::vector<std::string> argv;  ///< the command line, for the ranks --nproc starts
};

/// Adds `train` with its arguments and options.
CLI::App* add_train_command(CLI::App& app, TrainArgs& a);
/// Returns the exit code: 0, 1 (an error), kExitInterrupted (75: stopped by a signal,
/// checkpoint written; run it again with --resume).
int run_train(const TrainArgs& a, const std::shared_ptr<spdlog::logger>& log);

}  // namespace frugal::cli
