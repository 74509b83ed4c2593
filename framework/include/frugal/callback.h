#pragma once
/// The callback base: a plugin or a user overrides only the hooks it needs; each is a no-op.
/// The bus (Learner) owns ordering, error context and timing: hooks are never called directly.
#include <string>

#include <torch/torch.h>

#include "frugal/event.h"

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

class Callback {
 public:
  virtual ~Callback();

  /// A short unique name, used in logs and errors ("amp", "grad_accum").
  virtual std::string name() const = 0;
  /// Lower runs first in before_* events and last in after_* events. Default 0.
  virtual int order() const { return 0; }

  /// Whether this callback wraps the forward pass (see wrap_forward). Default false.
  virtual bool wraps_forward() const { return false; }
  /// Runs instead of the plain forward when wraps_forward(); call next(x) to continue the
  /// chain (autocast around it, checkpointing instead of it, ...). Default: next(x).
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
  /// Learner's checkpoint under the callback's name. Default: nothing.
  virtual void save_state(torch::serialize::OutputArchive&) const {}
  /// Reads what save_state wrote. Runs before the optimizer's state is loaded, so a callback
  /// that replaced the optimizer replaces it again first (hence the Learner). Default: nothing.
  virtual void load_state(Learner&, torch::serialize::InputArchive&) {}
  /// Bytes of tensors this callback keeps alive between batches (histories, caches, saved
  /// outputs). Memory diagnostics name the callbacks that hold bytes. Default 0.
  virtual int64_t held_bytes() const { return 0; }

  /// Dispatches an event to its hook. Used by the Learner.
  void dispatch(Event e, Learner& l);
};

}  // namespace frugal
