#pragma once
/// The sections of a run's configuration as typed options, each with its defaults and checks
/// ([run], [data], [model], [optimizer], [loss], [[stages]], [distributed], [ablation]). What a
/// plugin or the Learner reads; no TOML here (config/config.h reads and writes the file).
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "frugal/base/options.h"

namespace frugal {

/// An optimizer's own keys with their values, kept as TOML values (a config holds no object a
/// plugin made). Opaque here, so the SDK's headers need no TOML library: config/own_keys.h
/// opens it.
class OwnKeys {
 public:
  struct Table;
  OwnKeys();
  OwnKeys(const OwnKeys& o);
  OwnKeys& operator=(const OwnKeys& o);
  OwnKeys(OwnKeys&& o) noexcept;
  OwnKeys& operator=(OwnKeys&& o) noexcept;
  ~OwnKeys();
  size_t size() const;
  bool contains(const std::string& key) const;
  bool operator==(const OwnKeys& o) const;
  bool operator!=(const OwnKeys& o) const { return !(*this == o); }
  Table& table() { return *t_; }
  const Table& table() const { return *t_; }

 private:
  std::unique_ptr<Table> t_;
};
/// As an inline TOML table: `{ momentum = 0.9 }`.
std::ostream& operator<<(std::ostream& os, const OwnKeys& k);

/// [distributed]: how the ranks talk. Outside training: none of it changes the result.
struct DistributedOptions : Options {
  std::string backend = "auto";  ///< auto (nccl on CUDA, else gloo) | gloo | nccl
  int64_t timeout = 300;         ///< seconds for the rendezvous and for each collective
  ByteSize bucket_size{25 << 20};  ///< gradient bytes per all-reduce (DDP's 25 MiB)
  bool overlap = true;             ///< launch each bucket's all-reduce from backward
  void visit(FieldVisitor& v) override;
};

struct RunOptions : Options {
  int64_t seed = 0;                    ///< default 0: weights, data order, dropout
  std::string device = "auto";         ///< cpu | cuda | auto
  std::string out_dir = "runs/latest"; ///< report, resolved config and checkpoints go here
  int64_t threads = Limits::kAuto;     ///< intra-op threads; kAuto = measured; 0 = LibTorch's
  int64_t max_steps = 0;               ///< stop the fit after this many batches; 0 = no limit
  int64_t log_every = 100;             ///< batches between log lines when not on a terminal
  std::string progress = "auto";       ///< auto | bar | log | none
  int64_t checkpoint_every = 0;        ///< optimizer steps between checkpoints; 0 = off
  int64_t checkpoint_epochs = 0;       ///< epochs between checkpoints; 0 = off
  int64_t keep_checkpoints = 1;        ///< the newest K checkpoints are kept (numbered if K > 1)
  std::string resume = "off";          ///< off | auto: continue out_dir's unfinished run
  std::string preempt_signal = "SIGUSR1";  ///< stops cleanly like SIGTERM; "none" = off
  int64_t warmup = 2;                  ///< batches per stage left out of the step-time statistics
  std::string trace;                   ///< Chrome-trace JSON of phases and live memory; "" = off
  ByteSize memory_budget;              ///< "1GiB"; default none
  std::string on_oom = "fail";         ///< fail | retry
  int64_t oom_retries = 4;             ///< retry: out-of-memory errors allowed on one batch
  std::string micro_batch = "off";     ///< off | auto (the largest that fits memory_budget)
  // the metrics history (metrics_log.h): a row every log_every batches and per epoch
  bool metrics = true;                 ///< out_dir/metrics.csv and metrics.jsonl
  bool tensorboard = true;             ///< out_dir/tensorboard/events.out.tfevents.*
  bool plots = true;                   ///< out_dir/metrics.svg and .png, drawn by gnuplot
  // safety nets (nonfinite.h, early_stopping.h, SaveBest in model_export.h)
  std::string save_best = "off";       ///< off | valid_loss | accuracy | the task's metric
  std::string on_nonfinite = "fail";   ///< fail | skip: a step with an inf/NaN loss or gradient
  std::string early_stopping = "off";  ///< off | valid_loss | accuracy | the task's metric
  int64_t patience = 3;                ///< early stopping: epochs without an improvement
  double min_delta = 0.0;              ///< early stopping: the least change that improves
  void visit(FieldVisitor& v) override;
  void check() const override;

 private:
  void visit_memory(FieldVisitor& v);
  void visit_history(FieldVisitor& v);
  void visit_safety(FieldVisitor& v);
};

struct DataOptions : Options {
  std::string dataset = "fashion-mnist";  ///< fashion-mnist | synthetic | text | image_folder | csv | one a plugin registers
  std::string path = "/usr/share/datasets/fashion-mnist";
  // image_folder and csv
  std::string valid_path;          ///< the validation folder (image_folder) or file (csv)
  // csv only
  std::string label_column;        ///< the label's header name; "" = the last column
  std::string task = "classification";  ///< classification | regression (csv)
  // image augmentation of the training split (seeded per epoch; resumes exactly)
  bool flip = false;               ///< mirror left-right with probability 1/2
  int64_t crop_padding = 0;        ///< pad by N pixels, crop back at a random offset; 0 = off
  // text data only
  std::vector<std::string> paths;  ///< text files or folders (read recursively, sorted)
  int64_t block_size = 128;        ///< tokens per training window
  int64_t windows_per_epoch = 0;   ///< random windows per epoch; 0 = train tokens / block_size
  std::string tokenizer = "bytes";  ///< bytes | sentencepiece | gpt2
  int64_t vocab_size = 4096;        ///< sentencepiece trained on the corpus: its pieces
  std::string tokenizer_model = "bpe";  ///< sentencepiece trained on the corpus: bpe | unigram
  /// An existing tokenizer: sentencepiece's .model file (or a folder holding tokenizer.model),
  /// gpt2's folder of encoder.json + vocab.bpe; "" = sentencepiece trains one on the corpus
  std::string tokenizer_path;
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
  void check() const override;

 private:
  void check_tokenizer_keys() const;
};

struct ModelOptions : Options {
  std::string arch = "cnn";  ///< mlp | cnn | resnet | vit | one a plugin registers
  int64_t width = 32;        ///< hidden units (mlp), base channels (cnn, resnet), embedding (vit)
  int64_t depth = 2;         ///< hidden blocks (mlp), residual blocks (resnet), layers (vit)
  double dropout = 0.0;
  int64_t patch = 7;         ///< vit: patch size in pixels
  int64_t heads = 4;         ///< vit: attention heads
  // gpt only
  int64_t n_layer = 4;       ///< transformer blocks
  int64_t n_head = 4;        ///< attention heads; must divide n_embd
  int64_t n_embd = 128;      ///< embedding size
  int64_t block_size = 0;    ///< longest context (position table); 0 = data.block_size
  // every model: the weights it starts from (io/weights.h)
  std::string init_from;                   ///< a .safetensors file or a run folder; "" = fresh
  bool init_strict = true;                 ///< every tensor matched, none left over
  std::vector<std::string> init_prefixes;  ///< load only these blocks; empty = all
  void visit(FieldVisitor& v) override;
  void check() const override;
};

/// [optimizer]: the keys every optimizer takes (name, lr, weight_decay) and the keys of the one
/// `name` chooses (adam: beta1, beta2, eps; sgd: momentum; ...). Each optimizer declares its
/// own keys in its registry entry (optimizers.h); the reader reads them from the same table
/// once `name` is known. Their values are kept as TOML values in `own`, so a config holds no
/// object made by a plugin.
struct OptimizerOptions : Options {
  std::string name = "adam";  ///< a registered optimizer (optimizers.h): adam, adamw, sgd, ...
  double lr = 1e-3;
  double weight_decay = 0.0;
  /// Which parameters weight_decay applies to: "all", "matrices" (2 or more dimensions: no
  /// decay on biases and norms, nanoGPT's rule) or "auto" (matrices for decoupled decay,
  /// adamw and adamw8bit; all for Adam's and SGD's L2 term).
  std::string decay = "auto";
  /// Gradient clipping before each step (callbacks/grad_clip.h): the global L2 norm at most
  /// this, as torch.nn.utils.clip_grad_norm_; 0 = off.
  double clip_grad_norm = 0.0;
  /// Each gradient element clamped to [-v, v] (clip_grad_value_), before the norm; 0 = off.
  double clip_grad_value = 0.0;
  /// The optimizer's own keys that have a value; an absent key has the optimizer's default.
  /// visit() keeps it to the keys of `name`: after a change of name, a key the new optimizer
  /// also has keeps its value (a stage inherits [optimizer]'s), the others are dropped.
  OwnKeys own;

  void visit(FieldVisitor& v) override;
  std::string unknown_key_note(const std::string& key) const override;

  /// Sets one of the optimizer's own keys, checked as the TOML reader checks it:
  /// `o.set("momentum", 0.9)`. Throws ConfigError naming the optimizer and its keys.
  OptimizerOptions& set(const std::string& key, double value);
  OptimizerOptions& set(const std::string& key, int64_t value);
  OptimizerOptions& set(const std::string& key, int value) { return set(key, int64_t{value}); }
  OptimizerOptions& set(const std::string& key, bool value);
  OptimizerOptions& set(const std::string& key, const std::string& value);
  OptimizerOptions& set(const std::string& key, const char* value) { return set(key, std::string(value)); }
  /// Sets several of its own keys, checked.
  OptimizerOptions& set_own(const OwnKeys& keys);
  /// The value of one of its own keys, the optimizer's default when unset:
  /// `o.get<double>("momentum")`; T is double, int64_t, bool or std::string. Throws ConfigError
  /// when it has no such key.
  template <class T>
  T get(const std::string& key) const;
  /// `own` with every default of the optimizer filled in.
  OwnKeys own_keys() const;
  /// The optimizer's own Options (the type its registry entry makes) with the values of `own`:
  /// what an entry's build reads. Keys of another optimizer are left out.
  template <class T>
  T own_as() const {
    T t;
    read_own(t);
    return t;
  }
  /// Reads the values of `own` into `into`; a value `into` refuses throws ConfigError.
  void read_own(Options& into) const;

 private:
  [[noreturn]] void no_such_key(const std::string& key) const;
};

struct LossOptions : Options {
  std::string name = "cross_entropy";  ///< cross_entropy | one a plugin registers
  double label_smoothing = 0.0;
  void visit(FieldVisitor& v) override;
};

/// [stages.schedule]: the stage's learning-rate schedule; its peak is the stage's optimizer's
/// `lr`. The formulas and the callback applying them: schedule.h.
struct ScheduleOptions : Options {
  std::string name = "constant";  ///< constant | linear_warmup | cosine | one_cycle | step
  int64_t warmup_steps = 0;       ///< linear_warmup, cosine: batches rising linearly to lr
  double min_lr = 0.0;            ///< cosine: the learning rate at the stage's end
  double pct_start = 0.25;        ///< one_cycle: share of the stage spent rising
  double div = 25.0;              ///< one_cycle: starts at lr / div
  double div_final = 1e5;         ///< one_cycle: ends at lr / div_final
  bool cycle_momentum = true;     ///< one_cycle: momentum (Adam's beta1) from mom_max down and back
  double mom_max = 0.95;          ///< one_cycle: momentum at the start and the end
  double mom_min = 0.85;          ///< one_cycle: momentum at the peak learning rate
  int64_t step_size = 0;          ///< step: batches between decays; must be set
  double gamma = 0.1;             ///< step: factor of each decay
  /// What the curve runs over: "stage" (its own batches, restarting at each stage) or "fit"
  /// (every stage's batches as one curve: warmup once, the cosine down to the fit's end).
  std::string span = "stage";
  void visit(FieldVisitor& v) override;
  void check() const override;
};

/// One stage: epochs with one setup (frozen prefixes, image size, optimizer).
struct StageOptions : Options {
  std::string name = "train";
  int64_t epochs = 1;
  std::vector<std::string> freeze;  ///< module-name prefixes whose parameters do not train
  int64_t image_size = 0;           ///< 0 = the data's own size
  int64_t seq_len = 0;              ///< text: tokens per training window; 0 = data.block_size
  OptimizerOptions optimizer;       ///< inherits [optimizer]; used when has_optimizer
  bool has_optimizer = false;       ///< the stage has its own [stages.optimizer] table
  ScheduleOptions schedule;         ///< [stages.schedule]; keys it omits inherit [schedule]
  void visit(FieldVisitor& v) override;
  void check() const override;
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

}  // namespace frugal
