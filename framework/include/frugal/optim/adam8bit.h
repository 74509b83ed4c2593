#pragma once
/// 8-bit Adam (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization"), as a
/// torch::optim::Optimizer: Adam whose two moments are stored as one byte per element,
/// block-wise dynamically quantized (blocks of 2048 elements, each with its float32 absolute
/// maximum; the signed dynamic map for the first moment, the unsigned one for the second), as
/// bitsandbytes' Adam8bit does. A step dequantizes a parameter's moments, runs Adam's update in
/// float32 and quantizes them again. Parameters under 4096 elements keep float32 moments
/// (bitsandbytes' min_8bit_size): there the step is exactly torch::optim::Adam's.
/// Weight decay is Adam's (added to the gradient) or, with `decoupled`, AdamW's. Registered as
/// "adam8bit" and "adamw8bit" (optimizers.h).
#include <cstdint>
#include <tuple>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

namespace frugal {

namespace quant8 {
inline constexpr int64_t kBlock = 2048;       ///< elements per quantization block
inline constexpr int64_t kMinElements = 4096; ///< smaller tensors keep float32 moments

/// bitsandbytes' create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8): 256 sorted
/// float32 codes in [-1, 1] (signed) or [0, 1], dense near 0 (one decimal exponent per bit).
torch::Tensor dynamic_map(bool is_signed);

/// A tensor quantized block by block: codes (uint8, one per element) and each block's absmax.
struct Quantized {
  torch::Tensor codes;   ///< uint8, x.numel() elements
  torch::Tensor absmax;  ///< float32, one per block of kBlock elements
};
/// Each block of `x` (flattened) divided by its absolute maximum, each element replaced by the
/// index of the nearest code in `map` (the lower code on a tie).
/// keep_positive: a positive element never gets the zero code (the second moment's: see
/// optim_adam8bit.cpp), it gets the smallest positive one.
Quantized quantize(const torch::Tensor& x, const torch::Tensor& map, bool keep_positive = false);
/// The float32 tensor (flat, `q.codes.numel()` elements) `q` stands for: map[code] x absmax.
torch::Tensor dequantize(const Quantized& q, const torch::Tensor& map);
}  // namespace quant8

struct Adam8bitOptions : public torch::optim::OptimizerCloneableOptions<Adam8bitOptions> {
  Adam8bitOptions(double lr = 1e-3);  // NOLINT: implicit, like torch::optim::AdamOptions
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);  ///< default (0.9, 0.999)
  TORCH_ARG(double, eps) = 1e-8;                            ///< default 1e-8
  TORCH_ARG(double, weight_decay) = 0;                      ///< default 0
  /// AdamW's decoupled decay (p *= 1 - lr weight_decay before the update; "adamw8bit") instead
  /// of Adam's L2 term added to the gradient.
  TORCH_ARG(bool, decoupled) = false;
  /// One pass per quantization block on the CPU (float32, contiguous): the moments decoded,
  /// updated and coded again block by block, the same bits as the tensor operations, without
  /// their float32 copies of the parameter's moments. Not saved in checkpoints.
  TORCH_ARG(bool, fused) = true;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Per parameter: float32 moments (exp_avg, exp_avg_sq) under kMinElements elements, else the
/// 8-bit codes and block maxima of each.
struct Adam8bitParamState : public torch::optim::OptimizerCloneableParamState<Adam8bitParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg) = {};
  TORCH_ARG(torch::Tensor, exp_avg_sq) = {};
  TORCH_ARG(torch::Tensor, exp_avg_codes) = {};
  TORCH_ARG(torch::Tensor, exp_avg_absmax) = {};
  TORCH_ARG(torch::Tensor, exp_avg_sq_codes) = {};
  TORCH_ARG(torch::Tensor, exp_avg_sq_absmax) = {};

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  /// Bytes of every tensor it holds in memory (tensor_bytes: offloaded ones are not counted).
  int64_t bytes() const;
};

class Adam8bit : public torch::optim::Optimizer {
 public:
  explicit Adam8bit(std::vector<torch::optim::OptimizerParamGroup> groups,
                    Adam8bitOptions defaults = {});
  explicit Adam8bit(std::vector<torch::Tensor> params, Adam8bitOptions defaults = {})
      : Adam8bit({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Bytes of the state Adam8bit keeps for a float32 parameter of `numel` elements.
  static int64_t state_bytes(int64_t numel);

 private:
  void step_one(torch::Tensor& p, const Adam8bitOptions& o);
  void step_fused(torch::Tensor& p, Adam8bitParamState& s, const Adam8bitOptions& o);
  torch::Tensor map1_, map2_;  // the signed and unsigned dynamic maps
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    _TORCH_OPTIM_SERIALIZE_WITH_TEMPLATE_ARG(Adam8bit);
  }
};

}  // namespace frugal
