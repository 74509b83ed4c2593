#pragma once
/// The trained model kept, as fastai's export: when a fit ends, its weights alone (no optimizer
/// state, no callback state) go to <out_dir>/model.pt, written atomically beside the run's
/// config.toml, and the same weights to <out_dir>/model.safetensors for use outside frugal
/// (safetensors.h). `frugal generate` and `frugal evaluate` load a run folder with
/// load_run_model.
#include <map>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "frugal/callback.h"
#include "frugal/config.h"
#include "frugal/plugin_host.h"

namespace frugal {

class ModelExport : public Callback {
 public:
  /// `path`: the model.pt to write; the .safetensors beside it gets `metadata`.
  explicit ModelExport(std::string path, std::map<std::string, std::string> metadata = {});
  std::string name() const override { return "model_export"; }
  int order() const override { return order::kModelExport; }
  /// Writes both files once the fit has ended without an error.
  void after_fit(Learner& l) override;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::map<std::string, std::string> metadata_;
};

/// <out_dir>/model.pt: where a run keeps its trained model.
std::string model_path(const RunOptions& r);

/// A trained run, loaded back: its resolved config (with its plugins loaded, since a plugin may
/// register the model) and its model with the exported weights, in eval mode.
struct RunModel {
  ConfigWithPlugins loaded;
  torch::nn::Sequential model{nullptr};
};

/// Reads <run_dir>/config.toml, builds its model on `device` and loads <run_dir>/model.pt into
/// it, every shape checked first. Throws ConfigError (no run folder, no config) or
/// CheckpointError (no model.pt, a corrupt one, or one of another model) naming the file.
RunModel load_run_model(const std::string& run_dir, const torch::Device& device = torch::kCPU);

}  // namespace frugal
