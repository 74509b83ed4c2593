#pragma once
/// The Learner runs the training loop and fires the events of event.h on its callbacks.
/// Callbacks steer it through flags (skip_step, skip_batch, stop_epoch, stop_fit), the loss
/// scale, and by wrapping the forward; they read the memory meter and the run's statistics.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/config/sections.h"
#include "frugal/core/callback.h"
#include "frugal/core/collective.h"
#include "frugal/core/micro_batch.h"
#include "frugal/core/parameter_shards.h"
#include "frugal/data/data.h"
#include "frugal/data/task.h"
#include "frugal/memory/fit_stats.h"
#include "frugal/memory/memory.h"
#include "frugal/models/registry.h"
#include "frugal/optim/optimizers.h"

namespace frugal {

namespace archive {
struct ResumeRecord;
}
struct RngState;

using Stage = StageOptions;

class Learner {
 public:
  /// `valid` may be empty (no validation). The optimizer is built over all parameters.
  Learner(torch::nn::Sequential model, DataLoader train, std::optional<DataLoader> valid,
          OptimizerOptions optimizer, LossFn loss, torch::Device device = torch::kCPU);
  ~Learner();
  Learner(const Learner&) = delete;
  Learner& operator=(const Learner&) = delete;

  // ---- composition ----
  /// Adds a callback; callbacks run in ascending order() (stable for equal orders). Throws
  /// ConfigError, and leaves the callbacks as they were, when a relation (Callback::relations)
  /// of the callbacks with the new one fails: a conflict, runs_before, innermost forward.
  void add_callback(std::shared_ptr<Callback> cb);
  /// Removes the callbacks named `name`; returns how many.
  size_t remove_callback(const std::string& name);
  const std::vector<std::shared_ptr<Callback>>& callbacks() const { return callbacks_; }
  /// Removes every callback (their libraries may unload after).
  void clear_callbacks();

  // ---- training ----
  void fit(const std::vector<Stage>& stages);
  /// One stage named "fit".
  void fit(int64_t epochs);
  /// Throws what fit(stages) would throw before its first event (epochs, image sizes, sequence
  /// lengths, freeze prefixes, a fit of no epochs); runs nothing. What `frugal check` runs.
  void check_fit(const std::vector<Stage>& stages) const;
  /// Scores the validation data (fires before_validate / after_validate): sets valid_sums()
  /// and returns the accuracy (of samples, or of next tokens for a language model).
  double validate();
  /// Logits for a batch of normalized images, in eval mode without gradients.
  torch::Tensor predict(const torch::Tensor& x);
  /// Logits for every sample of `data`, batch by batch.
  torch::Tensor predict(const DataLoader& data);
  /// Runs the forward chain (callbacks that wrap the forward, then the model).
  torch::Tensor forward(const torch::Tensor& x);

  // ---- state callbacks read and change ----
  torch::nn::Sequential& model() { return live().model_; }
  torch::optim::Optimizer& optimizer() { return *live().optimizer_; }
  const OptimizerOptions& optimizer_options() const { return optimizer_options_; }
  /// Replaces the optimizer; the old one and its state are freed.
  void set_optimizer(std::unique_ptr<torch::optim::Optimizer> opt, OptimizerOptions o);
  /// Builds a new optimizer from `o` over the model's parameters.
  void set_optimizer(const OptimizerOptions& o);
  /// A stage's [stages.optimizer]: when it differs from the current one only in its learning
  /// rate (or the clip keys, read outside the optimizer) the optimizer and its state stay and
  /// every group takes the new rate; anything else (another name, decay or own key) builds a
  /// new one, whose state starts empty (set_optimizer).
  void adopt_stage_optimizer(const OptimizerOptions& o);
  /// How many times set_optimizer replaced the optimizer: a callback that must react to a new
  /// optimizer compares it (a new optimizer may reuse the old one's address).
  int64_t optimizer_changes() const { return optimizer_changes_; }
  /// For an optimizer sharded across data-parallel ranks (each rank steps only its share of
  /// the parameters, as ZeRO): checkpoints then keep every rank's optimizer state (gathered to
  /// rank 0, which writes the file), a resume gives each rank its own, and a checkpoint of the
  /// other kind is refused. Default false: the ranks' optimizers are equal; rank 0's is saved.
  void set_per_rank_optimizer_state(bool on) { per_rank_optimizer_ = on; }
  bool per_rank_optimizer_state() const { return per_rank_optimizer_; }
  /// For optimizer state kept outside memory (the offload plugin's files): the micro-batch
  /// search (micro_batch = auto) then reserves no bytes for the state the first step makes.
  /// Set by a callback in before_fit; every fit starts with it false.
  void set_optimizer_state_offloaded(bool on) { state_offloaded_ = on; }
  bool optimizer_state_offloaded() const { return state_offloaded_; }
  /// Bytes the gradient sync adds for a moment at the end of backward (data_parallel's flat
  /// copy of its largest bucket, made while backward still holds the activations when the
  /// all-reduce overlaps it), which the micro-batch probe does not run: find_micro_batch keeps
  /// them free. Set by a callback in before_stage; every fit starts with 0.
  void set_sync_reserve(int64_t bytes) { sync_reserve_ = bytes; }
  int64_t sync_reserve() const { return sync_reserve_; }
  /// Parameters kept in shards between uses (zero stage 3): set by the callback that frees
  /// them, in before_fit, and cleared (nullptr) in its after_fit. save_checkpoint gathers them
  /// for its write (FullParameters, parameter_shards.h).
  void set_parameter_shards(ParameterShards* s) { shards_ = s; }
  ParameterShards* parameter_shards() const { return shards_; }
  /// The processes this Learner trains with: SingleProcess until a data-parallel run sets its
  /// World (not owned: it outlives every Learner). Checkpoints, validation, the micro-batch
  /// probe and the in-tree callbacks' shared verdicts go through it.
  Collective& collective() const { return *collective_; }
  void set_collective(Collective& c) { collective_ = &c; }
  const LossFn& loss_fn() const { return loss_fn_; }
  void set_loss_fn(LossFn f) { loss_fn_ = std::move(f); }
  DataLoader& train_data() { return live().train_; }
  DataLoader* valid_data() { return valid_ ? &*valid_ : nullptr; }
  const torch::Device& device() const { return device_; }
  /// Where the run writes its files and what its model is (`frugal train` sets them), for a
  /// callback that writes files of its own (lora's adapter); empty outside a run.
  struct RunInfo {
    std::string out_dir;
    std::string arch;       ///< model.arch
    std::string init_from;  ///< model.init_from: the weights the model started from
  };
  const RunInfo& run_info() const { return run_info_; }
  void set_run_info(RunInfo r) { run_info_ = std::move(r); }

  /// The current batch (before_batch may replace it), prediction and loss. During the
  /// forward and backward events of a split batch, x() and y() are the micro-batch. pred() is
  /// set from after_forward to after_loss; then the loop drops it, so its memory is free in
  /// backward (as `loss = cross_entropy(model(x), y)` in PyTorch), unless keep_pred() was
  /// called.
  torch::Tensor& x() { return x_; }
  torch::Tensor& y() { return y_; }
  torch::Tensor& pred() { return pred_; }
  /// Keeps pred() until the next forward, for a callback that reads it after after_loss
  /// (call it in before_fit); it costs the prediction's memory during backward.
  void keep_pred(bool keep = true) { keep_pred_ = keep; }
  /// The unscaled loss, as logged. Backward uses loss() * loss_scale().
  torch::Tensor& loss() { return loss_; }
  /// Multiplies the factor backward applies to the loss; reset to 1 before each forward.
  void scale_loss(double factor) { loss_scale_ *= factor; }
  double loss_scale() const { return loss_scale_; }
  /// Runs backward on loss() * loss_scale() * micro_weight(). The loop calls it.
  void backward();

  // ---- micro-batches: one optimizer step's batch run as several forward/backward passes ----
  /// Splits every training batch into micro-batches of at most n samples (0 = whole batch).
  /// Each runs before_forward .. after_backward; before_batch, the step and after_batch run
  /// once. Gradients equal the whole batch's: each micro-batch's mean loss is weighted by its
  /// share of the batch's samples (micro_weight()), so uneven splits stay exact.
  void set_micro_batch_size(int64_t n) { micro_.set_size(n); }
  int64_t micro_batch_size() const { return micro_.size(); }
  int64_t micro_index() const { return micro_index_; }  ///< within the batch
  int64_t micro_count() const { return micro_count_; }  ///< micro-batches in this batch
  /// The weight backward applies to this micro-batch's loss: its samples / the batch's.
  double micro_weight() const { return micro_weight_; }
  /// Extra weight for the batch's losses, set by callbacks that accumulate several batches
  /// into one step (samples of this batch / samples of the group). Reset to 1 each batch.
  void set_batch_weight(double w) { batch_weight_ = w; }
  double batch_weight() const { return batch_weight_; }

  // ---- out of memory ----
  /// The budget, retry and auto micro-batch settings; see OomPolicy.
  ///
  /// A retry: the error is only noted in the catch block; after it the batch's x, pred and
  /// loss are dropped, caches released (release_caches()), and the micro-batch cap halved.
  /// An error in forward (no gradient touched yet) resumes the batch at the failed
  /// micro-batch's first sample; an error in backward (some gradients may hold part of it)
  /// drops the batch's gradients and restarts it at its first sample. Micro-batches are
  /// weighted by their samples, so the step's gradients are those of the whole batch either
  /// way. Callbacks see before_forward again without the after_* of the failed attempt, as
  /// after any exception; before_batch does not fire again and the batch's flags and weight
  /// stay. A backward error while gradients of earlier batches are accumulated (a callback
  /// skipped their steps) cannot be undone and stops the fit with OomError.
  void set_oom_policy(const OomPolicy& p);
  const OomPolicy& oom_policy() const { return oom_; }
  /// The largest micro-batch the loop runs (0 = no cap), set by a retry or find_micro_batch().
  /// It caps set_micro_batch_size() (so a callback re-applying its split does not undo it).
  int64_t micro_batch_cap() const { return micro_.cap(); }
  /// The micro-batch a batch of n samples runs in: min(n, micro_batch_size(), cap).
  int64_t effective_micro_batch(int64_t n) const { return micro_.effective(n); }
  /// Out-of-memory errors caught in this fit.
  int64_t oom_count() const { return micro_.oom_count(); }
  /// Finds the largest micro-batch whose forward and backward on the first training batch
  /// fit the meter's budget with room for the optimizer's step, and sets it as the cap.
  /// The probe leaves the run unchanged: no step, gradients as they were, BatchNorm buffers
  /// and RNG restored. Throws UsageError without a budget, OomError if 1 sample does not fit.
  int64_t find_micro_batch();

  // ---- flags: set during a batch or an epoch, cleared by the loop ----
  /// The optimizer does not step and gradients are kept (they accumulate); a callback that
  /// wants them dropped calls zero_grad(). after_step does not fire.
  void skip_step() { skip_step_ = true; }
  /// The rest of the batch's phases are skipped; after_batch still fires.
  void skip_batch() { skip_batch_ = true; }
  /// The epoch's training loop ends after this batch; validation and after_epoch still run.
  void stop_epoch() { stop_epoch_ = true; }
  /// The fit ends after this batch; every open before_X gets its after_X.
  void stop_fit() { stop_fit_ = true; }
  bool step_skipped() const { return skip_step_; }
  bool batch_skipped() const { return skip_batch_; }
  /// Whether this backward completes the optimizer step: the batch's last micro-batch, and no
  /// callback skipped the step (gradient accumulation across batches skips it). Where a plugin
  /// syncs, unscales or steps gradients (data_parallel, zero, amp, step_in_backward).
  bool completes_step() const { return !skip_step_ && micro_index_ + 1 >= micro_count_; }
  bool fit_stopped() const { return stop_fit_; }
  void zero_grad();

  // ---- counters ----
  const Stage& stage() const { return stages_.at(stage_index_); }
  /// Every stage of the current fit (set before before_fit fires).
  const std::vector<Stage>& stages() const { return stages_; }
  int64_t stage_index() const { return stage_index_; }
  int64_t epoch() const { return epoch_; }          ///< within the stage
  int64_t batch_index() const { return batch_index_; }  ///< within the epoch
  int64_t num_batches() const { return num_batches_; }
  int64_t iteration() const { return iteration_; }  ///< training batches seen in fit
  int64_t steps() const { return steps_; }          ///< optimizer steps taken in fit
  bool training() const { return training_; }
  Event event() const { return event_; }            ///< the event being dispatched

  // ---- measurements ----
  MemoryMeter& memory() { return MemoryMeter::get(); }
  /// The highest live bytes since the current stage's setup ended (after before_stage and the
  /// micro-batch probe); 0 outside a fit.
  int64_t stage_peak() const { return stage_window_.is_open() ? stage_window_.peak() : 0; }
  /// The highest live bytes since the current phase began: the forward (opened before
  /// before_forward, with the loss), the backward (before before_backward), the step (before
  /// before_step) or validation (before before_validate); 0 outside a fit and validation.
  int64_t phase_peak() const { return phase_window_.is_open() ? phase_window_.peak() : 0; }
  const std::vector<StageStats>& stage_stats() const { return stats_.stages(); }
  /// Bytes of the training and validation datasets, which stay in (host) memory for the fit.
  int64_t data_bytes() const;
  /// Mean training loss of the batches since the epoch began (syncs the device); 0 when none
  /// counted (see epoch_losses).
  double epoch_loss() const;
  /// The batches in epoch_loss: those with a loss (a batch whose non-finite loss the check
  /// skipped has none).
  int64_t epoch_losses() const { return loss_count_; }
  /// The last validation's accuracy; -1 before any.
  double valid_accuracy() const { return valid_sums_.count ? valid_sums_.accuracy() : -1; }
  /// The last validation's sums (count 0 before any) and the task's metric of them.
  const MetricSums& valid_sums() const { return valid_sums_; }
  TaskMetric valid_metric() const { return task_.metric(valid_sums_); }
  /// What the model is trained to do: task_for(the training data).
  const Task& task() const { return task_; }
  /// Every measurement of the fit as JSON (the run report's "fit" object).
  nlohmann::json report() const;

  // ---- model management ----
  /// Parameters whose names start with any prefix stop training (requires_grad = false).
  void freeze(const std::vector<std::string>& prefixes);
  /// Trains again what freeze() froze (each stage starts with it); a parameter frozen otherwise
  /// (by a callback: lora's base weights) stays frozen.
  void unfreeze();
  /// Names of the parameters that do not train.
  std::vector<std::string> frozen() const;

  /// Saves the model (and the optimizer's state) atomically: temp file, fsync, rename.
  void save(const std::string& path, bool with_opt = true);
  /// Loads what save() wrote. Throws CheckpointError for a missing, truncated or foreign file.
  void load(const std::string& path, bool with_opt = true);
  // ---- checkpoint and resume ----
  /// Writes everything needed to continue this fit exactly where it is, atomically (temp
  /// file, fsync, rename: an existing `path` stays intact until the new one replaces it):
  /// model, optimizer (and its name), every callback's save_state under "callbacks.<name>",
  /// the CPU (and CUDA) random generators, the position (stage, epoch, batch, the data
  /// order's epoch, iteration, steps), the epoch's running loss and the stage statistics.
  /// `info` is stored as is (the CLI keeps the resolved config there).
  /// Called from after_batch (or after_epoch, after_fit) the position is after that batch
  /// (epoch, fit). Called mid-batch, e.g. after a failure, it is that batch's start, unless
  /// the batch already stepped the optimizer; the replayed batch then draws fresh random
  /// numbers (dropout), so only a checkpoint taken between batches resumes bitwise.
  /// Gradients are not saved: take it when none are pending (CheckpointWriter does).
  void save_checkpoint(const std::string& path, const nlohmann::json& info = {});
  /// Loads the model from a save_checkpoint file now and keeps the rest for the next fit(),
  /// which continues from the saved position with the same stages. Returns the stored info.
  /// Throws CheckpointError for a missing, truncated or foreign file, or one save() wrote.
  ///
  /// What a resumed fit does: the batches, epochs and stages before the position fire no
  /// events. before_fit, then before_stage, before_epoch and before_train of the resumed
  /// position fire as on a fresh start (the stage's freeze, image size and optimizer are set
  /// first), and the counters (iteration, steps) already hold their saved values. Then each
  /// callback's load_state runs, then the optimizer's state is loaded, then the random
  /// generators are restored, and the loop continues with the next batch.
  ///
  /// Another world size, or an optimizer sharded another way (zero on N ranks, resumed on M,
  /// or without zero), resumes too: each parameter's optimizer state moves to the rank whose
  /// optimizer holds it now (the file's "optimizer_layout"), the data continues at the same
  /// global batch (data.batch_size is the batch of a step at any world size), and a rank the
  /// writing run did not have starts from rank 0's generator. Not bitwise: the gradients' mean
  /// is summed in another order, and dropout's draws differ.
  nlohmann::json load_checkpoint(const std::string& path);
  /// The stored "resume" record of a checkpoint without touching any learner: "position",
  /// "info", "stages", "stage_epochs", "optimizer". Throws CheckpointError like load_checkpoint.
  static nlohmann::json read_checkpoint(const std::string& path);
  /// The position a loaded checkpoint will resume from, until fit() consumes it.
  std::optional<FitPosition> pending_resume() const;
  /// Where the fit stands now (what save_checkpoint would record).
  FitPosition position() const;

  /// fastai's purge: drops the optimizer's state (unless clear_opt is false), sets gradients
  /// to none, drops cached batch, prediction and loss. Returns the live bytes released.
  int64_t purge(bool clear_opt = true);
  /// Releases cached memory: every callback's release_caches hook, then the allocator's cache
  /// (MemoryMeter::empty_cache). The loop calls it after an out-of-memory error, after each
  /// probe of find_micro_batch, in purge and in destroy.
  void release_caches();
  /// Releases everything that holds memory (model, optimizer, data, callbacks); the
  /// Learner is an empty shell afterwards and any use throws UsageError.
  void destroy();
  bool destroyed() const { return destroyed_; }

 private:
  friend class ForwardNext;
  struct PendingResume;

  Learner& live();
  const Learner& live() const;
  void fire(Event e);
  torch::Tensor forward_from(size_t index, const torch::Tensor& x);
  void rebuild_forward_wrappers();
  size_t start_fit(const std::vector<Stage>& stages);
  void run_stages(size_t first_stage);
  void run_stage(const Stage& s);
  void setup_stage(const Stage& s);
  void run_epoch();
  void start_epoch();
  void run_batches(int64_t first);
  void train_batch(const Batch& b);
  void reset_batch_state();
  void run_micro_batches();
  /// What one micro-batch's forward and backward came to: it ran, a callback skipped the batch
  /// after its forward, or it ran out of memory (the message, and the phase it was in).
  struct MicroAttempt {
    bool ran = false;
    OomError::Phase phase = OomError::Phase::Forward;
    std::optional<std::string> oom;
  };
  void enter_micro_batch(const torch::Tensor& bx, const torch::Tensor& by, int64_t begin,
                         int64_t len);
  MicroAttempt attempt_micro_batch();
  /// Tells the callbacks of an optimizer replaced since they last heard (optimizer_replaced).
  void announce_optimizer();
  bool forward_backward(OomError::Phase& phase);
  void run_step();
  void recover_from_oom(const OomEvent& e);
  /// The cursor (next_): where a checkpoint taken now would resume. cursor_at: the start of
  /// `epoch` of `stage` (data order `data_epoch`); advance_cursor: the batch after this one.
  void cursor_at(int64_t stage, int64_t epoch, int64_t data_epoch);
  void advance_cursor();
  /// The recorder (learner_record.cpp): the statistics and memory windows of each event, kept
  /// before any callback's hook and after the last (the outermost place, as fastai's Recorder),
  /// so the loop only fires events. Nothing of it is saved: FitStats travels with checkpoints.
  void record_before(Event e);
  void record_after(Event e);
  void measure_steady();
  void note_phase_peak(Phase p, int64_t bytes) { stats_.note_phase_peak(p, bytes); }
  ProbeResult probe_micro_batch(const Batch& b, int64_t m);
  size_t prepare_resume();
  int64_t resume_epoch() const;
  int64_t apply_resume();
  void load_callback_states(PendingResume& r);
  void restore_loop_state(PendingResume& r);
  void write_checkpoint_file(const std::string& path, const archive::ResumeRecord& r,
                             const RngState& rng, const std::vector<torch::Tensor>& rank_rngs,
                             const std::vector<std::vector<char>>& rank_optimizers);
  void load_optimizer_state(PendingResume& r);
  std::vector<std::vector<char>> record_optimizers(Collective& world, archive::ResumeRecord& r);

  torch::nn::Sequential model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  OptimizerOptions optimizer_options_;
  int64_t optimizer_changes_ = 0;
  int64_t announced_changes_ = 0;  // the optimizer_changes_ the callbacks were told of
  bool per_rank_optimizer_ = false;
  bool state_offloaded_ = false;
  int64_t sync_reserve_ = 0;
  ParameterShards* shards_ = nullptr;
  int full_parameter_scopes_ = 0;
  friend class FullParameters;
  Collective* collective_ = &SingleProcess::get();
  LossFn loss_fn_;
  DataLoader train_;
  std::optional<DataLoader> valid_;
  torch::Device device_;
  std::vector<std::shared_ptr<Callback>> callbacks_;  // sorted by order()
  std::unordered_set<const c10::TensorImpl*> frozen_by_freeze_;  // what unfreeze() undoes
  RunInfo run_info_;
  std::vector<Callback*> forward_wrappers_;

  std::vector<Stage> stages_;
  torch::Tensor x_, y_, pred_, loss_;
  float loss_sum_ = 0;  // on the host, in float32 as the loss (one read per step, no op)
  int64_t loss_count_ = 0;
  double loss_scale_ = 1.0;
  int64_t micro_index_ = 0, micro_count_ = 1;
  double micro_weight_ = 1.0, batch_weight_ = 1.0;
  bool skip_step_ = false, skip_batch_ = false, stop_epoch_ = false, stop_fit_ = false;
  bool capped_ = false;
  bool keep_pred_ = false;  // stop_fit_ was set by set_max_batches' cap, not by a callback
  int64_t stage_index_ = 0, epoch_ = 0, batch_index_ = 0, num_batches_ = 0;
  int64_t iteration_ = 0, steps_ = 0;
  bool training_ = false;
  Event event_ = Event::BeforeFit;
  MetricSums valid_sums_;
  Task task_;
  FitStats stats_;
  MemoryWindow stage_window_, phase_window_;  // open while a fit (or validate) runs
  int64_t max_steps_ = 0;
  int64_t global_epoch_ = 0;  // across stages: the data order of each epoch differs
  std::chrono::steady_clock::time_point train_started_{};  // this epoch's training batches began
  struct Recording {  // the recorder's view of the batch under way
    std::chrono::steady_clock::time_point batch_started{};
    int64_t stage_batch = 0;    // its index among the stage's timed batches
    int64_t batch_samples = 0;  // its samples on every rank (data parallel)
    int64_t forward_live = 0;   // live bytes when the micro-batch's forward began
    bool stepping = false;      // the step's phase window is open
    BatchMemory mem;            // for the steady state
  } rec_;
  bool destroyed_ = false;
  FitPosition next_;  // the next batch to run, kept current by the loop
  std::unique_ptr<PendingResume> resume_;  // set by load_checkpoint, consumed by fit
  OomPolicy oom_;
  MicroBatching micro_;

 public:
  /// Stop the fit after this many training batches (0 = no limit): ablations, smoke tests. A
  /// cap that falls on an epoch's last batch still validates that epoch.
  void set_max_batches(int64_t n) { max_steps_ = n; }
  /// The first n training batches of each stage are left out of the report's step times
  /// (they allocate caches); default 2. A stage with no more batches than that keeps them all.
  void set_warmup_batches(int64_t n) { warmup_batches_ = n < 0 ? 0 : n; }

 private:
  int64_t warmup_batches_ = 2;
};

/// Throws ConfigError naming `key` when `prefix` of a stage matches no parameter of `model`
/// (the nearest block and every block listed), and when a stage that trains freezes every parameter.
void check_freeze_prefixes(const torch::nn::Module& model, const std::vector<StageOptions>& stages);


}  // namespace frugal
