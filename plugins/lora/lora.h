#pragma once
// lora: low-rank adapters (Hu et al. 2021) on a model's linear layers, the base weights frozen;
// with `quantize`, the frozen weights kept in 8 bits or 4-bit NF4 with double quantization
// (QLoRA, Dettmers et al. 2023), dequantized layer by layer in the forward and again in the
// backward (never all at once). README.md is the method card.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/models/linear.h>
#include <frugal/plugin.h>

#include "quantize.h"

namespace frugal::lora {

struct LoraOptions : frugal::Options {
  int64_t rank = 8;
  double alpha = 16.0;   ///< the update is scaled by alpha / rank
  double dropout = 0.0;  ///< on the adapter's input
  /// Layers adapted: a layer whose name is one of these or ends with "." + one (PEFT's rule).
  std::vector<std::string> targets = {"c_attn"};
  std::string quantize = "none";  ///< "none" | "int8" | "nf4": how the frozen weights are kept
  int64_t block = 64;             ///< weights per absmax scale
  bool double_quant = true;       ///< the scales themselves in 8 bits (QLoRA's double quantization)
  bool export_adapter = true;     ///< <run.out_dir>/adapter in PEFT's layout when the fit ends
  void visit(frugal::FieldVisitor& v) override;
  void check() const override;
};

/// A frozen weight in fewer bits, as buffers of the layer's child "quant" (saved in checkpoints).
class QuantStoreImpl : public torch::nn::Module {
 public:
  explicit QuantStoreImpl(QuantizedWeight q);
  QuantizedWeight weight() const;  ///< the buffers as a QuantizedWeight
  int64_t bytes() const { return weight().bytes(); }

 private:
  QuantizedWeight meta_;  ///< kind, shape and blocks; its tensors are the buffers
};
TORCH_MODULE(QuantStore);

/// y = base(x) + scale * B(A(dropout(x))), base = x W (+ b) with W frozen (or dequantized).
class LoraAdapter : public frugal::LinearAdapter {
 public:
  LoraAdapter(double scale, double dropout) : scale_(scale), dropout_(dropout) {}
  torch::Tensor forward(frugal::AdaptableLinearImpl& layer, const torch::Tensor& x) override;
  torch::Tensor merged_weight(const frugal::AdaptableLinearImpl& layer) const override;

 private:
  double scale_, dropout_;
};

/// What attach() did, for the log and the tests.
struct Adapted {
  std::vector<std::string> layers;  ///< the adapted layers' names
  int64_t trainable = 0, total = 0;  ///< parameters (elements)
  int64_t base_bytes = 0, stored_bytes = 0;  ///< adapted layers' weights: float vs as kept
};

/// Adapts `model`'s layers named by o.targets: adds lora_A [rank, in] (Kaiming uniform) and
/// lora_B [out, rank] (zeros: the model computes what it did) to each, quantizes their
/// weights if asked, and freezes every parameter but the adapters'. Throws ConfigError when
/// no layer matches (naming the layers there are); a model without any adaptable layer is
/// left as it is (nothing adapted).
Adapted adapt(torch::nn::Module& model, const LoraOptions& o);
/// Folds every adapter into its layer's weight for good (float, the layer's layout) and
/// removes it: the plain model the adapted one computes.
void merge_for_good(torch::nn::Module& model);
/// Writes PEFT's adapter_model.safetensors and adapter_config.json into `folder`: tensor
/// names "base_model.model.<the name in model files>.lora_A.weight" (`arch`'s WeightNames);
/// base_model_name_or_path is `base` (model.init_from), or the arch when there is none.
void export_peft(const torch::nn::Module& model, const LoraOptions& o, const std::string& arch,
                 const std::string& folder, const std::string& base = "");

class Lora : public frugal::Callback {
 public:
  Lora(const LoraOptions& o, const frugal::PluginContext& ctx);
  ~Lora() override;
  std::string name() const override { return "lora"; }
  int order() const override { return frugal::order::kModelRewrite; }
  void attach(frugal::Learner& l) override;
  void after_fit(frugal::Learner& l) override;
  const Adapted& adapted() const { return adapted_; }

 private:
  LoraOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  Adapted adapted_;
  std::shared_ptr<torch::nn::Module> model_;  ///< adapted by attach; its adapters merged when this goes
};

}  // namespace frugal::lora
