// step_in_backward: the optimizer step of each parameter from its AccumulateGrad post hook.
#include "step_in_backward.h"

#include <cmath>
#include <utility>

namespace frugal::step_in_backward {

bool step_one(torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto& groups = opt.param_groups();
  std::vector<std::vector<torch::Tensor>> kept(groups.size());
  bool found = false;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<torch::Tensor>& params = groups[g].params();
    std::vector<torch::Tensor> only;
    for (const auto& q : params)
      if (q.is_same(p)) only.push_back(q);
    found = found || !only.empty();
    kept[g] = std::exchange(params, std::move(only));
  }
  // The groups are restored whatever the step does (an exception, an out-of-memory error).
  struct Restore {
    std::vector<torch::optim::OptimizerParamGroup>& groups;
    std::vector<std::vector<torch::Tensor>>& kept;
    ~Restore() {
      for (size_t g = 0; g < groups.size(); ++g) groups[g].params() = std::move(kept[g]);
    }
  } restore{groups, kept};
  if (found) opt.step();
  return found;
}

// ---- the plugin ---------------------------------------------------------------------------

StepInBackward::StepInBackward(const StepInBackwardOptions&, const frugal::PluginContext& ctx)
    : log_(ctx.logger) {}

void StepInBackward::before_stage(frugal::Learner& l) {
  hooks_.install(l.model()->parameters(), [this](const torch::Tensor& p) { on_ready(p); });
  log_->debug("hooked {} parameters", hooks_.size());
}

void StepInBackward::before_backward(frugal::Learner& l) {
  if (l.loss_scale() != 1.0)
    throw std::runtime_error(
        "step_in_backward steps each parameter as soon as its gradient is complete, but the "
        "loss is scaled (x" + std::to_string(l.loss_scale()) +
        "): a loss scaler (amp with float16) must check every gradient for inf/NaN before any "
        "step. Use [plugins.amp] dtype = \"bfloat16\" (no scaler), or turn step_in_backward off");
  if (l.step_skipped() && l.micro_index() + 1 >= l.micro_count() && !warned_skip_) {
    warned_skip_ = true;
    log_->warn("a callback skipped the step of batch {} (gradient accumulation over batches): "
               "such batches keep their gradients whole, as without step_in_backward; only a "
               "batch that steps steps in backward",
               l.batch_index());
  }
  // A non-finite loss is not stepped in backward: its gradients are kept for the step, where
  // the non-finite check (run.on_nonfinite) stops the run or skips the step. One sync per batch.
  const bool finite_loss = !l.loss().defined() || std::isfinite(l.loss().item<double>());
  armed_ = l.completes_step() && !l.batch_skipped() && finite_loss;
  learner_ = &l;
  stepped_in_backward_ = 0;
}

void StepInBackward::after_backward(frugal::Learner&) { armed_ = false; }

void StepInBackward::on_ready(const torch::Tensor& p) {
  if (!armed_ || !learner_ || !p.grad().defined()) return;
  ++stepped_in_backward_;  // before the step: one that fails part-way has touched the state
  if (step_one(learner_->optimizer(), p)) ++stepped_total_;
  // Freed whether stepped or not: a parameter no optimizer group holds is not trained.
  torch::Tensor(p).mutable_grad().reset();
}

std::string StepInBackward::retry_veto(const frugal::Learner&) const {
  if (!armed_ || stepped_in_backward_ == 0) return {};
  return "the failed backward had already stepped " + std::to_string(stepped_in_backward_) +
         " parameters; a retry would step them twice. Lower data.batch_size or set a smaller "
         "micro-batch (the gradients' memory is freed as each parameter steps, so the rest is "
         "activations)";
}

void StepInBackward::release_caches(frugal::Learner&) { armed_ = false; }

void StepInBackward::after_fit(frugal::Learner&) {
  hooks_.remove();
  log_->info("{} parameter steps ran inside backward", stepped_total_);
}

namespace {
/// data_parallel all-reduces a bucket once all its gradients are complete (or after backward):
/// a step inside backward would use this rank's gradients alone. A global-norm clipping (grad_clip) needs every gradient before any step.
frugal::CallbackRelations relations() { return {{}, {"data_parallel", "grad_clip"}, false}; }
}  // namespace

frugal::CallbackRelations StepInBackward::relations() const { return step_in_backward::relations(); }

}  // namespace frugal::step_in_backward

FRUGAL_PLUGIN_EX(frugal::step_in_backward::StepInBackward,
                 frugal::step_in_backward::StepInBackwardOptions, "step_in_backward",
                 "each parameter's optimizer step inside backward, its gradient freed at once: "
                 "the model's gradients are never all alive",
                 "1.0.0", &frugal::step_in_backward::relations, nullptr)
