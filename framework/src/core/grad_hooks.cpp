// GradReadyHooks: post hooks on the parameters' AccumulateGrad nodes (see grad_hooks.h).
#include "frugal/core/grad_hooks.h"

#include <utility>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace frugal {

namespace {
/// The post hook: AccumulateGrad has just stored the parameter's complete gradient.
struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(torch::Tensor p, GradReadyHooks::OnReady f) : param(std::move(p)), fn(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn(param);
    return outputs;
  }
  torch::Tensor param;
  GradReadyHooks::OnReady fn;
};
}  // namespace

void GradReadyHooks::install(const std::vector<torch::Tensor>& params, OnReady on_ready) {
  remove();
  for (const auto& p : params) {
    if (!p.requires_grad()) continue;
    std::shared_ptr<torch::autograd::Node> node = torch::autograd::impl::grad_accumulator(p);
    if (!node) continue;
    const uintptr_t key = node->add_post_hook(std::make_unique<ReadyHook>(p, on_ready));
    hooks_.push_back({std::move(node), key});
  }
}

void GradReadyHooks::remove() {
  for (auto& h : hooks_) h.node->del_post_hook(h.key);
  hooks_.clear();
}

}  // namespace frugal
