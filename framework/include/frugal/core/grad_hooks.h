#pragma once
/// A function called as soon as each parameter's gradient is complete in a backward: the post
/// hook of the parameter's AccumulateGrad node (LibTorch 1.13 has no post-accumulate-grad hook
/// on tensors; the node's hook exists in 2.x too). data_parallel launches a bucket's all-reduce
/// from it while backward goes on; step_in_backward steps the parameter there.
///
/// The node is the one autograd routes a leaf's gradient through: it is created at the first
/// use of the parameter in a graph and kept (weakly) by the parameter, so GradReadyHooks holds
/// it; a parameter whose node nobody holds gets a new one, without the hook, at the next
/// forward. A parameter's hook runs once per backward in which it got a gradient (the engine
/// adds up a parameter's uses before accumulating), unless a custom function runs a backward of
/// its own on it (a reentrant backward): then once per backward call.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

namespace torch::autograd {
struct Node;
}

namespace frugal {

class GradReadyHooks {
 public:
  using OnReady = std::function<void(const torch::Tensor& p)>;
  GradReadyHooks() = default;
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;
  ~GradReadyHooks() { remove(); }
  /// Hooks every parameter of `params` that requires a gradient (after removing earlier hooks).
  void install(const std::vector<torch::Tensor>& params, OnReady on_ready);
  /// Removes every hook it installed.
  void remove();
  size_t size() const { return hooks_.size(); }

 private:
  struct Hooked {
    std::shared_ptr<torch::autograd::Node> node;
    uintptr_t key;
  };
  std::vector<Hooked> hooks_;
};

}  // namespace frugal
