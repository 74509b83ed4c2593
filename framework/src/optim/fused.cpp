// Fused CPU optimizers (fused.h): Adam, AdamW and SGD as one pass per parameter, and the
// non-finite scan. Compiled with -O3 -fno-math-errno -ffp-contract=off (CMakeLists): the loops
// vectorize (sqrt included), and the only fused multiply-adds are the ones written below, where
// LibTorch's kernels have them.
#include "frugal/optim/fused.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

#include "frugal/base/compat.h"
#include "base/cpu_arith.h"

namespace frugal {
namespace {

constexpr int64_t kChunk = int64_t{1} << 14;        // elements per task (64 KiB of float32)
constexpr int64_t kSerialBelow = int64_t{1} << 16;  // fewer elements in all: one thread

using cpu_arith::cpu_has_avx512;
using cpu_arith::cpu_has_fma;
using cpu_arith::madd;

// A float is inf or NaN when its exponent bits are all ones: the largest exponent field seen
// (an integer maximum, which vectorizes) tells.
constexpr uint32_t kExponent = 0x7f800000u;

// Keeps in `largest` the largest exponent field seen (x's bits as an integer: it vectorizes).
FRUGAL_ALWAYS_INLINE void keep_largest_exponent(uint32_t& largest, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t e = bits & kExponent;
  largest = e > largest ? e : largest;
}

// ---- Adam and AdamW -------------------------------------------------------------------------
// LibTorch 1.13 (torch/csrc/api/src/optim/adam.cpp, adamw.cpp), per element:
//   AdamW: p.mul_(1 - lr * wd)                         p = p * decay
//   Adam:  grad = grad.add(p, wd)                      g = fma(p, wd, g)
//   exp_avg.mul_(beta1).add_(grad, 1 - beta1)          m = fma(g, 1 - b1, m * b1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1-b2)  v = fma((1 - b2) * g, g, v * b2)
//   denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)  d = sqrt(v) / sqrt(bc2) + eps
//   p.addcdiv_(exp_avg, denom, -lr / bc1)              p = p + (-lr / bc1 * m) / d
// Scalars are cast to float as the kernels cast them.
struct AdamArgs {
  float b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step, l2, decay;
};

// kCheck: also returns the largest exponent field of the gradient's elements (kExponent: one
// was inf or NaN), the non-finite check riding on the pass.
template <bool kFma, bool kL2, bool kDecay, bool kCheck>
FRUGAL_ALWAYS_INLINE uint32_t adam_span(float* __restrict p, const float* __restrict g,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const AdamArgs& a) {
  uint32_t mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    if constexpr (kDecay) pi = pi * a.decay;
    float gi = g[i];
    if constexpr (kCheck) keep_largest_exponent(mx, gi);
    if constexpr (kL2) gi = madd<kFma>(pi, a.l2, gi);
    const float mi = madd<kFma>(gi, a.omb1, m[i] * a.b1);
    const float vi = madd<kFma>(a.omb2 * gi, gi, v[i] * a.b2);
    const float d = std::sqrt(vi) / a.bc2_sqrt + a.eps;
    p[i] = pi + (a.neg_step * mi) / d;
    m[i] = mi;
    v[i] = vi;
  }
  return mx;
}

template <bool kFma, bool kCheck>
FRUGAL_ALWAYS_INLINE uint32_t adam_checked(float* p, const float* g, float* m, float* v, int64_t n,
                                           const AdamArgs& a, bool l2, bool decay) {
  if (l2) return adam_span<kFma, true, false, kCheck>(p, g, m, v, n, a);
  if (decay) return adam_span<kFma, false, true, kCheck>(p, g, m, v, n, a);
  return adam_span<kFma, false, false, kCheck>(p, g, m, v, n, a);
}

template <bool kFma>
FRUGAL_ALWAYS_INLINE uint32_t adam_any(float* p, const float* g, float* m, float* v, int64_t n,
                                       const AdamArgs& a, bool l2, bool decay, bool check) {
  return check ? adam_checked<kFma, true>(p, g, m, v, n, a, l2, decay)
               : adam_checked<kFma, false>(p, g, m, v, n, a, l2, decay);
}

FRUGAL_FMA_TARGET uint32_t adam_fma(float* p, const float* g, float* m, float* v, int64_t n,
                                    const AdamArgs& a, bool l2, bool decay, bool check) {
  return adam_any<true>(p, g, m, v, n, a, l2, decay, check);
}
uint32_t adam_plain(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a,
                    bool l2, bool decay, bool check) {
  return adam_any<false>(p, g, m, v, n, a, l2, decay, check);
}

// ---- SGD ------------------------------------------------------------------------------------
// LibTorch 1.13 (sgd.cpp), per element:
//   d_p = d_p.add(p, wd)                               d = fma(p, wd, g)
//   first step: buf = clone(d_p); later:
//   buf.mul_(momentum).add_(d_p, 1 - dampening)        b = fma(d, 1 - damp, b * mom)
//   nesterov: d_p = d_p.add(buf, momentum), else buf   d = fma(b, mom, d) | b
//   p.add_(d_p, -lr)                                   p = fma(d, -lr, p)
struct SgdArgs {
  float l2, mom, omd, neg_lr;
  bool has_l2, first, nesterov;
};

template <bool kFma, bool kL2, bool kMomentum, bool kCheck>
FRUGAL_ALWAYS_INLINE uint32_t sgd_span(float* __restrict p, const float* __restrict g,
                                       float* __restrict buf, int64_t n, const SgdArgs& a) {
  uint32_t mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if constexpr (kCheck) keep_largest_exponent(mx, d);
    if constexpr (kL2) d = madd<kFma>(p[i], a.l2, d);
    if constexpr (kMomentum) {
      const float b = a.first ? d : madd<kFma>(d, a.omd, buf[i] * a.mom);
      buf[i] = b;
      d = a.nesterov ? madd<kFma>(b, a.mom, d) : b;
    }
    p[i] = madd<kFma>(d, a.neg_lr, p[i]);
  }
  return mx;
}

template <bool kFma, bool kCheck>
FRUGAL_ALWAYS_INLINE uint32_t sgd_checked(float* p, const float* g, float* buf, int64_t n,
                                          const SgdArgs& a) {
  if (buf)
    return a.has_l2 ? sgd_span<kFma, true, true, kCheck>(p, g, buf, n, a)
                    : sgd_span<kFma, false, true, kCheck>(p, g, buf, n, a);
  return a.has_l2 ? sgd_span<kFma, true, false, kCheck>(p, g, buf, n, a)
                  : sgd_span<kFma, false, false, kCheck>(p, g, buf, n, a);
}

FRUGAL_FMA_TARGET uint32_t sgd_fma(float* p, const float* g, float* buf, int64_t n, const SgdArgs& a,
                                   bool check) {
  return check ? sgd_checked<true, true>(p, g, buf, n, a) : sgd_checked<true, false>(p, g, buf, n, a);
}
uint32_t sgd_plain(float* p, const float* g, float* buf, int64_t n, const SgdArgs& a, bool check) {
  return check ? sgd_checked<false, true>(p, g, buf, n, a) : sgd_checked<false, false>(p, g, buf, n, a);
}

// ---- the non-finite scan --------------------------------------------------------------------

template <int>
FRUGAL_ALWAYS_INLINE uint32_t max_exponent(const float* __restrict x, int64_t n) {
  uint32_t mx = 0;
  for (int64_t i = 0; i < n; ++i) keep_largest_exponent(mx, x[i]);
  return mx;
}
FRUGAL_FMA_TARGET uint32_t max_exponent_avx2(const float* x, int64_t n) { return max_exponent<1>(x, n); }
FRUGAL_AVX512_TARGET uint32_t max_exponent_avx512(const float* x, int64_t n) { return max_exponent<2>(x, n); }
uint32_t max_exponent_plain(const float* x, int64_t n) { return max_exponent<0>(x, n); }

// ---- chunks over threads --------------------------------------------------------------------

// Calls f(k, begin, end) over the elements of every span k (sizes[k] elements), in chunks
// spread over the intra-op threads; on the calling thread alone when there is little work.
void for_each_chunk(const std::vector<int64_t>& sizes,
                    const std::function<void(size_t, int64_t, int64_t)>& f) {
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  if (total < kSerialBelow || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (size_t k = 0; k < sizes.size(); ++k) f(k, 0, sizes[k]);
    return;
  }
  std::vector<std::tuple<size_t, int64_t, int64_t>> tasks;
  for (size_t k = 0; k < sizes.size(); ++k)
    for (int64_t b = 0; b < sizes[k]; b += kChunk)
      tasks.emplace_back(k, b, std::min(sizes[k], b + kChunk));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const auto& [k, b, e] = tasks[static_cast<size_t>(t)];
      f(k, b, e);
    }
  });
}

bool fusable(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat &&
         t.layout() == torch::kStrided && t.is_contiguous();
}

// Whether every parameter with a gradient can take the fused pass.
template <class GroupOptions>
bool all_fusable(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                 bool (*group_ok)(const GroupOptions&)) {
  for (const auto& group : groups) {
    if (!group_ok(static_cast<const GroupOptions&>(group.options()))) return false;
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) continue;
      if (!fusable(p) || !fusable(g) || g.sizes() != p.sizes()) return false;
    }
  }
  return true;
}

torch::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

// Which spans of a pass held an inf or a NaN, from their chunks' largest exponents (any thread).
class SpanVerdicts {
 public:
  explicit SpanVerdicts(size_t spans) : bad_(spans) {}
  void note(size_t k, uint32_t largest_exponent) {
    if (largest_exponent == kExponent) bad_[k].store(true, std::memory_order_relaxed);
  }
  /// The first span that did, or -1.
  int64_t first() const {
    for (size_t k = 0; k < bad_.size(); ++k)
      if (bad_[k].load(std::memory_order_relaxed)) return static_cast<int64_t>(k);
    return -1;
  }

 private:
  std::vector<std::atomic<bool>> bad_;
};

// The first parameter (param_groups order) whose gradient holds an inf or a NaN, or undefined.
torch::Tensor first_nonfinite_parameter(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (const auto& group : groups)
    for (const auto& p : group.params())
      if (p.grad().defined() && !all_finite({p.grad()})) return p;
  return {};
}

// A fused pass's verdict: the parameter of work item `bad` (-1: none); the pass ran regardless.
template <class Work>
void record_pass(GradientVerdict& verdict, const std::vector<Work>& work, int64_t bad) {
  verdict.record_verdict(bad >= 0 ? *work[static_cast<size_t>(bad)].param : torch::Tensor(), /*ran=*/true);
}

// LibTorch's step where the fused pass does not apply. Asked to check: the gradients are
// scanned first, and a step that would read an inf or a NaN is not run.
template <class Step>
void unfused_step(GradientVerdict& verdict, bool check,
                  const std::vector<torch::optim::OptimizerParamGroup>& groups, const Step& step) {
  if (check) {
    torch::Tensor bad = first_nonfinite_parameter(groups);
    const bool run = !bad.defined();
    verdict.record_verdict(std::move(bad), /*ran=*/false);
    if (!run) return;
  }
  step();
}

// One parameter's part of a fused Adam step: its pointers and coefficients.
struct AdamWork {
  float *p, *m, *v;
  const float* g;
  int64_t n;
  AdamArgs args;
  bool l2, decay;
  const torch::Tensor* param;
};

template <class State, class GroupOptions>
std::vector<AdamWork> adam_work(std::vector<torch::optim::OptimizerParamGroup>& groups,
                                decltype(std::declval<torch::optim::Optimizer&>().state())& state,
                                bool decoupled) {
  std::vector<AdamWork> work;
  for (auto& group : groups) {
    const auto& o = static_cast<const GroupOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state[compat::optimizer_state_key(p)];
      if (!slot) {
        auto s = std::make_unique<State>();
        s->step(0);
        s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<State&>(*slot);
      s.step(s.step() + 1);
      const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
      const double bc1 = 1 - std::pow(beta1, static_cast<double>(s.step()));
      const double bc2 = 1 - std::pow(beta2, static_cast<double>(s.step()));
      AdamWork w{p.data_ptr<float>(), s.exp_avg().template data_ptr<float>(),
                 s.exp_avg_sq().template data_ptr<float>(), p.grad().data_ptr<float>(), p.numel(), {},
                 !decoupled && o.weight_decay() != 0, decoupled && o.weight_decay() != 0, &p};
      w.args = {static_cast<float>(beta1), static_cast<float>(1 - beta1),
                static_cast<float>(beta2), static_cast<float>(1 - beta2),
                static_cast<float>(std::sqrt(bc2)), static_cast<float>(o.eps()),
                static_cast<float>(-(o.lr() / bc1)), static_cast<float>(o.weight_decay()),
                static_cast<float>(1 - o.lr() * o.weight_decay())};
      work.push_back(w);
    }
  }
  return work;
}

// The pass over every parameter; checking, the first work item whose gradient held an inf or a
// NaN (or -1).
int64_t run_adam(const std::vector<AdamWork>& work, bool check) {
  std::vector<int64_t> sizes;
  for (const auto& w : work) sizes.push_back(w.n);
  const auto kernel = cpu_has_fma() ? adam_fma : adam_plain;
  SpanVerdicts verdicts(check ? work.size() : 0);
  for_each_chunk(sizes, [&](size_t k, int64_t b, int64_t e) {
    const AdamWork& w = work[k];
    const uint32_t mx = kernel(w.p + b, w.g + b, w.m + b, w.v + b, e - b, w.args, w.l2, w.decay, check);
    if (check) verdicts.note(k, mx);
  });
  return verdicts.first();
}

template <class Options>
bool no_amsgrad(const Options& o) {
  return !o.amsgrad();
}

// Adam's and AdamW's step (decoupled: AdamW's decay): LibTorch's own where the pass does not
// apply, else the fused pass.
template <class Base, class State, class GroupOptions>
torch::Tensor fused_adam_step(Base& self, GradientVerdict& verdict,
                              std::vector<torch::optim::OptimizerParamGroup>& groups,
                              decltype(std::declval<torch::optim::Optimizer&>().state())& state,
                              const torch::optim::Optimizer::LossClosure& closure, bool decoupled) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = run_closure(closure);
  const bool check = verdict.take_check();
  if (!all_fusable<GroupOptions>(groups, no_amsgrad<GroupOptions>)) {
    unfused_step(verdict, check, groups, [&] { self.Base::step(nullptr); });
    return loss;
  }
  const auto work = adam_work<State, GroupOptions>(groups, state, decoupled);
  const int64_t bad = run_adam(work, check);
  if (check) record_pass(verdict, work, bad);
  return loss;
}

// One parameter's part of a fused SGD step.
struct SgdWork {
  float *p, *buf;
  const float* g;
  int64_t n;
  SgdArgs args;
  const torch::Tensor* param;
};

std::vector<SgdWork> sgd_work(std::vector<torch::optim::OptimizerParamGroup>& groups,
                              decltype(std::declval<torch::optim::Optimizer&>().state())& state) {
  std::vector<SgdWork> work;
  for (auto& group : groups) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      SgdArgs a{static_cast<float>(o.weight_decay()), static_cast<float>(o.momentum()),
                static_cast<float>(1 - o.dampening()), static_cast<float>(-1 * o.lr()),
                o.weight_decay() != 0, false, o.nesterov()};
      float* buf = nullptr;
      if (o.momentum() != 0) {
        auto& slot = state[compat::optimizer_state_key(p)];
        if (!slot) {  // LibTorch: buf = clone(d_p), which the pass writes
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(torch::empty_like(p, torch::MemoryFormat::Preserve));
          slot = std::move(s);
          a.first = true;
        }
        buf = static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer().data_ptr<float>();
      }
      work.push_back({p.data_ptr<float>(), buf, p.grad().data_ptr<float>(), p.numel(), a, &p});
    }
  }
  return work;
}

// The pass; checking, the first work item whose gradient held an inf or a NaN (or -1).
int64_t run_sgd(const std::vector<SgdWork>& work, bool check) {
  std::vector<int64_t> sizes;
  for (const auto& w : work) sizes.push_back(w.n);
  const auto kernel = cpu_has_fma() ? sgd_fma : sgd_plain;
  SpanVerdicts verdicts(check ? work.size() : 0);
  for_each_chunk(sizes, [&](size_t k, int64_t b, int64_t e) {
    const SgdWork& w = work[k];
    const uint32_t mx = kernel(w.p + b, w.g + b, w.buf ? w.buf + b : nullptr, e - b, w.args, check);
    if (check) verdicts.note(k, mx);
  });
  return verdicts.first();
}

bool sgd_ok(const torch::optim::SGDOptions& o) {
  return !(o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0));  // LibTorch refuses it
}

}  // namespace

torch::Tensor FusedAdam::step(LossClosure closure) {
  return fused_adam_step<torch::optim::Adam, torch::optim::AdamParamState,
                         torch::optim::AdamOptions>(*this, *this, param_groups_, state_, closure, false);
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  return fused_adam_step<torch::optim::AdamW, torch::optim::AdamWParamState,
                         torch::optim::AdamWOptions>(*this, *this, param_groups_, state_, closure, true);
}

torch::Tensor FusedSGD::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = run_closure(closure);
  const bool check = take_check();
  if (!all_fusable<torch::optim::SGDOptions>(param_groups_, sgd_ok)) {
    unfused_step(*this, check, param_groups_, [&] { torch::optim::SGD::step(nullptr); });
    return loss;
  }
  const auto work = sgd_work(param_groups_, state_);
  const int64_t bad = run_sgd(work, check);
  if (check) record_pass(*this, work, bad);
  return loss;
}

bool all_finite(const std::vector<torch::Tensor>& tensors) {
  std::vector<const float*> data;
  std::vector<int64_t> sizes;
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    if (fusable(t)) {
      data.push_back(t.data_ptr<float>());
      sizes.push_back(t.numel());
    } else if (!torch::isfinite(t).all().item<bool>()) {
      return false;
    }
  }
  std::atomic<uint32_t> largest{0};
  const auto scan = cpu_has_avx512() ? max_exponent_avx512
                    : cpu_has_fma()  ? max_exponent_avx2
                                     : max_exponent_plain;
  for_each_chunk(sizes, [&](size_t k, int64_t b, int64_t e) {
    const uint32_t mx = scan(data[k] + b, e - b);
    uint32_t seen = largest.load(std::memory_order_relaxed);
    while (mx > seen && !largest.compare_exchange_weak(seen, mx, std::memory_order_relaxed)) {
    }
  });
  return largest.load() != kExponent;
}

}  // namespace frugal
