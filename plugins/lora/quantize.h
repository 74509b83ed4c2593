// Block-wise weight quantisation for the lora plugin's `qlora` option: the frozen base weight
// is held in 4 bits (NF4, as QLoRA) or 8 bits and dequantised on the fly in the forward.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal::lora {

/// How a frozen weight is coded: 8-bit linear or 4-bit NormalFloat.
enum class QuantKind { Int8, Nf4 };

/// A frozen weight stored in fewer bits. Every tensor is a plain tensor (the caller registers
/// them as buffers); the ones a configuration does not use are empty (numel 0) rather than
/// undefined, so that moving, saving and registering them needs no special case.
struct QuantizedWeight {
  QuantKind kind = QuantKind::Nf4;
  /// The original weight's shape.
  std::vector<int64_t> shape;
  int64_t numel = 0;
  /// Elements per absmax block (row-major flattening; the last block is zero-padded).
  int64_t block = 64;
  /// Int8: kChar (int8), one code in [-127, 127] per element. Nf4: kByte, two 4-bit codebook
  /// indices per byte, the first element in the low nibble. Both padded to whole blocks.
  torch::Tensor codes;
  /// Float [nblocks], the per-block absmax; empty when double_quant.
  torch::Tensor absmax;
  /// With double_quant: kChar [nblocks], codes in [-127, 127] of (absmax - offset).
  torch::Tensor absmax_codes;
  /// With double_quant: float [ceil(nblocks / block2)], the max |absmax - offset| per group.
  torch::Tensor absmax_scale;
  /// With double_quant: float 0-d, the mean of absmax.
  torch::Tensor absmax_offset;
  /// absmax values per second-level block.
  int64_t block2 = 256;
  bool double_quant = false;
  /// Bytes held (all tensors' nbytes).
  int64_t bytes() const;
};

/// Quantises `w` (float, bfloat16, half or double; any shape; any device) in blocks of `block`
/// elements, with QLoRA's double quantisation of the absmax values in groups of `block2`.
/// The result lives on w's device. Throws std::invalid_argument for an undefined, empty or
/// non-floating `w` or a non-positive block size.
QuantizedWeight quantize(const torch::Tensor& w, QuantKind kind, int64_t block = 64,
                         bool double_quant = true, int64_t block2 = 256);

/// The weight, shape q.shape, in `dtype` (float by default), on codes' device.
torch::Tensor dequantize(const QuantizedWeight& q, torch::ScalarType dtype = torch::kFloat);

/// The 16 NF4 values (Dettmers et al. 2023, QLoRA, Appendix E; the exact float table
/// bitsandbytes uses), ascending, as a float CPU tensor. 0 is exact, at index 7.
torch::Tensor nf4_codebook();

/// "int8" / "nf4"
std::string quant_kind_name(QuantKind kind);

}  // namespace frugal::lora
