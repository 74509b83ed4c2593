#pragma once
/// Watching a validation metric across epochs: MetricMonitor (what is better, by how much) and
/// EarlyStopping, the callback that ends a fit once the metric has not improved for `patience`
/// validations (Keras' and Lightning's EarlyStopping). From TOML: run.early_stopping = "<metric>"
/// with run.patience and run.min_delta; from C++:
///
///   learner.add_callback(std::make_shared<frugal::EarlyStopping>(
///       frugal::MetricMonitor("valid_loss", /*min_delta=*/1e-3), /*patience=*/3));
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "frugal/core/callback.h"

namespace frugal {

struct MetricSums;
struct Task;

/// One validation metric: "valid_loss" (lower is better), "accuracy" (higher is better), or the
/// name of the task's headline metric (Task::metric: its own direction). An improvement must
/// beat the best so far by more than min_delta.
class MetricMonitor {
 public:
  /// Throws ConfigError for a negative or non-finite min_delta.
  explicit MetricMonitor(std::string metric = "valid_loss", double min_delta = 0.0);
  /// Throws ConfigError naming `key` (e.g. "run.save_best"; "" = none) and the allowed names
  /// when `task` has no such metric.
  void check(const Task& task, const std::string& key) const;

  const std::string& metric() const { return metric_; }
  double min_delta() const { return min_delta_; }
  /// The metric of validation sums under `task`.
  double value(const Task& task, const MetricSums& s) const;
  bool higher_is_better(const Task& task) const;
  /// Whether `value` improves on `best` by more than min_delta (any value improves on none).
  bool improves(const Task& task, double value, bool have_best, double best) const;

 private:
  std::string metric_;
  double min_delta_;
};

/// Ends the fit (Learner::stop_fit) after `patience` consecutive validations inside the fit
/// without an improvement. Runs in after_validate of an epoch's validation, so the stopped
/// epoch's checkpoint (after_epoch) already records the stop. Data parallel: validation sums
/// are reduced across ranks, and the decision is agreed with one all-reduce, so all ranks stop
/// after the same epoch.
class EarlyStopping : public Callback {
 public:
  /// Throws ConfigError for patience < 1.
  EarlyStopping(MetricMonitor monitor, int64_t patience);
  std::string name() const override { return "early_stopping"; }
  int order() const override { return order::kEarlyStopping; }
  /// Checks the metric against the Learner's task, before any batch.
  void before_fit(Learner& l) override;
  void before_epoch(Learner&) override { in_epoch_ = true; }
  void after_validate(Learner& l) override;
  void after_epoch(Learner&) override { in_epoch_ = false; }

  const MetricMonitor& monitor() const { return monitor_; }
  int64_t patience() const { return patience_; }
  bool stopped() const { return stopped_; }
  bool has_best() const { return has_best_; }
  double best() const { return best_; }
  /// Validations since the best one.
  int64_t waited() const { return wait_; }
  /// {"metric", "patience", "min_delta", "best", "best_epoch", "stopped", "stopped_epoch"}:
  /// epochs are counted across stages from 1.
  nlohmann::json record() const;

  /// The best value, its epoch and the wait, so a resumed run stops where the whole one would.
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(Learner&, torch::serialize::InputArchive& a) override;

 private:
  MetricMonitor monitor_;
  int64_t patience_;
  bool in_epoch_ = false, has_best_ = false, stopped_ = false;
  double best_ = 0;
  int64_t wait_ = 0, epochs_ = 0, best_epoch_ = 0;
};

}  // namespace frugal
