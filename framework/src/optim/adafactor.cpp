// Adafactor: a factored second moment, update clipping, an optional relative step size and
// first moment. The arithmetic of fairseq's and Hugging Face's Adafactor, with a parameter of
// more than 2 dimensions factored as (first dimension) x (all the others), as the paper treats
// a matrix, rather than over its last two dimensions (a conv kernel's 3 x 3).
#include "frugal/base/compat.h"
#include "frugal/optim/adafactor.h"
#include "optim/optim_step.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace frugal {
namespace {

using torch::Tensor;

/// The r x c matrix a parameter's second moment is factored over.
std::pair<int64_t, int64_t> rows_cols(torch::IntArrayRef shape) {
  int64_t rows = shape[0], n = 1;
  for (int64_t d : shape) n *= d;
  return {rows, rows ? n / rows : 0};
}

/// Root mean square of t's elements, as a 0-dim tensor (no device sync).
Tensor rms(const Tensor& t) { return t.pow(2).mean().sqrt(); }

/// The step size of step t of a parameter: lr, or the relative step; times RMS(p) when
/// scale_parameter.
double step_size(const AdafactorOptions& o, int64_t t, const Tensor& p) {
  double size = o.lr();
  if (o.relative_step()) {
    const double min_step = o.warmup_init() ? 1e-6 * double(t) : 1e-2;
    size = std::min(min_step, 1.0 / std::sqrt(double(t)));
  }
  if (o.scale_parameter()) size *= std::max(o.eps2(), rms(p).item<double>());
  return size;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("adafactor: " + what);
}

}  // namespace

AdafactorOptions::AdafactorOptions(double lr) : lr_(lr) {}

void AdafactorOptions::check() const {
  require(lr() > 0, "lr must be > 0, got " + std::to_string(lr()));
  require(eps1() > 0 && eps2() > 0, "eps1 and eps2 must be > 0");
  require(clip_threshold() > 0, "clip_threshold must be > 0, got " + std::to_string(clip_threshold()));
  require(decay_rate() < 0, "decay_rate must be < 0 (beta2 = 1 - t^decay_rate), got " +
                                std::to_string(decay_rate()));
  require(beta1() >= 0 && beta1() < 1, "beta1 must be in [0, 1), got " + std::to_string(beta1()));
  require(weight_decay() >= 0, "weight_decay must be >= 0, got " + std::to_string(weight_decay()));
}

void AdafactorOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps1);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps2);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(clip_threshold);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decay_rate);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(beta1);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(relative_step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(scale_parameter);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(warmup_init);
}

void AdafactorOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps1);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps2);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, clip_threshold);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, decay_rate);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, beta1);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, relative_step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, scale_parameter);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, warmup_init);
}

void AdafactorParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_row);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_col);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
}

void AdafactorParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_sq_row);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_sq_col);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg);
}

Adafactor::Adafactor(std::vector<torch::optim::OptimizerParamGroup> groups,
                     AdafactorOptions defaults)
    : Optimizer(std::move(groups), std::make_unique<AdafactorOptions>(defaults)) {
  defaults.check();
}

int64_t Adafactor::state_bytes(torch::IntArrayRef shape, bool momentum) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t f = 4;  // float32
  int64_t bytes = momentum ? f * n : 0;
  if (factored(shape)) {
    const auto [r, c] = rows_cols(shape);
    return bytes + f * (r + c);
  }
  return bytes + f * n;
}

torch::Tensor Adafactor::step(LossClosure closure) {
  return step_each_parameter<AdafactorOptions>(param_groups_, closure,
                                    [this](Tensor& p, const AdafactorOptions& o) { step_one(p, o); });
}

void Adafactor::step_one(Tensor& p, const AdafactorOptions& o) {
  const Tensor grad = p.grad();
  TORCH_CHECK(!grad.is_sparse(), "Adafactor does not support sparse gradients");
  auto& slot = state_[compat::optimizer_state_key(p)];
  const bool fact = factored(p.sizes());
  const auto [r, c] = fact ? rows_cols(p.sizes()) : std::pair<int64_t, int64_t>{0, 0};
  if (!slot) slot = std::make_unique<AdafactorParamState>();
  auto& s = static_cast<AdafactorParamState&>(*slot);
  // Zeros for what is missing (also after a resume, or a change of beta1 between stages).
  if (fact && !s.exp_avg_sq_row().defined()) {
    s.exp_avg_sq_row(torch::zeros({r}, grad.options()));
    s.exp_avg_sq_col(torch::zeros({c}, grad.options()));
  }
  if (!fact && !s.exp_avg_sq().defined())
    s.exp_avg_sq(torch::zeros_like(grad, torch::MemoryFormat::Preserve));
  if (o.beta1() > 0 && !s.exp_avg().defined())
    s.exp_avg(torch::zeros_like(grad, torch::MemoryFormat::Preserve));
  s.step(s.step() + 1);
  const double lr = step_size(o, s.step(), p);
  const double beta2t = 1.0 - std::pow(double(s.step()), o.decay_rate());
  const Tensor g2 = grad * grad + o.eps1();
  Tensor update;
  if (fact) {
    const Tensor g2m = g2.reshape({r, c});
    s.exp_avg_sq_row().mul_(beta2t).add_(g2m.mean(1), 1.0 - beta2t);
    s.exp_avg_sq_col().mul_(beta2t).add_(g2m.mean(0), 1.0 - beta2t);
    // V ~ row col^T / sum(row): the rank-1 estimate, as 1/sqrt of a row and a column factor.
    const Tensor row = s.exp_avg_sq_row();
    const Tensor r_factor = (row / row.mean()).rsqrt().unsqueeze(1);
    const Tensor c_factor = s.exp_avg_sq_col().rsqrt().unsqueeze(0);
    update = (r_factor * c_factor).mul_(grad.reshape({r, c})).reshape(p.sizes());
  } else {
    s.exp_avg_sq().mul_(beta2t).add_(g2, 1.0 - beta2t);
    update = s.exp_avg_sq().rsqrt().mul_(grad);
  }
  update.div_((rms(update) / o.clip_threshold()).clamp_min_(1.0));
  update.mul_(lr);
  if (o.beta1() > 0) {
    s.exp_avg().mul_(o.beta1()).add_(update, 1.0 - o.beta1());
    update = s.exp_avg();
  }
  if (o.weight_decay() > 0) p.add_(p, -o.weight_decay() * lr);
  p.sub_(update);
}

void Adafactor::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }

void Adafactor::load(torch::serialize::InputArchive& archive) { serialize(*this, archive); }

}  // namespace frugal
