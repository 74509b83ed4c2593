#include "frugal/model_export.h"

#include <filesystem>

#include "archive.h"
#include "frugal/error.h"
#include "frugal/learner.h"
#include "frugal/run.h"
#include "frugal/safetensors.h"

namespace frugal {

namespace fs = std::filesystem;

ModelExport::ModelExport(std::string path, std::map<std::string, std::string> metadata)
    : path_(std::move(path)), metadata_(std::move(metadata)) {}

void ModelExport::after_fit(Learner& l) {
  l.save(path_, /*with_opt=*/false);
  auto metadata = metadata_;
  metadata.emplace("format", "pt");  // what safetensors.torch.load_file expects of PyTorch weights
  safetensors::write(fs::path(path_).replace_extension(".safetensors").string(),
                     safetensors::state_dict(*l.model()), metadata);
}

std::string model_path(const RunOptions& r) { return (fs::path(r.out_dir) / "model.pt").string(); }

RunModel load_run_model(const std::string& run_dir, const torch::Device& device) {
  const fs::path dir(run_dir);
  const fs::path config = dir / "config.toml";
  if (!fs::is_directory(dir)) throw_config_error(run_dir + ": not a run folder (no such folder)");
  if (!fs::is_regular_file(config))
    throw_config_error(run_dir + ": not a run folder: it has no config.toml (frugal train writes "
                       "one into run.out_dir)");
  RunModel r;
  r.loaded = load_config_with_plugins(config.string());
  const fs::path weights = dir / "model.pt";
  if (!fs::is_regular_file(weights))
    throw CheckpointError(weights.string() + ": no trained model in this run folder (a run writes "
                          "model.pt when its fit ends; this one did not finish)");
  r.model = make_config_model(r.loaded.config);
  r.model->to(device);
  archive::InputArchive a;
  archive::open(weights.string(), device, a);
  archive::load_model(*r.model, a, weights.string());
  r.model->eval();
  return r;
}

}  // namespace frugal
