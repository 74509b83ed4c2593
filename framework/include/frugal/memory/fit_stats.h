#pragma once
/// What a fit measured (per stage and for the whole fit) and where it stands. The Learner fills
/// a FitStats as it runs; its report() is the run report's "fit" object.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "frugal/memory/memory.h"

namespace frugal {

/// What a stage measured; the run report holds one per stage.
struct StageStats {
  std::string name;
  int64_t peak_bytes = 0;
  std::array<int64_t, 4> phase_peaks{};  ///< per Phase
  MemoryBreakdown steady;                ///< measured on the stage's third step (or its last)
  bool steady_measured = false;
  std::vector<double> step_seconds;      ///< wall time of each training batch
  int64_t samples = 0;
  double train_seconds = 0;
  double last_epoch_loss = 0;            ///< mean training loss of the stage's last epoch
  double valid_accuracy = -1;            ///< after the stage's last epoch; -1 = not validated
  double valid_loss = -1;                ///< its mean cross-entropy per target element (nats)
};

/// Where a fit continues: the next batch to run. `epoch` may equal the stage's epochs (only
/// after_stage is left) and `batch` the epoch's batch count (validation and after_epoch are
/// left).
struct FitPosition {
  int64_t stage = 0, epoch = 0, batch = 0;
  int64_t data_epoch = 0;  ///< the DataLoader epoch (its order's seed offset) of `epoch`
  int64_t iteration = 0, steps = 0;
  bool stop_epoch = false, stop_fit = false;  ///< flags set by the batch before the position
  bool done = false;                          ///< the fit ended: nothing is left to run
};

/// What one training batch's memory looked like, for the steady-state breakdown.
struct BatchMemory {
  int64_t live_before_forward = 0;  ///< live bytes when the batch's first forward began
  int64_t forward_peak = 0;  ///< highest live bytes of its forwards, as if from live_before_forward
  int64_t gradients = 0;     ///< gradient bytes after its last backward
};

/// The bytes a steady batch holds by kind: parameters, gradients, optimizer state, data and
/// what callbacks hold (their held_bytes()) as given, activations = what the forward added,
/// other = what was live before the forward and is none of parameters, optimizer state, data
/// and callbacks' (the batch, caches).
MemoryBreakdown steady_breakdown(const BatchMemory& b, int64_t parameters, int64_t optimizer_state,
                                 int64_t data, int64_t callbacks = 0);

/// The q-quantile (0..1) of `v` by linear interpolation; 0 for an empty `v`.
double percentile(std::vector<double> v, double q);

/// One fit's statistics: a StageStats per stage, the fit's phase peaks, the steady state.
class FitStats {
 public:
  /// A new fit: `resumed` holds the statistics a checkpoint saved (empty for a fresh fit).
  void start(std::vector<StageStats> resumed = {});
  /// Stage `index` begins: its statistics continue (resumed) or start under `name`.
  void begin_stage(size_t index, const std::string& name);
  /// The current stage's statistics (the last begun).
  StageStats& stage() { return stages_.back(); }
  const std::vector<StageStats>& stages() const { return stages_; }

  /// Highest bytes of a phase, for the fit and the current stage.
  void note_phase_peak(Phase p, int64_t bytes);
  /// The stage's peak: the highest of what it saw so far and `bytes`.
  void note_stage_peak(int64_t bytes);

  /// Whether the current stage still wants a steady-state measurement.
  bool wants_steady() const { return !stages_.empty() && !stages_.back().steady_measured; }
  /// A batch's breakdown: the stage's third batch (stage_batch 2) or later is its steady
  /// state; an earlier one is kept in case the stage ends first.
  void offer_steady(const MemoryBreakdown& m, int64_t stage_batch);
  /// An epoch ended: a stage still without a steady state takes its last batch's.
  void end_epoch();

  /// The last epoch's mean training loss of the last stage that trained (0 when none did).
  double final_loss() const;
  /// The "fit" object of the run report (without "oom"): per stage and for the whole fit; the
  /// first `warmup` batches of a stage are left out of its step times.
  nlohmann::json report(int64_t warmup, int64_t iterations, int64_t steps,
                        double valid_accuracy) const;

 private:
  std::vector<StageStats> stages_;
  std::array<int64_t, 4> phase_peaks_{};  // the fit's, per Phase
  bool last_valid_ = false;               // last_ holds the stage's last measured batch
  MemoryBreakdown last_;
};

}  // namespace frugal
