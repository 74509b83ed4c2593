#pragma once
/// Learning-rate schedules, per stage ([stages.schedule]): constant, linear warm-up, cosine with
/// warm-up, one-cycle (fastai's fit_one_cycle) and step. The learning rate of a batch is a pure
/// function of the batch's position in its stage (epoch * batches + batch), so a resumed fit
/// continues the schedule exactly: nothing is saved.
///
///   [[stages]]
///   name = "train"
///   epochs = 3
///   [stages.schedule]
///   name = "one_cycle"   # lr rises from lr/div to the optimizer's lr, then falls to lr/div_final
///   pct_start = 0.25
#include <cstdint>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "frugal/config/sections.h"
#include "frugal/core/callback.h"

namespace frugal {

/// The learning rate of batch `i` (0-based) of a stage of `n` batches whose optimizer's lr is
/// `lr`:
///   constant       lr
///   linear_warmup  lr * (i + 1) / warmup_steps while i < warmup_steps, then lr
///   cosine         the warm-up, then min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2,
///                  t = (i - warmup_steps) / (n - warmup_steps)
///   one_cycle      fastai's combined_cos(pct_start, lr / div, lr, lr / div_final) at i / n:
///                  cos_ramp(lr / div, lr, p / pct_start) while p = i / n < pct_start, then
///                  cos_ramp(lr, lr / div_final, (p - pct_start) / (1 - pct_start)), where
///                  cos_ramp(a, b, q) = a + (b - a) * (1 - cos(pi * q)) / 2
///   step           lr * gamma ^ floor(i / step_size)
double schedule_lr(const ScheduleOptions& s, double lr, int64_t i, int64_t n);
/// one_cycle with cycle_momentum: fastai's combined_cos(pct_start, mom_max, mom_min, mom_max) at
/// i / n. Otherwise nullopt (the optimizer's momentum stays).
std::optional<double> schedule_momentum(const ScheduleOptions& s, int64_t i, int64_t n);

/// Sets the learning rate of every parameter group of `opt`.
void set_learning_rate(torch::optim::Optimizer& opt, double lr);
/// The learning rate of `opt`'s first parameter group; 0 when it has none.
double learning_rate(const torch::optim::Optimizer& opt);
/// Sets the momentum of every parameter group: Adam's and AdamW's beta1, SGD's momentum when
/// it has one (an SGD built without momentum keeps none: it would grow a buffer per parameter).
/// False when `opt` has no momentum to set (RMSprop, Adagrad, a plugin's optimizer).
bool set_momentum(torch::optim::Optimizer& opt, double momentum);

/// Applies the stage's schedule before each batch (the in-tree callback every run has). A stage
/// with the constant schedule that follows a scheduled one starts at its optimizer's lr (and
/// momentum) again. It keeps no state: resume needs nothing saved.
class ScheduleCallback : public Callback {
 public:
  std::string name() const override { return "schedule"; }
  int order() const override { return order::kSchedule; }
  void before_stage(Learner& l) override;
  void before_batch(Learner& l) override;

 private:
  bool warned_momentum_ = false;
};

}  // namespace frugal
