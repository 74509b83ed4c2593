// Optimizer state moved between optimizers cut over different sets of one model's parameters.
#include "frugal/optim/reshard.h"

#include <algorithm>
#include <unordered_map>

#include "frugal/base/compat.h"
#include "frugal/base/error.h"

namespace frugal {

namespace {

using Index = std::unordered_map<const c10::TensorImpl*, int64_t>;

Index index_of(const std::vector<torch::Tensor>& params) {
  Index index;
  for (size_t i = 0; i < params.size(); ++i)
    index.emplace(params[i].unsafeGetTensorImpl(), static_cast<int64_t>(i));
  return index;
}

// CheckpointError for an index the model lacks.
void check_indices(const std::vector<OptimizerLayout>& saved, size_t n, const std::string& where) {
  for (const auto& layout : saved)
    for (const auto& group : layout)
      for (const int64_t i : group)
        if (i < 0 || i >= static_cast<int64_t>(n))
          throw CheckpointError(where + ": its optimizer layout names parameter " + std::to_string(i) +
                                "; this model has " + std::to_string(n));
}

// The layout's parameters, flattened (its indices checked).
std::vector<torch::Tensor> layout_params(const OptimizerLayout& layout, const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& group : layout)
    for (const int64_t i : group) out.push_back(params[static_cast<size_t>(i)]);
  return out;
}

// make_optimizer must group the parameters as the saved optimizer did: a saved optimizer reads
// back by position within each group.
void check_grouping(const torch::optim::Optimizer& built, const OptimizerLayout& layout,
                    const std::vector<torch::Tensor>& params, const std::string& where) {
  const OptimizerLayout got = optimizer_layout(built, params);
  if (got != layout)
    throw CheckpointError(where + ": its optimizer's parameter groups (" + std::to_string(layout.size()) +
                          ") cannot be rebuilt over the same parameters (this configuration makes " +
                          std::to_string(got.size()) +
                          " groups of other parameters): resume with the [optimizer] it was written with");
}

}  // namespace

OptimizerLayout optimizer_layout(const torch::optim::Optimizer& opt,
                                 const std::vector<torch::Tensor>& params) {
  const Index index = index_of(params);
  OptimizerLayout layout;
  for (const auto& group : opt.param_groups()) {
    layout.emplace_back();
    for (const auto& p : group.params()) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end())
        throw Error("optimizer_layout: the optimizer holds a tensor of shape " + c10::str(p.sizes()) +
                    " that is not one of the model's parameters");
      layout.back().push_back(it->second);
    }
  }
  return layout;
}

int64_t reshard_optimizer_state(torch::optim::Optimizer& into, const OptimizerOptions& o,
                                const std::vector<torch::Tensor>& params,
                                const std::vector<OptimizerLayout>& saved,
                                const LoadSavedOptimizer& load, const std::string& where) {
  check_indices(saved, params.size(), where);
  std::vector<bool> wanted(params.size(), false), saved_somewhere(params.size(), false);
  const OptimizerLayout mine = optimizer_layout(into, params);
  for (const auto& group : mine)
    for (const int64_t i : group) wanted[static_cast<size_t>(i)] = true;
  const auto holds_wanted = [&](const OptimizerLayout& layout) {
    bool any = false;
    for (const auto& group : layout)
      for (const int64_t i : group) any = any || wanted[static_cast<size_t>(i)];
    return any;
  };
  for (const auto& layout : saved)
    for (const auto& group : layout)
      for (const int64_t i : group) saved_somewhere[static_cast<size_t>(i)] = true;
  // A parameter no saved optimizer held would start with fresh moments, silently (LibTorch's
  // own load refuses a group of another size).
  for (size_t i = 0; i < params.size(); ++i)
    if (wanted[i] && !saved_somewhere[i])
      throw CheckpointError(where + ": this run's optimizer steps parameter " + std::to_string(i) + " " +
                            c10::str(params[i].sizes()) + ", which none of its saved optimizers held: "
                            "the trained parameters changed (freeze, adapters); resume with the ones it "
                            "was written with");
  std::unordered_map<int64_t, std::unique_ptr<torch::optim::OptimizerParamState>> found;
  for (size_t k = 0; k < saved.size(); ++k) {
    if (!holds_wanted(saved[k])) continue;
    const std::vector<torch::Tensor> ps = layout_params(saved[k], params);
    std::unique_ptr<torch::optim::Optimizer> from = make_optimizer(o, ps);
    check_grouping(*from, saved[k], params, where);
    load(k, *from);
    for (const auto& group : saved[k])
      for (const int64_t i : group) {
        if (!wanted[static_cast<size_t>(i)]) continue;
        auto it = from->state().find(compat::optimizer_state_key(params[static_cast<size_t>(i)]));
        if (it != from->state().end()) found[i] = std::move(it->second);
      }
  }
  int64_t moved = 0;
  for (const auto& group : mine)
    for (const int64_t i : group) {
      auto it = found.find(i);
      if (it == found.end()) continue;
      into.state()[compat::optimizer_state_key(params[static_cast<size_t>(i)])] = std::move(it->second);
      ++moved;
    }
  return moved;
}

}  // namespace frugal
