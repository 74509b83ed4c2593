#pragma once
// optim_swap's testable part: which trigger fires, and SGD's momentum seeded from Adam's first
// moment. Header-only: the plugin and the tests compile the same code.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <frugal/compat.h>

namespace frugal::optim_swap {

/// The epoch of the whole fit (counted from 0 across stages) that `stage_epoch` of stage
/// `stage_index` is: epochs of the earlier stages plus the epoch within the stage.
template <class Stages>
int64_t fit_epoch(const Stages& stages, int64_t stage_index, int64_t stage_epoch) {
  int64_t n = stage_epoch;
  for (int64_t i = 0; i < stage_index && i < static_cast<int64_t>(stages.size()); ++i)
    n += stages[static_cast<size_t>(i)].epochs;
  return n;
}

/// Adam's (or AdamW's) first moment of each parameter that has one, as (parameter, exp_avg)
/// pairs. The tensors are shared, not copied: they outlive the optimizer that made them and
/// become SGD's momentum buffers without a second copy in memory.
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> first_moments(
    torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  auto& state = opt.state();
  for (const auto& p : params) {
    auto it = state.find(compat::optimizer_state_key(p));
    if (it == state.end()) continue;
    const auto* s = it->second.get();
    if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s))
      out.emplace_back(p, a->exp_avg());
    else if (const auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s))
      out.emplace_back(p, w->exp_avg());
  }
  return out;
}

/// Installs each moment as the parameter's SGD momentum buffer in `sgd` (which must be a
/// torch::optim::SGD with momentum > 0: SGD only reads a buffer when momentum is on). The
/// first SGD step then is buf = momentum * exp_avg + grad; p -= lr * buf. Returns how many
/// buffers it seeded.
inline int64_t seed_momentum(torch::optim::Optimizer& sgd,
                             const std::vector<std::pair<torch::Tensor, torch::Tensor>>& moments) {
  int64_t n = 0;
  for (const auto& [p, m] : moments) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(m.detach());
    sgd.state()[compat::optimizer_state_key(p)] = std::move(s);
    ++n;
  }
  return n;
}

}  // namespace frugal::optim_swap
