#pragma once
// `frugal lr_find`: fastai's learning-rate finder. CLI-internal.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
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
/// lr_find.csv and its plot, and prints fastai's "valley" suggestion (suggested_index; over the
/// whole sweep, with a warning, when it is too short for fastai's points). Exit code 0.
int run_lr_find(const LrFindArgs& a, spdlog::logger& log);

// The suggestion's arithmetic is defined here, inline: the test binary links the library, not
// the CLI's objects, and checks it against fastai's numbers (tests/framework/test_history.cpp).

/// fastai's `valley` (fastai/callback/schedule.py), over every point it is given: the longest
/// valley (the longest run of losses each below an earlier one, found as a longest decreasing
/// subsequence, lds) ends at max_end, and max_start = max_end - lds[max_end]; the suggestion is
/// max_start + int(len / 3) + int(len / 6) with len = max_end - max_start, about 2/3 into it. An
/// index of -1 (a valley of the first two points only) is Python's last point, as there. 0 for
/// no loss.
inline size_t valley_index(const std::vector<double>& losses) {
  const auto n = static_cast<int64_t>(losses.size());
  if (n == 0) return 0;
  std::vector<int64_t> lds(static_cast<size_t>(n), 1);
  int64_t max_start = 0, max_end = 0;  // signed: max_start is -1 for a valley from the first point
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) {
      if (losses[i] < losses[j] && lds[i] < lds[j] + 1) lds[i] = lds[j] + 1;
      if (lds[max_end] < lds[i]) {
        max_end = i;
        max_start = max_end - lds[max_end];
      }
    }
  }
  const double sections = static_cast<double>(max_end - max_start) / 3.0;
  const int64_t idx = max_start + static_cast<int64_t>(sections) + static_cast<int64_t>(sections / 2.0);
  return static_cast<size_t>(idx < 0 ? n + idx : idx);
}

/// The points of a sweep fastai's lr_find hands its suggestions: [num_it / 10, size - 5) (the
/// first tenth of the requested sweep, where the loss has not moved yet, and the last 5 points,
/// where it runs away), ended before the first NaN loss. begin == end when none is left.
struct SuggestionPoints {
  size_t begin = 0, end = 0;
};
inline SuggestionPoints suggestion_points(const std::vector<double>& losses, int64_t num_it) {
  SuggestionPoints p;
  p.begin = static_cast<size_t>(std::max<int64_t>(0, num_it / 10));
  p.end = std::max(p.begin, losses.size() > 5 ? losses.size() - 5 : size_t{0});
  for (size_t i = p.begin; i < p.end; ++i) {
    if (std::isnan(losses[i])) {
      p.end = i;
      break;
    }
  }
  return p;
}

/// The index, into the whole sweep, of fastai's valley over its suggestion points; nullopt when
/// the sweep is too short to have any (fastai fails there).
inline std::optional<size_t> suggested_index(const std::vector<double>& losses, int64_t num_it) {
  const SuggestionPoints p = suggestion_points(losses, num_it);
  if (p.begin >= p.end) return std::nullopt;
  const auto first = losses.begin() + static_cast<std::ptrdiff_t>(p.begin);
  const std::vector<double> kept(first, first + static_cast<std::ptrdiff_t>(p.end - p.begin));
  return p.begin + valley_index(kept);
}

}  // namespace frugal::cli
