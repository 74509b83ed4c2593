#pragma once
/// A safety net for training that diverges: before each optimizer step, the batch's loss and
/// every gradient are checked for inf/NaN. A non-finite one stops the fit with an error naming
/// the stage, epoch, batch and the first offending parameter (the step is not taken, so the
/// parameters and every checkpoint written so far stay good), or, with on_nonfinite = "skip",
/// the step is skipped (Learner::skip_step, the gradients dropped) and counted. A skipped step
/// leaves the model as it was: its forwards updated buffers (BatchNorm's running statistics,
/// NaN after a NaN batch), so the buffers are copied before the step's first forward (the first
/// after the last step, or after the gradients were last dropped: an accumulation group's
/// first batch) and copied back when the step is skipped.
///
/// A step another callback already skipped is not checked: amp's loss scaler skips steps whose
/// scaled gradients overflowed (and backs its scale off), grad_accum skips the steps of an
/// accumulation group but its last. Hence the order: before_step runs in ascending order, and
/// order::kNonFiniteCheck is above every band that may skip a step in before_batch,
/// after_backward or before_step (kBatchGrouping, kPrecision, kGradientSync).
///
/// Scan::InStep (what `frugal train` runs with on_nonfinite = "fail"): where the optimizer's
/// step can check the gradients itself (GradientVerdict: frugal's fused adam, adamw and sgd)
/// and steps them all on this rank (not zero's shards), and no clip by value would clamp an inf
/// into range first nor a clip by norm spread a NaN (optimizer.clip_grad_value, clip_grad_norm),
/// and in data parallel the gradients were reduced in this batch, the gradients are not scanned before
/// the step; the fused pass finds an inf or a NaN while it updates, and after_step fails the fit
/// with the same error. That step's update then reached the parameters in memory (the event
/// says so: step_ran); nothing is written after it, so the checkpoints on disk are the same
/// as with the scan before. The loss is checked before the step either way. It checks the
/// gradients the optimizer steps; a parameter with a gradient the optimizer does not hold is not
/// stepped, and not checked.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/core/callback.h"

namespace frugal {

class DataParallel;
class GradientVerdict;

/// The first parameter (in named_parameters order) whose gradient holds an inf or a NaN, or
/// nullopt when all are finite. Reads each gradient once, sums it in double (a finite float
/// gradient cannot overflow a double sum) and syncs once; only when some sum is not finite does
/// it look for the parameter, so the common case allocates nothing the size of a gradient.
std::optional<std::string> first_nonfinite_gradient(const torch::nn::Module& m);

/// Where and why a fit stopped for a non-finite value.
struct NonFiniteEvent {
  std::string what;       ///< "loss" | "gradient"
  std::string parameter;  ///< the first parameter with a non-finite gradient; "" when none
  double loss = 0;        ///< the batch's (unscaled) loss
  int64_t stage = 0, epoch = 0, batch = 0, iteration = 0, steps = 0;
  std::string stage_name;
  bool step_ran = false;  ///< Scan::InStep: the step that read the gradient ran (in memory)
  nlohmann::json to_json() const;
  /// "non-finite loss (nan) in stage 'train' (1), epoch 2, batch 5 (iteration 12, after 11
  /// optimizer steps); first non-finite gradient: 0.weight"
  std::string describe() const;
};

class NonFiniteCheck : public Callback {
 public:
  enum class Mode { Fail, Skip };
  /// Where the gradients are checked in Mode::Fail: a pass before the step (the step is never
  /// taken), or inside the optimizer's step where it can (see above).
  enum class Scan { BeforeStep, InStep };
  /// Mode::Fail throws (a CallbackError whose text is NonFiniteEvent::describe()).
  explicit NonFiniteCheck(Mode mode = Mode::Fail, Scan scan = Scan::BeforeStep)
      : mode_(mode), scan_(scan) {}
  /// "fail" | "skip"; throws ConfigError naming run.on_nonfinite otherwise.
  static Mode parse_mode(const std::string& s);

  std::string name() const override { return "nonfinite_check"; }
  int order() const override { return order::kNonFiniteCheck; }
  void before_fit(Learner& l) override;
  /// Data parallel: whether this rank's loss is finite rides on the step's gradient sync.
  void before_backward(Learner& l) override;
  /// Mode::Skip: copies the model's buffers at the step's first forward.
  void before_forward(Learner& l) override;
  /// Checks the loss and the gradients of a step no other callback skipped. Data parallel:
  /// one all-reduce of the verdict, so every rank fails or skips the same step.
  void before_step(Learner& l) override;
  /// Scan::InStep: fails the fit when the step found a non-finite gradient.
  void after_step(Learner& l) override;
  /// Scan::InStep: the optimizer asked for a verdict was replaced before its step: the
  /// gradients are scanned then.
  void optimizer_replaced(Learner& l) override;
  /// A verdict asked and not used (the step did not come) is withdrawn.
  void release_caches(Learner& l) override;
  /// Mode::Skip: notes whether the next forward starts a new step (no gradient is pending).
  void after_batch(Learner& l) override;
  /// Mode::Skip: the bytes of the buffers' copy.
  int64_t held_bytes() const override;

  Mode mode() const { return mode_; }
  /// Steps skipped for a non-finite loss or gradient in this fit (Mode::Skip).
  int64_t skipped() const { return skipped_; }
  /// The event that stopped the fit (Mode::Fail), or the last skipped one (Mode::Skip).
  const std::optional<NonFiniteEvent>& last() const { return last_; }
  /// {"mode", "skipped_steps", "event"?: NonFiniteEvent} for the run report.
  nlohmann::json record() const;

  /// The count of skips, so a resumed run reports the whole run's.
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(Learner&, torch::serialize::InputArchive& a) override;

 private:
  void snapshot_buffers(Learner& l);
  void restore_buffers(Learner& l) const;
  GradientVerdict* riding_verdict(Learner& l) const;
  void withdraw_request(Learner& l);
  [[noreturn]] void fail_at_gradient(const Learner& l, std::string parameter, int64_t steps, bool ran);
  NonFiniteEvent event_at(const Learner& l) const;

  Mode mode_;
  Scan scan_;
  int64_t verdict_due_ = -1;  // Scan::InStep: the optimizer's checked_steps() after this step
  double step_loss_ = 0;      // the loss before_step saw
  int64_t skipped_ = 0;
  DataParallel* dp_ = nullptr;  // data parallel: the loss verdict's ride (DataParallel::flag_slot)
  size_t loss_slot_ = 0;
  bool loss_bad_ = false;  // a micro-batch of this batch had a non-finite loss
  std::optional<NonFiniteEvent> last_;
  // Mode::Skip: the buffers as they were before the step under way, in tensors allocated once
  // (again only if the model's buffers change: a stage rewrote the model).
  std::vector<torch::Tensor> buffers_;
  bool snapshot_due_ = true;  // the next forward starts a step
};

}  // namespace frugal
