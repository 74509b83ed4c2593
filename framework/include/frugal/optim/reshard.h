#pragma once
/// Moving optimizer state between optimizers cut over different sets of the same model's
/// parameters: what a checkpoint written by N ranks with sharded optimizers (zero) needs to
/// resume on M ranks, cut another way or not at all. An optimizer's state is per parameter
/// (LibTorch keys it by the parameter); a saved optimizer is read back positionally, group by
/// group. So each saved optimizer comes with its layout: per parameter group, the index in the
/// model's parameter list of each of its parameters. With it, a saved optimizer loads into a
/// temporary optimizer built over exactly those parameters, and each parameter's state moves to
/// the optimizer that holds it now. One saved optimizer is resident at a time (plus what the
/// target keeps), never the whole state.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/optim/optimizers.h"

namespace frugal {

/// Per parameter group of an optimizer, the index in a model's parameter list of each of its
/// parameters, in the group's order.
using OptimizerLayout = std::vector<std::vector<int64_t>>;

/// The layout of `opt` over `params` (a model's parameters()). Throws Error when `opt` holds a
/// tensor that is not one of `params`.
OptimizerLayout optimizer_layout(const torch::optim::Optimizer& opt,
                                 const std::vector<torch::Tensor>& params);

/// Loads saved optimizer `k` into `opt`, an optimizer built over the parameters of layout `k`.
using LoadSavedOptimizer = std::function<void(size_t k, torch::optim::Optimizer& opt)>;

/// Gives `into` (an optimizer over some of `params`, built by make_optimizer with `o`) the saved
/// state of each parameter it holds: saved optimizer k (layout `saved[k]`) is loaded, through
/// `load`, into an optimizer `make_optimizer(o, ...)` builds over its parameters, and the states
/// of `into`'s parameters move over. The groups' options stay `into`'s, as LibTorch's load
/// leaves them (the schedule sets the lr each batch). A saved optimizer holding none of
/// `into`'s parameters is not read. Throws CheckpointError naming `where` when a layout names a
/// parameter the model does not have or make_optimizer would group its parameters otherwise.
/// Returns the number of `into`'s parameters that received a state.
int64_t reshard_optimizer_state(torch::optim::Optimizer& into, const OptimizerOptions& o,
                                const std::vector<torch::Tensor>& params,
                                const std::vector<OptimizerLayout>& saved,
                                const LoadSavedOptimizer& load, const std::string& where);

}  // namespace frugal
