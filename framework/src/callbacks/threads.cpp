#include "frugal/callbacks/threads.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include <spdlog/spdlog.h>

#include "frugal/core/learner.h"

namespace frugal {

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::mutex g_choice_m;
std::optional<ThreadChoice> g_choice;

}  // namespace

void set_threads(int64_t n) {
  if (n <= 0) return;
  at::set_num_threads(static_cast<int>(n));
  // Looked up, not linked: present only when LibTorch's BLAS is one of these.
  using OpenBlasSet = void (*)(int);
  using BlisSet = void (*)(int64_t);  // dim_t
  if (auto* f = reinterpret_cast<OpenBlasSet>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    f(static_cast<int>(n));
  if (auto* f = reinterpret_cast<BlisSet>(dlsym(RTLD_DEFAULT, "bli_thread_set_num_threads"))) f(n);
}

int64_t available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

std::optional<ThreadChoice> last_thread_choice() {
  std::lock_guard<std::mutex> g(g_choice_m);
  return g_choice;
}

ThreadTuner::ThreadTuner(int64_t many, std::shared_ptr<spdlog::logger> log)
    : many_(many),
      initial_(at::get_num_threads()),
      log_(log ? std::move(log) : spdlog::default_logger()) {}

// Step 0 warms up with `many`; then 1, many, 1, many, ... for `rounds` each.
int64_t ThreadTuner::threads_for(int64_t step) const { return step % 2 == 1 ? 1 : many_; }

void ThreadTuner::before_batch(Learner&) {
  if (inert() || decided()) return;
  set_threads(threads_for(step_));
  started_ = now_ms();
}

void ThreadTuner::after_batch(Learner& l) {
  if (inert() || decided() || l.batch_skipped()) return;  // a skipped batch times nothing
  const double ms = now_ms() - started_;
  if (step_ > 0) (threads_for(step_) == 1 ? one_ : many_ms_).push_back(ms);
  ++step_;
  if (static_cast<int>(many_ms_.size()) >= rounds_) decide();
}

void ThreadTuner::after_fit(Learner&) {
  if (inert() || decided()) return;
  if (!one_.empty() && !many_ms_.empty()) return decide();
  set_threads(initial_);
}

void ThreadTuner::decide() {
  choice_.many = many_;
  choice_.one_ms = median(one_);
  choice_.many_ms = median(many_ms_);
  choice_.samples = static_cast<int64_t>(many_ms_.size());
  choice_.chosen = choice_.many_ms < choice_.one_ms ? many_ : 1;
  set_threads(choice_.chosen);
  {
    std::lock_guard<std::mutex> g(g_choice_m);
    g_choice = choice_;
  }
  log_->info("run.threads = auto: a step took {:.2f} ms on 1 thread and {:.2f} ms on {} (medians of "
             "{}); training on {}",
             choice_.one_ms, choice_.many_ms, many_, rounds_, choice_.chosen);
}

void ThreadTuner::save_state(torch::serialize::OutputArchive& a) const {
  if (inert()) return;
  a.write("chosen", torch::tensor(choice_.chosen));
  a.write("many", torch::tensor(choice_.many));
  a.write("times_ms", torch::tensor(std::vector<double>{choice_.one_ms, choice_.many_ms}));
}

void ThreadTuner::load_state(Learner&, torch::serialize::InputArchive& a) {
  if (inert()) return;  // run.threads is a number now, or nothing can be tuned here
  torch::Tensor chosen, many, times;
  a.read("chosen", chosen);
  a.read("many", many);
  a.read("times_ms", times);
  if (chosen.item<int64_t>() <= 0) return;  // saved before the choice: measure again
  // "All cores" means this machine's: a run resumed elsewhere keeps the choice, not the count.
  choice_.chosen = chosen.item<int64_t>() == 1 ? 1 : many_;
  choice_.many = many_;
  choice_.one_ms = times[0].item<double>();
  choice_.many_ms = times[1].item<double>();
  choice_.samples = rounds_;
  set_threads(choice_.chosen);
  std::lock_guard<std::mutex> g(g_choice_m);
  g_choice = choice_;
}

}  // namespace frugal
