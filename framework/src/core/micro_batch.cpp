#include "frugal/core/micro_batch.h"

#include <algorithm>

#include "frugal/memory/memory.h"

namespace frugal {

namespace {
constexpr size_t kMaxOomRecords = 100;
// Slack for the loop's own scalars (the logged loss and its sums: a few bytes).
constexpr int64_t kProbeSlack = 256;

std::string budget_text(int64_t budget) {
  return budget > 0 ? "run.memory_budget = " + format_bytes(budget)
                    : "no run.memory_budget (the device's memory)";
}
}  // namespace

int64_t effective_micro_batch(int64_t n, int64_t size, int64_t cap) {
  int64_t m = size > 0 ? std::min(size, n) : n;
  if (cap > 0) m = std::min(m, cap);
  return std::max<int64_t>(m, 1);
}

std::string describe(const OomEvent& e) {
  return std::string(to_string(e.phase)) + " of batch " + std::to_string(e.batch) +
         " (iteration " + std::to_string(e.iteration) + ", micro-batch " +
         std::to_string(e.micro_batch) + " of " + std::to_string(e.batch_samples) + " samples)";
}

OomRetry decide_oom_retry(const OomPolicy& policy, const OomEvent& e) {
  const std::string head = "out of memory in " + describe(e);
  const std::string budget = budget_text(e.budget);
  auto stop = [&](const std::string& text) { return OomError(text, e.phase, e.iteration); };
  if (!policy.retry)
    throw stop(head + ": " + e.message + ". With run.on_oom = \"retry\" the batch is retried " +
               "with smaller micro-batches; or raise run.memory_budget, or lower data.batch_size");
  if (e.phase == OomError::Phase::Backward && e.grads_at_start)
    throw stop(head + ": " + e.message + ". Gradients of earlier batches were being accumulated " +
               "into this step (a callback skipped the earlier steps), so a failed backward may " +
               "have added part of this batch to them and the step cannot be retried exactly: " +
               "accumulate fewer batches into one step, or give it more room than " + budget);
  if (e.micro_batch <= 1)
    throw stop(head + " even at micro-batch size 1, with " + budget + ": " + e.message +
               ". The model, its gradients and the optimizer's state do not fit: raise the " +
               "budget or use a technique that shrinks them");
  if (e.failures > policy.max_retries)
    throw stop(head + ": " + std::to_string(e.failures) + " out-of-memory errors on this batch " +
               "(run.oom_retries = " + std::to_string(policy.max_retries) + "), with " + budget +
               ": " + e.message);
  return {e.iteration, e.phase, e.micro_batch, (e.micro_batch + 1) / 2,
          e.phase == OomError::Phase::Backward};
}

OomError oom_in_step(int64_t batch, int64_t iteration, const std::string& message) {
  return OomError("out of memory in the optimizer step of batch " + std::to_string(batch) +
                      " (iteration " + std::to_string(iteration) + "): " + message +
                      ". Smaller micro-batches do not shrink the step (it holds the parameters, "
                      "their gradients and the optimizer's state): raise run.memory_budget or "
                      "use a lighter optimizer",
                  OomError::Phase::Step, iteration);
}

OomError oom_loading(int64_t batch, int64_t batch_size, int64_t iteration,
                     const std::string& message) {
  // Micro-batches cannot help: the loader builds the whole batch.
  return OomError("out of memory loading training batch " + std::to_string(batch) + " of " +
                      std::to_string(batch_size) + " samples: " + message +
                      ". The batch itself must fit: raise run.memory_budget or lower "
                      "data.batch_size",
                  OomError::Phase::Load, iteration);
}

OomError oom_in_event(std::string_view event, int64_t iteration, const std::string& message) {
  return OomError("out of memory in event '" + std::string(event) + "' (iteration " +
                      std::to_string(iteration) + "): " + message +
                      ". Retries cover the forward and backward of training batches only",
                  OomError::Phase::Event, iteration);
}

OomError oom_budget_below_live(int64_t budget, int64_t live, int64_t iteration) {
  return OomError("run.memory_budget = " + format_bytes(budget) +
                      " is less than what the model, the optimizer and the data already hold (" +
                      format_bytes(live) + " live): raise the budget",
                  OomError::Phase::Start, iteration);
}

bool probe_fits(const ProbeResult& r, const StepNeeds& needs, int64_t budget) {
  return !r.oom && r.peak + needs.state + kProbeSlack <= budget &&
         r.after_backward + needs.state + needs.temporaries + kProbeSlack <= budget;
}

ProbeSearch largest_fitting(int64_t start, const std::function<bool(int64_t)>& fits) {
  ProbeSearch s;
  auto ask = [&](int64_t m) {
    ++s.probes;
    return fits(m);
  };
  int64_t lo = 0, hi = start + 1;  // lo fits (0: none yet), hi does not
  for (int64_t m = start; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) {
    if (ask(m)) {
      lo = m;
      break;
    }
    hi = m;
  }
  while (lo > 0 && hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (ask(mid) ? lo : hi) = mid;
  }
  s.size = lo;
  return s;
}

OomError oom_in_probe(int64_t budget, int64_t live, int64_t state_bytes, int64_t iteration) {
  return OomError("run.micro_batch = \"auto\": not even 1 sample fits run.memory_budget = " +
                      format_bytes(budget) + " (" + format_bytes(live) +
                      " live before the probe, " + format_bytes(state_bytes) +
                      " for the optimizer's state): raise the budget",
                  OomError::Phase::Probe, iteration);
}

void MicroBatching::start_fit() {
  cap_ = last_ = oom_count_ = 0;
  retries_.clear();
  probed_.clear();
}

void MicroBatching::set_size(int64_t n) {
  if (n < 0)
    throw_usage_error("micro-batch size must be >= 0 (0 = whole batch), got " + std::to_string(n));
  size_ = n;
}

void MicroBatching::set_cap(int64_t n) {
  if (n < 0) throw_usage_error("micro-batch cap must be >= 0 (0 = none), got " + std::to_string(n));
  cap_ = n;
}

void MicroBatching::retried(const OomRetry& r) {
  cap_ = r.to;
  if (retries_.size() < kMaxOomRecords) retries_.push_back(r);
}

nlohmann::json MicroBatching::report(const OomPolicy& policy) const {
  nlohmann::json retries = nlohmann::json::array(), autos = nlohmann::json::array();
  for (const auto& r : retries_)
    retries.push_back({{"iteration", r.iteration}, {"phase", std::string(to_string(r.phase))},
                       {"from", r.from}, {"to", r.to}, {"restarted", r.restarted}});
  for (const auto& [stage, m] : probed_) autos.push_back({{"stage", stage}, {"micro_batch", m}});
  return {{"budget", policy.budget},
          {"on_oom", policy.retry ? "retry" : "fail"},
          {"count", oom_count_},
          {"micro_batch", last_},  // as the last batch ran
          {"retries", retries},
          {"auto", autos}};
}

}  // namespace frugal
