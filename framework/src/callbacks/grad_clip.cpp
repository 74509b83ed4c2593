// Gradient clipping by value and by global norm (grad_clip.h).
#include "frugal/callbacks/grad_clip.h"

#include <algorithm>

#include "frugal/core/collective.h"
#include "frugal/core/learner.h"
#include "frugal/distributed/data_parallel.h"

namespace frugal {

namespace {

std::vector<torch::Tensor> defined_grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  return grads;
}

}  // namespace

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm, Collective* sum_over) {
  torch::NoGradGuard g;
  const std::vector<torch::Tensor> grads = defined_grads(params);
  // torch.nn.utils.clip_grad_norm_: each gradient's norm, the norm of those, then one factor.
  torch::Tensor total;
  if (!grads.empty()) {
    std::vector<torch::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& gr : grads) norms.push_back(gr.norm(2).to(grads.front().device()));
    total = torch::stack(norms).norm(2);
  }
  if (sum_over && sum_over->distributed()) {  // a share of the gradients: sum the squares
    torch::Tensor sq = total.defined() ? (total * total).to(torch::kDouble).to(sum_over->device())
                                       : torch::zeros({}, torch::TensorOptions(torch::kDouble).device(sum_over->device()));
    sum_over->all_reduce(sq);
    total = sq.sqrt().to(torch::kFloat);
  }
  if (!total.defined()) return 0.0;
  const double norm = total.item<double>();
  if (grads.empty()) return norm;
  const torch::Tensor coef = (max_norm / (total.to(grads.front().device()) + 1e-6)).clamp_max(1.0);
  for (const auto& gr : grads) gr.mul_(coef.to(gr.device()));
  return norm;
}

void clip_grad_value(const std::vector<torch::Tensor>& params, double value) {
  torch::NoGradGuard g;
  for (const auto& gr : defined_grads(params)) gr.clamp_(-value, value);
}

void GradClip::before_fit(Learner&) {
  steps_ = scaled_ = 0;
  max_seen_ = last_ = 0;
}

void GradClip::before_step(Learner& l) {
  if (l.step_skipped() || l.batch_skipped()) return;
  const OptimizerOptions& o = l.optimizer_options();
  if (o.clip_grad_value <= 0 && o.clip_grad_norm <= 0) return;  // this stage does not clip
  const auto params = l.model()->parameters();
  ++steps_;
  if (o.clip_grad_value > 0) clip_grad_value(params, o.clip_grad_value);
  if (o.clip_grad_norm <= 0) return;
  // Sharded gradients: a callback took data parallel's all-reduce over (zero stage 2).
  const DataParallel* dp = find_data_parallel(l);
  const bool shared_out = dp && !dp->gradient_sync_taken_by().empty();
  last_ = clip_grad_norm(params, o.clip_grad_norm, shared_out ? &l.collective() : nullptr);
  max_seen_ = std::max(max_seen_, last_);
  if (last_ > o.clip_grad_norm) ++scaled_;
}

nlohmann::json GradClip::record() const {
  return {{"steps", steps_}, {"scaled_steps", scaled_}, {"max_norm_seen", max_seen_}, {"last_norm", last_}};
}

}  // namespace frugal
