#pragma once
// What the fused CPU kernels (fused.cpp, adam8bit_kernel.cpp) share to stay bitwise LibTorch's:
// the CPU's features, the target attributes of their FMA and AVX-512 clones, and the one
// multiply-add. One copy, so the kernels cannot drift apart on how they round.
#include <cstdint>

namespace frugal::cpu_arith {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FRUGAL_FMA_TARGET __attribute__((target("avx2,fma")))
#define FRUGAL_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define FRUGAL_ALWAYS_INLINE inline __attribute__((always_inline))
/// AVX2 and FMA: where LibTorch runs its AVX2/AVX-512 kernels, which use fmadd.
inline bool cpu_has_fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}
/// AVX-512F and BW: the non-finite scan's widest clone (16 lanes of integer maximum).
inline bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}
#else
#define FRUGAL_FMA_TARGET
#define FRUGAL_AVX512_TARGET
#define FRUGAL_ALWAYS_INLINE inline
inline bool cpu_has_fma() { return false; }
inline bool cpu_has_avx512() { return false; }
#endif

/// a * b + c: rounded once where LibTorch's vectorized kernel uses fmadd (kFma: a CPU with FMA),
/// twice otherwise (its default kernels).
template <bool kFma>
FRUGAL_ALWAYS_INLINE float madd(float a, float b, float c) {
  if constexpr (kFma)
    return __builtin_fmaf(a, b, c);
  else
    return a * b + c;
}

}  // namespace frugal::cpu_arith
