#pragma once
/// Fused CPU optimizers: Adam, AdamW and SGD whose step is one pass over each parameter's
/// elements (gradient, moments and weight read once, written once, no temporaries) instead of
/// LibTorch's six to eight tensor operations per parameter, each a pass of its own with a
/// full-size temporary or two. The arithmetic is LibTorch 1.13's, operation for operation in
/// the same order and float32 rounding, with a fused multiply-add exactly where LibTorch's
/// vectorized kernels use one (on a CPU with FMA): on such a CPU the weights match
/// torch::optim's to the last bit or within 1e-6 relative (FusedOptimizers tests). The chunks
/// of every parameter are spread over ATen's intra-op threads in one parallel region.
///
/// Each is its LibTorch class (same options, state, checkpoints, dynamic_cast), stepping in
/// LibTorch's way where the fused pass does not apply: a parameter off the CPU, not float32,
/// not contiguous, a sparse gradient, amsgrad. Registered as `optimizer.fused = true`, the
/// default, for adam, adamw and sgd (optimizers.h).
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace frugal {

class FusedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// Whether every element of every defined tensor is finite: one pass over float32 contiguous
/// CPU tensors (no operation dispatched, no allocation, split over the intra-op threads),
/// LibTorch's reductions for the others. What the non-finite check runs before each step.
bool all_finite(const std::vector<torch::Tensor>& tensors);

}  // namespace frugal
