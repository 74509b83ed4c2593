#pragma once
/// The trained model kept, as fastai's export: when a fit ends, its weights alone (no optimizer
/// state, no callback state) go to <out_dir>/model.pt, written atomically beside the run's
/// config.toml, and the same weights to <out_dir>/model.safetensors for use outside frugal
/// (safetensors.h). model.pt is a TorchScript module with a forward: in Python,
/// `m = torch.jit.load("runs/x/model.pt"); m(m.prepare(images))`. `frugal generate` and `frugal evaluate` load a run folder with
/// load_run_model.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/app/plugin_host.h"
#include "frugal/callbacks/early_stopping.h"
#include "frugal/config/config.h"
#include "frugal/core/callback.h"
#include "frugal/data/tokenizer.h"

namespace frugal {

class ModelExport : public Callback {
 public:
  /// `path`: the model.pt to write; the .safetensors beside it gets `metadata`. `data`: the
  /// run's data.json (run_data), from which model.pt's `prepare` method is written.
  explicit ModelExport(std::string path, std::map<std::string, std::string> metadata = {},
                       nlohmann::json data = nullptr);
  std::string name() const override { return "model_export"; }
  int order() const override { return order::kModelExport; }
  /// Writes both files once the fit has ended without an error.
  void after_fit(Learner& l) override;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::map<std::string, std::string> metadata_;
  nlohmann::json data_;
};

/// run.save_best: after each validation inside the fit that improves on the best so far (by
/// the monitor's min_delta), the model's weights go to `path` (best.pt) and the same weights to
/// best.safetensors beside it, each written atomically (temp file, fsync, rename), so a crash
/// leaves the previous best intact. Its record names the value, stage, epoch and steps. Under
/// data parallel it runs on every rank: rank 0's verdict decides, rank 0 writes, and the others
/// take part in gathering sharded parameters (FullParameters).
class SaveBest : public Callback {
 public:
  SaveBest(MetricMonitor monitor, std::string path, std::map<std::string, std::string> metadata = {},
           nlohmann::json data = nullptr);
  std::string name() const override { return "save_best"; }
  int order() const override { return order::kBestModel; }
  /// Checks the metric against the Learner's task and that it validates, before any batch.
  void before_fit(Learner& l) override;
  void before_epoch(Learner&) override { in_epoch_ = true; }
  void after_validate(Learner& l) override;
  void after_epoch(Learner&) override { in_epoch_ = false; }

  const std::string& path() const { return path_; }
  bool has_best() const { return has_best_; }
  double best() const { return best_; }
  /// {"metric", "value", "stage", "stage_name", "epoch", "steps", "validation", "pt",
  /// "safetensors"} of the kept model (epochs counted from 1 within the stage); null when none.
  nlohmann::json record() const { return record_; }

  /// The best value and its record: a resumed run keeps a better earlier model.
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(Learner&, torch::serialize::InputArchive& a) override;

 private:
  MetricMonitor monitor_;
  std::string path_;
  std::map<std::string, std::string> metadata_;
  nlohmann::json data_;
  bool in_epoch_ = false, has_best_ = false;
  double best_ = 0;
  int64_t validations_ = 0;
  nlohmann::json record_;
};

/// Writes `l`'s weights to `path` (as Learner::save without the optimizer) and to the
/// .safetensors beside it with `metadata`, both atomically: what ModelExport and SaveBest write.
/// `path` is also a TorchScript module: `forward(x)`, the model in eval mode on prepared inputs
/// (script.h), and for images or CSV features `prepare(x)`, raw inputs to prepared ones as
/// `data` (run_data) says. A model with a module that has no TorchScript form is saved without
/// them, with a warning.
void export_weights(Learner& l, const std::string& path, std::map<std::string, std::string> metadata,
                    const nlohmann::json& data = nullptr);
/// The same for a model outside a Learner.
void export_model(const torch::nn::Module& model, const std::string& path,
                  std::map<std::string, std::string> metadata, const nlohmann::json& data = nullptr);

/// <out_dir>/model.pt: where a run keeps its trained model.
std::string model_path(const RunOptions& r);
/// <out_dir>/best.pt: where run.save_best keeps the best model (best.safetensors beside it).
std::string best_model_path(const RunOptions& r);

/// <out_dir>/data.json: what a trained model needs of its data to be built and fed again, so
/// `evaluate` and `predict` read the run folder, not the training files: the task, the model's
/// input (channels, image sizes, classes or vocabulary, block size), the image normalization,
/// the class names and, for a CSV, the feature columns with the training split's means and
/// standard deviations.
nlohmann::json run_data(const Config& c, const Dataset& train);
void write_run_data(const std::string& out_dir, const nlohmann::json& data);
/// A subword corpus' tokenizer files into out_dir (tokenizer.model; encoder.json + vocab.bpe),
/// named by data.json's "tokenizer" {kind, vocab_size}; returns the files' names (none for bytes).
std::vector<std::string> save_run_tokenizer(const std::string& out_dir, const Dataset& train);
/// When the run folder is claimed: a resume whose freshly built tokenizer differs from the one
/// the folder keeps is refused (Error naming the file: the ids would mean other text); then the
/// tokenizer is saved (so a run stopped early keeps it too).
void keep_run_tokenizer(const std::string& out_dir, const Dataset& train, bool resuming);
/// The kind of tokenizer a run folder's data.json names, else `config_kind` (the run config's).
std::string run_tokenizer_kind(const nlohmann::json& data, const std::string& config_kind);
/// The tokenizer a run folder's data.json names (else `config_kind`, the run config's
/// data.tokenizer: a run stopped before data.json), loaded from the folder; null for bytes.
std::shared_ptr<const Tokenizer> run_tokenizer(const std::string& run_dir, const nlohmann::json& data,
                                               const std::string& config_kind);

/// A trained run, loaded back: its resolved config (with its plugins loaded, since a plugin may
/// register the model), its model with the exported weights, in eval mode, and its data.json
/// (null for a run written before it was kept).
struct RunModel {
  ConfigWithPlugins loaded;
  torch::nn::Sequential model{nullptr};
  nlohmann::json data;
};

/// Reads <run_dir>/config.toml, builds its model on `device` and loads <run_dir>/model.pt into
/// it, every shape checked first. Throws ConfigError (no run folder, no config) or
/// CheckpointError (no model.pt, a corrupt one, or one of another model) naming the file.
RunModel load_run_model(const std::string& run_dir, const torch::Device& device = torch::kCPU);

}  // namespace frugal
