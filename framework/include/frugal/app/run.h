#pragma once
/// Assembles a Learner from a Config: the same path for `frugal train`, `frugal check`
/// and the C++ API.
#include <memory>

#include "frugal/callbacks/stop.h"
#include "frugal/config/config.h"
#include "frugal/core/learner.h"

namespace frugal {

/// The device `run.device` names: "auto" is CUDA when this build and machine have it.
torch::Device resolve_device(const std::string& device);

/// Checks what the config names against the registries (dataset, model, loss) and that the
/// model can be built for the stages' image sizes, without loading data. Throws ConfigError
/// naming the file and key. What needs more (the output folder, freeze prefixes, the memory
/// budget against the bytes the run will hold) is preflight() (frugal/preflight.h), which
/// `frugal check` and `frugal train` run too.
void check_config(const Config& c);
/// The names only (dataset, loss, model against the registries; the keys they read), no file
/// read: what rebuilding a run folder's model needs (load_run_model).
void check_config_names(const Config& c);

/// Loads the data, builds the model, loss and optimizer: a Learner ready to fit(c.stages).
/// Seeds LibTorch with run.seed and sets run.threads first. With run.checkpoint_every or
/// run.checkpoint_epochs set, a CheckpointWriter writes to checkpoint_path(c.run).
/// With `stop`, a StopCallback polls it: a requested stop checkpoints (also without
/// run.checkpoint_every) and ends the fit; see stop.h. Checkpoints go through one
/// CheckpointHistory (run.keep_checkpoints). The safety nets: a NonFiniteCheck
/// (run.on_nonfinite), and with run.save_best a SaveBest writing best_model_path(c.run), with
/// run.early_stopping an EarlyStopping; their metrics are checked against the task here
/// (ConfigError naming the file and key).
std::unique_ptr<Learner> make_learner(const Config& c, const StopRequest* stop = nullptr);
/// make_learner, then Learner::check_fit of the config's stages (errors name the file): all
/// that `train` refuses before its first step, with nothing written. What `frugal check` runs,
/// and `frugal train` before it claims run.out_dir.
std::unique_ptr<Learner> make_checked_learner(const Config& c, const StopRequest* stop = nullptr);

/// The model the config describes, freshly initialised, for the shapes the config alone gives
/// (no data is read): what load_run_model fills with a run's exported weights. Throws
/// ConfigError naming the file and `model`.
torch::nn::Sequential make_config_model(const Config& c);
/// What the config's model is built for: from the loaded training data when given, else from
/// the config (and the files of image_folder and csv).
ModelInput config_model_input(const Config& c, const Dataset* data = nullptr);

/// What the safety nets make_learner adds did, for the run report: {"nonfinite": the
/// NonFiniteCheck's record (mode, skipped_steps, the event that failed or was last skipped),
/// "early_stopping": EarlyStopping's record, "best_model": SaveBest's record}, each present when
/// its callback is.
nlohmann::json safety_records(const Learner& l);

/// <out_dir>/checkpoints/last.ckpt: where a run's periodic checkpoints go.
std::string checkpoint_path(const RunOptions& r);
/// What every checkpoint of a run stores about it: {"config": the resolved config TOML}.
nlohmann::json checkpoint_info(const Config& c);
/// The checkpoint `--resume WHERE` means: WHERE itself when it is a file, else the run folder
/// WHERE's checkpoints/last.ckpt. Throws CheckpointError when there is none.
std::string resume_checkpoint(const std::string& where);
/// Throws ConfigError listing the keys in which `c` differs from the config stored in the
/// checkpoint at `path` (its `info`). Keys whose fields are marked outside_training may differ:
/// those of c.keys_outside_training() (run.out_dir, device, threads, progress, log_every,
/// max_steps, the memory settings, checkpoint_*) and `plugin_keys_outside_training` (from
/// PluginHost::keys_outside_training()). `finished`: the checkpoint ends a finished fit, which
/// may be extended: its last stage's epochs and the keys of stages after it may differ too
/// (the Learner checks that the stages run are the same, with epochs added or stages appended).
void check_resume_config(const Config& c, const nlohmann::json& info, const std::string& path,
                         const std::vector<std::string>& plugin_keys_outside_training = {},
                         bool finished = false);

}  // namespace frugal
