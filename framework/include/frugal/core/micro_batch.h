#pragma once
/// Micro-batching and what the loop does when memory runs out: the micro-batch cap, the
/// decision after an out-of-memory error (retry at half the micro-batch, or stop with which
/// OomError), the records the report shows, and the micro-batch probe's search. Pure functions
/// and plain state: the Learner drives them; tests call them without one.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/base/error.h"
#include "frugal/config/sections.h"
#include "frugal/optim/optimizers.h"

namespace frugal {

/// What the loop does about memory (run.memory_budget, run.on_oom, run.oom_retries,
/// run.micro_batch).
struct OomPolicy {
  /// Bytes installed as the meter's budget while fit() runs (0 = leave the meter's budget).
  int64_t budget = 0;
  /// On an out-of-memory error in forward or backward: retry the batch with half the
  /// micro-batch (true), or stop with OomError (false).
  bool retry = false;
  /// Out-of-memory errors allowed on one batch before the fit stops with OomError.
  int64_t max_retries = 4;
  /// Before each stage, find_micro_batch(): the largest micro-batch that fits the budget.
  bool auto_micro_batch = false;
};

/// The micro-batch a batch of n samples runs in: min(n, size, cap), where size 0 is the whole
/// batch and cap 0 is no cap; at least 1.
int64_t effective_micro_batch(int64_t n, int64_t size, int64_t cap);

/// An out-of-memory error in a training batch's forward or backward, as the loop saw it.
struct OomEvent {
  OomError::Phase phase = OomError::Phase::Forward;  ///< Forward or Backward
  int64_t batch = 0, iteration = 0;     ///< the batch within its epoch, and within the fit
  int64_t micro_batch = 0;              ///< the micro-batch size that failed
  int64_t batch_samples = 0;            ///< the whole batch's samples
  int64_t failures = 0;                 ///< errors on this batch, this one included
  bool grads_at_start = false;  ///< gradients of earlier batches were held when the batch began
  int64_t budget = 0;           ///< the meter's budget (0 = none: the device's memory)
  std::string message;          ///< the allocator's message (its first line)
};
/// "backward of batch 3 (iteration 7, micro-batch 16 of 64 samples)".
std::string describe(const OomEvent& e);

/// A retry: the batch runs on at micro-batches of `to` instead of `from`.
struct OomRetry {
  int64_t iteration = 0;
  OomError::Phase phase = OomError::Phase::Forward;
  int64_t from = 0, to = 0;
  bool restarted = false;  ///< backward: the batch restarted at its first sample
};

/// What an out-of-memory error in forward or backward leads to under `policy`: a retry at half
/// the micro-batch (rounded up). Throws OomError (phase and iteration of `e`) when none applies:
/// the policy says fail; a backward while gradients of earlier batches were held (a failed
/// backward may have added part of the batch to them: the step cannot be retried exactly);
/// micro-batch 1 already; more than policy.max_retries errors on the batch.
OomRetry decide_oom_retry(const OomPolicy& policy, const OomEvent& e);

/// The OomError of a failed optimizer step (smaller micro-batches do not shrink it).
OomError oom_in_step(int64_t batch, int64_t iteration, const std::string& message);
/// The OomError of a training batch that could not be loaded.
OomError oom_loading(int64_t batch, int64_t batch_size, int64_t iteration,
                     const std::string& message);
/// The OomError of an event where no retry applies (a callback's hook, validation).
OomError oom_in_event(std::string_view event, int64_t iteration, const std::string& message);
/// The OomError of a budget below the bytes the learner holds before the first batch.
OomError oom_budget_below_live(int64_t budget, int64_t live, int64_t iteration);

/// What one probe (a forward and backward at one micro-batch size) measured.
struct ProbeResult {
  bool oom = false;
  int64_t peak = 0;            ///< live bytes at the highest point of forward and backward
  int64_t after_backward = 0;  ///< live bytes once backward is done (gradients held)
};
/// Whether a probe's micro-batch fits `budget` with room for the step: its peak with the
/// optimizer's state to come, and the live bytes after backward with the state and the step's
/// temporaries (plus a few bytes for the loop's own scalars).
bool probe_fits(const ProbeResult& r, const StepNeeds& needs, int64_t budget);

/// The largest micro-batch in [1, start] with fits(m), for a fits that holds up to some size
/// and not above: from `start` down by halves (rounded up) until one fits, then a binary search
/// between it and the smallest that did not. Each size is asked at most once.
struct ProbeSearch {
  int64_t size = 0;    ///< 0: not even 1 fits
  int64_t probes = 0;  ///< sizes asked
};
ProbeSearch largest_fitting(int64_t start, const std::function<bool(int64_t)>& fits);

/// The OomError of a probe that found nothing: not even one sample fits.
OomError oom_in_probe(int64_t budget, int64_t live, int64_t state_bytes, int64_t iteration);

/// The loop's micro-batch settings and what a fit recorded about memory.
class MicroBatching {
 public:
  /// A new fit: the cap, the count and the records start over (the size stays).
  void start_fit();
  /// Splits every batch into micro-batches of at most n samples (0 = whole batch).
  void set_size(int64_t n);
  int64_t size() const { return size_; }
  /// The largest micro-batch the loop runs (0 = no cap).
  void set_cap(int64_t n);
  int64_t cap() const { return cap_; }
  int64_t effective(int64_t n) const { return effective_micro_batch(n, size_, cap_); }

  /// An out-of-memory error was caught.
  void count_oom() { ++oom_count_; }
  int64_t oom_count() const { return oom_count_; }
  /// A retry: lowers the cap to r.to and records it (the first 100 retries are kept).
  void retried(const OomRetry& r);
  /// The micro-batch the last training batch ran at.
  void ran_at(int64_t m) { last_ = m; }
  /// find_micro_batch's answer for a stage.
  void probed(const std::string& stage, int64_t m) { probed_.emplace_back(stage, m); }

  /// The report's "oom" object: the policy, the count, the last micro-batch, the retries and
  /// the probe's answers.
  nlohmann::json report(const OomPolicy& policy) const;

 private:
  int64_t size_ = 0, cap_ = 0, last_ = 0, oom_count_ = 0;
  std::vector<OomRetry> retries_;
  std::vector<std::pair<std::string, int64_t>> probed_;
};

}  // namespace frugal
