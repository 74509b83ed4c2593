#pragma once
/// What `frugal check` (and every run, before any work) can know without training: the output
/// folder can be written, the memory budget holds what the model, its gradients, the first
/// stage's optimizer state and the data will hold, and each freeze prefix names parameters.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/config.h"

namespace frugal {

/// Bytes a run holds before and at its first step, estimated from the config's shapes (the
/// model is built, the optimizer's state made by one step on zero gradients; the data from its
/// sample count and image size, not loaded).
struct HeldBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;        ///< of the parameters the first stage trains
  int64_t optimizer_state = 0;  ///< the first stage's optimizer, over those parameters
  int64_t data = 0;             ///< counted against the budget on CPU only
  std::string optimizer;        ///< its name
  bool data_on_device = false;  ///< the budget's device holds the data (CPU)
  int64_t total() const { return parameters + gradients + optimizer_state + (data_on_device ? data : 0); }
};

/// The estimate for a config whose dataset is built in (fashion-mnist, synthetic, text); throws
/// ConfigError naming the key when the model cannot be built.
HeldBytes estimate_held_bytes(const Config& c);

/// Bytes the built-in dataset of `c` holds in memory (both splits), from shapes alone; 0 for
/// a dataset a plugin registers.
int64_t estimated_data_bytes(const Config& c);

/// Throws ConfigError naming `key` when `prefix` of a stage matches no parameter of `model`
/// (the nearest block and every block listed).
void check_freeze_prefixes(const torch::nn::Module& model, const std::vector<StageOptions>& stages);

/// Throws ConfigError when run.out_dir cannot be created or written: the nearest existing
/// folder on its path is probed with a temporary folder, removed again.
void check_out_dir(const Config& c);

/// Everything above for a config: out_dir; for a built-in dataset, the freeze prefixes and
/// run.memory_budget against estimate_held_bytes (the error lists each part).
void preflight(const Config& c);

}  // namespace frugal
