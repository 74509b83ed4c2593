#pragma once
// `frugal lr_find`: fastai's learning-rate finder. CLI-internal.
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/logger.h>

namespace frugal::cli {

struct LrFindArgs {
  std::string config;
  std::vector<std::string> sets;
  double start_lr = 1e-7;
  double end_lr = 10.0;
  int64_t num_it = 100;
  std::string out;  ///< "" = <run.out_dir>/lr_find
};

CLI::App* add_lr_find_command(CLI::App& app, LrFindArgs& a);
/// Sweeps the learning rate exponentially from start_lr to end_lr over num_it batches of the
/// config's first stage (stopping once the smoothed loss passes 4x its minimum), writes
/// lr_find.csv and its plot, and prints fastai's "valley" suggestion. Exit code 0.
int run_lr_find(const LrFindArgs& a, spdlog::logger& log);

/// fastai's valley: the index, into `losses`, half-way into the longest run of losses each below
/// an earlier one (start + len/3 + len/6). 0 for fewer than 2 losses.
size_t valley_index(const std::vector<double>& losses);

}  // namespace frugal::cli
