// Tasks: how validation is scored.
#include "frugal/task.h"

#include <cmath>
#include <cstdio>

#include "frugal/data.h"

namespace frugal {

std::string Task::name() const {
  return kind == TaskKind::LanguageModel ? "language_model" : "classification";
}

std::string Task::element() const { return kind == TaskKind::LanguageModel ? "token" : "sample"; }

TaskMetric Task::metric(const MetricSums& s) const {
  TaskMetric m;
  char buf[96];
  if (kind == TaskKind::LanguageModel) {
    m.name = "valid_loss";
    m.value = s.mean_loss();
    m.higher_is_better = false;
    m.unit = "nats/token";
    std::snprintf(buf, sizeof buf, "%.4f nats/token (perplexity %.2f)", m.value, std::exp(m.value));
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
  if (kind == TaskKind::LanguageModel) j["perplexity"] = std::exp(s.mean_loss());
  return j;
}

Task task_for(const Dataset& d) {
  Task t;
  t.kind = d.is_text() ? TaskKind::LanguageModel : TaskKind::Classification;
  return t;
}

MetricSums score(const DataLoader& data, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                 torch::Device device) {
  namespace F = torch::nn::functional;
  torch::NoGradGuard no_grad;
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(device));
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  int64_t count = 0;
  for (int64_t i = 0; i < data.num_batches(); ++i) {
    const Batch b = data.batch(i);
    const torch::Tensor pred = forward(b.x);
    auto logits = pred.reshape({-1, pred.size(-1)});
    auto y = b.y.reshape({-1});
    loss_sum += F::cross_entropy(logits.to(torch::kFloat), y,
                                 F::CrossEntropyFuncOptions().reduction(torch::kSum));
    correct += logits.argmax(1).eq(y).sum();
    count += y.numel();
  }
  return MetricSums{loss_sum.item<double>(), count, correct.item<int64_t>()};
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
