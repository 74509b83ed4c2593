#pragma once
/// Shows training progress: a one-line bar on a terminal (stage, epoch, batch, loss,
/// samples/s, live memory), plain log lines otherwise.
#include <chrono>
#include <memory>
#include <string>

#include <spdlog/logger.h>

#include "frugal/core/callback.h"

namespace frugal {

class ProgressCallback : public Callback {
 public:
  enum class Mode { Bar, Log, None };
  /// "auto" picks Bar when stderr is a terminal, else Log.
  static Mode parse_mode(const std::string& mode);
  ProgressCallback(Mode mode, int64_t log_every, std::shared_ptr<spdlog::logger> log);

  std::string name() const override { return "progress"; }
  int order() const override { return order::kProgress; }  // after every plugin in before_*, first in after_*
  void before_stage(Learner& l) override;
  void before_epoch(Learner& l) override;
  void after_batch(Learner& l) override;
  void after_epoch(Learner& l) override;

 private:
  std::string line(Learner& l, bool final) const;
  Mode mode_;
  int64_t log_every_;
  std::shared_ptr<spdlog::logger> log_;
  std::chrono::steady_clock::time_point epoch_start_, last_draw_;
  int64_t samples_ = 0;
};

}  // namespace frugal
