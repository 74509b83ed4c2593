#pragma once
// The step shared by the optimizers that update each parameter on its own (optim_adafactor.cpp,
// optim_adam8bit.cpp): the closure's loss, taken with gradients on, then one update per
// parameter that has a gradient, with its group's options.
#include <vector>

#include <torch/torch.h>

namespace frugal {

template <class GroupOptions, class StepOne>
torch::Tensor step_each_parameter(std::vector<torch::optim::OptimizerParamGroup>& groups,
                                  const torch::optim::Optimizer::LossClosure& closure,
                                  StepOne&& step_one) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : groups) {
    const auto& o = static_cast<const GroupOptions&>(group.options());
    for (auto& p : group.params())
      if (p.grad().defined()) step_one(p, o);
  }
  return loss;
}

}  // namespace frugal
