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
///
/// Each can also tell, from the same pass, whether every gradient it read was finite
/// (GradientVerdict): the non-finite check then costs no pass of its own.
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace frugal {

/// An optimizer whose step can say whether every gradient it read was finite. The fused pass
/// keeps an integer maximum of each gradient element's exponent bits beside the update (two
/// vector instructions per eight or sixteen elements it already loads); where LibTorch's step
/// runs instead, the gradients are scanned (all_finite) before it, and a step that would read
/// an inf or a NaN is not run. What NonFiniteCheck's Scan::InStep asks.
class GradientVerdict {
 public:
  virtual ~GradientVerdict() = default;
  /// The next step() checks every gradient it reads.
  void check_next_step() { check_next_ = true; }
  /// Withdraws a check_next_step that no step used.
  void cancel_check() { check_next_ = false; }
  /// Steps that checked, so far: a verdict belongs to the step that made it.
  int64_t checked_steps() const { return checked_steps_; }
  /// After a step that checked: the first parameter (param_groups order) whose gradient held
  /// an inf or a NaN (that step's update reached the parameters when it was the fused pass);
  /// undefined when every gradient was finite.
  const torch::Tensor& first_nonfinite() const { return first_nonfinite_; }
  /// Whether that step ran all the same (the fused pass finds it while updating; LibTorch's
  /// step, scanned before, did not run).
  bool nonfinite_step_ran() const { return nonfinite_step_ran_; }

  // The step's side.
  /// Whether this step checks (and the request is used up).
  bool take_check() {
    const bool c = check_next_;
    check_next_ = false;
    return c;
  }
  void record_verdict(torch::Tensor first_nonfinite, bool ran) {
    first_nonfinite_ = std::move(first_nonfinite);
    nonfinite_step_ran_ = ran && first_nonfinite_.defined();
    ++checked_steps_;
  }

 private:
  bool check_next_ = false;
  bool nonfinite_step_ran_ = false;
  int64_t checked_steps_ = 0;
  torch::Tensor first_nonfinite_;
};

class FusedAdam : public torch::optim::Adam, public GradientVerdict {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class FusedAdamW : public torch::optim::AdamW, public GradientVerdict {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class FusedSGD : public torch::optim::SGD, public GradientVerdict {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// Whether every element of every defined tensor is finite: one pass over float32 contiguous
/// CPU tensors (no operation dispatched, no allocation, split over the intra-op threads),
/// LibTorch's reductions for the others. What the non-finite check runs before each step.
bool all_finite(const std::vector<torch::Tensor>& tensors);

}  // namespace frugal
