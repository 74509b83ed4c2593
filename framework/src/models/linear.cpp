// The linear layer plugins can adapt (LoRA, quantized weights).
#include "frugal/models/linear.h"

#include <cmath>

namespace frugal {

AdaptableLinearImpl::AdaptableLinearImpl(int64_t in, int64_t out, bool with_bias, WeightLayout l)
    : in_features(in), out_features(out), layout(l) {
  weight = register_parameter("weight", l == WeightLayout::OutIn ? torch::empty({out, in}) : torch::empty({in, out}));
  // torch.nn.Linear's draws on the [out, in] view, so both layouts start alike.
  torch::nn::init::kaiming_uniform_(out_in(weight), std::sqrt(5.0));
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    bias = register_parameter("bias", torch::empty({out}));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

torch::Tensor AdaptableLinearImpl::project(const torch::Tensor& x, const torch::Tensor& w) const {
  if (layout == WeightLayout::OutIn) return torch::nn::functional::linear(x, w, bias);
  auto y = torch::matmul(x, w);
  return bias.defined() ? y + bias : y;
}

torch::Tensor AdaptableLinearImpl::forward(const torch::Tensor& x) {
  return adapter_ ? adapter_->forward(*this, x) : project(x, weight);
}

AdaptersMerged::AdaptersMerged(torch::nn::Module& model) {
  torch::NoGradGuard g;
  try {
    for (const auto& m : model.modules(/*include_self=*/false)) {
      auto* layer = dynamic_cast<AdaptableLinearImpl*>(m.get());
      if (!layer || !layer->adapter()) continue;
      SetAside s{layer, layer->adapter(), layer->weight.data(), {}};
      const auto merged = s.adapter->merged_weight(*layer).to(layer->weight.device());
      for (const auto& child : layer->named_children()) s.children.emplace_back(child.key(), child.value());
      for (const auto& child : s.children) layer->unregister_module(child.first);
      layer->weight.set_data(merged);
      layer->set_adapter(nullptr);
      set_aside_.push_back(std::move(s));
    }
  } catch (...) {  // out of memory merging: every layer as it was, then the error
    restore();
    throw;
  }
}

AdaptersMerged::~AdaptersMerged() { restore(); }

void AdaptersMerged::restore() {
  for (auto& s : set_aside_) {
    s.layer->weight.set_data(s.weight);
    for (auto& child : s.children) s.layer->register_module(child.first, child.second);
    s.layer->set_adapter(s.adapter);
  }
  set_aside_.clear();
}

}  // namespace frugal
