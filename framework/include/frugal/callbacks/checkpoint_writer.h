#pragma once
/// Periodic resumable checkpoints: Learner::save_checkpoint every N optimizer steps and every
/// M epochs, and once when the fit ends, to one file (written atomically, so the previous
/// checkpoint stays intact until the new one has replaced it). `frugal train --resume`
/// continues from it.
#include <memory>
#include <string>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "frugal/callbacks/checkpoint_history.h"
#include "frugal/core/callback.h"

namespace frugal {

class CheckpointWriter : public Callback {
 public:
  /// `every_steps`, `every_epochs`: 0 = off. `info` is stored in every checkpoint.
  CheckpointWriter(std::string path, int64_t every_steps, int64_t every_epochs,
                   nlohmann::json info = {}, std::shared_ptr<spdlog::logger> log = nullptr);

  std::string name() const override { return "checkpoint_writer"; }
  /// Lowest: runs last in after_* events, so the state it saves includes every other
  /// callback's work on the batch.
  int order() const override { return order::kCheckpointWriter; }
  void before_fit(Learner& l) override;
  /// Writes when `every_steps` optimizer steps passed since the last checkpoint and no
  /// gradients are pending (an accumulation group is closed): a checkpoint holds no
  /// gradients, so only then does a resume continue exactly.
  void after_batch(Learner& l) override;
  void after_epoch(Learner& l) override;
  void after_fit(Learner& l) override;
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(Learner&, torch::serialize::InputArchive& a) override;

  const std::string& path() const { return path_; }
  /// Where the checkpoints go (default: one file, path()); shared with a StopCallback.
  void set_history(std::shared_ptr<CheckpointHistory> h) { history_ = std::move(h); }
  int64_t written() const { return written_; }  ///< checkpoints written by this process

 private:
  void write(Learner& l, const char* why);
  std::string path_;
  int64_t every_steps_, every_epochs_;
  nlohmann::json info_;
  std::shared_ptr<spdlog::logger> log_;
  std::shared_ptr<CheckpointHistory> history_;
  int64_t saved_at_step_ = 0, epochs_done_ = 0, written_ = 0;
};

/// True when no parameter holds a gradient (none is pending for a later step).
bool no_pending_gradients(Learner& l);

}  // namespace frugal
