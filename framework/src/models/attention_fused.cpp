// The fused CPU causal attention (attention.h, fused_causal_attention): per (batch, head) pair,
// BLAS on the projection's strided q, k and v (no copies), the scale in the product, the mask
// and the softmax in one pass over each row's visible keys, the output written in [B, T, C].
// Built with the fused kernels' options (framework/CMakeLists.txt): -O3, OpenMP for
// at::parallel_for, no fused multiply-add unless written.
#include "frugal/models/attention.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>

#include "base/cpu_arith.h"

namespace frugal {
namespace {

// ---- BLAS ------------------------------------------------------------------------------------
// LibTorch calls the BLAS it was built with; that BLAS is in the process (Debian: libblas.so.3,
// OpenBLAS). LibTorch does not export its own gemm wrapper, so the BLAS's entry point is looked
// up: CBLAS's (row-major, as below) where the library has it, else the Fortran one (its
// one-character flags passed as OpenBLAS's and the reference BLAS's C interfaces read them). A
// LibTorch whose BLAS is hidden (a static MKL) has neither, and the plain kernel runs.
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                            float*, int);
using FortranSgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                              const float*, const int*, const float*, const int*, const float*, float*,
                              const int*);
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

struct Blas {
  CblasSgemm cblas = reinterpret_cast<CblasSgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  FortranSgemm fortran = reinterpret_cast<FortranSgemm>(dlsym(RTLD_DEFAULT, "sgemm_"));
  bool found() const { return cblas != nullptr || fortran != nullptr; }
};

const Blas& blas() {
  static const Blas b;
  return b;
}

/// Row-major C[m x n] (leading dimension ldc) = alpha op(A) op(B) + beta C, op(X) = Xᵀ when
/// `tX`. The Fortran call solves the transposed problem in column-major order (the operands
/// swap, the flags stay).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  const int ia = static_cast<int>(lda), ib = static_cast<int>(ldb), ic = static_cast<int>(ldc);
  if (blas().cblas) {
    blas().cblas(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans, tb ? kCblasTrans : kCblasNoTrans, im, in, ik,
                 alpha, a, ia, b, ib, beta, c, ic);
    return;
  }
  const char fa = ta ? 'T' : 'N', fb = tb ? 'T' : 'N';
  blas().fortran(&fb, &fa, &in, &im, &ik, &alpha, b, &ib, a, &ia, &beta, c, &ic);
}

// ---- the row passes ----------------------------------------------------------------------------
// Eight lanes in GCC's vector extension (one AVX register in the FMA clone, two SSE ones in the
// plain one); a row's tail goes through the same code on a padded copy.
// (Every function taking or returning one is inlined into its caller's clone: no call passes one,
// so GCC's note on the AVX calling convention does not apply.)
#pragma GCC diagnostic ignored "-Wpsabi"
using V8 = float __attribute__((vector_size(32)));
using V8i = int32_t __attribute__((vector_size(32)));
using V8u = uint32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

FRUGAL_ALWAYS_INLINE V8 load(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
FRUGAL_ALWAYS_INLINE void store(float* p, V8 v) { std::memcpy(p, &v, sizeof v); }
FRUGAL_ALWAYS_INLINE V8 splat(float x) { return V8{x, x, x, x, x, x, x, x}; }
FRUGAL_ALWAYS_INLINE V8 vmax(V8 a, V8 b) { return a > b ? a : b; }
FRUGAL_ALWAYS_INLINE float hmax(V8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}
FRUGAL_ALWAYS_INLINE float hsum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/// exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp: Cephes' expf (2^n by the
/// exponent bits, a degree-6 polynomial on the remainder); below -87.3 it gives ~1e-38, not 0.
FRUGAL_ALWAYS_INLINE V8 exp_nonpositive(V8 x) {
  const V8 lo = splat(-87.33654f);
  x = x < lo ? lo : x;
  const V8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  V8 fn = (x * 1.44269504088896341f + magic) - magic;
  V8 r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  V8 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  // n in [-126, 0]; a NaN score (y is NaN already) takes -126, so the conversion stays defined
  const V8 lowest = splat(-126.0f);
  fn = fn >= lowest ? fn : lowest;
  const V8u bits = __builtin_convertvector(__builtin_convertvector(fn, V8i) + 127, V8u) << 23;
  V8 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

/// Row i of the probabilities: s[0, n) the scaled scores of the visible keys become
/// softmax(s); s[n, end) (future keys) become 0.
FRUGAL_ALWAYS_INLINE void softmax_row(float* s, int64_t n, int64_t end) {
  const int64_t body = n - n % kLanes;
  float pad[kLanes];
  std::fill(pad, pad + kLanes, -std::numeric_limits<float>::infinity());
  std::copy(s + body, s + n, pad);
  V8 mx = load(pad);
  for (int64_t j = 0; j < body; j += kLanes) mx = vmax(mx, load(s + j));
  const V8 m = splat(hmax(mx));
  V8 sum = splat(0.0f);
  for (int64_t j = 0; j < body; j += kLanes) {
    const V8 e = exp_nonpositive(load(s + j) - m);
    store(s + j, e);
    sum += e;
  }
  V8 tail = exp_nonpositive(load(pad) - m);
  for (int64_t l = n - body; l < kLanes; ++l) tail[l] = 0.0f;
  sum += tail;
  const V8 inv = splat(1.0f / hsum(sum));
  for (int64_t j = 0; j < body; j += kLanes) store(s + j, load(s + j) * inv);
  tail *= inv;
  std::memcpy(s + body, &tail, sizeof(float) * static_cast<size_t>(n - body));
  std::fill(s + n, s + end, 0.0f);
}

/// Softmax's backward on row i: g[j] = p[j] (g[j] - sum_k g[k] p[k]) for the visible keys,
/// 0 for the future ones up to `end`.
FRUGAL_ALWAYS_INLINE void softmax_grad_row(float* g, const float* p, int64_t n, int64_t end) {
  const int64_t body = n - n % kLanes;
  V8 dot = splat(0.0f);
  for (int64_t j = 0; j < body; j += kLanes) dot += load(g + j) * load(p + j);
  float r = hsum(dot);
  for (int64_t j = body; j < n; ++j) r += g[j] * p[j];
  const V8 rv = splat(r);
  for (int64_t j = 0; j < body; j += kLanes) store(g + j, load(p + j) * (load(g + j) - rv));
  for (int64_t j = body; j < n; ++j) g[j] = p[j] * (g[j] - r);
  std::fill(g + n, g + end, 0.0f);
}

// ---- one (batch, head) pair ------------------------------------------------------------------

/// Where one pair's operands are: q, k, v rows `w` apart in the projection [B, T, 3C]; its
/// output (and the output's gradient) rows `c` apart in [B, T, C]; its probabilities T x T.
struct Pair {
  const float* q;
  const float* k;
  const float* v;
  float* p;
  int64_t t, d, w, c;
};

/// Query rows are taken in blocks: a block sees only the keys before its end (the causal mask
/// skips the products with the others, about (blocks - 1) / (2 blocks) of them).
constexpr int64_t kBlock = 32;

FRUGAL_ALWAYS_INLINE void forward_pair(const Pair& a, float scale, float* y) {
  for (int64_t r0 = 0; r0 < a.t; r0 += kBlock) {
    const int64_t r1 = std::min(a.t, r0 + kBlock), nr = r1 - r0;
    gemm(false, true, nr, r1, a.d, scale, a.q + r0 * a.w, a.w, a.k, a.w, 0.0f, a.p + r0 * a.t, a.t);
    for (int64_t i = r0; i < r1; ++i) softmax_row(a.p + i * a.t, i + 1, a.t);
    gemm(false, false, nr, a.d, r1, 1.0f, a.p + r0 * a.t, a.t, a.v, a.w, 0.0f, y + r0 * a.c, a.c);
  }
}

/// g: T x T scratch. dq, dk, dv: the pair's rows of the projection's gradient (`w` apart).
FRUGAL_ALWAYS_INLINE void backward_pair(const Pair& a, float scale, const float* dy, float* g, float* dq,
                                        float* dk, float* dv) {
  for (int64_t r0 = 0; r0 < a.t; r0 += kBlock) {
    const int64_t r1 = std::min(a.t, r0 + kBlock), nr = r1 - r0;
    // dP = dY Vᵀ on the visible keys, then dS = P (dP - rowsum(dP P)), 0 past the diagonal
    gemm(false, true, nr, r1, a.d, 1.0f, dy + r0 * a.c, a.c, a.v, a.w, 0.0f, g + r0 * a.t, a.t);
    for (int64_t i = r0; i < r1; ++i) softmax_grad_row(g + i * a.t, a.p + i * a.t, i + 1, r1);
    gemm(false, false, nr, a.d, r1, scale, g + r0 * a.t, a.t, a.k, a.w, 0.0f, dq + r0 * a.w, a.w);
  }
  // key block [c0, c1) is seen by queries c0..T-1: dV = Pᵀ dY, dK = scale dSᵀ Q over them
  for (int64_t c0 = 0; c0 < a.t; c0 += kBlock) {
    const int64_t nc = std::min(a.t, c0 + kBlock) - c0, rows = a.t - c0;
    gemm(true, false, nc, a.d, rows, 1.0f, a.p + c0 * a.t + c0, a.t, dy + c0 * a.c, a.c, 0.0f, dv + c0 * a.w,
         a.w);
    gemm(true, false, nc, a.d, rows, scale, g + c0 * a.t + c0, a.t, a.q + c0 * a.w, a.w, 0.0f, dk + c0 * a.w,
         a.w);
  }
}

// Two clones of each: AVX2 + FMA where the CPU has them (eight lanes in one register), the
// baseline otherwise. The row passes round the same in both (no multiply-add is fused).
FRUGAL_FMA_TARGET void forward_pair_fma(const Pair& a, float scale, float* y) { forward_pair(a, scale, y); }
void forward_pair_plain(const Pair& a, float scale, float* y) { forward_pair(a, scale, y); }
FRUGAL_FMA_TARGET void backward_pair_fma(const Pair& a, float scale, const float* dy, float* g, float* dq,
                                         float* dk, float* dv) {
  backward_pair(a, scale, dy, g, dq, dk, dv);
}
void backward_pair_plain(const Pair& a, float scale, const float* dy, float* g, float* dq, float* dk,
                         float* dv) {
  backward_pair(a, scale, dy, g, dq, dk, dv);
}

// ---- the autograd function ---------------------------------------------------------------------

struct Shape {
  int64_t b, t, h, d, c, w;
  explicit Shape(const torch::Tensor& qkv, int64_t heads)
      : b(qkv.size(0)), t(qkv.size(1)), h(heads), d(qkv.size(2) / 3 / heads), c(qkv.size(2) / 3),
        w(qkv.size(2)) {}
  int64_t pairs() const { return b * h; }
  /// Pair n = (batch n / h, head n % h): where its q starts in the projection, its output in y.
  int64_t qkv_offset(int64_t n) const { return (n / h) * t * w + (n % h) * d; }
  int64_t out_offset(int64_t n) const { return (n / h) * t * c + (n % h) * d; }
  Pair pair(const float* qkv, float* probs, int64_t n) const {
    const float* q = qkv + qkv_offset(n);
    return Pair{q, q + c, q + 2 * c, probs + n * t * t, t, d, w, c};
  }
};

struct FusedAttentionFn : public torch::autograd::Function<FusedAttentionFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& qkv_in,
                               int64_t heads) {
    const auto qkv = qkv_in.contiguous();
    const Shape s(qkv, heads);
    auto y = torch::empty({s.b, s.t, s.c}, qkv.options());
    auto probs = torch::empty({s.b, s.h, s.t, s.t}, qkv.options());
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.d)));
    const float* in = qkv.data_ptr<float>();
    float* pr = probs.data_ptr<float>();
    float* out = y.data_ptr<float>();
    const auto step = cpu_arith::cpu_has_fma() ? forward_pair_fma : forward_pair_plain;
    at::parallel_for(0, s.pairs(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) step(s.pair(in, pr, n), scale, out + s.out_offset(n));
    });
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["heads"] = heads;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& qkv = saved[0];
    const auto& probs = saved[1];
    // the gradient is written through pointers: no graph of it for a second derivative
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fused_causal_attention is differentiable once (no create_graph); the plain kernel is not");
    const Shape s(qkv, ctx->saved_data["heads"].toInt());
    const auto dy = grads[0].contiguous();
    auto dqkv = torch::empty_like(qkv);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.d)));
    const float* in = qkv.data_ptr<float>();
    float* pr = probs.data_ptr<float>();
    const float* gy = dy.data_ptr<float>();
    float* gin = dqkv.data_ptr<float>();
    const auto step = cpu_arith::cpu_has_fma() ? backward_pair_fma : backward_pair_plain;
    at::parallel_for(0, s.pairs(), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(s.t * s.t));
      for (int64_t n = begin; n < end; ++n) {
        float* dq = gin + s.qkv_offset(n);
        step(s.pair(in, pr, n), scale, gy + s.out_offset(n), scratch.data(), dq, dq + s.c, dq + 2 * s.c);
      }
    });
    return {dqkv, torch::Tensor()};
  }
};

}  // namespace

namespace {
// BLAS takes 32-bit sizes: T x T and T x 3C elements per pair (its leading dimensions) must fit.
bool fits_blas(const torch::Tensor& qkv) {
  const int64_t lim = std::numeric_limits<int>::max();
  return qkv.size(1) <= lim / std::max<int64_t>(qkv.size(1), 1) && qkv.size(2) <= lim;
}
}  // namespace

bool fused_attention_applies(const torch::Tensor& qkv, double p, bool training) {
  static const bool off = [] {
    const char* e = std::getenv("FRUGAL_FUSED_ATTENTION");
    return e != nullptr && std::string(e) == "0";
  }();
  return !off && blas().found() && qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat &&
         qkv.dim() == 3 && qkv.size(2) > 0 && !(p > 0 && training) && fits_blas(qkv);
}

torch::Tensor fused_causal_attention(const torch::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && heads > 0 && qkv.size(2) > 0 && qkv.size(2) % (3 * heads) == 0,
              "fused_causal_attention: qkv must be [B, T, 3 C] with C > 0 a multiple of heads (", heads, ")");
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat,
              "fused_causal_attention: a float tensor on the CPU");
  TORCH_CHECK(fits_blas(qkv), "fused_causal_attention: T x T and 3 C must fit BLAS's 32-bit sizes");
  TORCH_CHECK(blas().found(), "fused_causal_attention: no BLAS sgemm in this process");
  return FusedAttentionFn::apply(qkv, heads);
}

}  // namespace frugal
