#pragma once
/// CPU threads: LibTorch's intra-op pool and the BLAS library's own, and `run.threads = "auto"`
/// (the default), which keeps whichever setting trains fastest.
///
/// Debian's LibTorch runs its operations on an OpenMP pool and its matrix products on
/// OpenBLAS, which has a pthread pool of its own. Both pools busy-wait between jobs, so with
/// both above one thread they take the cores from each other: on 2 cores a small MLP's step
/// took 3.4x as long with 2 + 2 threads as with 1 + 1, and no workload measured was fastest so
/// (docs/speed.md). A setting therefore gives threads to one pool: `run.threads = N` is N
/// ATen threads and 1 BLAS thread. "auto" measures, on the first training batches, 1 + 1,
/// N ATen + 1 BLAS and 1 ATen + N BLAS (N = the cores this process may run on; the last only
/// where the BLAS has a pool of its own), alternating, keeps the fastest and logs the medians
/// (a CNN trained 2.1x faster with its convolutions on ATen's pool, an MLP at batch 256 1.5x
/// with its products on OpenBLAS's). The batches are real training steps (nothing is computed
/// twice); the choice is saved with checkpoints, so a resumed run keeps it.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <spdlog/logger.h>

#include "frugal/core/callback.h"

namespace frugal {

/// Sets LibTorch's intra-op threads to `aten` and, when LibTorch calls an OpenBLAS or BLIS
/// with threads of its own (Debian's does), theirs to `blas` (at::set_num_threads alone
/// leaves OpenBLAS on all cores).
void set_threads(int64_t aten, int64_t blas);
/// run.threads = n: n ATen threads, 1 BLAS thread (the pools do not share cores well).
void set_threads(int64_t n);
/// The BLAS library's own threads; 0 when it has no pool of its own that frugal knows.
int64_t blas_threads();
/// The cores this process may run on (its CPU affinity), at least 1.
int64_t available_cores();

/// What ThreadTuner measured and chose.
struct ThreadChoice {
  int64_t chosen = 0;      ///< ATen threads chosen: 1 or `many`
  int64_t blas = 0;        ///< BLAS threads chosen: 1 or `many`
  int64_t many = 0;        ///< the other count: available_cores()
  double one_ms = 0;       ///< median step time with 1 ATen and 1 BLAS thread
  double many_ms = 0;      ///< ... with `many` ATen threads and 1 BLAS thread
  double blas_ms = 0;      ///< ... with 1 ATen thread and `many` BLAS threads (0: not timed)
  int64_t samples = 0;     ///< timed steps of the chosen setting (3; fewer when the others were dropped early)
  /// Timed steps per candidate (1 + 1, N + 1, 1 + N): which settings the first steps ran on, so
  /// two runs that probed alike (and chose alike) must give the same bits; empty when resumed.
  std::vector<int64_t> timed;
};
/// The choice made in this process, if any (threads are process-wide).
std::optional<ThreadChoice> last_thread_choice();

class ThreadTuner : public Callback {
 public:
  /// Steps it takes to decide, at most: one warm-up, then rounds of one step per candidate, in
  /// turn, 3 rounds at most. A candidate slower than the round's best by more than kDropFirst
  /// after the first round (by its fastest step), or kDropLater after the second, and by more
  /// than kDropMs, is timed no more (its further steps would be training time lost; below
  /// kDropMs they cost next to nothing, and one noisy step of a tiny model decides nothing);
  /// when one is left it is chosen. Otherwise the fastest median after 3 rounds wins.
  static constexpr int64_t kSteps = 10;
  static constexpr double kDropFirst = 1.25;
  static constexpr double kDropLater = 1.10;
  static constexpr double kDropMs = 10.0;
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
  /// For tests: the milliseconds clock a step is timed with (steady_clock by default).
  void set_clock(std::function<double()> ms) { clock_ = std::move(ms); }

 private:
  struct Setting {
    int64_t aten, blas;
  };
  const Setting& current() const;
  void end_round();
  void decide();
  static constexpr int rounds_ = 3;
  bool inert() const { return many_ <= 1; }
  int64_t many_;
  int64_t initial_;  // the intra-op threads before tuning
  std::shared_ptr<spdlog::logger> log_;
  int64_t step_ = 0;  // training steps seen while deciding
  std::vector<Setting> candidates_;  // 1 + 1, many + 1, and 1 + many with a BLAS pool
  std::vector<std::vector<double>> times_;  // per candidate
  std::vector<size_t> round_;  // the candidates still timed, in turn
  size_t next_ = 0;           // round_[next_] runs the next timed step
  int rounds_done_ = 0;
  std::function<double()> clock_;
  double started_ = 0;
  ThreadChoice choice_;
};

}  // namespace frugal
