// amp: mixed precision (autocast + a loss scaler with PyTorch's GradScaler semantics).
#include "amp.h"

#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include <frugal/base/compat.h>
#include <frugal/distributed/distributed.h>
#include <frugal/base/error.h>

namespace frugal::amp {

bool unscale_and_check(const std::vector<torch::Tensor>& grads, double inv_scale) {
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

// ---- GradScaler ---------------------------------------------------------------------------

GradScaler::GradScaler(ScalerOptions o) : o_(o), state_{o.init_scale, 0} {
  if (!(o.init_scale > 0) || !std::isfinite(o.init_scale))
    throw std::invalid_argument("GradScaler: init_scale must be a finite number > 0");
  if (!(o.growth_factor > 1.0))
    throw std::invalid_argument("GradScaler: growth_factor must be > 1");
  if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
    throw std::invalid_argument("GradScaler: backoff_factor must be in (0, 1)");
  if (o.growth_interval < 1)
    throw std::invalid_argument("GradScaler: growth_interval must be >= 1");
}

bool GradScaler::unscale(const std::vector<torch::Tensor>& grads) {
  ++unscales_;
  return unscale_and_check(grads, 1.0 / state_.scale);
}

void GradScaler::update(bool found_inf) {
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

void GradScaler::load_state(const ScalerState& s) {
  if (!(s.scale > 0) || s.growth_tracker < 0)
    throw std::invalid_argument("GradScaler::load_state: scale must be > 0, tracker >= 0");
  state_ = s;
}

// ---- options ------------------------------------------------------------------------------

void AmpOptions::visit(frugal::FieldVisitor& v) {
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

// ---- the callback -------------------------------------------------------------------------

Amp::Amp(const AmpOptions& o, const frugal::PluginContext& ctx)
    : o_(o), log_(ctx.logger), scaler_(o.scaler_options()) {}

void Amp::release_caches(frugal::Learner&) { frugal::compat::clear_autocast_cache(); }

void Amp::before_fit(frugal::Learner& l) {
  resolve(l.device());
  log_->info("autocast {} on {}; loss scaler {}{}", c10::toString(dtype_),
             c10::DeviceTypeName(device_, true), use_scaler_ ? "on, scale " : "off",
             use_scaler_ ? std::to_string(scaler_.scale()) : "");
}

void Amp::before_forward(frugal::Learner&) {
  if (!active_) enter();
}

torch::Tensor Amp::wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                                const frugal::ForwardNext& next) {
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

void Amp::after_loss(frugal::Learner& l) {
  if (use_scaler_) l.scale_loss(scaler_.scale());
  if (active_) leave();
}

void Amp::after_backward(frugal::Learner& l) {
  if (!use_scaler_ || !l.completes_step()) return;
  std::vector<torch::Tensor> grads;
  for (const auto& p : l.model()->parameters())
    if (p.grad().defined()) grads.push_back(p.grad());
  const double scale = scaler_.scale();
  // Every rank must skip the same steps, and a rank may hold only its share of the gradients
  // (a sharded sync): the verdict is the ranks' any.
  const bool found_inf = l.collective().any(scaler_.unscale(grads));
  scaler_.update(found_inf);
  if (found_inf) {
    l.skip_step();
    l.zero_grad();
    log_->debug("batch {}: inf/NaN gradients at scale {}: step skipped, scale now {}",
                l.iteration(), scale, scaler_.scale());
  }
}

void Amp::after_batch(frugal::Learner&) {
  if (active_) leave();  // the batch was skipped between forward and loss
}

void Amp::after_fit(frugal::Learner&) {
  if (active_) leave();
  if (use_scaler_)
    log_->info("loss scale {} after {} unscales; {} steps skipped for inf/NaN", scaler_.scale(),
               scaler_.unscale_calls(), scaler_.skipped_steps());
}

void Amp::save_state(torch::serialize::OutputArchive& a) const {
  const ScalerState st = scaler_.state();
  a.write("scale", c10::IValue(st.scale));
  a.write("growth_tracker", c10::IValue(st.growth_tracker));
}

void Amp::load_state(frugal::Learner&, torch::serialize::InputArchive& a) {
  c10::IValue scale, tracker;
  if (!a.try_read("scale", scale) || !a.try_read("growth_tracker", tracker) ||
      !scale.isDouble() || !tracker.isInt())
    throw std::runtime_error("the checkpoint holds no loss-scaler state for amp");
  scaler_.load_state({scale.toDouble(), tracker.toInt()});
}

void Amp::resolve(const torch::Device& d) {
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

void Amp::enter() {
  prev_enabled_ = frugal::compat::autocast_enabled(device_);
  prev_dtype_ = frugal::compat::autocast_dtype(device_);
  frugal::compat::set_autocast(device_, true, dtype_);
  active_ = true;
}

void Amp::leave() {
  frugal::compat::set_autocast(device_, prev_enabled_, prev_dtype_);
  if (!prev_enabled_) frugal::compat::clear_autocast_cache();  // as autocast's __exit__
  active_ = false;
}

}  // namespace frugal::amp

FRUGAL_PLUGIN(frugal::amp::Amp, frugal::amp::AmpOptions, "amp",
              "mixed precision: autocast (bfloat16 on cpu, float16 on cuda) and a loss scaler",
              "1.0.0")
