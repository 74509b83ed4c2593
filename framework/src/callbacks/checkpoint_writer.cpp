#include "frugal/callbacks/checkpoint_writer.h"

#include "frugal/core/learner.h"

namespace frugal {

bool no_pending_gradients(Learner& l) {
  for (const auto& p : l.model()->parameters())
    if (p.grad().defined()) return false;
  return true;
}

CheckpointWriter::CheckpointWriter(std::string path, int64_t every_steps, int64_t every_epochs,
                                   nlohmann::json info, std::shared_ptr<spdlog::logger> log)
    : path_(std::move(path)),
      every_steps_(every_steps),
      every_epochs_(every_epochs),
      info_(std::move(info)),
      log_(std::move(log)),
      history_(std::make_shared<CheckpointHistory>(path_)) {}

void CheckpointWriter::before_fit(Learner& l) {
  saved_at_step_ = l.steps();
  epochs_done_ = 0;
}

void CheckpointWriter::after_batch(Learner& l) {
  if (every_steps_ > 0 && l.steps() - saved_at_step_ >= every_steps_ && no_pending_gradients(l))
    write(l, "step");
}

void CheckpointWriter::after_epoch(Learner& l) {
  ++epochs_done_;
  if (every_epochs_ > 0 && epochs_done_ % every_epochs_ == 0 && no_pending_gradients(l))
    write(l, "epoch");
}

void CheckpointWriter::after_fit(Learner& l) { write(l, "end of fit"); }

void CheckpointWriter::write(Learner& l, const char* why) {
  // Set before the save, which stores it: a resumed run then keeps the cadence (it wrote one
  // step late, at step 121 after resuming from step 120's checkpoint).
  const int64_t before = saved_at_step_;
  saved_at_step_ = l.steps();
  std::string path;
  try {
    path = history_->write(l, info_);
  } catch (...) {
    saved_at_step_ = before;
    throw;
  }
  if (path.empty()) {  // sealed: an interrupted fit's checkpoint stays its last
    saved_at_step_ = before;
    return;
  }
  ++written_;
  if (log_) {
    const FitPosition p = l.position();
    log_->debug("checkpoint ({}) written to {}: stage {} epoch {} batch {}, {} steps", why, path,
                p.stage, p.epoch, p.batch, p.steps);
  }
}

void CheckpointWriter::save_state(torch::serialize::OutputArchive& a) const {
  a.write("saved_at_step", c10::IValue(saved_at_step_));
  a.write("epochs_done", c10::IValue(epochs_done_));
}

void CheckpointWriter::load_state(Learner&, torch::serialize::InputArchive& a) {
  c10::IValue v;
  if (a.try_read("saved_at_step", v) && v.isInt()) saved_at_step_ = v.toInt();
  if (a.try_read("epochs_done", v) && v.isInt()) epochs_done_ = v.toInt();
}

}  // namespace frugal
