#pragma once
// 8-bit Adam's step as one pass per quantization block (adam8bit_kernel.cpp, compiled like the
// fused optimizers: -O3 -fno-math-errno -ffp-contract=off, OpenMP): each block's moments
// decoded from their codes, Adam's update in float32 with LibTorch's arithmetic (fused.cpp's
// table), the moments coded again. The same bits as Adam8bit's tensor operations, without
// their whole-parameter float32 temporaries.
#include <cstdint>

namespace frugal::quant8 {

struct BlockAdamArgs {
  float b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step, l2, decay;
  bool l2_on, decay_on;
};

/// One step over n elements: p and g (float32), the moments' codes c1, c2 (n bytes each) and
/// block maxima a1, a2 (one per block of kBlock), the signed and unsigned maps (256 sorted
/// floats). `first`: no moments yet (read as zeros; the codes and maxima are only written).
void adam8bit_step(float* p, const float* g, uint8_t* c1, float* a1, uint8_t* c2, float* a2,
                   int64_t n, const float* map1, const float* map2, bool first,
                   const BlockAdamArgs& a);

/// The same update on float32 moments m, v (parameters under kMinElements).
void adam_float_step(float* p, const float* g, float* m, float* v, int64_t n,
                     const BlockAdamArgs& a);

}  // namespace frugal::quant8
