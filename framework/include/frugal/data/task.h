#pragma once
/// What a model is trained to do and how its validation is scored. A batch is (x, y) of any
/// shape: a prediction has one row of logits per target element (classification: [B, C] for
/// [B] labels; language modelling: [B, T, V] for [B, T] next tokens). Validation sums, per
/// target element, the cross-entropy and the argmax hits; the task turns the sums into its
/// metric: accuracy for classification, loss in nats per token (and perplexity) for language
/// modelling. A regression (float targets, one output per sample) sums squared errors instead:
/// its metric is the RMSE (lower is better), and nothing is argmax'd.
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/data/data.h"

namespace frugal {

/// Validation's running sums (as tensors on the device while it runs; synced once).
struct MetricSums {
  double loss_sum = 0;  ///< cross-entropy (nats), or a regression's squared error, summed over
                        ///< target elements
  int64_t count = 0;    ///< target elements: samples or tokens
  int64_t correct = 0;  ///< target elements whose argmax prediction is right; < 0: the task has
                        ///< no accuracy (regression)
  double bytes = 0;     ///< language modelling: the text bytes the target tokens stand for
  double mean_loss() const { return count ? loss_sum / static_cast<double>(count) : 0.0; }
  /// The loss in bits per byte of text (cross-entropy / ln 2 / bytes): 0 without bytes.
  double bits_per_byte() const { return bytes > 0 ? loss_sum / (std::log(2.0) * bytes) : 0.0; }
  /// -1 when the task has no accuracy (regression).
  double accuracy() const {
    if (correct < 0) return -1.0;
    return count ? static_cast<double>(correct) / static_cast<double>(count) : 0.0;
  }
};

/// A task's headline number.
struct TaskMetric {
  std::string name;               ///< "accuracy" | "valid_loss" | "rmse"
  double value = 0;
  bool higher_is_better = true;
  std::string unit;               ///< "" (a fraction) | "nats/token"
  std::string text;               ///< "89.95%" | "1.234 nats/token (perplexity 3.43, 1.780 bits/byte)" |
                                  ///< "RMSE 0.1234 (MSE 0.01523)"
};

enum class TaskKind { Classification, LanguageModel, Regression };

struct Task {
  TaskKind kind = TaskKind::Classification;

  /// "classification" | "language_model" | "regression"
  std::string name() const;
  /// What count counts: "sample" | "token".
  std::string element() const;
  /// The headline metric of validation sums.
  TaskMetric metric(const MetricSums& s) const;
  /// {"task", "valid_loss", "valid_accuracy", "valid_metric": {name, value, higher_is_better,
  /// unit, text}} (+ "perplexity" and "bits_per_byte" for a language model) for the report. A regression has
  /// "valid_loss" (the MSE) and "valid_rmse", and no "valid_accuracy".
  nlohmann::json to_json(const MetricSums& s) const;
};

/// The task a dataset asks for: language modelling for text, regression for float labels, else
/// classification.
Task task_for(const Dataset& d);

/// Scores every batch of `data` with `forward`, without gradients: cross-entropy (in float)
/// summed over the target elements, the argmax hits and the element count, summed on `device`
/// and synced once. A regression dataset (task_for) sums squared errors (in double) instead,
/// with correct = -1: no argmax, no cross-entropy. What validation (Learner::validate, through the forward chain) and
/// `frugal evaluate` (the bare model) report. `skipped` runs for a batch this rank has no row
/// of (data parallel's last batch), in place of its forward.
MetricSums score(const DataLoader& data, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                 torch::Device device, const std::function<void()>& skipped = {});

/// A metric read back from a report's "valid_metric" object (ablate, plan).
TaskMetric metric_from_json(const nlohmann::json& j);

}  // namespace frugal
