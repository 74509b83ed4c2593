#include "frugal/callbacks/stop.h"

#include <signal.h>

#include <cstring>

#include "frugal/base/error.h"
#include "frugal/callbacks/checkpoint_writer.h"
#include "frugal/core/learner.h"
#include "frugal/distributed/data_parallel.h"

namespace frugal {

namespace {

struct NamedSignal {
  const char* name;
  int number;
};

constexpr NamedSignal kSignals[] = {{"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGUSR1", SIGUSR1},
                                    {"SIGUSR2", SIGUSR2}, {"SIGHUP", SIGHUP},   {"SIGALRM", SIGALRM},
                                    {"SIGXCPU", SIGXCPU}, {"SIGQUIT", SIGQUIT}};

}  // namespace

// Only lock-free atomics, signal() and raise(): all async-signal-safe.
void on_stop_signal(int sig) noexcept {
  StopRequest& r = StopRequest::process();
  if (r.requests_.fetch_add(1, std::memory_order_relaxed) > 0) {
    std::signal(sig, SIG_DFL);  // a second signal: stop at once, as if no handler were set
    std::raise(sig);
    return;
  }
  int none = 0;
  r.signal_.compare_exchange_strong(none, sig, std::memory_order_relaxed);
}

namespace {
extern "C" void stop_signal_handler(int sig) { on_stop_signal(sig); }
}  // namespace

StopRequest& StopRequest::process() {
  static StopRequest r;
  return r;
}

void StopRequest::request(int signal) noexcept {
  int none = 0;
  if (signal != 0) signal_.compare_exchange_strong(none, signal, std::memory_order_relaxed);
  requests_.fetch_add(1, std::memory_order_relaxed);
}

void StopRequest::clear() noexcept {
  requests_.store(0, std::memory_order_relaxed);
  signal_.store(0, std::memory_order_relaxed);
}

void StopRequest::install(const std::vector<int>& signals) {
  process();  // constructed before any handler can run
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = stop_signal_handler;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int s : signals)
    if (::sigaction(s, &sa, nullptr) != 0)
      throw Error("cannot install a handler for " + signal_name(s) + ": " + std::strerror(errno));
}

std::vector<int> stop_signals(const std::string& preempt_signal) {
  std::vector<int> out = {SIGTERM, SIGINT};
  if (preempt_signal == "none" || preempt_signal.empty()) return out;
  for (const auto& s : kSignals)
    if (preempt_signal == s.name) {
      if (s.number != SIGTERM && s.number != SIGINT) out.push_back(s.number);
      return out;
    }
  throw ConfigError("run.preempt_signal = \"" + preempt_signal +
                    "\" is not a signal frugal handles (SIGUSR1, SIGUSR2, SIGHUP, SIGALRM, "
                    "SIGXCPU or \"none\")");
}

std::string signal_name(int signal) {
  for (const auto& s : kSignals)
    if (s.number == signal) return s.name;
  return "signal " + std::to_string(signal);
}

// ---------------------------------------------------------------- the poll

StopCallback::StopCallback(const StopRequest& request, std::shared_ptr<CheckpointHistory> history,
                           nlohmann::json info, std::shared_ptr<spdlog::logger> log)
    : request_(request), history_(std::move(history)), info_(std::move(info)), log_(std::move(log)) {}

void StopCallback::before_fit(Learner& l) {
  stopped_ = false;
  dp_ = find_data_parallel(l);
  if (dp_) slot_ = dp_->flag_slot();
  checkpoint_.clear();
  history_->unseal();
}

void StopCallback::before_backward(Learner&) {
  if (dp_) dp_->set_flag(slot_, request_.requested());
}

void StopCallback::after_batch(Learner& l) {
  if (stopped_ || !no_pending_gradients(l)) return;
  // Data parallel: a signal reaches the ranks at different batches; all stop at the first
  // batch after any saw it: the flag came with the step's gradients (a request after this
  // rank's backward is seen at the next batch), or one all-reduce of it here.
  const bool any = dp_ && dp_->synced_this_batch() ? dp_->any_flag(slot_)
                                                   : l.collective().any(request_.requested());
  if (!any) return;
  at_ = l.position();
  // The CheckpointWriter (which runs before this in after_batch) may have written this very
  // position already.
  if (history_->written_at_iteration() == l.iteration() && !history_->sealed())
    checkpoint_ = history_->last_path();
  else
    checkpoint_ = history_->write(l, info_);
  history_->seal();
  stopped_ = true;
  l.stop_fit();
  if (log_)
    log_->warn("{}: stopping after stage {} epoch {} batch {} ({} steps); checkpoint {}",
               request_.signal() ? signal_name(request_.signal()) : "stop requested",
               at_.stage + 1, at_.epoch + 1, at_.batch, at_.steps, checkpoint_);
}

}  // namespace frugal
