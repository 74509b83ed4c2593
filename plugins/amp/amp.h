#pragma once
/// amp: mixed precision. Autocast runs the forward and the loss in a lower precision; a
/// GradScaler with PyTorch's semantics (torch.cuda.amp.GradScaler) keeps float16 gradients
/// from underflowing. The scaler is plain C++ so tests and resume reach it.
#include <cstdint>
#include <string>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

namespace frugal::amp {

/// torch.cuda.amp.GradScaler's constructor arguments, with its defaults.
struct ScalerOptions {
  double init_scale = 65536.0;   ///< default 2^16
  double growth_factor = 2.0;    ///< default 2: the scale after growth_interval finite steps
  double backoff_factor = 0.5;   ///< default 0.5: the scale after a step with inf/NaN
  int64_t growth_interval = 2000;  ///< default 2000 consecutive finite steps
};

/// What a checkpoint must keep to resume (GradScaler.state_dict()).
struct ScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;  ///< consecutive finite steps since the last change
};

/// Multiplies every defined gradient by `inv_scale` in place and reports whether any holds an
/// inf or a NaN (torch's _amp_foreach_non_finite_check_and_unscale_). One device sync.
bool unscale_and_check(const std::vector<torch::Tensor>& grads, double inv_scale);

/// PyTorch's GradScaler: scale the loss, unscale the gradients once per optimizer step, skip the
/// step and back off when they hold inf/NaN, grow the scale after growth_interval good steps.
class GradScaler {
 public:
  /// Throws std::invalid_argument for options torch's GradScaler would not accept.
  explicit GradScaler(ScalerOptions o = {});

  /// The factor the loss is multiplied by before backward.
  double scale() const { return state_.scale; }
  int64_t growth_tracker() const { return state_.growth_tracker; }

  /// Divides the gradients by the scale (in place); returns whether any is inf/NaN. Call once
  /// per optimizer step, after the last backward that contributes to it.
  bool unscale(const std::vector<torch::Tensor>& grads);
  /// After unscale: backs off (and resets the tracker) on inf/NaN, else counts a good step and
  /// grows the scale every growth_interval of them (torch's _amp_update_scale_).
  void update(bool found_inf);

  /// For checkpoint/resume (GradScaler.state_dict / load_state_dict).
  ScalerState state() const { return state_; }
  void load_state(const ScalerState& s);

  int64_t unscale_calls() const { return unscales_; }  ///< unscale() calls so far
  int64_t skipped_steps() const { return skipped_; }   ///< update(true) calls so far

 private:
  ScalerOptions o_;
  ScalerState state_;
  int64_t unscales_ = 0, skipped_ = 0;
};

/// [plugins.amp]: TOML keys are the field names.
struct AmpOptions : frugal::Options {
  std::string dtype = "auto";      ///< default "auto": bfloat16 on cpu, float16 on cuda
  std::string scaler = "auto";     ///< default "auto": on for float16, off for bfloat16
  double init_scale = 65536.0;     ///< default 2^16
  double growth_factor = 2.0;      ///< default 2
  double backoff_factor = 0.5;     ///< default 0.5
  int64_t growth_interval = 2000;  ///< default 2000
  void visit(frugal::FieldVisitor& v) override;
  ScalerOptions scaler_options() const {
    return {init_scale, growth_factor, backoff_factor, growth_interval};
  }
};

/// The plugin's callback. Autocast is on from before_forward to after_loss (the forward and the
/// loss, as `with autocast(): loss = loss_fn(model(x), y)`), and around every other forward
/// (validation, predict) through wrap_forward. The scaler multiplies each micro-batch's loss in
/// after_loss and unscales once per optimizer step, after the step's last backward.
class Amp : public frugal::Callback {
 public:
  Amp(const AmpOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "amp"; }
  /// After grad_accum (order::kBatchGrouping), which decides which batches step; below
  /// checkpoint (order::kInnermostForward), so autocast is on around the checkpointed forward.
  int order() const override { return frugal::order::kPrecision; }
  /// Autocast's cast cache (weights cast to the lower precision) is the cache amp adds.
  void release_caches(frugal::Learner&) override;
  bool wraps_forward() const override { return true; }

  /// Resolves dtype and scaler for the run's device; float16 on cpu stops here.
  void before_fit(frugal::Learner& l) override;
  /// Turns autocast on for the forward and the loss.
  void before_forward(frugal::Learner&) override;
  /// Forwards outside training (validation, predict) run under autocast too.
  torch::Tensor wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                             const frugal::ForwardNext& next) override;
  /// The loss is computed: scales it for backward and restores autocast (clearing its cache).
  void after_loss(frugal::Learner& l) override;
  /// After the last backward of a batch that steps: unscales once, and drops the step when a
  /// gradient is inf/NaN. Batches that only accumulate (step_skipped) keep scaled gradients.
  void after_backward(frugal::Learner& l) override;
  /// Leaves autocast if the batch was skipped between forward and loss.
  void after_batch(frugal::Learner&) override;
  void after_fit(frugal::Learner&) override;

  /// The loss scale and its growth tracker (GradScaler.state_dict()), so a resumed run
  /// scales, skips and grows exactly as the uninterrupted one.
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(frugal::Learner&, torch::serialize::InputArchive& a) override;

  /// The scaler, for checkpoint/resume (state(), load_state()) and for tests.
  GradScaler& scaler() { return scaler_; }
  const GradScaler& scaler() const { return scaler_; }

 private:
  void resolve(const torch::Device& d);
  void enter();
  void leave();

  AmpOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  GradScaler scaler_;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  at::ScalarType dtype_ = at::kBFloat16, prev_dtype_ = at::kBFloat16;
  bool resolved_ = false, use_scaler_ = false, active_ = false, prev_enabled_ = false;
};

}  // namespace frugal::amp
