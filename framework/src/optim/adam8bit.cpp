// 8-bit Adam: Adam whose moments are stored block-wise quantized to one byte per element
// (bitsandbytes' dynamic maps and block size), float32 for parameters under 4096 elements.
#include "frugal/base/compat.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/optimizers.h"
#include "optim/adam8bit_kernel.h"
#include "optim/optim_step.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace frugal {

using torch::Tensor;

// ---- block-wise dynamic quantization --------------------------------------------------------

namespace quant8 {

// bitsandbytes' create_dynamic_map: for each decimal exponent i in 0..6, the midpoints of a
// linear split of [0.1, 1] (2^i pieces signed, 2^(i+1) unsigned) times 10^(i-6), mirrored
// for the signed map; then 0 and 1. 127 x 2 + 2 = 254 + 2 = 256 codes either way.
Tensor dynamic_map(bool is_signed) {
  const int max_exponent_bits = 7, non_sign_bits = 7;
  std::vector<double> data;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int items = is_signed ? (1 << (i + non_sign_bits - max_exponent_bits)) + 1
                                : (1 << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    // torch.linspace(0.1, 1, items) in float32, as bitsandbytes computes it
    const Tensor bounds = torch::linspace(0.1, 1.0, items, torch::kFloat).to(torch::kDouble);
    const double scale = std::pow(10.0, -(max_exponent_bits - 1) + i);
    for (int k = 0; k + 1 < items; ++k) {
      const double mean = (bounds[k].item<double>() + bounds[k + 1].item<double>()) / 2.0;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  TORCH_INTERNAL_ASSERT(data.size() == 256, "dynamic map of ", data.size(), " codes");
  std::sort(data.begin(), data.end());
  return torch::tensor(data, torch::kDouble).to(torch::kFloat);
}

namespace {
int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Quantized in chunks of this many blocks: the search's int64 indices and float temporaries
// (about 40 bytes per element) stay a few MiB instead of growing with the largest parameter.
constexpr int64_t kChunkBlocks = 32;

/// One chunk (whole blocks but perhaps the last) of a flat float32 tensor into `codes` and
/// `absmax`, views of the result.
void quantize_chunk(const Tensor& flat, const Tensor& map, Tensor codes, Tensor absmax,
                    bool keep_positive) {
  const int64_t n = flat.numel(), nb = blocks_of(n);
  const Tensor padded = torch::constant_pad_nd(flat, {0, nb * kBlock - n}).view({nb, kBlock});
  absmax.copy_(padded.abs().amax(1));
  // An all-zero block divides by 1: its elements are 0, code 0.0.
  const Tensor scale = torch::where(absmax > 0, absmax, torch::ones_like(absmax));
  const Tensor normed = (padded / scale.unsqueeze(1)).reshape({-1}).narrow(0, 0, n);
  // The nearest code: the first code >= x and the one below it, the lower on a tie.
  const Tensor hi = torch::searchsorted(map, normed).clamp_(1, map.numel() - 1);
  const Tensor lo = hi - 1;
  const Tensor take_lo = (normed - map.index_select(0, lo)) <= (map.index_select(0, hi) - normed);
  Tensor nearest = torch::where(take_lo, lo, hi);
  // The second moment's zero point (Li et al. 2023, "Memory Efficient Optimizers with 4-bit
  // States"): a positive v read back as 0 makes the next update m / eps. In a block whose
  // largest gradient is G, every element with |g| < 4e-4 G lands there, while its first moment
  // (signed map, finer near 0) does not; a unit silent for one batch then moves by ~lr / eps.
  // Such a v keeps the smallest positive code instead.
  if (keep_positive) nearest.masked_fill_((normed > 0).logical_and(nearest == 0), 1);
  codes.copy_(nearest);
}
}  // namespace

Quantized quantize(const Tensor& x, const Tensor& map, bool keep_positive) {
  const Tensor flat = x.detach().reshape({-1}).to(torch::kFloat);
  const int64_t n = flat.numel(), chunk = kChunkBlocks * kBlock;
  Quantized q;
  q.codes = torch::empty({n}, flat.options().dtype(torch::kUInt8));
  q.absmax = torch::empty({blocks_of(n)}, flat.options());
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t len = std::min(chunk, n - begin);
    quantize_chunk(flat.narrow(0, begin, len), map, q.codes.narrow(0, begin, len),
                   q.absmax.narrow(0, begin / kBlock, blocks_of(len)), keep_positive);
  }
  return q;
}

Tensor dequantize(const Quantized& q, const Tensor& map) {
  const int64_t n = q.codes.numel(), chunk = kChunkBlocks * kBlock;
  Tensor out = torch::empty({n}, q.absmax.options());
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t len = std::min(chunk, n - begin);
    const Tensor values = map.index_select(0, q.codes.narrow(0, begin, len).to(torch::kLong));
    const Tensor scale = q.absmax.narrow(0, begin / kBlock, blocks_of(len)).repeat_interleave(kBlock);
    out.narrow(0, begin, len).copy_(values * scale.narrow(0, 0, len));
  }
  return out;
}

}  // namespace quant8

// ---- options and state ----------------------------------------------------------------------

Adam8bitOptions::Adam8bitOptions(double lr) : lr_(lr) {}

void Adam8bitOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled);
}

void Adam8bitOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  c10::IValue decoupled_value;  // absent in checkpoints written before adamw8bit: coupled
  decoupled(archive.try_read("decoupled", decoupled_value) && decoupled_value.toBool());
}

void Adam8bitParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_codes);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_absmax);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_codes);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_absmax);
}

void Adam8bitParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_codes);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_absmax);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_sq_codes);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(Tensor, exp_avg_sq_absmax);
}

int64_t Adam8bitParamState::bytes() const {
  int64_t total = 0;
  for (const Tensor* t : {&exp_avg(), &exp_avg_sq(), &exp_avg_codes(), &exp_avg_absmax(),
                          &exp_avg_sq_codes(), &exp_avg_sq_absmax()})
    total += tensor_bytes(*t);  // in memory (offloaded codes are not)
  return total;
}

// ---- the optimizer --------------------------------------------------------------------------

namespace {
void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("adam8bit: " + what);
}
}  // namespace

Adam8bit::Adam8bit(std::vector<torch::optim::OptimizerParamGroup> groups, Adam8bitOptions defaults)
    : Optimizer(std::move(groups), std::make_unique<Adam8bitOptions>(defaults)),
      map1_(quant8::dynamic_map(true)),
      map2_(quant8::dynamic_map(false)) {
  const auto [b1, b2] = defaults.betas();
  require(defaults.lr() > 0, "lr must be > 0, got " + std::to_string(defaults.lr()));
  require(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1, "betas must be in [0, 1)");
  require(defaults.eps() > 0, "eps must be > 0, got " + std::to_string(defaults.eps()));
  require(defaults.weight_decay() >= 0, "weight_decay must be >= 0");
}

int64_t Adam8bit::state_bytes(int64_t numel) {
  if (numel < quant8::kMinElements) return 2 * 4 * numel;
  const int64_t blocks = (numel + quant8::kBlock - 1) / quant8::kBlock;
  return 2 * (numel + 4 * blocks);
}

torch::Tensor Adam8bit::step(LossClosure closure) {
  return step_each_parameter<Adam8bitOptions>(param_groups_, closure,
                                    [this](Tensor& p, const Adam8bitOptions& o) { step_one(p, o); });
}

namespace {
bool fusable(const Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.layout() == torch::kStrided &&
         t.is_contiguous();
}
// Whether a parameter's saved state is what the fused pass writes through raw pointers: on the
// CPU, contiguous, of the parameter's size (a checkpoint is untrusted input: the tensor path
// would throw on a mismatch, the pass would write past its buffers).
bool state_fits(const Adam8bitParamState& s, int64_t n, bool quantized) {
  auto fits = [](const Tensor& t, torch::ScalarType type, int64_t numel) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() &&
           t.numel() == numel;
  };
  if (!quantized) return fits(s.exp_avg(), torch::kFloat, n) && fits(s.exp_avg_sq(), torch::kFloat, n);
  const int64_t blocks = (n + quant8::kBlock - 1) / quant8::kBlock;
  return fits(s.exp_avg_codes(), torch::kUInt8, n) && fits(s.exp_avg_sq_codes(), torch::kUInt8, n) &&
         fits(s.exp_avg_absmax(), torch::kFloat, blocks) &&
         fits(s.exp_avg_sq_absmax(), torch::kFloat, blocks);
}
}  // namespace

// The fused pass (adam8bit_kernel.h): the state's tensors are made once and then written in
// place; nothing else is allocated, so an out-of-memory error cannot stop it half-way.
void Adam8bit::step_fused(Tensor& p, Adam8bitParamState& s, const Adam8bitOptions& o) {
  const int64_t n = p.numel(), t = s.step() + 1;
  const bool quantized = n >= quant8::kMinElements, first = s.step() == 0;
  if (first && quantized) {
    const int64_t blocks = (n + quant8::kBlock - 1) / quant8::kBlock;
    s.exp_avg_codes(torch::empty({n}, p.options().dtype(torch::kUInt8)))
        .exp_avg_absmax(torch::empty({blocks}, p.options()))
        .exp_avg_sq_codes(torch::empty({n}, p.options().dtype(torch::kUInt8)))
        .exp_avg_sq_absmax(torch::empty({blocks}, p.options()));
  } else if (first) {
    s.exp_avg(torch::zeros_like(p)).exp_avg_sq(torch::zeros_like(p));
  }
  const auto [beta1, beta2] = o.betas();
  const double bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
  const bool decay = o.weight_decay() != 0;
  const quant8::BlockAdamArgs a{static_cast<float>(beta1),     static_cast<float>(1 - beta1),
                                static_cast<float>(beta2),     static_cast<float>(1 - beta2),
                                static_cast<float>(std::sqrt(bc2)), static_cast<float>(o.eps()),
                                static_cast<float>(-(o.lr() / bc1)),
                                static_cast<float>(o.weight_decay()),
                                static_cast<float>(1 - o.lr() * o.weight_decay()),
                                decay && !o.decoupled(), decay && o.decoupled()};
  float* pp = p.data_ptr<float>();
  const float* g = p.grad().data_ptr<float>();
  if (quantized)
    quant8::adam8bit_step(pp, g, s.exp_avg_codes().data_ptr<uint8_t>(),
                          s.exp_avg_absmax().data_ptr<float>(),
                          s.exp_avg_sq_codes().data_ptr<uint8_t>(),
                          s.exp_avg_sq_absmax().data_ptr<float>(), n, map1_.data_ptr<float>(),
                          map2_.data_ptr<float>(), first, a);
  else
    quant8::adam_float_step(pp, g, s.exp_avg().data_ptr<float>(), s.exp_avg_sq().data_ptr<float>(),
                            n, a);
  s.step(t);
}

// torch::optim::Adam's step (LibTorch 1.13's arithmetic, op for op) on float32 moments that
// are dequantized before and quantized after when the parameter is large enough.
void Adam8bit::step_one(Tensor& p, const Adam8bitOptions& o) {
  Tensor grad = p.grad();
  TORCH_CHECK(!grad.is_sparse(), "Adam8bit does not support sparse gradients");
  auto& slot = state_[compat::optimizer_state_key(p)];
  if (!slot) slot = std::make_unique<Adam8bitParamState>();
  auto& s = static_cast<Adam8bitParamState&>(*slot);
  const bool quantized = p.numel() >= quant8::kMinElements;
  if (map1_.device() != p.device()) {  // the maps live where the parameters do (CUDA)
    map1_ = map1_.to(p.device());
    map2_ = map2_.to(p.device());
  }
  if (o.fused() && fusable(p) && fusable(grad) && grad.sizes() == p.sizes() &&
      (s.step() == 0 || state_fits(s, p.numel(), quantized))) {
    step_fused(p, s, o);
    return;
  }
  Tensor m, v;
  if (s.step() == 0) {
    m = torch::zeros_like(p, torch::MemoryFormat::Preserve);
    v = torch::zeros_like(p, torch::MemoryFormat::Preserve);
  } else if (quantized) {
    m = quant8::dequantize({s.exp_avg_codes(), s.exp_avg_absmax()}, map1_).view(p.sizes());
    v = quant8::dequantize({s.exp_avg_sq_codes(), s.exp_avg_sq_absmax()}, map2_).view(p.sizes());
  } else {
    m = s.exp_avg();
    v = s.exp_avg_sq();
  }
  const int64_t t = s.step() + 1;
  const auto [beta1, beta2] = o.betas();
  const double bias_correction1 = 1 - std::pow(beta1, t);
  const double bias_correction2 = 1 - std::pow(beta2, t);
  if (o.weight_decay() != 0 && !o.decoupled()) grad = grad.add(p, o.weight_decay());
  m.mul_(beta1).add_(grad, 1 - beta1);
  v.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  // Quantized before p changes: a failure here (out of memory) leaves p and its state as they
  // were, so a retried step is not a second one.
  quant8::Quantized q1, q2;
  if (quantized) {
    q1 = quant8::quantize(m, map1_);
    q2 = quant8::quantize(v, map2_, /*keep_positive=*/true);
  }
  const Tensor denom = (v.sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  if (o.weight_decay() != 0 && o.decoupled()) p.mul_(1 - o.lr() * o.weight_decay());  // as AdamW
  p.addcdiv_(m, denom, -o.lr() / bias_correction1);
  s.step(t);
  if (quantized) {
    // Into the tensors the state holds when they fit (no allocation, so nothing can fail
    // after p changed): whoever holds them (offload's mapped files) keeps them.
    const auto into = [](const Tensor& held, const Tensor& now) {
      if (!held.defined() || held.sizes() != now.sizes() || held.dtype() != now.dtype()) return now;
      Tensor(held).copy_(now);
      return held;
    };
    s.exp_avg_codes(into(s.exp_avg_codes(), q1.codes)).exp_avg_absmax(into(s.exp_avg_absmax(), q1.absmax));
    s.exp_avg_sq_codes(into(s.exp_avg_sq_codes(), q2.codes))
        .exp_avg_sq_absmax(into(s.exp_avg_sq_absmax(), q2.absmax));
  } else {
    s.exp_avg(m).exp_avg_sq(v);
  }
}

void Adam8bit::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }

void Adam8bit::load(torch::serialize::InputArchive& archive) { serialize(*this, archive); }

}  // namespace frugal
