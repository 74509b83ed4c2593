#pragma once
/// Where a run's checkpoints go. keep = 1: one file, `last_path` (checkpoints/last.ckpt),
/// replaced atomically by each new checkpoint. keep = K > 1: numbered files beside it
/// (step-00000120.ckpt: the optimizer steps taken), `last_path` a symbolic link to the newest,
/// and the newest K kept. Each file is written atomically by Learner::save_checkpoint; the
/// link moves only after the new file is complete, and the oldest goes only after that, so a
/// crash at any moment leaves `last_path` naming a complete checkpoint.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace frugal {

class Learner;

class CheckpointHistory {
 public:
  explicit CheckpointHistory(std::string last_path, int64_t keep = 1);

  /// Saves `l`'s checkpoint; returns the file written, "" when sealed.
  std::string write(Learner& l, const nlohmann::json& info);
  /// No later write() happens: an interrupted fit's checkpoint stays its last, while the
  /// stopped fit's after_epoch and after_fit still fire.
  void seal() { sealed_ = true; }
  void unseal() { sealed_ = false; }
  bool sealed() const { return sealed_; }

  const std::string& last_path() const { return last_path_; }
  int64_t keep() const { return keep_; }
  /// The iteration of the last checkpoint this object wrote (-1: none yet).
  int64_t written_at_iteration() const { return written_at_; }
  /// The numbered checkpoints beside last_path, oldest first (by write time, then number).
  std::vector<std::string> numbered() const;

 private:
  void link_last(const std::string& file) const;
  std::string where_it_stopped(const Learner& l) const;
  void prune(const std::string& newest) const;
  std::string last_path_;
  int64_t keep_;
  bool sealed_ = false;
  int64_t written_at_ = -1;
};

/// "step-00000120.ckpt": the name of the numbered checkpoint after `steps` optimizer steps.
std::string numbered_checkpoint_name(int64_t steps);

}  // namespace frugal
