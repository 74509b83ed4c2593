#pragma once
/// A model's starting weights from a file (model.init_from): a model.safetensors a run wrote, or
/// any safetensors file whose tensor names are the model's state-dict names.
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal {

/// What init_weights loaded and left out, by state-dict name.
struct InitReport {
  std::string file;                     ///< the safetensors file read
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     ///< the model's, not in the file
  std::vector<std::string> unexpected;  ///< the file's, not in the model
  std::vector<std::string> misshaped;   ///< "name: file [a, b], model [c, d]"
  /// "12 tensors loaded; 2 left at their fresh values (head.0.weight, ...); ..."
  std::string summary() const;
};

/// The safetensors file `from` means: itself, or a run folder's model.safetensors. Throws
/// CheckpointError naming what was looked for.
std::string weights_file(const std::string& from);

/// Copies the tensors of `from` into `model`'s parameters and buffers of the same name (those
/// under one of `prefixes`; all when empty), converted to each one's dtype and device. `strict`:
/// a missing, mis-shaped or (under the prefixes) unexpected tensor is a ConfigError listing
/// each kind; otherwise they are left out and listed in the report. Nothing is copied when it
/// throws.
InitReport init_weights(torch::nn::Module& model, const std::string& from, bool strict,
                        const std::vector<std::string>& prefixes = {});

}  // namespace frugal
