#pragma once
/// grad_accum: one optimizer step over more samples than one forward pass holds. "split" runs
/// each batch as `steps` micro-batches (the core's exact micro-batching: same step, a quarter of
/// the activations for steps = 4); "accumulate" sums the gradients of `steps` whole batches into
/// one step, each batch's loss weighted by its share of the group's samples. Its arithmetic is
/// free functions the tests call directly: where a batch falls in its accumulation group, and
/// the micro-batch size that splits a batch into `steps` passes.
#include <cstdint>
#include <string>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>

namespace frugal::grad_accum {

/// Samples in batch `i` of an epoch over `dataset_size` samples in batches of `batch_size`
/// (every batch is full but possibly the last).
int64_t batch_samples(int64_t i, int64_t batch_size, int64_t dataset_size);

/// Where one batch falls in its accumulation group of `steps` consecutive batches.
struct Group {
  int64_t first = 0, last = 0;  ///< the group's batch indices, inclusive
  int64_t samples = 0;          ///< samples in the whole group
  int64_t batch_samples = 0;    ///< samples in this batch
  bool closes = false;          ///< this batch is the group's last: the optimizer steps here
  bool partial = false;         ///< the epoch ends before the group has `steps` batches
  /// The weight of this batch's mean loss so the group's gradient is the mean over its samples.
  double weight() const { return samples > 0 ? double(batch_samples) / double(samples) : 1.0; }
};

/// The group of batch `index` in an epoch of `num_batches` batches of `batch_size` over
/// `dataset_size` samples. Throws std::invalid_argument for an index or size out of range.
Group group_of(int64_t index, int64_t steps, int64_t num_batches, int64_t batch_size,
               int64_t dataset_size);

/// The micro-batch size that runs a batch of `batch_size` samples as `steps` passes.
int64_t split_size(int64_t batch_size, int64_t steps);

/// [plugins.grad_accum]: TOML keys are the field names.
struct GradAccumOptions : frugal::Options {
  int64_t steps = 4;               ///< default 4
  std::string mode = "split";      ///< default "split"
  bool step_last_partial = true;   ///< default true
  void visit(frugal::FieldVisitor& v) override;
};

/// The callback: sets the core's micro-batch size (split), or weights batches and skips the
/// steps inside a group (accumulate).
class GradAccum : public frugal::Callback {
 public:
  GradAccum(const GradAccumOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "grad_accum"; }
  /// Before amp (order::kPrecision), whose loss scaler must see which batches step.
  int order() const override { return frugal::order::kBatchGrouping; }
  frugal::CallbackRelations relations() const override;

  /// split: the micro-batch size for the loader's batch size; remembers the one to restore.
  void before_fit(frugal::Learner& l) override;
  /// split: again, in case a stage changed the data.
  void before_stage(frugal::Learner& l) override;
  /// accumulate: an epoch always starts a fresh group (drops one a stopped epoch left open).
  void before_train(frugal::Learner& l) override;
  /// accumulate: weights the batch by its share of the group's samples; steps only when the
  /// batch closes its group (and the group is whole, or step_last_partial).
  void before_batch(frugal::Learner& l) override;
  /// accumulate: a dropped last group loses its gradients instead of stepping.
  void before_step(frugal::Learner& l) override;
  /// Checkpoints are taken only between accumulation groups (CheckpointWriter waits until no
  /// gradient is pending) and the group of a batch follows from its index, so the position
  /// suffices; saved here: the counters of the final log line.
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(frugal::Learner&, torch::serialize::InputArchive& a) override;
  void after_fit(frugal::Learner& l) override;

 private:
  void apply_split(frugal::Learner& l);

  GradAccumOptions o_;
  bool split_;
  std::shared_ptr<spdlog::logger> log_;
  Group group_;
  int64_t saved_micro_ = 0, micro_ = 0, steps_before_ = 0, dropped_ = 0;
};

}  // namespace frugal::grad_accum
