#pragma once
/// A timeline of the fit as a Chrome-trace JSON file (opens in Perfetto or chrome://tracing):
/// one span ("X" event) per batch and per phase (forward with the loss, backward, step,
/// validate) with the phase's peak live bytes, and a "live memory" counter ("C" events)
/// sampled at every phase boundary. Switched on by `[run] trace = "path"`.
///
/// Cheap by construction: each hook reads the clock and MemoryMeter::current() and pushes one
/// fixed-size record into a vector reserved up front; the JSON is formatted once, at after_fit
/// (or, when the fit throws, when the callback is destroyed).
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "frugal/core/callback.h"

namespace frugal {

class TraceCallback : public Callback {
 public:
  /// What a record is: a span of one kind, or a counter sample.
  enum class Kind : uint8_t { Batch, Forward, Backward, Step, Validate, Counter };
  struct Record {
    int64_t start_ns = 0;  ///< since before_fit
    int64_t dur_ns = 0;    ///< spans only
    int64_t bytes = 0;     ///< live bytes (counter) or the span's peak live bytes
    int64_t step = 0;      ///< the fit's batch index (iteration)
    Kind kind = Kind::Counter;
  };

  /// `path`: the JSON file written at after_fit. `reserve`: records preallocated.
  explicit TraceCallback(std::string path, size_t reserve = 1 << 15);
  ~TraceCallback() override;

  std::string name() const override { return "trace"; }
  /// First in before_* events and last in after_* events: spans include the plugins' hooks.
  int order() const override { return order::kTrace; }

  void before_fit(Learner& l) override;
  void before_batch(Learner& l) override;
  void before_forward(Learner& l) override;
  void after_loss(Learner& l) override;
  void before_backward(Learner& l) override;
  void after_backward(Learner& l) override;
  void before_step(Learner& l) override;
  void after_batch(Learner& l) override;
  void before_validate(Learner& l) override;
  void after_validate(Learner& l) override;
  void after_fit(Learner& l) override;

  const std::vector<Record>& records() const { return records_; }
  /// Writes the JSON atomically now. Throws Error when the file cannot be written.
  void write();
  bool written() const { return written_; }
  /// The Chrome-trace JSON text of the records.
  std::string json() const;

 private:
  using Clock = std::chrono::steady_clock;
  int64_t now_ns() const;
  void sample(int64_t t, int64_t step);
  void open(Kind k, int64_t step);
  /// Ends the span of kind k; a phase's span takes `phase_peak` (a batch's, its phases' highest).
  void close(Kind k, int64_t phase_peak = 0);

  std::string path_;
  std::vector<Record> records_;
  Clock::time_point t0_;
  bool started_ = false, written_ = false;
  /// Open spans by kind: start time, step; -1 = not open.
  int64_t open_start_[5] = {-1, -1, -1, -1, -1};
  int64_t open_step_[5] = {0, 0, 0, 0, 0};
};

}  // namespace frugal
