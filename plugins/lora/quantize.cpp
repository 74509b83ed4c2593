// Block-wise absmax quantisation of a frozen weight: QLoRA's NF4 or a linear int8, with
// QLoRA's double quantisation of the absmax values. Every step is a whole-tensor torch op, so
// a 124M-parameter model quantises in a few passes over memory and on any device.
#include "quantize.h"

#include <stdexcept>

namespace frugal::lora {
namespace quant_impl {
namespace {

// Symmetric linear 8 bits: codes in [-127, 127], so that 0 is exact and -128 never occurs.
constexpr double kInt8Max = 127.0;
// The NF4 index of the exact 0.0: padding nibbles decode to zero.
constexpr int64_t kNf4Zero = 7;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("lora quantize: " + what);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_quantize_args(const torch::Tensor& w, int64_t block, bool double_quant,
                         int64_t block2) {
  require(w.defined(), "the weight is an undefined tensor");
  require(w.numel() > 0, "the weight is empty (shape " + c10::str(w.sizes()) + ")");
  require(w.is_floating_point(), "the weight must be floating point, not " +
                                     std::string(c10::toString(w.scalar_type())));
  require(block > 0, "block must be > 0, got " + std::to_string(block));
  require(!double_quant || block2 > 0, "block2 must be > 0, got " + std::to_string(block2));
}

/// The number of code bytes a well-formed `q` holds.
int64_t expected_code_count(const QuantizedWeight& q, int64_t nblocks) {
  const int64_t padded = nblocks * q.block;
  return q.kind == QuantKind::Nf4 ? ceil_div(padded, 2) : padded;
}

/// Catches a QuantizedWeight assembled by hand (or loaded) inconsistently before it indexes
/// out of range.
void check_quantized(const QuantizedWeight& q) {
  require(q.block > 0 && q.numel > 0, "dequantize needs block > 0 and numel > 0");
  int64_t shape_numel = 1;
  for (int64_t d : q.shape) shape_numel *= d;
  require(shape_numel == q.numel, "shape " + c10::str(c10::IntArrayRef(q.shape)) +
                                      " does not hold numel " + std::to_string(q.numel));
  const int64_t nblocks = ceil_div(q.numel, q.block);
  require(q.codes.defined() && q.codes.numel() == expected_code_count(q, nblocks),
          "codes do not match numel and block");
  if (q.double_quant) {
    require(q.block2 > 0 && q.absmax_codes.defined() && q.absmax_codes.numel() == nblocks &&
                q.absmax_scale.defined() &&
                q.absmax_scale.numel() == ceil_div(nblocks, q.block2) &&
                q.absmax_offset.defined() && q.absmax_offset.numel() == 1,
            "the double-quantised absmax does not match numel, block and block2");
  } else {
    require(q.absmax.defined() && q.absmax.numel() == nblocks, "absmax does not match");
  }
}

/// `flat` (1-d) zero-padded to rows x cols.
torch::Tensor pad_to_blocks(const torch::Tensor& flat, int64_t rows, int64_t cols) {
  return torch::constant_pad_nd(flat, {0, rows * cols - flat.numel()}, 0).view({rows, cols});
}

/// Each row divided by its absmax; an all-zero row divides by 1, so it stays 0 (no NaN).
torch::Tensor normalise_rows(const torch::Tensor& rows, const torch::Tensor& absmax) {
  auto safe = torch::where(absmax > 0, absmax, torch::ones_like(absmax));
  return rows / safe.unsqueeze(1);
}

/// Symmetric linear 8-bit codes (kChar) of values in [-1, 1].
torch::Tensor int8_codes(const torch::Tensor& normalised) {
  return torch::round(normalised * kInt8Max).clamp(-kInt8Max, kInt8Max).to(torch::kChar);
}

/// The nearest NF4 index of each value in [-1, 1], by bucketize against the 15 midpoints
/// (int32, not int64: half the temporary for a large weight).
torch::Tensor nf4_indices(const torch::Tensor& normalised) {
  auto cb = nf4_codebook().to(normalised.device());
  auto midpoints = (cb.slice(0, 1) + cb.slice(0, 0, 15)) / 2;
  return torch::bucketize(normalised, midpoints, /*out_int32=*/true);
}

/// Two 4-bit indices per byte, the first in the low nibble (bitsandbytes packs the first in
/// the high nibble; nothing here reads its files, and low-first is the natural order).
torch::Tensor pack_nibbles(const torch::Tensor& indices) {
  auto flat = indices.reshape(-1);
  if (flat.numel() % 2 != 0) flat = torch::constant_pad_nd(flat, {0, 1}, kNf4Zero);
  auto pairs = flat.view({-1, 2});
  return (pairs.select(1, 0) + pairs.select(1, 1) * 16).to(torch::kByte);
}

/// The first `count` indices (int64, for index_select) of packed bytes.
torch::Tensor unpack_nibbles(const torch::Tensor& bytes, int64_t count) {
  auto low = torch::bitwise_and(bytes, 15);
  auto high = torch::bitwise_right_shift(bytes, 4);
  return torch::stack({low, high}, 1).view(-1).slice(0, 0, count).to(torch::kLong);
}

/// QLoRA's double quantisation: the absmax vector minus its mean, coded in 8 bits per group of
/// block2 with a float scale per group. QLoRA codes these in FP8; a symmetric linear int8 is
/// simpler, costs the same byte, and its error is bounded by scale/254 (the tests check it).
void compress_absmax(QuantizedWeight& q, const torch::Tensor& absmax) {
  const int64_t nblocks = absmax.numel();
  q.absmax_offset = absmax.mean();
  auto groups = pad_to_blocks(absmax - q.absmax_offset, ceil_div(nblocks, q.block2), q.block2);
  q.absmax_scale = groups.abs().amax(1);
  auto codes = int8_codes(normalise_rows(groups, q.absmax_scale)).view(-1);
  q.absmax_codes = codes.slice(0, 0, nblocks).clone();  // clone: drop the padding's storage
  q.absmax = torch::empty({0}, absmax.options());
}

/// The float absmax per block, decoded if double-quantised: code * scale / 127 + offset.
torch::Tensor block_absmax(const QuantizedWeight& q, int64_t nblocks) {
  if (!q.double_quant) return q.absmax;
  auto codes = pad_to_blocks(q.absmax_codes.to(torch::kFloat), q.absmax_scale.numel(), q.block2);
  auto centred = codes * q.absmax_scale.unsqueeze(1) / kInt8Max;
  return centred.view(-1).slice(0, 0, nblocks) + q.absmax_offset;
}

/// 1-d float tensor torch.linspace(start, end, steps) as PyTorch's scalar CPU kernel computes
/// it (start + i*step for the first half, end - (steps-1-i)*step for the rest). bitsandbytes'
/// published table was made with it and this reproduces it bit for bit; start + i*step
/// throughout (torch::linspace's vectorised path) is off by up to 9e-8 in three entries,
/// because a quantile's slope (up to ~14 near p = 0.97) magnifies an ulp of p.
torch::Tensor float_linspace(double start, double end, int64_t steps) {
  auto opts = torch::dtype(torch::kFloat);
  auto i = torch::arange(steps, opts);
  auto first = torch::scalar_tensor(start, opts);
  auto last = torch::scalar_tensor(end, opts);
  auto step = (last - first) / static_cast<double>(steps - 1);
  auto from_end = static_cast<double>(steps - 1) - i;
  return torch::where(i < steps / 2, first + step * i, last - step * from_end);
}

/// Standard normal quantiles of float probabilities, computed in double, rounded to float
/// (as scipy's norm.ppf into a float32 tensor).
torch::Tensor normal_quantiles(const torch::Tensor& p) {
  return torch::special::ndtri(p.to(torch::kDouble)).to(torch::kFloat);
}

}  // namespace
}  // namespace quant_impl

int64_t QuantizedWeight::bytes() const {
  int64_t total = 0;
  for (const torch::Tensor* t : {&codes, &absmax, &absmax_codes, &absmax_scale, &absmax_offset})
    if (t->defined()) total += static_cast<int64_t>(t->nbytes());
  return total;
}

torch::Tensor nf4_codebook() {
  using namespace quant_impl;
  // bitsandbytes' create_normal_map(offset=0.9677083, use_extra_value=True), QLoRA Appendix E:
  // 8 positive and 7 negative normal quantiles and an exact 0 (asymmetric, so 0 is a code),
  // sorted and scaled so the largest is 1. The offset is the mean of 1 - 1/(2*15) and
  // 1 - 1/(2*16). Computed rather than tabled; the test pins it to the published floats.
  constexpr double offset = 0.9677083;
  auto positive = normal_quantiles(float_linspace(offset, 0.5, 9).slice(0, 0, 8));
  auto negative = -normal_quantiles(float_linspace(offset, 0.5, 8).slice(0, 0, 7));
  auto values = std::get<0>(torch::cat({negative, torch::zeros({1}), positive}).sort());
  return values / values.max();
}

std::string quant_kind_name(QuantKind kind) {
  switch (kind) {
    case QuantKind::Int8: return "int8";
    case QuantKind::Nf4: return "nf4";
  }
  return "unknown";
}

QuantizedWeight quantize(const torch::Tensor& w, QuantKind kind, int64_t block,
                         bool double_quant, int64_t block2) {
  using namespace quant_impl;
  check_quantize_args(w, block, double_quant, block2);
  torch::NoGradGuard no_grad;
  QuantizedWeight q;
  q.kind = kind;
  q.shape = w.sizes().vec();
  q.numel = w.numel();
  q.block = block;
  q.block2 = block2;
  q.double_quant = double_quant;
  const int64_t nblocks = ceil_div(q.numel, block);
  auto rows = pad_to_blocks(w.detach().reshape(-1).to(torch::kFloat), nblocks, block);
  auto absmax = rows.abs().amax(1);
  auto normalised = normalise_rows(rows, absmax);
  // Int8 is bitsandbytes' block-wise absmax scheme, but with a linear code where bitsandbytes
  // uses its dynamic (non-linear) 8-bit map: simpler, and its error bound is absmax/254.
  q.codes = kind == QuantKind::Nf4 ? pack_nibbles(nf4_indices(normalised))
                                   : int8_codes(normalised).view(-1);
  if (double_quant) {
    compress_absmax(q, absmax);
  } else {  // unused tensors are empty, not undefined (see QuantizedWeight)
    q.absmax = absmax;
    q.absmax_codes = torch::empty({0}, absmax.options().dtype(torch::kChar));
    q.absmax_scale = torch::empty({0}, absmax.options());
    q.absmax_offset = torch::empty({0}, absmax.options());
  }
  return q;
}

torch::Tensor dequantize(const QuantizedWeight& q, torch::ScalarType dtype) {
  using namespace quant_impl;
  check_quantized(q);
  torch::NoGradGuard no_grad;
  const int64_t nblocks = ceil_div(q.numel, q.block);
  const int64_t padded = nblocks * q.block;
  torch::Tensor values;  // [padded] codes as float: codebook values or int8 codes
  if (q.kind == QuantKind::Nf4) {
    auto cb = nf4_codebook().to(q.codes.device());
    values = cb.index_select(0, unpack_nibbles(q.codes, padded));
  } else {
    values = q.codes.to(torch::kFloat);
  }
  auto rows = values.reshape({nblocks, q.block}) * block_absmax(q, nblocks).unsqueeze(1);
  if (q.kind == QuantKind::Int8) rows = rows / kInt8Max;  // code * absmax / 127
  return rows.view(-1).slice(0, 0, q.numel).view(q.shape).to(dtype);
}

}  // namespace frugal::lora
