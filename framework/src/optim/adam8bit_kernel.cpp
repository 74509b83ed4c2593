// 8-bit Adam's fused step (adam8bit_kernel.h).
#include "optim/adam8bit_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "frugal/optim/adam8bit.h"
#include "base/cpu_arith.h"

namespace frugal::quant8 {
namespace {

using cpu_arith::cpu_has_fma;
using cpu_arith::madd;

// Adam's update of one element (fused.cpp's adam_span, the table above it), in place.
template <bool kFma>
inline void update(float& p, float g, float& m, float& v, const BlockAdamArgs& a) {
  float pi = p;
  if (a.decay_on) pi = pi * a.decay;
  if (a.l2_on) g = madd<kFma>(pi, a.l2, g);
  m = madd<kFma>(g, a.omb1, m * a.b1);
  v = madd<kFma>(a.omb2 * g, g, v * a.b2);
  const float d = std::sqrt(v) / a.bc2_sqrt + a.eps;
  p = pi + (a.neg_step * m) / d;
}

// quant8::quantize's choice for one normalized value: the first code >= x (searchsorted) and
// the one below it, the lower on a tie; keep_positive: a positive x never gets code 0.
inline uint8_t nearest(const float* map, float x, bool keep_positive) {
  // How many codes are below x: a branch-free lower bound over 256, compared as ATen's
  // searchsorted compares (!(code >= x): a NaN lands past the end, as there).
  int idx = 0;
  for (int step = 128; step > 0; step >>= 1) idx += !(map[idx + step - 1] >= x) ? step : 0;
  const int hi = std::clamp(idx, 1, 255), lo = hi - 1;
  int code = (x - map[lo]) <= (map[hi] - x) ? lo : hi;
  if (keep_positive && x > 0 && code == 0) code = 1;
  return static_cast<uint8_t>(code);
}

// The largest |value|, NaN kept once seen (amax propagates it).
inline float max_abs(float sofar, float x) {
  const float a = std::abs(x);
  return a > sofar || std::isnan(a) ? a : sofar;
}

template <bool kFma>
void block_step(float* p, const float* g, uint8_t* c1, float* a1, uint8_t* c2, float* a2,
                int64_t n, const float* map1, const float* map2, bool first,
                const BlockAdamArgs& a) {
  float m[kBlock], v[kBlock];
  const float s1 = first ? 0.0f : *a1, s2 = first ? 0.0f : *a2;
  float max1 = 0, max2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = first ? 0.0f : map1[c1[i]] * s1;  // dequantize: map[code] x absmax
    v[i] = first ? 0.0f : map2[c2[i]] * s2;
    update<kFma>(p[i], g[i], m[i], v[i], a);
    max1 = std::isnan(max1) ? max1 : max_abs(max1, m[i]);
    max2 = std::isnan(max2) ? max2 : max_abs(max2, v[i]);
  }
  *a1 = max1;
  *a2 = max2;
  const float d1 = max1 > 0 ? max1 : 1.0f, d2 = max2 > 0 ? max2 : 1.0f;  // an all-zero block: 1
  for (int64_t i = 0; i < n; ++i) {
    c1[i] = nearest(map1, m[i] / d1, false);
    c2[i] = nearest(map2, v[i] / d2, true);
  }
}

using BlockFn = void (*)(float*, const float*, uint8_t*, float*, uint8_t*, float*, int64_t,
                        const float*, const float*, bool, const BlockAdamArgs&);

// The blocks over ATen's threads. The kernel is a function of its own, called from inside the
// parallel region (as in fused.cpp): the region's outlined body is compiled for the baseline
// instruction set, so an FMA clone must be the callee, not the caller.
void step_all(BlockFn block, float* p, const float* g, uint8_t* c1, float* a1, uint8_t* c2,
              float* a2, int64_t n, const float* map1, const float* map2, bool first,
              const BlockAdamArgs& a) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t at = b * kBlock, len = std::min(kBlock, n - at);
      block(p + at, g + at, c1 + at, a1 + b, c2 + at, a2 + b, len, map1, map2, first, a);
    }
  });
}

FRUGAL_FMA_TARGET void block_fma(float* p, const float* g, uint8_t* c1, float* a1, uint8_t* c2,
                                 float* a2, int64_t n, const float* map1, const float* map2,
                                 bool first, const BlockAdamArgs& a) {
  block_step<true>(p, g, c1, a1, c2, a2, n, map1, map2, first, a);
}
void block_plain(float* p, const float* g, uint8_t* c1, float* a1, uint8_t* c2, float* a2,
                 int64_t n, const float* map1, const float* map2, bool first,
                 const BlockAdamArgs& a) {
  block_step<false>(p, g, c1, a1, c2, a2, n, map1, map2, first, a);
}

FRUGAL_FMA_TARGET void float_fma(float* p, const float* g, float* m, float* v, int64_t n,
                                 const BlockAdamArgs& a) {
  for (int64_t i = 0; i < n; ++i) update<true>(p[i], g[i], m[i], v[i], a);
}

}  // namespace

void adam8bit_step(float* p, const float* g, uint8_t* c1, float* a1, uint8_t* c2, float* a2,
                   int64_t n, const float* map1, const float* map2, bool first,
                   const BlockAdamArgs& a) {
  step_all(cpu_has_fma() ? block_fma : block_plain, p, g, c1, a1, c2, a2, n, map1, map2, first, a);
}

void adam_float_step(float* p, const float* g, float* m, float* v, int64_t n, const BlockAdamArgs& a) {
  if (cpu_has_fma()) {
    float_fma(p, g, m, v, n, a);
    return;
  }
  for (int64_t i = 0; i < n; ++i) update<false>(p[i], g[i], m[i], v[i], a);
}

}  // namespace frugal::quant8
