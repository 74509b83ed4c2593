#include "frugal/callbacks/threads.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "frugal/core/learner.h"

namespace frugal {

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The lower median: of two steps the faster, so a candidate cut short (a fit that ended within
// a round) is not judged by its slower step against another's only one.
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[(v.size() - 1) / 2];
}

std::mutex g_choice_m;
std::optional<ThreadChoice> g_choice;

}  // namespace

namespace {
// Looked up, not linked: present only when LibTorch's BLAS is one of these.
using OpenBlasSet = void (*)(int);
using OpenBlasGet = int (*)();
using BlisSet = void (*)(int64_t);  // dim_t
using BlisGet = int64_t (*)();
template <class F>
F blas_symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}
}  // namespace

void set_threads(int64_t aten, int64_t blas) {
  if (aten <= 0 || blas <= 0) return;
  at::set_num_threads(static_cast<int>(aten));
  if (auto* f = blas_symbol<OpenBlasSet>("openblas_set_num_threads")) f(static_cast<int>(blas));
  if (auto* f = blas_symbol<BlisSet>("bli_thread_set_num_threads")) f(blas);
}

void set_threads(int64_t n) { set_threads(n, 1); }

int64_t blas_threads() {
  if (auto* f = blas_symbol<OpenBlasGet>("openblas_get_num_threads")) return f();
  if (auto* f = blas_symbol<BlisGet>("bli_thread_get_num_threads")) return f();
  return 0;
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
      log_(log ? std::move(log) : spdlog::default_logger()),
      clock_(now_ms) {
  candidates_ = {{1, 1}, {many_, 1}};
  if (blas_threads() > 0) candidates_.push_back({1, many_});
  times_.resize(candidates_.size());
  for (size_t i = 0; i < candidates_.size(); ++i) round_.push_back(i);
}

// Step 0 warms up on many ATen threads; then the candidates still timed, in turn.
const ThreadTuner::Setting& ThreadTuner::current() const {
  return step_ == 0 ? candidates_[1] : candidates_[round_[next_]];
}

void ThreadTuner::before_batch(Learner&) {
  if (inert() || decided()) return;
  const Setting& s = current();
  set_threads(s.aten, s.blas);
  started_ = clock_();
}

void ThreadTuner::after_batch(Learner& l) {
  if (inert() || decided() || l.batch_skipped()) return;  // a skipped batch times nothing
  const double ms = clock_() - started_;
  if (step_++ == 0) return;  // the warm-up
  times_[round_[next_]].push_back(ms);
  if (++next_ == round_.size()) end_round();
}

// After a round: a candidate whose fastest step is slower than the best one's by more than the
// round's margin (and kDropMs) is timed no more: its steps would be training time lost. One
// left is chosen.
void ThreadTuner::end_round() {
  next_ = 0;
  if (++rounds_done_ >= rounds_) return decide();  // the last round: the fastest median wins
  auto fastest = [&](size_t c) { return *std::min_element(times_[c].begin(), times_[c].end()); };
  double best = fastest(round_[0]);
  for (size_t c : round_) best = std::min(best, fastest(c));
  const double limit = std::max(best * (rounds_done_ == 1 ? kDropFirst : kDropLater), best + kDropMs);
  round_.erase(std::remove_if(round_.begin(), round_.end(), [&](size_t c) { return fastest(c) > limit; }),
               round_.end());
  if (round_.size() == 1) decide();
}

void ThreadTuner::after_fit(Learner&) {
  if (inert() || decided()) return;
  if (std::all_of(round_.begin(), round_.end(), [&](size_t c) { return !times_[c].empty(); }))
    return decide();
  set_threads(initial_);
}

void ThreadTuner::decide() {
  std::vector<double> ms;
  for (const auto& t : times_) ms.push_back(median(t));
  size_t best = round_[0];  // among the candidates still timed
  for (size_t c : round_) best = ms[c] < ms[best] ? c : best;
  choice_.many = many_;
  choice_.one_ms = ms[0];
  choice_.many_ms = ms[1];
  choice_.blas_ms = ms.size() > 2 ? ms[2] : 0.0;
  choice_.samples = static_cast<int64_t>(times_[best].size());
  choice_.timed.clear();
  for (const auto& t : times_) choice_.timed.push_back(static_cast<int64_t>(t.size()));
  choice_.chosen = candidates_[best].aten;
  choice_.blas = candidates_[best].blas;
  set_threads(choice_.chosen, choice_.blas);
  {
    std::lock_guard<std::mutex> g(g_choice_m);
    g_choice = choice_;
  }
  std::string counts;
  for (const auto& t : times_) counts += (counts.empty() ? "" : "/") + std::to_string(t.size());
  log_->info("run.threads = auto: a step took {:.2f} ms on 1 thread, {:.2f} ms on {} ATen threads"
             "{} (medians of {} steps; one more than 25% and 10 ms slower than the best after a "
             "round, or 10% after two, is timed no more); training on {} ATen and {} BLAS thread(s)",
             choice_.one_ms, choice_.many_ms, many_,
             ms.size() > 2 ? fmt::format(", {:.2f} ms on {} BLAS threads", choice_.blas_ms, many_)
                           : std::string(),
             counts, choice_.chosen, choice_.blas);
}

void ThreadTuner::save_state(torch::serialize::OutputArchive& a) const {
  if (inert()) return;
  a.write("chosen", torch::tensor(choice_.chosen));
  a.write("blas", torch::tensor(choice_.blas));
  a.write("many", torch::tensor(choice_.many));
  a.write("times_ms",
          torch::tensor(std::vector<double>{choice_.one_ms, choice_.many_ms, choice_.blas_ms}));
  a.write("samples", torch::tensor(choice_.samples));
}

void ThreadTuner::load_state(Learner&, torch::serialize::InputArchive& a) {
  if (inert()) return;  // run.threads is a number now, or nothing can be tuned here
  torch::Tensor chosen, blas, many, times;
  a.read("chosen", chosen);
  // Checkpoints before the BLAS candidate have no "blas": their many-thread choice is many + 1.
  const bool has_blas = a.try_read("blas", blas);
  a.read("many", many);
  a.read("times_ms", times);
  if (chosen.item<int64_t>() <= 0) return;  // saved before the choice: measure again
  // "All cores" means this machine's: a run resumed elsewhere keeps the choice, not the count.
  choice_.chosen = chosen.item<int64_t>() == 1 ? 1 : many_;
  choice_.blas = has_blas && blas.item<int64_t>() > 1 ? many_ : 1;
  choice_.many = many_;
  choice_.one_ms = times[0].item<double>();
  choice_.many_ms = times[1].item<double>();
  choice_.blas_ms = times.numel() > 2 ? times[2].item<double>() : 0.0;
  torch::Tensor samples;  // checkpoints before the early drop: 3 each
  choice_.samples = a.try_read("samples", samples) ? samples.item<int64_t>() : rounds_;
  set_threads(choice_.chosen, choice_.blas);
  std::lock_guard<std::mutex> g(g_choice_m);
  g_choice = choice_;
}

}  // namespace frugal
