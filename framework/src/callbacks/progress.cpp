#include "frugal/callbacks/progress.h"

#include <unistd.h>

#include <cstdio>
#include <iomanip>
#include <sstream>

#include "frugal/base/error.h"
#include "frugal/core/learner.h"

namespace frugal {

ProgressCallback::Mode ProgressCallback::parse_mode(const std::string& mode) {
  if (mode == "bar") return Mode::Bar;
  if (mode == "log") return Mode::Log;
  if (mode == "none") return Mode::None;
  if (mode == "auto") return ::isatty(STDERR_FILENO) ? Mode::Bar : Mode::Log;
  throw_config_error("run.progress must be one of auto, bar, log, none; got \"" + mode + "\"");
}

ProgressCallback::ProgressCallback(Mode mode, int64_t log_every, std::shared_ptr<spdlog::logger> log)
    : mode_(mode), log_every_(std::max<int64_t>(1, log_every)), log_(std::move(log)) {}

void ProgressCallback::before_stage(Learner& l) {
  if (mode_ == Mode::None) return;
  const auto& s = l.stage();
  std::ostringstream os;
  os << "stage " << l.stage_index() + 1 << " '" << s.name << "': " << s.epochs << " epoch(s)";
  if (s.image_size) os << ", image size " << s.image_size;
  if (s.seq_len) os << ", sequence length " << s.seq_len;
  if (!s.freeze.empty()) {
    os << ", frozen:";
    for (const auto& f : s.freeze) os << ' ' << f;
  }
  if (s.has_optimizer) os << ", optimizer " << s.optimizer.name << " lr " << s.optimizer.lr;
  log_->info(os.str());
}

void ProgressCallback::before_epoch(Learner&) {
  epoch_start_ = last_draw_ = std::chrono::steady_clock::now();
  samples_ = 0;
}

std::string ProgressCallback::line(Learner& l, bool final) const {
  using namespace std::chrono;
  const double secs = duration<double>(steady_clock::now() - epoch_start_).count();
  std::ostringstream os;
  os << '[' << l.stage().name << "] epoch " << l.epoch() + 1 << '/' << l.stage().epochs;
  if (!final) os << " batch " << l.batch_index() + 1 << '/' << l.num_batches();
  // No loss yet (or every step so far skipped for a non-finite one): "-", not a perfect 0.0000.
  os << std::fixed << std::setprecision(4) << " loss ";
  if (l.epoch_losses() > 0) os << l.epoch_loss(); else os << '-';
  os << std::setprecision(0)
     << ' ' << (secs > 0 ? samples_ / secs : 0.0) << " samples/s live "
     << format_bytes(l.memory().current()) << " peak " << format_bytes(l.memory().peak());
  if (final) {
    os << std::setprecision(1) << ' ' << secs << " s";
    if (l.valid_data() && l.valid_sums().count > 0) {
      const TaskMetric m = l.valid_metric();
      // A regression's text names its metric ("RMSE 0.12 (MSE 0.015)").
      os << " valid " << (m.name == "accuracy" ? "accuracy " : m.name == "valid_loss" ? "loss " : "")
         << m.text;
    }
  }
  return os.str();
}

void ProgressCallback::after_batch(Learner& l) {
  samples_ += l.y().defined() ? l.y().size(0) : 0;
  if (mode_ == Mode::Bar) {
    auto now = std::chrono::steady_clock::now();
    if (now - last_draw_ < std::chrono::milliseconds(250)) return;
    last_draw_ = now;
    std::fprintf(stderr, "\r\033[K%s", line(l, false).c_str());
    std::fflush(stderr);
  } else if (mode_ == Mode::Log && (l.batch_index() + 1) % log_every_ == 0) {
    log_->info(line(l, false));
  }
}

void ProgressCallback::after_epoch(Learner& l) {
  if (mode_ == Mode::None) return;
  if (mode_ == Mode::Bar) std::fprintf(stderr, "\r\033[K");
  log_->info(line(l, true));
}

}  // namespace frugal
