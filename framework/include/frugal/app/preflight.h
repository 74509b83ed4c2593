#pragma once
/// What `frugal check` and `frugal train` (before any work) can know without training: the
/// output folder can be written, the memory budget holds what the model, its gradients, the
/// first step's optimizer state and the data will hold, and each freeze prefix names parameters.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/config/config.h"

namespace frugal {

/// Bytes a run holds before and at its first step, estimated from the config's shapes: the
/// model is built (for Fashion-MNIST at its 1x28x28 images), the optimizer's state is what its
/// registry entry says a step over the trained parameters makes (nothing allocated), the data
/// its sample counts (from the IDX headers for Fashion-MNIST) times a sample's bytes.
struct HeldBytes {
  int64_t parameters = 0;       ///< each tensor once (tied weights are one)
  int64_t buffers = 0;          ///< BatchNorm's running statistics, ...
  int64_t gradients = 0;        ///< of the parameters the first stage trains
  int64_t optimizer_state = 0;  ///< the first stage's optimizer, over those parameters
  int64_t step_temporaries = 0; ///< what the first optimizer step allocates and frees again
  int64_t data = 0;             ///< counted against the budget on CPU only
  /// The larger of a training batch's and a validation batch's inputs and targets on the
  /// device (images as float, tokens as int64): validation's batch is often the larger.
  int64_t batch = 0;
  std::string optimizer;        ///< its name
  bool data_on_device = false;  ///< the budget's device holds the data (CPU)
  /// Held before the first batch, whatever plugins do.
  int64_t before_training() const { return parameters + buffers + (data_on_device ? data : 0); }
  /// Held at the first step's peak, activations left out.
  int64_t total() const {
    return before_training() + gradients + optimizer_state + step_temporaries + batch;
  }
};

/// The estimate for a config whose dataset is built in (fashion-mnist, synthetic, text); throws
/// ConfigError naming the key when the model cannot be built.
HeldBytes estimate_held_bytes(const Config& c);

/// Bytes the built-in dataset of `c` holds in memory (both splits), from shapes alone; 0 for
/// a dataset a plugin registers.
int64_t estimated_data_bytes(const Config& c);

/// Throws ConfigError when run.out_dir (or run.trace's file) cannot be created or written: the
/// nearest existing folder on its path is probed with a temporary folder, removed again; a
/// name longer than the file system allows, or a trace path that is a folder, is refused.
void check_out_dir(const Config& c);

/// Everything above for a config: out_dir; for a built-in dataset, the freeze prefixes and
/// run.memory_budget against estimate_held_bytes (the error lists each part). With plugins on
/// (`plugins_on`, their names), only what is held before the first batch is held against the
/// budget: a plugin may change the first step (optim_swap to a stateless optimizer).
void preflight(const Config& c, const std::vector<std::string>& plugins_on = {});

}  // namespace frugal
