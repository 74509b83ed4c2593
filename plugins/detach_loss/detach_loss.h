#pragma once
/// detach_loss: once backward has run, the Learner's loss and prediction are swapped for
/// detached tensors, so a callback that keeps them (a history, a metric) keeps numbers, not the
/// autograd graph (Composer's FreeOutputs; tip 7 of "17 PyTorch memory saving techniques").
/// And a leak watch: after warm-up, the live bytes at the end of each batch should be flat
/// (fastai: from the second batch on memory is constant); steady growth over a window is
/// reported with the bytes per batch and the callbacks that hold memory.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>

namespace frugal::detach_loss {

/// The leak watch's arithmetic: live bytes sampled once per batch, in windows of `window`
/// samples after `warmup` ignored ones. A window is a leak when its least-squares slope is
/// above `threshold` bytes per batch and the bytes grew in at least two and a third of its steps
/// (one jump, a cache filled once, is not a leak; a leak grows batch after batch).
class LeakWatch {
 public:
  LeakWatch(int64_t warmup, int64_t window, double threshold);

  /// Starts over: the next `warmup` samples are ignored (a new stage: new sizes, new optimizer).
  void reset();

  /// One sample. Returns the window's growth in bytes per batch when this sample closes a window
  /// that is a leak; nullopt otherwise.
  std::optional<double> add(int64_t bytes);

  /// Least-squares slope of v against 0, 1, 2, ...: bytes per batch.
  static double slope(const std::vector<int64_t>& v);

  double last_growth() const { return last_growth_; }  ///< of the last closed window
  int64_t windows() const { return windows_; }          ///< windows closed
  int64_t leaks() const { return leaks_; }              ///< of them, leaks
  int64_t window() const { return window_; }
  /// Samples in the open window (0: the next sample after warm-up opens one).
  int64_t pending() const { return static_cast<int64_t>(samples_.size()); }

 private:
  int64_t warmup_, window_;
  double threshold_;
  int64_t seen_ = 0;
  std::vector<int64_t> samples_;
  double last_growth_ = 0;
  int64_t windows_ = 0, leaks_ = 0;
};

/// [plugins.detach_loss]: TOML keys are the field names.
struct DetachLossOptions : frugal::Options {
  bool detach = true;
  bool watch = true;
  int64_t warmup = 2;
  int64_t window = 8;
  frugal::ByteSize threshold{1024};  ///< default "1KiB"
  int64_t max_warnings = 3;
  void visit(frugal::FieldVisitor& v) override;
};

/// The callback. Order order::kOutputRelease: after_* events run in descending order, so its
/// after_backward and after_batch run before every plugin's and they all see detached tensors
/// (only the progress log, order::kProgress, runs earlier).
class DetachLoss : public frugal::Callback {
 public:
  DetachLoss(const DetachLossOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "detach_loss"; }
  int order() const override { return frugal::order::kOutputRelease; }

  void before_fit(frugal::Learner&) override;
  void before_stage(frugal::Learner&) override;
  /// The graph is spent (its saved tensors are freed); what is left of it is let go.
  void after_backward(frugal::Learner& l) override;
  /// Also a batch skipped before backward: its graph still holds every saved activation.
  void after_batch(frugal::Learner& l) override;
  void after_fit(frugal::Learner&) override;

  /// The leak watch and the largest growth it reported (bytes per batch), for tests and tools.
  const LeakWatch& watch() const { return watch_; }
  double largest_growth() const { return growth_; }

 private:
  static void detach(frugal::Learner& l);
  std::vector<std::pair<std::string, int64_t>> held(frugal::Learner& l) const;

  DetachLossOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t threshold_;
  LeakWatch watch_;
  int64_t warnings_ = 0;
  double growth_ = 0;
  std::vector<std::pair<std::string, int64_t>> held_at_start_;
};

}  // namespace frugal::detach_loss
