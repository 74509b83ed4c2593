#pragma once
// auto_purge's testable part: the stage-transition contract. After a purge, live memory should
// be what the next stage starts from — parameters and buffers, the datasets held in memory,
// what the user asked to keep — within a tolerance; whatever is over it is attributed.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <frugal/memory.h>

namespace frugal::auto_purge {

/// What was live right after a purge, and what was allowed to be.
struct Residual {
  int64_t live = 0;
  int64_t parameters = 0;      ///< parameters and buffers
  int64_t data = 0;            ///< the datasets held in (the meter's) memory
  int64_t kept_optimizer = 0;  ///< optimizer state kept on purpose (clear_opt = false)
  int64_t keep = 0;            ///< the `keep` option
  int64_t tolerance = 0;
  // what still holds memory, for the warning
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  std::vector<std::pair<std::string, int64_t>> callbacks;  ///< held_bytes() > 0

  /// The baseline the contract promises.
  int64_t allowed() const { return parameters + data + kept_optimizer + keep; }
  /// Live bytes over the baseline (negative when under it).
  int64_t over() const { return live - allowed(); }
  bool ok() const { return over() <= tolerance; }
  /// Bytes over the baseline that no category explains.
  int64_t other() const {
    int64_t known = gradients + (optimizer_state - kept_optimizer);
    for (const auto& c : callbacks) known += c.second;
    return std::max<int64_t>(0, over() - known);
  }
};

/// "live 1.2 MiB = parameters 1.0 MiB + data 200 KiB + 12 B": one line for the log.
inline std::string summary(const Residual& r) {
  std::string s = "live " + format_bytes(r.live) + " = parameters and buffers " +
                  format_bytes(r.parameters) + " + data " + format_bytes(r.data);
  if (r.kept_optimizer) s += " + kept optimizer state " + format_bytes(r.kept_optimizer);
  if (r.keep) s += " + keep " + format_bytes(r.keep);
  const int64_t over = r.over();
  s += over >= 0 ? " + " + format_bytes(over) : " - " + format_bytes(-over);
  return s;
}

/// The warning when the contract does not hold: how much is over, and what holds it.
inline std::string explain(const Residual& r, const std::string& where) {
  std::string s = "after the purge at " + where + ", live memory is " + format_bytes(r.over()) +
                  " over the stage baseline (" + summary(r) + "; tolerance " +
                  format_bytes(r.tolerance) + "). Still held:";
  std::string held;
  auto add = [&](const std::string& what, int64_t bytes) {
    if (bytes > 0) held += (held.empty() ? " " : ", ") + what + " " + format_bytes(bytes);
  };
  add("gradients", r.gradients);
  add("optimizer state", r.optimizer_state - r.kept_optimizer);
  for (const auto& [name, bytes] : r.callbacks) add("callback '" + name + "'", bytes);
  add("other (not attributed: tensors kept outside the Learner)", r.other());
  if (held.empty()) held = " nothing attributable";
  return s + held + ". Raise plugins.auto_purge.keep if this is meant to stay";
}

}  // namespace frugal::auto_purge
