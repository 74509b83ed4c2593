#pragma once
/// CPU threads: one setting for LibTorch's intra-op pool and the BLAS library, and
/// `run.threads = "auto"` (the default), which keeps whichever of 1 thread and all available
/// cores trains faster.
///
/// Intra-op threads help big operations and cost more than they give on small ones (a small
/// MLP at batch 32 runs several times slower on 2 threads than on 1), so the choice is
/// measured, not guessed: ThreadTuner times the first training batches alternately with 1 and
/// with N threads (N = the cores this process may run on), keeps the faster and logs both
/// medians. The batches are real training steps (nothing is computed twice); the choice is
/// saved with checkpoints, so a resumed run keeps it.
#include <cstdint>
#include <memory>
#include <optional>

#include <spdlog/logger.h>

#include "frugal/core/callback.h"

namespace frugal {

/// Sets LibTorch's intra-op threads and, when LibTorch calls an OpenBLAS or BLIS of its own
/// threads (Debian's does), theirs: at::set_num_threads alone leaves OpenBLAS on all cores.
void set_threads(int64_t n);
/// The cores this process may run on (its CPU affinity), at least 1.
int64_t available_cores();

/// What ThreadTuner measured and chose.
struct ThreadChoice {
  int64_t chosen = 0;      ///< 1 or `many`
  int64_t many = 0;        ///< the other candidate: available_cores()
  double one_ms = 0;       ///< median step time with 1 thread
  double many_ms = 0;      ///< median step time with `many`
  int64_t samples = 0;     ///< timed steps per candidate
};
/// The choice made in this process, if any (threads are process-wide).
std::optional<ThreadChoice> last_thread_choice();

class ThreadTuner : public Callback {
 public:
  /// Steps it takes to decide: one warm-up, then 3 per candidate, alternating.
  static constexpr int64_t kSteps = 7;
  /// `many` > 1: the candidate besides 1 thread. `many` <= 1: an inert tuner that measures
  /// nothing and saves nothing, and ignores a checkpoint's choice (run.threads set to a number,
  /// a GPU, one core, a run too short to measure in): so a checkpoint of an "auto" run resumes
  /// under any thread setting, and one of a numbered run under "auto".
  explicit ThreadTuner(int64_t many, std::shared_ptr<spdlog::logger> log = nullptr);
  std::string name() const override { return "thread_tuner"; }
  void before_batch(Learner& l) override;
  void after_batch(Learner& l) override;
  /// A fit that ended before the choice (stopped, or too short) decides from what it measured,
  /// or goes back to the thread count it started with.
  void after_fit(Learner& l) override;
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(Learner& l, torch::serialize::InputArchive& a) override;
  bool decided() const { return choice_.chosen > 0; }
  const ThreadChoice& choice() const { return choice_; }

 private:
  int64_t threads_for(int64_t step) const;
  void decide();
  static constexpr int rounds_ = (kSteps - 1) / 2;
  bool inert() const { return many_ <= 1; }
  int64_t many_;
  int64_t initial_;  // the intra-op threads before tuning
  std::shared_ptr<spdlog::logger> log_;
  int64_t step_ = 0;  // training steps seen while deciding
  std::vector<double> one_, many_ms_;
  double started_ = 0;
  ThreadChoice choice_;
};

}  // namespace frugal
