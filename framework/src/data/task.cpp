// Tasks: how validation is scored.
#include "frugal/data/task.h"

#include <cmath>
#include <cstdio>

#include "frugal/base/error.h"
#include "frugal/data/data.h"

namespace frugal {

std::string Task::name() const {
  switch (kind) {
    case TaskKind::LanguageModel: return "language_model";
    case TaskKind::Regression: return "regression";
    default: return "classification";
  }
}

std::string Task::element() const { return kind == TaskKind::LanguageModel ? "token" : "sample"; }

TaskMetric Task::metric(const MetricSums& s) const {
  TaskMetric m;
  char buf[96];
  if (kind == TaskKind::Regression) {
    m.name = "rmse";
    m.value = std::sqrt(s.mean_loss());
    m.higher_is_better = false;
    std::snprintf(buf, sizeof buf, "RMSE %.4g (MSE %.4g)", m.value, s.mean_loss());
  } else if (kind == TaskKind::LanguageModel) {
    m.name = "valid_loss";
    m.value = s.mean_loss();
    m.higher_is_better = false;
    m.unit = "nats/token";
    std::snprintf(buf, sizeof buf, "%.4f nats/token (perplexity %.2f, %.4f bits/byte)", m.value,
                  std::exp(m.value), s.bits_per_byte());
  } else {
    m.name = "accuracy";
    m.value = s.accuracy();
    std::snprintf(buf, sizeof buf, "%.2f%%", 100.0 * m.value);
  }
  m.text = buf;
  return m;
}

nlohmann::json Task::to_json(const MetricSums& s) const {
  const TaskMetric m = metric(s);
  nlohmann::json j = {{"task", name()},
                      {"valid_loss", s.mean_loss()},
                      {"valid_accuracy", s.accuracy()},
                      {"valid_" + element() + "s", s.count},
                      {"valid_metric",
                       {{"name", m.name},
                        {"value", m.value},
                        {"higher_is_better", m.higher_is_better},
                        {"unit", m.unit},
                        {"text", m.text}}}};
  if (kind == TaskKind::LanguageModel) {
    j["perplexity"] = std::exp(s.mean_loss());
    j["bits_per_byte"] = s.bits_per_byte();
  }
  if (kind == TaskKind::Regression) {
    j.erase("valid_accuracy");
    j["valid_rmse"] = m.value;
  }
  return j;
}

Task task_for(const Dataset& d) {
  Task t;
  t.kind = d.is_text()         ? TaskKind::LanguageModel
           : d.is_regression() ? TaskKind::Regression
                               : TaskKind::Classification;
  return t;
}

namespace {
/// Squared errors summed in double: one output per target.
MetricSums score_regression(const DataLoader& data,
                            const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                            torch::Device device, const std::function<void()>& skipped) {
  torch::NoGradGuard no_grad;
  auto sq_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  int64_t count = 0;
  for (int64_t i = 0; i < data.num_batches(); ++i) {
    if (data.rows(i) == 0) {  // data parallel: another rank scores this last batch
      if (skipped) skipped();
      continue;
    }
    const Batch b = data.batch(i);
    const torch::Tensor pred = forward(b.x);
    if (pred.numel() != b.y.numel())
      throw_config_error("regression: the model predicts " + std::to_string(pred.numel()) +
                         " values for " + std::to_string(b.y.numel()) +
                         " targets; a regression model has one output");
    sq_sum += (pred.reshape(b.y.sizes()).to(torch::kDouble) - b.y.to(torch::kDouble)).pow(2).sum();
    count += b.y.numel();
  }
  return MetricSums{sq_sum.item<double>(), count, -1};
}
}  // namespace

MetricSums score(const DataLoader& data, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                 torch::Device device, const std::function<void()>& skipped) {
  if (task_for(data.dataset()).kind == TaskKind::Regression)
    return score_regression(data, forward, device, skipped);
  namespace F = torch::nn::functional;
  torch::NoGradGuard no_grad;
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(device));
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  auto bytes = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  const bool text = data.dataset().is_text();
  const torch::Tensor token_bytes =
      text && data.dataset().token_bytes.defined() ? data.dataset().token_bytes.to(device, torch::kDouble) : torch::Tensor();
  int64_t count = 0;
  for (int64_t i = 0; i < data.num_batches(); ++i) {
    if (data.rows(i) == 0) {  // data parallel: another rank scores this last batch
      if (skipped) skipped();
      continue;
    }
    const Batch b = data.batch(i);
    const torch::Tensor pred = forward(b.x);
    auto logits = pred.reshape({-1, pred.size(-1)});
    auto y = b.y.reshape({-1});
    loss_sum += F::cross_entropy(logits.to(torch::kFloat), y,
                                 F::CrossEntropyFuncOptions().reduction(torch::kSum));
    correct += logits.argmax(1).eq(y).sum();
    count += y.numel();
    if (token_bytes.defined()) bytes += token_bytes.index_select(0, y).sum();
  }
  MetricSums s{loss_sum.item<double>(), count, correct.item<int64_t>()};
  if (text) s.bytes = token_bytes.defined() ? bytes.item<double>() : static_cast<double>(count);
  return s;
}

TaskMetric metric_from_json(const nlohmann::json& j) {
  TaskMetric m;
  m.name = j.value("name", std::string());
  m.value = j.value("value", 0.0);
  m.higher_is_better = j.value("higher_is_better", true);
  m.unit = j.value("unit", std::string());
  m.text = j.value("text", std::string());
  return m;
}

}  // namespace frugal
