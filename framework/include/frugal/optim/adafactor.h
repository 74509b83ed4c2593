#pragma once
/// Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
/// Cost"), as a torch::optim::Optimizer. The second moment of a parameter with 2 or more
/// dimensions, seen as an r x c matrix (its first dimension by all the others), is kept as its
/// row and column means (4(r + c) bytes instead of 4rc); a vector keeps it whole. No first
/// moment unless beta1 > 0. Each update is divided by max(1, RMS(update) / clip_threshold).
/// The step size is `lr`, or with relative_step the paper's min(1e-2, 1/sqrt(t)) (warmup_init:
/// min(1e-6 t, 1/sqrt(t))); scale_parameter multiplies it by max(eps2, RMS(parameter)).
/// Registered as "adafactor" (optimizers.h); the arithmetic follows the reference
/// implementations (fairseq's and Hugging Face's Adafactor).
#include <cstdint>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

namespace frugal {

struct AdafactorOptions : public torch::optim::OptimizerCloneableOptions<AdafactorOptions> {
  AdafactorOptions(double lr = 1e-3);  // NOLINT: implicit, like torch::optim::AdamOptions
  TORCH_ARG(double, lr) = 1e-3;              ///< default 1e-3 (ignored with relative_step)
  TORCH_ARG(double, eps1) = 1e-30;           ///< default 1e-30: added to the squared gradient
  TORCH_ARG(double, eps2) = 1e-3;            ///< default 1e-3: least parameter scale
  TORCH_ARG(double, clip_threshold) = 1.0;   ///< default 1: the update's RMS is capped here
  TORCH_ARG(double, decay_rate) = -0.8;      ///< default -0.8: beta2 at step t = 1 - t^decay_rate
  TORCH_ARG(double, beta1) = 0.0;            ///< default 0: no first moment (no state for it)
  TORCH_ARG(double, weight_decay) = 0.0;     ///< default 0: decoupled, scaled by the step size
  TORCH_ARG(bool, relative_step) = false;    ///< default false: the paper's step size, not lr
  TORCH_ARG(bool, scale_parameter) = false;  ///< default false: step size x RMS(parameter)
  TORCH_ARG(bool, warmup_init) = false;      ///< default false: relative step grows as 1e-6 t

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  /// Throws std::invalid_argument naming the first value out of range.
  void check() const;
};

struct AdafactorParamState
    : public torch::optim::OptimizerCloneableParamState<AdafactorParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg_sq_row) = {};  ///< factored: the r row means
  TORCH_ARG(torch::Tensor, exp_avg_sq_col) = {};  ///< factored: the c column means
  TORCH_ARG(torch::Tensor, exp_avg_sq) = {};      ///< a vector's full second moment
  TORCH_ARG(torch::Tensor, exp_avg) = {};         ///< the first moment when beta1 > 0

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class Adafactor : public torch::optim::Optimizer {
 public:
  explicit Adafactor(std::vector<torch::optim::OptimizerParamGroup> groups,
                     AdafactorOptions defaults = {});
  explicit Adafactor(std::vector<torch::Tensor> params, AdafactorOptions defaults = {})
      : Adafactor({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Whether a parameter of this shape keeps a factored second moment (2 or more dimensions).
  static bool factored(torch::IntArrayRef shape) { return shape.size() >= 2; }
  /// Bytes of the state Adafactor keeps for a float32 parameter of this shape.
  static int64_t state_bytes(torch::IntArrayRef shape, bool momentum);

 private:
  void step_one(torch::Tensor& p, const AdafactorOptions& o);
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    _TORCH_OPTIM_SERIALIZE_WITH_TEMPLATE_ARG(Adafactor);
  }
};

}  // namespace frugal
