#pragma once
/// step_in_backward: each parameter's optimizer step runs inside backward, as soon as its
/// gradient is complete, and the gradient is freed right after, so the gradients of the whole
/// model are never alive together (PyTorch's "optimizer step in backward" recipe; LOMO, Lv et
/// al. 2023). A post hook on each parameter's AccumulateGrad node (frugal::GradReadyHooks)
/// steps the Learner's own optimizer restricted to that parameter (step_one). The Learner's step then finds no
/// gradient and changes nothing; its counters and after_step run as usual.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <frugal/core/grad_hooks.h>
#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

namespace frugal::step_in_backward {

/// One optimizer step over parameter `p` alone: every param group is shown only `p` (or
/// nothing) while opt.step() runs, then restored. The state stays keyed by the parameter, as
/// in a whole step, so checkpoints are those of the plain loop. Works with any optimizer whose
/// step walks param_groups() (every one in the registry). Returns false when no group holds p.
bool step_one(torch::optim::Optimizer& opt, const torch::Tensor& p);

/// [plugins.step_in_backward]: no keys.
struct StepInBackwardOptions : frugal::Options {
  void visit(frugal::FieldVisitor&) override {}
};

/// The callback: hooks the trained parameters at each stage; steps in the backward of the
/// batch's last micro-batch unless a callback skipped the step before backward (gradient
/// accumulation over batches: those batches keep their gradients, as without it).
class StepInBackward : public frugal::Callback {
 public:
  StepInBackward(const StepInBackwardOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "step_in_backward"; }
  frugal::CallbackRelations relations() const override;

  /// Hooks the parameters that train in this stage (its freeze is applied).
  void before_stage(frugal::Learner& l) override;
  /// Arms the hooks for this backward: the last micro-batch of a batch that steps. Refuses a
  /// scaled loss (a float16 loss scaler must see every gradient before any step).
  void before_backward(frugal::Learner& l) override;
  void after_backward(frugal::Learner& l) override;
  /// An out-of-memory error in a backward that has stepped parameters cannot be retried (the
  /// batch would step them twice): stops the fit with an error saying so.
  void release_caches(frugal::Learner& l) override;
  std::string retry_veto(const frugal::Learner& l) const override;
  void after_fit(frugal::Learner& l) override;

  int64_t parameters_stepped() const { return stepped_total_; }  ///< in backward, this fit

 private:
  void on_ready(const torch::Tensor& p);

  std::shared_ptr<spdlog::logger> log_;
  frugal::GradReadyHooks hooks_;
  frugal::Learner* learner_ = nullptr;  // while armed
  bool armed_ = false, warned_skip_ = false;
  int64_t stepped_in_backward_ = 0, stepped_total_ = 0;
};

}  // namespace frugal::step_in_backward
