#pragma once
/// Gradient clipping, as torch.nn.utils.clip_grad_value_ and clip_grad_norm_ (the optimizer's
/// `clip_grad_value` and `clip_grad_norm` keys, per stage as every optimizer key): before each
/// step that is taken, every gradient clamped to [-value, value], then all of them scaled by
/// min(1, max_norm / (norm + 1e-6)), norm being their global L2 norm.
///
/// Where in the step: before_step, after everything that changes the gradients the optimizer
/// will see: grad_accum's last micro-batch (inner batches skip their step and are not
/// clipped), data parallel's all-reduce and amp's unscaling (both in after_backward), and the
/// non-finite check (order::kGradientClip > kNonFiniteCheck: a skipped step is not clipped).
/// With gradients sharded across ranks (zero stage 2 reduces each to its owner; the others drop
/// theirs) the squares are summed across ranks, so every rank scales by the same global norm.
/// step_in_backward steps each parameter during backward, before the global norm exists: the
/// two refuse each other (its relations name "grad_clip").
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/core/callback.h"

namespace frugal {

class Collective;

/// Scales the defined gradients of `params` in place so that their global L2 norm is at most
/// `max_norm` (PyTorch's formula and order of operations); returns the norm before scaling.
/// `sum_over`: the ranks among which the gradients are shared out (each rank holds a disjoint
/// part), or nullptr when this process holds them all.
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm, Collective* sum_over = nullptr);
/// Clamps every defined gradient of `params` to [-value, value] in place.
void clip_grad_value(const std::vector<torch::Tensor>& params, double value);

class GradClip : public Callback {
 public:
  std::string name() const override { return "grad_clip"; }
  int order() const override { return order::kGradientClip; }
  void before_fit(Learner& l) override;
  void before_step(Learner& l) override;

  /// {"steps": clipped by norm or value, "scaled_steps": those whose norm exceeded max_norm,
  /// "max_norm_seen", "last_norm"} over the fit (norms before clipping).
  nlohmann::json record() const;

 private:
  int64_t steps_ = 0, scaled_ = 0;
  double max_seen_ = 0, last_ = 0;
};

}  // namespace frugal
