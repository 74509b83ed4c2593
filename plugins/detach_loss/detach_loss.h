#pragma once
/// detach_loss: once backward has run, the Learner's loss and prediction are swapped for
/// detached tensors, so a callback that keeps them (a history, a metric) keeps numbers, not the
/// autograd graph (Composer's FreeOutputs; tip 7 of "17 PyTorch memory saving techniques").
/// And a leak watch: after warm-up, the live bytes at the end of each batch should be flat
/// (fastai: from the second batch on memory is constant); steady growth over a window is
/// reported with the bytes per batch and the callbacks that hold memory. Header-only so tests
/// reach the same code.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <frugal/error.h>
#include <frugal/learner.h>
#include <frugal/memory.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

namespace frugal::detach_loss {

/// The leak watch's arithmetic: live bytes sampled once per batch, in windows of `window`
/// samples after `warmup` ignored ones. A window is a leak when its least-squares slope is
/// above `threshold` bytes per batch and the bytes grew in at least two and a third of its steps
/// (one jump, a cache filled once, is not a leak; a leak grows batch after batch).
class LeakWatch {
 public:
  LeakWatch(int64_t warmup, int64_t window, double threshold)
      : warmup_(warmup), window_(std::max<int64_t>(2, window)), threshold_(threshold) {}

  /// Starts over: the next `warmup` samples are ignored (a new stage: new sizes, new optimizer).
  void reset() {
    seen_ = 0;
    samples_.clear();
  }

  /// One sample. Returns the window's growth in bytes per batch when this sample closes a window
  /// that is a leak; nullopt otherwise.
  std::optional<double> add(int64_t bytes) {
    if (seen_++ < warmup_) return std::nullopt;
    samples_.push_back(bytes);
    if (static_cast<int64_t>(samples_.size()) < window_) return std::nullopt;
    last_growth_ = slope(samples_);
    int64_t grew = 0;
    for (size_t i = 1; i < samples_.size(); ++i) grew += samples_[i] > samples_[i - 1] ? 1 : 0;
    ++windows_;
    // A leak in every other batch (kept graphs of skipped batches) still counts; a single jump
    // does not.
    const bool leak = last_growth_ > threshold_ && grew >= 2 && 3 * grew >= window_ - 1;
    samples_.clear();
    if (!leak) return std::nullopt;
    ++leaks_;
    return last_growth_;
  }

  /// Least-squares slope of v against 0, 1, 2, ...: bytes per batch.
  static double slope(const std::vector<int64_t>& v) {
    const auto n = static_cast<double>(v.size());
    if (v.size() < 2) return 0;
    const double mean_x = (n - 1) / 2;
    double mean_y = 0;
    for (auto b : v) mean_y += static_cast<double>(b);
    mean_y /= n;
    double sxy = 0, sxx = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      const double dx = static_cast<double>(i) - mean_x;
      sxy += dx * (static_cast<double>(v[i]) - mean_y);
      sxx += dx * dx;
    }
    return sxy / sxx;
  }

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

struct DetachLossOptions : frugal::Options {
  bool detach = true;
  bool watch = true;
  int64_t warmup = 2;
  int64_t window = 8;
  frugal::ByteSize threshold{1024};  ///< default "1KiB"
  int64_t max_warnings = 3;
  void visit(frugal::FieldVisitor& v) override {
    v.field("detach", detach,
            "replace the loss and prediction by detached tensors after backward and at the end "
            "of each batch");
    // The watch only reports: its keys do not change what the run computes.
    v.field("watch", watch,
            frugal::outside_training("watch the live bytes at the end of each batch for steady "
                                     "growth"));
    v.field("warmup", warmup,
            frugal::outside_training("batches of each stage not watched (caches, optimizer "
                                     "state)"),
            frugal::at_least(0));
    v.field("window", window, frugal::outside_training("batches per watched window"),
            frugal::at_least(2));
    v.field("threshold", threshold,
            frugal::outside_training("growth per batch over a window that is reported as a "
                                     "leak (\"1KiB\", \"512\")"));
    v.field("max_warnings", max_warnings,
            frugal::outside_training("leak warnings per fit; a summary comes at the end"),
            frugal::at_least(0));
  }
};

/// The callback. Order 1000: after_* events run in descending order, so its after_backward and
/// after_batch run before every other callback's and they all see detached tensors.
class DetachLoss : public frugal::Callback {
 public:
  DetachLoss(const DetachLossOptions& o, const frugal::PluginContext& ctx)
      : o_(o),
        log_(ctx.logger),
        threshold_(o.threshold.bytes),
        watch_(o.warmup, o.window, static_cast<double>(threshold_)) {}
  std::string name() const override { return "detach_loss"; }
  int order() const override { return 1000; }

  void before_fit(frugal::Learner&) override {
    watch_ = LeakWatch(o_.warmup, o_.window, static_cast<double>(threshold_));
    warnings_ = 0;
    growth_ = 0;
  }
  void before_stage(frugal::Learner&) override {
    watch_.reset();
    held_at_start_.clear();
  }
  /// The graph is spent (its saved tensors are freed); what is left of it is let go.
  void after_backward(frugal::Learner& l) override {
    if (o_.detach) detach(l);
  }
  /// Also a batch skipped before backward: its graph still holds every saved activation.
  void after_batch(frugal::Learner& l) override {
    if (o_.detach) detach(l);
    if (!o_.watch || !l.training()) return;
    if (watch_.pending() == 0) held_at_start_ = held(l);  // this sample may open a window
    const auto leak = watch_.add(l.memory().current());
    if (!leak) return;
    growth_ = std::max(growth_, *leak);
    if (warnings_++ >= o_.max_warnings) return;
    std::string who;
    const auto now = held(l);
    for (size_t i = 0; i < now.size(); ++i) {
      const int64_t before = i < held_at_start_.size() ? held_at_start_[i].second : 0;
      if (now[i].second > 0)
        who += (who.empty() ? "" : ", ") + now[i].first + " holds " +
               format_bytes(now[i].second) + " (+" + format_bytes(now[i].second - before) +
               " in the window)";
    }
    log_->warn("live memory grows {} per batch over batches {}-{} of stage '{}' (live {}); {}",
               format_bytes(static_cast<int64_t>(*leak)), l.batch_index() + 2 - watch_.window(),
               l.batch_index() + 1, l.stage().name, format_bytes(l.memory().current()),
               who.empty() ? "no callback reports held bytes: a tensor kept across batches (a "
                             "loss or prediction with its graph, a history) is the usual cause"
                           : "callbacks holding memory: " + who);
  }
  void after_fit(frugal::Learner&) override {
    if (!o_.watch) return;
    if (watch_.leaks() > 0)
      log_->warn("{} of {} watched windows grew (largest {} per batch)", watch_.leaks(),
                 watch_.windows(), format_bytes(static_cast<int64_t>(growth_)));
    else
      log_->info("leak watch: live memory flat in all {} windows of {} batches", watch_.windows(),
                 watch_.window());
  }

  /// The leak watch and the largest growth it reported (bytes per batch), for tests and tools.
  const LeakWatch& watch() const { return watch_; }
  double largest_growth() const { return growth_; }

 private:
  static void detach(frugal::Learner& l) {
    if (l.loss().defined() && l.loss().requires_grad()) l.loss() = l.loss().detach();
    if (l.pred().defined() && l.pred().requires_grad()) l.pred() = l.pred().detach();
  }
  std::vector<std::pair<std::string, int64_t>> held(frugal::Learner& l) const {
    std::vector<std::pair<std::string, int64_t>> out;
    for (const auto& cb : l.callbacks()) out.emplace_back(cb->name(), cb->held_bytes());
    return out;
  }

  DetachLossOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t threshold_;
  LeakWatch watch_;
  int64_t warnings_ = 0;
  double growth_ = 0;
  std::vector<std::pair<std::string, int64_t>> held_at_start_;
};

}  // namespace frugal::detach_loss
