// detach_loss: the loss and prediction detached once backward has run, and a watch for live
// memory that grows batch after batch.
#include "detach_loss.h"

#include <algorithm>

#include <frugal/base/error.h>
#include <frugal/memory/memory.h>

namespace frugal::detach_loss {

LeakWatch::LeakWatch(int64_t warmup, int64_t window, double threshold)
    : warmup_(warmup), window_(std::max<int64_t>(2, window)), threshold_(threshold) {}

void LeakWatch::reset() {
  seen_ = 0;
  samples_.clear();
}

std::optional<double> LeakWatch::add(int64_t bytes) {
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

double LeakWatch::slope(const std::vector<int64_t>& v) {
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

// ---- the plugin ---------------------------------------------------------------------------

void DetachLossOptions::visit(frugal::FieldVisitor& v) {
  v.field("detach", detach,
          "replace the loss and prediction by detached tensors after backward and at the end "
          "of each batch");
  // The watch only reports: its keys do not change what the run computes.
  v.field("watch", watch,
          frugal::outside_training("watch the live bytes at the end of each batch for steady "
                                   "growth"));
  v.field("warmup", warmup,
          frugal::outside_training("batches of each stage not watched (caches, optimizer state)"),
          frugal::at_least(0));
  v.field("window", window, frugal::outside_training("batches per watched window"),
          frugal::at_least(2));
  v.field("threshold", threshold,
          frugal::outside_training("growth per batch over a window that is reported as a leak "
                                   "(\"1KiB\", \"512\")"));
  v.field("max_warnings", max_warnings,
          frugal::outside_training("leak warnings per fit; a summary comes at the end"),
          frugal::at_least(0));
}

DetachLoss::DetachLoss(const DetachLossOptions& o, const frugal::PluginContext& ctx)
    : o_(o),
      log_(ctx.logger),
      threshold_(o.threshold.bytes),
      watch_(o.warmup, o.window, static_cast<double>(threshold_)) {}

void DetachLoss::before_fit(frugal::Learner&) {
  watch_ = LeakWatch(o_.warmup, o_.window, static_cast<double>(threshold_));
  warnings_ = 0;
  growth_ = 0;
}

void DetachLoss::before_stage(frugal::Learner&) {
  watch_.reset();
  held_at_start_.clear();
}

void DetachLoss::after_backward(frugal::Learner& l) {
  if (o_.detach) detach(l);
}

void DetachLoss::after_batch(frugal::Learner& l) {
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

void DetachLoss::after_fit(frugal::Learner&) {
  if (!o_.watch) return;
  if (watch_.leaks() > 0)
    log_->warn("{} of {} watched windows grew (largest {} per batch)", watch_.leaks(),
               watch_.windows(), format_bytes(static_cast<int64_t>(growth_)));
  else
    log_->info("leak watch: live memory flat in all {} windows of {} batches", watch_.windows(),
               watch_.window());
}

void DetachLoss::detach(frugal::Learner& l) {
  if (l.loss().defined() && l.loss().requires_grad()) l.loss() = l.loss().detach();
  if (l.pred().defined() && l.pred().requires_grad()) l.pred() = l.pred().detach();
}

std::vector<std::pair<std::string, int64_t>> DetachLoss::held(frugal::Learner& l) const {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& cb : l.callbacks()) out.emplace_back(cb->name(), cb->held_bytes());
  return out;
}

}  // namespace frugal::detach_loss

FRUGAL_PLUGIN(frugal::detach_loss::DetachLoss, frugal::detach_loss::DetachLossOptions,
              "detach_loss",
              "detaches loss and prediction after backward; warns when live memory grows per batch",
              "1.0.0")
