#pragma once
/// amp: mixed precision. Autocast runs the forward and the loss in a lower precision; a
/// GradScaler with PyTorch's semantics (torch.cuda.amp.GradScaler) keeps float16 gradients
/// from underflowing. The scaler is plain C++ here so tests and a checkpoint can reach it.
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <frugal/compat.h>
#include <frugal/error.h>
#include <frugal/learner.h>
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
inline bool unscale_and_check(const std::vector<torch::Tensor>& grads, double inv_scale) {
  std::vector<torch::Tensor> defined;
  for (const auto& g : grads)
    if (g.defined()) defined.push_back(g);
  if (defined.empty()) return false;
  // inv_scale in float32, as torch computes it: scale.double().reciprocal().float().
  const float inv = static_cast<float>(inv_scale);
#ifdef FRUGAL_WITH_CUDA
  if (defined.front().is_cuda()) {
    auto opts = defined.front().options().dtype(torch::kFloat);
    torch::Tensor found = torch::zeros({1}, opts), inv_t = torch::full({1}, inv, opts);
    std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;  // the fused op wants one
    for (const auto& g : defined) by_dtype[g.scalar_type()].push_back(g);
    for (auto& kv : by_dtype) at::_amp_foreach_non_finite_check_and_unscale_(kv.second, found, inv_t);
    return found.item<float>() > 0;
  }
#endif
  torch::NoGradGuard no_grad;
  torch::Tensor all_finite;
  for (const auto& g : defined) {
    torch::Tensor ok = torch::isfinite(g).all();
    all_finite = all_finite.defined() ? all_finite.logical_and(ok) : ok;
    g.mul_(inv);
  }
  return !all_finite.item<bool>();
}

/// PyTorch's GradScaler: scale the loss, unscale the gradients once per optimizer step, skip the
/// step and back off when they hold inf/NaN, grow the scale after growth_interval good steps.
class GradScaler {
 public:
  explicit GradScaler(ScalerOptions o = {}) : o_(o), state_{o.init_scale, 0} {
    if (!(o.init_scale > 0) || !std::isfinite(o.init_scale))
      throw std::invalid_argument("GradScaler: init_scale must be a finite number > 0");
    if (!(o.growth_factor > 1.0))
      throw std::invalid_argument("GradScaler: growth_factor must be > 1");
    if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
      throw std::invalid_argument("GradScaler: backoff_factor must be in (0, 1)");
    if (o.growth_interval < 1)
      throw std::invalid_argument("GradScaler: growth_interval must be >= 1");
  }

  /// The factor the loss is multiplied by before backward.
  double scale() const { return state_.scale; }
  int64_t growth_tracker() const { return state_.growth_tracker; }
  const ScalerOptions& options() const { return o_; }

  /// Divides the gradients by the scale (in place); returns whether any is inf/NaN. Call once
  /// per optimizer step, after the last backward that contributes to it.
  bool unscale(const std::vector<torch::Tensor>& grads) {
    ++unscales_;
    return unscale_and_check(grads, 1.0 / state_.scale);
  }
  /// After unscale: backs off (and resets the tracker) on inf/NaN, else counts a good step and
  /// grows the scale every growth_interval of them (torch's _amp_update_scale_).
  void update(bool found_inf) {
    if (found_inf) {
      state_.scale *= o_.backoff_factor;
      state_.growth_tracker = 0;
      ++skipped_;
      return;
    }
    if (++state_.growth_tracker == o_.growth_interval) {
      const double grown = state_.scale * o_.growth_factor;
      if (std::isfinite(static_cast<float>(grown))) state_.scale = grown;  // float32, as torch
      state_.growth_tracker = 0;
    }
  }

  /// For checkpoint/resume (GradScaler.state_dict / load_state_dict).
  ScalerState state() const { return state_; }
  void load_state(const ScalerState& s) {
    if (!(s.scale > 0) || s.growth_tracker < 0)
      throw std::invalid_argument("GradScaler::load_state: scale must be > 0, tracker >= 0");
    state_ = s;
  }

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
  void visit(frugal::FieldVisitor& v) override {
    v.field("dtype", dtype,
            "autocast's lower precision: auto = bfloat16 on cpu, float16 on cuda; float16 needs "
            "cuda",
            {"auto", "bfloat16", "float16"});
    v.field("scaler", scaler,
            "loss scaling against float16 underflow: auto = on for float16, off for bfloat16 "
            "(its range is float32's)",
            {"auto", "on", "off"});
    v.field("init_scale", init_scale, "the loss scale the first step uses", frugal::positive());
    v.field("growth_factor", growth_factor,
            "the scale is multiplied by this after growth_interval steps without inf/NaN",
            frugal::Limits{1.0, std::numeric_limits<double>::infinity(), true});
    v.field("backoff_factor", backoff_factor,
            "the scale is multiplied by this after a step whose gradients hold inf/NaN",
            frugal::Limits{0.0, 1.0, true, true});
    v.field("growth_interval", growth_interval,
            "consecutive steps without inf/NaN before the scale grows", frugal::at_least(1));
  }
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
  Amp(const AmpOptions& o, const frugal::PluginContext& ctx)
      : o_(o), log_(ctx.logger), scaler_(o.scaler_options()) {}
  std::string name() const override { return "amp"; }
  /// After grad_accum (order::kBatchGrouping), which decides which batches step; below
  /// checkpoint (order::kInnermostForward), so autocast is on around the checkpointed forward.
  int order() const override { return frugal::order::kPrecision; }
  /// Autocast's cast cache (weights cast to the lower precision) is the cache amp adds.
  void release_caches(frugal::Learner&) override { frugal::compat::clear_autocast_cache(); }
  bool wraps_forward() const override { return true; }

  /// Resolves dtype and scaler for the run's device; float16 on cpu stops here.
  void before_fit(frugal::Learner& l) override {
    resolve(l.device());
    log_->info("autocast {} on {}; loss scaler {}{}", c10::toString(dtype_),
               c10::DeviceTypeName(device_, true), use_scaler_ ? "on, scale " : "off",
               use_scaler_ ? std::to_string(scaler_.scale()) : "");
  }
  /// Turns autocast on for the forward and the loss.
  void before_forward(frugal::Learner&) override {
    if (!active_) enter();
  }
  /// Forwards outside training (validation, predict) run under autocast too.
  torch::Tensor wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                             const frugal::ForwardNext& next) override {
    if (!resolved_) resolve(l.device());
    const bool own = !active_;
    if (own) enter();
    try {
      torch::Tensor y = next(x);
      if (own) leave();
      return y;
    } catch (...) {
      if (active_) leave();  // no autocast left on after an error
      throw;
    }
  }
  /// The loss is computed: scales it for backward and restores autocast (clearing its cache).
  void after_loss(frugal::Learner& l) override {
    if (use_scaler_) l.scale_loss(scaler_.scale());
    if (active_) leave();
  }
  /// After the last backward of a batch that steps: unscales once, and drops the step when a
  /// gradient is inf/NaN. Batches that only accumulate (step_skipped) keep scaled gradients.
  void after_backward(frugal::Learner& l) override {
    if (!use_scaler_ || l.step_skipped() || l.micro_index() + 1 < l.micro_count()) return;
    std::vector<torch::Tensor> grads;
    for (const auto& p : l.model()->parameters())
      if (p.grad().defined()) grads.push_back(p.grad());
    const double scale = scaler_.scale();
    const bool found_inf = scaler_.unscale(grads);
    scaler_.update(found_inf);
    if (found_inf) {
      l.skip_step();
      l.zero_grad();
      log_->debug("batch {}: inf/NaN gradients at scale {}: step skipped, scale now {}",
                  l.iteration(), scale, scaler_.scale());
    }
  }
  void after_batch(frugal::Learner&) override {
    if (active_) leave();  // the batch was skipped between forward and loss
  }
  void after_fit(frugal::Learner&) override {
    if (active_) leave();
    if (use_scaler_)
      log_->info("loss scale {} after {} unscales; {} steps skipped for inf/NaN", scaler_.scale(),
                 scaler_.unscale_calls(), scaler_.skipped_steps());
  }

  /// The loss scale and its growth tracker (GradScaler.state_dict()), so a resumed run
  /// scales, skips and grows exactly as the uninterrupted one.
  void save_state(torch::serialize::OutputArchive& a) const override {
    const ScalerState st = scaler_.state();
    a.write("scale", c10::IValue(st.scale));
    a.write("growth_tracker", c10::IValue(st.growth_tracker));
  }
  void load_state(frugal::Learner&, torch::serialize::InputArchive& a) override {
    c10::IValue scale, tracker;
    if (!a.try_read("scale", scale) || !a.try_read("growth_tracker", tracker) ||
        !scale.isDouble() || !tracker.isInt())
      throw std::runtime_error("the checkpoint holds no loss-scaler state for amp");
    scaler_.load_state({scale.toDouble(), tracker.toInt()});
  }

  /// The scaler, for checkpoint/resume (state(), load_state()) and for tests.
  GradScaler& scaler() { return scaler_; }
  const GradScaler& scaler() const { return scaler_; }
  bool scaler_enabled() const { return use_scaler_; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  void resolve(const torch::Device& d) {
    device_ = d.type();
    if (device_ != c10::DeviceType::CPU && device_ != c10::DeviceType::CUDA)
      frugal::throw_config_error("plugins.amp: autocast runs on cpu or cuda; this run is on " +
                                 d.str());
    if (o_.dtype == "float16" && device_ == c10::DeviceType::CPU)
      frugal::throw_config_error(
          "plugins.amp: dtype = \"float16\" needs a cuda device; this run is on cpu, where "
          "autocast runs in bfloat16. Set dtype = \"bfloat16\" (or \"auto\"), or run.device = "
          "\"cuda\"");
    if (o_.dtype == "auto")
      dtype_ = device_ == c10::DeviceType::CPU ? at::kBFloat16 : at::kHalf;
    else
      dtype_ = o_.dtype == "float16" ? at::kHalf : at::kBFloat16;
    use_scaler_ = o_.scaler == "on" || (o_.scaler == "auto" && dtype_ == at::kHalf);
    resolved_ = true;
  }
  void enter() {
    prev_enabled_ = frugal::compat::autocast_enabled(device_);
    prev_dtype_ = frugal::compat::autocast_dtype(device_);
    frugal::compat::set_autocast(device_, true, dtype_);
    active_ = true;
  }
  void leave() {
    frugal::compat::set_autocast(device_, prev_enabled_, prev_dtype_);
    if (!prev_enabled_) frugal::compat::clear_autocast_cache();  // as autocast's __exit__
    active_ = false;
  }

  AmpOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  GradScaler scaler_;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  at::ScalarType dtype_ = at::kBFloat16, prev_dtype_ = at::kBFloat16;
  bool resolved_ = false, use_scaler_ = false, active_ = false, prev_enabled_ = false;
};

}  // namespace frugal::amp
