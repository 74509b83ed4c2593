#pragma once
/// The run configuration: TOML to typed options, every key validated before any work.
/// Errors name file:line:column, the key, what is allowed and the nearest key for a typo.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "frugal/options.h"

namespace frugal {

struct RunOptions : Options {
  int64_t seed = 0;                    ///< default 0: weights, data order, dropout
  std::string device = "auto";         ///< cpu | cuda | auto
  std::string out_dir = "runs/latest"; ///< report, resolved config and checkpoints go here
  int64_t threads = 0;                 ///< intra-op threads; 0 = LibTorch's default
  int64_t max_steps = 0;               ///< stop the fit after this many batches; 0 = no limit
  int64_t log_every = 100;             ///< batches between log lines when not on a terminal
  std::string progress = "auto";       ///< auto | bar | log | none
  int64_t checkpoint_every = 0;        ///< optimizer steps between checkpoints; 0 = off
  int64_t checkpoint_epochs = 0;       ///< epochs between checkpoints; 0 = off
  int64_t warmup = 2;                  ///< batches per stage left out of the step-time statistics
  std::string trace;                   ///< Chrome-trace JSON of phases and live memory; "" = off
  std::string memory_budget;           ///< "1GiB"; "" = none (parse with memory_budget_bytes)
  std::string on_oom = "fail";         ///< fail | retry
  int64_t oom_retries = 4;             ///< retry: out-of-memory errors allowed on one batch
  std::string micro_batch = "off";     ///< off | auto (the largest that fits memory_budget)
  void visit(FieldVisitor& v) override;
  void check() const override;
  /// memory_budget in bytes (0 = none).
  int64_t memory_budget_bytes() const;
};

struct DataOptions : Options {
  std::string dataset = "fashion-mnist";  ///< fashion-mnist | synthetic | one a plugin registers
  std::string path = "/usr/share/datasets/fashion-mnist";
  int64_t batch_size = 128;
  int64_t valid_batch_size = 1000;
  int64_t train_samples = 0;  ///< use the first N training samples; 0 = all
  int64_t valid_samples = 0;  ///< use the first N validation samples; 0 = all; -1 = no validation
  bool shuffle = true;
  // synthetic data only
  int64_t channels = 1;
  int64_t image_size = 28;
  int64_t classes = 10;
  int64_t samples = 1024;
  void visit(FieldVisitor& v) override;
};

struct ModelOptions : Options {
  std::string arch = "cnn";  ///< mlp | cnn | resnet | vit | one a plugin registers
  int64_t width = 32;        ///< hidden units (mlp), base channels (cnn, resnet), embedding (vit)
  int64_t depth = 2;         ///< hidden blocks (mlp), residual blocks (resnet), layers (vit)
  double dropout = 0.0;
  int64_t patch = 7;         ///< vit: patch size in pixels
  int64_t heads = 4;         ///< vit: attention heads
  void visit(FieldVisitor& v) override;
  void check() const override;
};

struct OptimizerOptions : Options {
  std::string name = "adam";  ///< adam | adamw | sgd | rmsprop | adagrad
  double lr = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;  ///< sgd, rmsprop
  double beta1 = 0.9;     ///< adam, adamw
  double beta2 = 0.999;
  double eps = 1e-8;
  void visit(FieldVisitor& v) override;
};

struct LossOptions : Options {
  std::string name = "cross_entropy";  ///< cross_entropy | one a plugin registers
  double label_smoothing = 0.0;
  void visit(FieldVisitor& v) override;
};

/// One stage: epochs with one setup (frozen prefixes, image size, optimizer).
struct StageOptions : Options {
  std::string name = "train";
  int64_t epochs = 1;
  std::vector<std::string> freeze;  ///< module-name prefixes whose parameters do not train
  int64_t image_size = 0;           ///< 0 = the data's own size
  OptimizerOptions optimizer;       ///< inherits [optimizer]; used when has_optimizer
  bool has_optimizer = false;       ///< the stage has its own [stages.optimizer] table
  void visit(FieldVisitor& v) override;
};

/// [ablation]: what `frugal ablate` and `frugal plan` vary. Every run is the config itself with
/// the baseline plugins on and each technique on or off.
struct AblationOptions : Options {
  std::vector<std::string> baseline;    ///< plugins on in every run, the baseline included
  std::vector<std::string> techniques;  ///< plugins varied; empty = every [plugins.X] not in baseline
  int64_t repeats = 1;                  ///< runs of each combination; times are their median
  int64_t steps = 20;                   ///< training batches per run (run.max_steps)
  int64_t warmup = 2;                   ///< batches left out of the step times (run.warmup)
  bool leave_one_out = true;            ///< also run all techniques but one, for each
  /// "file:line:column" of the keys, for errors found after loading (a plugin not installed).
  std::string baseline_at, techniques_at;
  void visit(FieldVisitor& v) override;
  void check() const override;
};

struct Config {
  RunOptions run;
  DataOptions data;
  ModelOptions model;
  OptimizerOptions optimizer;
  LossOptions loss;
  std::vector<StageOptions> stages;  ///< at least one
  /// [plugins]: `path` and one [plugins.<name>] table per plugin; validated by the plugin
  /// loader against each plugin's declared options.
  toml::table plugins;
  AblationOptions ablation;   ///< used by `frugal ablate` and `frugal plan`
  bool has_ablation = false;  ///< the file has an [ablation] table
  std::string source;  ///< the config file's path (for errors)

  /// The resolved configuration, every key with its value, as TOML text.
  std::string to_toml() const;
};

/// Reads and validates `path`, applying `overrides` ("a.b=value", value in TOML syntax or a
/// bare string) first. Throws ConfigError: missing file, malformed TOML, unknown key (with
/// the nearest), wrong type, value out of range.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
/// The same from TOML text; `source` names it in errors.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

/// Fills `o` from `t` (an Options struct's keys) and rejects unknown keys. `where` is the
/// table's dotted path ("data", "plugins.amp") and `source` the file, both for errors.
void read_options(const toml::table& t, Options& o, const std::string& where,
                  const std::string& source);

/// "file:line:column" of a node, or "file" / "--set a.b=c" when it has none.
std::string location(const toml::node& n, const std::string& source);

}  // namespace frugal
