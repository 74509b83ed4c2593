#pragma once
/// A linear layer a plugin can adapt: the lora plugin adds a low-rank update to its output, and
/// keeps its weight in 4 or 8 bits (qlora), dequantized in the forward. The weight in either
/// layout: torch.nn.Linear's [out, in], or Hugging Face GPT-2's Conv1D [in, out], so that the
/// names and shapes of a Hugging Face checkpoint load as they are.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace frugal {

enum class WeightLayout {
  OutIn,  ///< [out, in], as torch.nn.Linear: y = x W^T + b
  InOut,  ///< [in, out], as transformers' Conv1D: y = x W + b
};

class AdaptableLinearImpl;

/// What a plugin puts into a layer's forward: called instead of the layer's own. It must not
/// outlive the plugin's library: the plugin detaches it (set_adapter(nullptr)) when its fit ends.
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  virtual torch::Tensor forward(AdaptableLinearImpl& layer, const torch::Tensor& x) = 0;
  /// The layer's weight (its layout, float) with the adaptation folded in: what an export
  /// writes, so the exported model computes what the adapted one does, without the adapter.
  virtual torch::Tensor merged_weight(const AdaptableLinearImpl& layer) const = 0;
};

class AdaptableLinearImpl : public torch::nn::Module {
 public:
  /// Initialised as torch.nn.Linear (Kaiming uniform, a = sqrt(5); bias uniform +-1/sqrt(in)).
  AdaptableLinearImpl(int64_t in_features, int64_t out_features, bool bias = true,
                      WeightLayout layout = WeightLayout::OutIn);
  torch::Tensor forward(const torch::Tensor& x);
  /// x W^T + b for a weight `w` in this layer's layout: its own, or a dequantized copy.
  torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w) const;
  /// `w` (this layer's layout) as [out, in].
  torch::Tensor out_in(const torch::Tensor& w) const { return layout == WeightLayout::InOut ? w.t() : w; }

  void set_adapter(std::shared_ptr<LinearAdapter> a) { adapter_ = std::move(a); }
  const std::shared_ptr<LinearAdapter>& adapter() const { return adapter_; }

  int64_t in_features, out_features;
  WeightLayout layout;
  torch::Tensor weight, bias;  ///< bias undefined when the layer has none

 private:
  std::shared_ptr<LinearAdapter> adapter_;
};
TORCH_MODULE(AdaptableLinear);

/// For the scope of an export: every adapted layer of `model` made plain, its weight the
/// adapter's merged_weight(), its child modules (the adapter's tensors) and its adapter set
/// aside; all put back as they were when it ends. So model.pt and model.safetensors hold the
/// model as a plain one, and the fit that follows (or a checkpoint) still has its adapters.
class AdaptersMerged {
 public:
  explicit AdaptersMerged(torch::nn::Module& model);
  ~AdaptersMerged();
  AdaptersMerged(const AdaptersMerged&) = delete;
  AdaptersMerged& operator=(const AdaptersMerged&) = delete;
  /// How many layers were merged.
  size_t size() const { return set_aside_.size(); }

 private:
  void restore();
  struct SetAside {
    AdaptableLinearImpl* layer;
    std::shared_ptr<LinearAdapter> adapter;
    torch::Tensor weight;
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> children;
  };
  std::vector<SetAside> set_aside_;
};

}  // namespace frugal
