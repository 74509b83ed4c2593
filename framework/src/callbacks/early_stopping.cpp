// Early stopping on a validation metric, and the metric monitor SaveBest shares.
#include "frugal/callbacks/early_stopping.h"

#include <cmath>

#include "frugal/base/error.h"
#include "frugal/core/learner.h"
#include "frugal/data/task.h"

namespace frugal {

MetricMonitor::MetricMonitor(std::string metric, double min_delta)
    : metric_(std::move(metric)), min_delta_(min_delta) {
  if (!(min_delta >= 0) || !std::isfinite(min_delta))
    throw_config_error("min_delta must be a finite number >= 0, got " + std::to_string(min_delta));
}

void MetricMonitor::check(const Task& task, const std::string& key) const {
  const std::string own = task.metric(MetricSums{}).name;
  // A regression scores no argmax hits: it has no accuracy to watch.
  const bool has_accuracy = task.kind != TaskKind::Regression;
  if (metric_ == "valid_loss" || (metric_ == "accuracy" && has_accuracy) || metric_ == own) return;
  throw_config_error((key.empty() ? "" : key + " = ") + "\"" + metric_ + "\": this " + task.name() +
                     " run's validation gives \"valid_loss\", " +
                     (has_accuracy ? "\"accuracy\" " : "") + "and its own metric \"" + own + "\"");
}

double MetricMonitor::value(const Task& task, const MetricSums& s) const {
  if (metric_ == "valid_loss") return s.mean_loss();
  if (metric_ == "accuracy") return s.accuracy();
  return task.metric(s).value;
}

bool MetricMonitor::higher_is_better(const Task& task) const {
  if (metric_ == "valid_loss") return false;
  if (metric_ == "accuracy") return true;
  return task.metric(MetricSums{}).higher_is_better;
}

bool MetricMonitor::improves(const Task& task, double value, bool have_best, double best) const {
  if (!std::isfinite(value)) return false;  // a diverged validation is never the best
  if (!have_best) return true;
  return higher_is_better(task) ? value > best + min_delta_ : value < best - min_delta_;
}

// ---------------------------------------------------------------- the callback

EarlyStopping::EarlyStopping(MetricMonitor monitor, int64_t patience)
    : monitor_(std::move(monitor)), patience_(patience) {
  if (patience < 1)
    throw_config_error("early stopping: patience must be >= 1 validations, got " +
                       std::to_string(patience));
}

void EarlyStopping::before_fit(Learner& l) {
  monitor_.check(l.task(), "early stopping metric");
  if (!l.valid_data())
    throw_config_error("early stopping on \"" + monitor_.metric() + "\" needs validation data; "
                       "this learner has none");
  in_epoch_ = has_best_ = stopped_ = false;
  wait_ = epochs_ = best_epoch_ = 0;
}

void EarlyStopping::after_validate(Learner& l) {
  if (!in_epoch_) return;  // a validate() called outside the fit's epochs
  ++epochs_;
  const double v = monitor_.value(l.task(), l.valid_sums());
  if (monitor_.improves(l.task(), v, has_best_, best_)) {
    has_best_ = true;
    best_ = v;
    best_epoch_ = epochs_;
    wait_ = 0;
  } else {
    ++wait_;
  }
  // The sums are reduced across ranks, so every rank decides the same; agreed all the same.
  if (l.collective().any(wait_ >= patience_) && !stopped_) {
    stopped_ = true;
    l.stop_fit();
  }
}

nlohmann::json EarlyStopping::record() const {
  nlohmann::json j = {{"metric", monitor_.metric()}, {"patience", patience_},
                      {"min_delta", monitor_.min_delta()}, {"stopped", stopped_},
                      {"validations", epochs_}};
  if (has_best_) {
    j["best"] = best_;
    j["best_epoch"] = best_epoch_;
  }
  if (stopped_) j["stopped_epoch"] = epochs_;
  return j;
}

void EarlyStopping::save_state(torch::serialize::OutputArchive& a) const {
  a.write("has_best", c10::IValue(has_best_));
  a.write("best", c10::IValue(best_));
  a.write("wait", c10::IValue(wait_));
  a.write("epochs", c10::IValue(epochs_));
  a.write("best_epoch", c10::IValue(best_epoch_));
  a.write("stopped", c10::IValue(stopped_));
}

void EarlyStopping::load_state(Learner&, torch::serialize::InputArchive& a) {
  c10::IValue has_best, best, wait, epochs, best_epoch, stopped;
  if (!a.try_read("has_best", has_best) || !a.try_read("best", best) || !a.try_read("wait", wait) ||
      !a.try_read("epochs", epochs) || !a.try_read("best_epoch", best_epoch) ||
      !a.try_read("stopped", stopped))
    throw CheckpointError("the checkpoint holds no early-stopping state");
  has_best_ = has_best.toBool();
  best_ = best.toDouble();
  wait_ = wait.toInt();
  epochs_ = epochs.toInt();
  best_epoch_ = best_epoch.toInt();
  stopped_ = stopped.toBool();
}

}  // namespace frugal
