#pragma once
/// One run per folder: a run holds a lock on its run.out_dir while it lives, and a new run does
/// not silently replace an earlier run's results (`frugal train --overwrite` says it may).
#include <string>
#include <vector>

namespace frugal {

/// An exclusive lock on a run folder for as long as this object lives: flock(2) on
/// <dir>/run.lock, which holds the holder's PID. The kernel releases the lock when the
/// process ends, however it ends (SIGKILL, a crash): a stale file locks nothing.
class RunLock {
 public:
  /// Throws Error naming the folder and the PID of the process holding it.
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

/// The files of an earlier run in `dir` that a new run would replace: report.json, report.md,
/// config.toml and the checkpoint folder (`checkpoint_dir`) when not empty. Names relative to
/// `dir`; empty when there are none.
std::vector<std::string> earlier_run_files(const std::string& dir, const std::string& checkpoint_dir);
/// Removes what earlier_run_files lists (and only that): `--overwrite`.
void remove_earlier_run(const std::string& dir, const std::string& checkpoint_dir);

/// The unfinished files a killed writer left in `dir` and `checkpoint_dir`: a write's temporary
/// file (`<name>.tmp.<pid>`), the checkpoint link's (`last.ckpt.link-tmp`), the writability
/// probe (`.frugal-probe.<pid>`). None is ever read; a checkpoint write killed midway would
/// otherwise leave its partial copy for good, and the folder would look like an earlier run's.
/// Call with the folder's RunLock held (no live writer then). Returns the paths removed.
std::vector<std::string> remove_unfinished_files(const std::string& dir,
                                                 const std::string& checkpoint_dir);

}  // namespace frugal
