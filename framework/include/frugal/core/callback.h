#pragma once
/// The callback base: a plugin or a user overrides only the hooks it needs; each is a no-op.
/// The bus (Learner) owns ordering, error context and timing: hooks are never called directly.
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/core/event.h"

namespace frugal {

class Learner;

/// The rest of the forward chain, handed to Callback::wrap_forward. Calling it runs the
/// callbacks after this one and finally the model. Cheap to copy; valid during the call only.
class ForwardNext {
 public:
  ForwardNext(Learner& l, size_t index) : learner_(&l), index_(index) {}
  torch::Tensor operator()(const torch::Tensor& x) const;

 private:
  Learner* learner_;
  size_t index_;
};

/// Callback orders: lower runs first in before_* events and last in after_* events (so a
/// callback undoes in after_* what it did in before_*, innermost first). Every in-tree callback
/// has its own; a callback of yours takes one of the gaps, or kDefault.
///
///   kTrace               the timeline: its spans include every other hook
///   kCheckpointWriter    saves in after_* once every other callback has updated its state
///   kMetricsHistory      writes a row in after_* once the others updated (before checkpoints)
///   kModelExport         writes the trained model once the fit's other after_fit hooks ran
///   kBestModel           keeps the best model (run.save_best) after a validation
///   kEarlyStopping       ends the fit when the validation metric stops improving
///   -- state changes between stages, before anything measures the stage --
///   kModelRewrite        rewrites the model's modules (in-place activations)
///   kOptimizerSwap       replaces the optimizer
///   kPurge               releases what the previous stage left (after a swap freed its state)
///   kSchedule            sets the batch's learning rate (after a swap set the optimizer)
///   kDefault             a callback that states no order
///   -- around the forward, outermost first --
///   kBatchGrouping       groups batches into steps, splits them (micro-batches, batch weights)
///   kPrecision           lower-precision forward and loss scaling (sees which batches step)
///   kInnermostForward    replaces the model's forward with its own (checkpointing)
///   -- late --
///   kGradientSync        data parallel: after_* before the precision and batch-grouping
///                        callbacks, so they see gradients averaged across ranks
///   kNonFiniteCheck      checks the loss and gradients in before_step after every callback
///                        that may skip the step (batch grouping, precision)
///   kGradientClip        clips the gradients in before_step once they are final: after the
///                        sync, amp's unscaling and the non-finite check
///   kOutputRelease       first in after_*: swaps loss and prediction for detached tensors
///   kProgress            logs, after every callback in before_*, first in after_*
namespace order {
inline constexpr int kTrace = -1000000;
inline constexpr int kCheckpointWriter = -1000;
inline constexpr int kMetricsHistory = -950;
inline constexpr int kModelExport = -900;
inline constexpr int kBestModel = -890;
inline constexpr int kEarlyStopping = -200;
inline constexpr int kModelRewrite = -100;
inline constexpr int kOptimizerSwap = -20;
inline constexpr int kPurge = -10;
inline constexpr int kSchedule = -5;
inline constexpr int kDefault = 0;
inline constexpr int kBatchGrouping = 10;
inline constexpr int kPrecision = 50;
inline constexpr int kInnermostForward = 100;
inline constexpr int kGradientSync = 500;
inline constexpr int kNonFiniteCheck = 900;
inline constexpr int kGradientClip = 950;
inline constexpr int kOutputRelease = 1000;
inline constexpr int kProgress = 1100;
}  // namespace order

/// How a callback must stand to the others on the same Learner. Learner::add_callback checks
/// the relations of every callback it holds (and the plugin loader those of the plugins it
/// loads), with check_relations.
struct CallbackRelations {
  /// Callbacks (by name) that, when present, must have a larger order() than this one.
  std::vector<std::string> runs_before;
  /// Callbacks (by name) that must not be present together with this one.
  std::vector<std::string> conflicts;
  /// This callback wraps the forward and runs the model itself (it does not call next(x)):
  /// every other forward wrapper must have a smaller order().
  bool innermost_forward = false;
};

/// A key a callback writes in its save_state to say a run without it may ignore the state.
inline constexpr const char* kOptionalState = "frugal.optional";

class Callback {
 public:
  virtual ~Callback();

  /// A short unique name, used in logs and errors (a plugin's callback: the plugin's name).
  virtual std::string name() const = 0;
  /// Lower runs first in before_* events and last in after_* events (see frugal::order).
  /// Default order::kDefault.
  virtual int order() const { return order::kDefault; }
  /// Its ordering needs and conflicts. Default: none.
  virtual CallbackRelations relations() const { return {}; }

  /// Whether this callback wraps the forward pass (see wrap_forward). Default false.
  virtual bool wraps_forward() const { return false; }
  /// Runs instead of the plain forward when wraps_forward(); call next(x) to continue the
  /// chain (a mode switched on around it, the model run another way instead of it, ...).
  /// Default: next(x).
  virtual torch::Tensor wrap_forward(Learner& l, const torch::Tensor& x, const ForwardNext& next);

  /// Runs once when fit starts.
  virtual void before_fit(Learner&) {}
  /// Runs at the start of each stage, after its freeze, image size and optimizer are set.
  virtual void before_stage(Learner&) {}
  /// Runs at the start of each epoch.
  virtual void before_epoch(Learner&) {}
  /// Runs before the training batches of an epoch; the model is in train mode.
  virtual void before_train(Learner&) {}
  /// Runs when a batch is loaded (l.x(), l.y()); may replace the batch or skip it.
  virtual void before_batch(Learner&) {}
  /// Runs just before the forward pass.
  virtual void before_forward(Learner&) {}
  /// Runs after the forward pass; l.pred() is set.
  virtual void after_forward(Learner&) {}
  /// Runs after the loss is computed; l.loss() is set; may scale it (l.scale_loss).
  virtual void after_loss(Learner&) {}
  /// Runs just before backward.
  virtual void before_backward(Learner&) {}
  /// Runs after backward; gradients are set.
  virtual void after_backward(Learner&) {}
  /// Runs before the optimizer step; may skip it (l.skip_step()).
  virtual void before_step(Learner&) {}
  /// Runs after the optimizer stepped and gradients were zeroed; not when the step was skipped.
  virtual void after_step(Learner&) {}
  /// Runs at the end of every batch, also a skipped one.
  virtual void after_batch(Learner&) {}
  /// Runs after the training batches of an epoch.
  virtual void after_train(Learner&) {}
  /// Runs before validation; the model is in eval mode.
  virtual void before_validate(Learner&) {}
  /// Runs after validation; l.valid_accuracy() is set.
  virtual void after_validate(Learner&) {}
  /// Runs at the end of each epoch.
  virtual void after_epoch(Learner&) {}
  /// Runs at the end of each stage.
  virtual void after_stage(Learner&) {}
  /// Runs once when fit ends, also when it was stopped early.
  virtual void after_fit(Learner&) {}

  // ---- state across a resume, and what a callback holds ----
  /// Writes what this callback needs to continue the same run after a resume (a loss scale,
  /// a position in an accumulation group, whether it swapped the optimizer). Saved in the
  /// Learner's checkpoint under the callback's name. Default: nothing. A resume without this
  /// callback refuses a checkpoint holding its state, unless the state holds the key
  /// kOptionalState (any value): a callback only rank 0 runs, or one a resumed run may turn
  /// off (the metrics history), marks its state so.
  virtual void save_state(torch::serialize::OutputArchive&) const {}
  /// Reads what save_state wrote. Runs before the optimizer's state is loaded, so a callback
  /// that replaced the optimizer replaces it again first (hence the Learner). Default: nothing.
  virtual void load_state(Learner&, torch::serialize::InputArchive&) {}
  /// Bytes of tensors this callback keeps alive between batches (histories, caches, saved
  /// outputs). Memory diagnostics name the callbacks that hold bytes. Default 0.
  virtual int64_t held_bytes() const { return 0; }
  /// Runs when the Learner releases cached memory: OOM recovery, the micro-batch probe,
  /// purge, destroy. Drop caches this callback (or a library it drives) keeps. Default: nothing.
  virtual void release_caches(Learner&) {}
  /// Asked after an out-of-memory error in forward or backward, before the batch is retried:
  /// why this batch cannot run again (e.g. parameters already stepped inside the failed
  /// backward), or "" to let the policy decide. A veto ends the fit with an OomError naming
  /// this callback and its reason. Default "".
  virtual std::string retry_veto(const Learner&) const { return {}; }
  /// Runs after Learner::set_optimizer replaced the optimizer (a stage's own [optimizer],
  /// optim_swap, a resume), once whoever replaced it is done: before the next callback's hook,
  /// the next load_state and the next optimizer step. A callback that keeps its own view of
  /// the optimizer (zero's shard) rebuilds it here. Default: nothing.
  virtual void optimizer_replaced(Learner&) {}

  /// Runs once when the callback joins a Learner (add_callback), before any fit, checkpoint
  /// load or optimizer step: a callback that changes the model's structure (lora's adapters,
  /// its quantized weights) does it here, then rebuilds the optimizer (Learner::set_optimizer)
  /// so that it holds the new parameters, and a resumed checkpoint finds them. A throw leaves
  /// the Learner without the callback. Default: nothing.
  virtual void attach(Learner&) {}

  /// Dispatches an event to its hook. Used by the Learner.
  void dispatch(Event e, Learner& l);
};

/// A callback as check_relations sees it: its name, order, whether it wraps the forward, and
/// its relations.
struct CallbackFacts {
  std::string name;
  int order = 0;
  bool wraps_forward = false;
  CallbackRelations relations;
};
/// The facts of a callback, from its name(), order(), wraps_forward() and relations().
CallbackFacts facts_of(const Callback& cb);
/// The first conflict among `cbs` (a callback that declares it cannot run with another one
/// present), as a message naming both and the fix; "" when none.
std::string conflict_violation(const std::vector<CallbackFacts>& cbs);
/// The first violated relation among `cbs`: a conflict, a runs_before against the orders, an
/// innermost forward wrapper with another wrapper at or above its order. "" when all hold.
std::string relation_violation(const std::vector<CallbackFacts>& cbs);

}  // namespace frugal
