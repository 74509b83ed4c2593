#pragma once
/// Stopping a run cleanly from outside: SIGTERM (Slurm, Kubernetes, spot instances), SIGINT
/// (Ctrl-C) and a configurable early-warning signal (run.preempt_signal) set a flag; the
/// training loop polls it after each complete optimizer step (StopCallback), writes a
/// checkpoint and ends the fit. Handlers do nothing else: all work happens in the loop.
#include <atomic>
#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "frugal/callbacks/checkpoint_history.h"
#include "frugal/core/callback.h"
#include "frugal/memory/fit_stats.h"

namespace frugal {

class DataParallel;

/// `frugal train`'s exit code after a clean stop on a signal: EX_TEMPFAIL (sysexits.h), "try
/// again later", which requeue scripts test for.
inline constexpr int kExitInterrupted = 75;

/// A request to stop at the next clean point. One per process (the signal handlers set it);
/// tests and the C++ API call request() directly.
class StopRequest {
 public:
  static StopRequest& process();
  /// Asks the loop to stop; `signal` is recorded (0: not a signal).
  void request(int signal = 0) noexcept;
  bool requested() const noexcept { return requests_.load(std::memory_order_relaxed) > 0; }
  /// The first signal received, 0 if none.
  int signal() const noexcept { return signal_.load(std::memory_order_relaxed); }
  void clear() noexcept;

  /// Installs the handlers: the first of `signals` received sets this request; a second one
  /// (any of them) restores the default action and re-raises it, so the process ends at once
  /// (exit status 128 + signal). SA_RESTART: system calls in progress (a checkpoint's write)
  /// are not interrupted.
  static void install(const std::vector<int>& signals);

 private:
  friend void on_stop_signal(int) noexcept;
  std::atomic<int> requests_{0}, signal_{0};
  static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");
};

/// SIGTERM, SIGINT and `preempt_signal` ("SIGUSR1", ...; "none" adds nothing).
/// Throws ConfigError naming run.preempt_signal for an unknown name.
std::vector<int> stop_signals(const std::string& preempt_signal);
/// "SIGTERM" for SIGTERM; "signal N" for a number without a name here.
std::string signal_name(int signal);

/// Polls a StopRequest after each batch. When a stop is requested and no gradients are
/// pending (an accumulation group is closed: the state resumes exactly), it writes a
/// checkpoint through `history`, seals it (the stopped fit's after_epoch and after_fit write
/// no other) and stops the fit.
///
/// With data-parallel training, `requested()` in after_batch becomes one all-reduce (MAX) of
/// the flag across ranks, so every rank stops after the same step; only rank 0 writes.
class StopCallback : public Callback {
 public:
  StopCallback(const StopRequest& request, std::shared_ptr<CheckpointHistory> history,
               nlohmann::json info = {}, std::shared_ptr<spdlog::logger> log = nullptr);
  std::string name() const override { return "stop_request"; }
  /// Below the CheckpointWriter: runs after it in after_batch, so the state it saves includes
  /// the writer's, and a checkpoint the writer just wrote at this batch is not written twice.
  int order() const override { return order::kCheckpointWriter - 1; }
  void before_fit(Learner& l) override;
  /// Data parallel: whether this rank saw a stop request rides on the step's gradient sync.
  void before_backward(Learner& l) override;
  void after_batch(Learner& l) override;

  bool stopped() const { return stopped_; }
  /// The position the checkpoint resumes from (valid when stopped()).
  const FitPosition& at() const { return at_; }
  const std::string& checkpoint() const { return checkpoint_; }

 private:
  const StopRequest& request_;
  std::shared_ptr<CheckpointHistory> history_;
  nlohmann::json info_;
  std::shared_ptr<spdlog::logger> log_;
  bool stopped_ = false;
  DataParallel* dp_ = nullptr;  // data parallel: the request's ride (DataParallel::flag_slot)
  size_t slot_ = 0;
  FitPosition at_;
  std::string checkpoint_;
};

}  // namespace frugal
