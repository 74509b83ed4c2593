#pragma once
/// A model's starting weights from a file (model.init_from): a model.safetensors a run wrote, or
/// any safetensors file whose tensor names are the model's state-dict names.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/models/registry.h"

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

/// The file `from` means: itself (a .safetensors), or in a folder (a run's, or a Hugging Face
/// model's) model.safetensors, else model.safetensors.index.json (a sharded checkpoint). Throws
/// CheckpointError naming what was looked for.
std::string weights_file(const std::string& from);

/// Every tensor `from` holds (weights_file): one file, or every shard an index names (each
/// tensor in the shard the index says). Throws CheckpointError naming the file and what is wrong.
std::map<std::string, torch::Tensor> read_weights(const std::string& from);

/// Copies the tensors of `from` into `model`'s parameters and buffers of the same name (those
/// under one of `prefixes`; all when empty), converted to each one's dtype and device; with
/// `names`, file names are read through names->from_file (Hugging Face's GPT-2 names). `strict`:
/// a missing, mis-shaped or (under the prefixes) unexpected tensor is a ConfigError listing
/// each kind; otherwise they are left out and listed in the report. Two file tensors for one
/// (a tied head's) must be equal. Nothing is copied when it throws.
InitReport init_weights(torch::nn::Module& model, const std::string& from, bool strict,
                        const std::vector<std::string>& prefixes = {},
                        const std::optional<WeightNames>& names = std::nullopt);

}  // namespace frugal
