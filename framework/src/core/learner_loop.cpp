// The Learner's training loop: fit, stages, epochs, a batch as micro-batches with retries after
// an out-of-memory error, the step, validation, and the micro-batch probe.
#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "core/guard.h"
#include "frugal/base/error.h"
#include "frugal/base/rng.h"
#include "frugal/core/learner.h"

namespace frugal {

namespace {

using Clock = std::chrono::steady_clock;

bool has_gradients(torch::nn::Module& m) {
  for (const auto& p : m.parameters())
    if (p.grad().defined()) return true;
  return false;
}

// Opens `w` for a scope if it is closed, and closes it at the scope's end; a window found open
// stays open (validate() inside a fit uses the fit's phase window).
class WindowScope {
 public:
  explicit WindowScope(MemoryWindow& w) : w_(w), opened_(!w.is_open()) {
    if (opened_) w_ = MemoryMeter::get().open_window();
  }
  ~WindowScope() {
    if (opened_) w_.close();
  }
  WindowScope(const WindowScope&) = delete;
  WindowScope& operator=(const WindowScope&) = delete;

 private:
  MemoryWindow& w_;
  bool opened_;
};

// What the micro-batch probe must leave as it found it: the RNG (dropout draws), the buffers
// (BatchNorm's running statistics), the gradients held before it, the module's mode.
struct RunState {
  RngState rng;
  std::vector<torch::Tensor> buffers, grads;
  bool module_training;

  RunState(torch::nn::Module& m, const torch::Device& d)
      : rng(RngState::capture(d)), module_training(m.is_training()) {
    torch::NoGradGuard g;
    for (const auto& b : m.buffers()) buffers.push_back(b.clone());
    for (auto& p : m.parameters()) {
      grads.push_back(p.grad());
      p.mutable_grad().reset();
    }
  }
  void restore(torch::nn::Module& m) {
    rng.restore();
    {
      torch::NoGradGuard g;
      auto bs = m.buffers();
      for (size_t i = 0; i < bs.size() && i < buffers.size(); ++i) bs[i].copy_(buffers[i]);
    }
    auto ps = m.parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = grads[i];
    if (!module_training) m.eval();
  }
};

}  // namespace

// ---------------------------------------------------------------- fit, stages, epochs

void Learner::fit(int64_t epochs) {
  Stage s;
  s.name = "fit";
  s.epochs = epochs;
  fit(std::vector<Stage>{s});
}

void Learner::check_fit(const std::vector<Stage>& stages) const {
  if (stages.empty()) throw_usage_error("fit: no stages");
  for (const auto& s : stages) {
    if (s.epochs < 0)
      throw_config_error("stage '" + s.name + "': epochs must be >= 0, got " + std::to_string(s.epochs));
    if (s.image_size < 0)
      throw_config_error("stage '" + s.name + "': image_size must be >= 0, got " +
                         std::to_string(s.image_size));
    const Dataset& d = train_.dataset();
    if (s.seq_len < 0 || (d.is_text() && s.seq_len > d.block_size))
      throw_config_error("stage '" + s.name + "': seq_len = " + std::to_string(s.seq_len) +
                         " must be in [0, data.block_size = " + std::to_string(d.block_size) +
                         "] (0 = the whole window)");
  }
  if (std::all_of(stages.begin(), stages.end(), [](const Stage& s) { return s.epochs == 0; }))
    throw_config_error("every stage has epochs = 0: the fit would train nothing and report "
                       "nothing; give at least one stage epochs >= 1");
  check_freeze_prefixes(*model_, stages);
}

void Learner::fit(const std::vector<Stage>& stages) {
  live();
  check_fit(stages);  // everything checkable, before any work
  const size_t first_stage = start_fit(stages);
  // The budget holds for the fit only: it is process-wide, and a test or a later fit must not
  // inherit it.
  std::optional<ScopedMemoryBudget> budget;
  if (oom_.budget > 0) budget.emplace(oom_.budget);
  if (memory().budget() > 0 && memory().current() > memory().budget())
    throw oom_budget_below_live(memory().budget(), memory().current(), iteration_);
  WindowScope stage_window(stage_window_), phase_window(phase_window_);
  if (auto oom = catch_oom([&] { run_stages(first_stage); })) {
    // Out of memory where no retry applies (a callback's hook, validation): the loop's own
    // places throw OomError with more context.
    reset_batch_state();
    micro_.count_oom();
    throw oom_in_event(to_string(event_), iteration_, *oom);
  }
  reset_batch_state();
  next_.done = true;
  fire(Event::AfterFit);
}

// The fit's counters, statistics and position start (or continue a loaded checkpoint's).
// Returns the first stage to run.
size_t Learner::start_fit(const std::vector<Stage>& stages) {
  stages_ = stages;
  stats_.start();
  iteration_ = steps_ = 0;
  const size_t first_stage = resume_ ? prepare_resume() : 0;
  stop_fit_ = stop_epoch_ = capped_ = false;
  cursor_at(static_cast<int64_t>(first_stage), 0, global_epoch_);
  model_->train();
  micro_.start_fit();
  return first_stage;
}

void Learner::run_stages(size_t first_stage) {
  state_offloaded_ = false;  // a callback that offloads says so again
  sync_reserve_ = 0;         // a gradient sync says so in before_stage
  if (shards_)  // a fit that failed left them: null or borrowed storage, not the model
    throw_usage_error(
        "Learner::fit: the model's parameters are still sharded by the fit that failed before "
        "(zero stage 3 frees the parameters a rank does not own): make a new Learner and resume "
        "from the last checkpoint");
  fire(Event::BeforeFit);
  if (resume_ && first_stage >= stages_.size()) apply_resume();  // the fit had ended
  for (size_t i = first_stage; i < stages_.size() && !stop_fit_; ++i) {
    stage_index_ = static_cast<int64_t>(i);
    run_stage(stages_[i]);
  }
}

void Learner::setup_stage(const Stage& s) {
  unfreeze();
  if (!s.freeze.empty()) freeze(s.freeze);
  train_.set_image_size(s.image_size);
  train_.set_seq_len(s.seq_len);  // validation keeps whole windows: one score for every stage
  if (valid_) valid_->set_image_size(s.image_size);
  if (s.has_optimizer) adopt_stage_optimizer(s.optimizer);
}

void Learner::run_stage(const Stage& s) {
  setup_stage(s);
  fire(Event::BeforeStage);
  if (oom_.auto_micro_batch) {
    micro_.probed(s.name, find_micro_batch());
    stage_window_.reset();  // the probe's failed attempts touch the budget: not the stage's peak
  }
  const int64_t first_epoch = resume_ ? resume_epoch() : 0;
  if (resume_ && first_epoch >= s.epochs) apply_resume();  // only after_stage was left
  for (int64_t e = first_epoch; e < s.epochs && !stop_fit_; ++e) {
    epoch_ = e;
    run_epoch();
  }
  cursor_at(stage_index_ + 1, 0, global_epoch_);
  fire(Event::AfterStage);
}

void Learner::start_epoch() {
  fire(Event::BeforeEpoch);
  train_.set_epoch(global_epoch_++);
  model_->train();
  training_ = true;
  loss_sum_ = 0;
  loss_count_ = 0;
  stop_epoch_ = false;
  num_batches_ = train_.num_batches();
  cursor_at(stage_index_, epoch_, global_epoch_ - 1);
}

void Learner::run_epoch() {
  start_epoch();
  fire(Event::BeforeTrain);
  int64_t first = 0;
  bool run = true;
  if (resume_) {
    first = apply_resume();
    run = !stop_epoch_ && !stop_fit_;  // the checkpointed batch had ended the epoch or the fit
  }
  train_started_ = Clock::now();
  if (run) run_batches(first);
  reset_batch_state();
  fire(Event::AfterTrain);
  training_ = false;

  // A fit the step cap ends on an epoch's last batch has trained that whole epoch: validated.
  const bool whole_epoch = capped_ && next_.batch >= num_batches_;
  if (valid_ && (!stop_fit_ || whole_epoch)) validate();
  cursor_at(stage_index_, epoch_ + 1, global_epoch_);
  next_.stop_fit = stop_fit_;
  fire(Event::AfterEpoch);
}

void Learner::run_batches(int64_t first) {
  for (int64_t i = first; i < num_batches_; ++i) {
    batch_index_ = i;
    Batch b;
    if (auto oom = catch_oom([&] { b = train_.batch(i); }))
      throw oom_loading(i, train_.batch_size(), iteration_, *oom);
    train_batch(b);
    ++iteration_;
    if (max_steps_ > 0 && iteration_ >= max_steps_ && !stop_fit_) stop_fit_ = capped_ = true;
    if (stop_epoch_ || stop_fit_) break;
  }
}

// ---------------------------------------------------------------- a training batch

void Learner::train_batch(const Batch& b) {
  reset_batch_state();
  x_ = b.x;
  y_ = b.y;
  rec_.batch_samples = b.total_size();  // data parallel: the step's samples on every rank
  fire(Event::BeforeBatch);
  if (!skip_batch_) run_micro_batches();
  if (!skip_batch_) run_step();
  if (loss_.defined()) {
    loss_sum_ += loss_.item<float>();
    ++loss_count_;
  }
  advance_cursor();
  fire(Event::AfterBatch);
}

// The batch (as before_batch left it) runs as one or several micro-batches, each forward, loss
// and backward; an out-of-memory error retries at a smaller size (recover_from_oom).
void Learner::run_micro_batches() {
  const torch::Tensor bx = x_, by = y_;
  const int64_t n = by.size(0);
  // Gradients of earlier batches (accumulation): a failed backward cannot be undone then.
  const bool grads_at_start = oom_.retry && has_gradients(*model_);
  torch::Tensor batch_loss;  // the batch's mean loss, for logging
  int64_t begin = 0, failures = 0;
  while (begin < n && !skip_batch_) {
    const int64_t mbs = micro_.effective(n);  // at each micro-batch: a retry lowers the cap
    const int64_t len = std::min(mbs, n - begin);
    micro_count_ = micro_index_ + (n - begin + mbs - 1) / mbs;
    enter_micro_batch(bx, by, begin, len);
    const MicroAttempt a = attempt_micro_batch();
    if (a.oom) {
      recover_from_oom({a.phase, batch_index_, iteration_, mbs, n, ++failures, grads_at_start,
                        memory().budget(), *a.oom});
      if (a.phase == OomError::Phase::Backward) {  // the batch's gradients were dropped
        begin = micro_index_ = 0;
        batch_loss = torch::Tensor();
      }
      continue;
    }
    if (!a.ran) break;  // a callback skipped the batch after its forward
    // A whole batch in one pass: its loss as is (no op, no allocation per step).
    torch::Tensor weighted = loss_.detach().to(torch::kFloat);
    if (len != n) weighted = weighted * micro_weight_;
    batch_loss = batch_loss.defined() ? batch_loss + weighted : weighted;
    begin += len;
    ++micro_index_;
    micro_.ran_at(mbs);
  }
  micro_index_ = std::max<int64_t>(0, std::min(micro_index_, micro_count_ - 1));
  x_ = bx;
  y_ = by;
  if (batch_loss.defined()) loss_ = batch_loss;  // the batch's loss, as one pass would give it
}

// The micro-batch [begin, begin + len) of the batch (bx, by) becomes the current one.
void Learner::enter_micro_batch(const torch::Tensor& bx, const torch::Tensor& by, int64_t begin,
                                int64_t len) {
  const int64_t n = by.size(0);
  x_ = len == n ? bx : bx.narrow(0, begin, len);
  y_ = len == n ? by : by.narrow(0, begin, len);
  micro_weight_ = static_cast<double>(len) / static_cast<double>(n);
  loss_scale_ = 1.0;
  pred_ = torch::Tensor();
  loss_ = torch::Tensor();
}

// One attempt at the current micro-batch: forward, loss, backward, then after_backward.
Learner::MicroAttempt Learner::attempt_micro_batch() {
  MicroAttempt a;
  a.oom = catch_oom([&] { a.ran = forward_backward(a.phase); });
  // after_backward: data parallel all-reduces there, on the last micro-batch. A retry stays
  // on its rank (the only collectives of a batch come after a rank's last micro-batch, and
  // each rank reaches that once); an out-of-memory error inside the all-reduce could not be
  // retried on one rank alone (its buckets are on the wire): it ends the fit there.
  if (!a.oom && a.ran) {
    if (collective().distributed())
      fire(Event::AfterBackward);
    else
      a.oom = catch_oom([&] { fire(Event::AfterBackward); });
  }
  return a;
}

// One micro-batch's forward (with the loss) and backward. False when a callback skipped the
// batch before backward. `phase` says where an exception left it.
bool Learner::forward_backward(OomError::Phase& phase) {
  fire(Event::BeforeForward);
  pred_ = forward(x_);
  fire(Event::AfterForward);
  loss_ = loss_fn_(pred_, y_);
  fire(Event::AfterLoss);
  // The loss's graph holds what backward needs; the prediction itself (a language model's
  // logits: batch x tokens x vocabulary) is free during backward unless a callback keeps it.
  if (!keep_pred_) pred_ = torch::Tensor();
  if (skip_batch_) return false;

  fire(Event::BeforeBackward);
  phase = OomError::Phase::Backward;  // from here gradients may hold part of this micro-batch
  // (after_backward fires once the ranks agree no one ran out of memory)
  backward();
  return true;
}

void Learner::run_step() {
  fire(Event::BeforeStep);
  announce_optimizer();  // the last before_step hook may have replaced it
  if (!skip_step_ && !skip_batch_) {
    // A step that fails (out of memory, a file it could not make) releases the caches: a
    // callback that prepared the step (offload's allocator redirect) undoes it there.
    const auto step = [&] {
      try {
        return catch_oom([&] { optimizer_->step(); });
      } catch (...) {
        release_caches();
        throw;
      }
    };
    if (auto oom = step()) {
      release_caches();
      micro_.count_oom();
      zero_grad();
      throw oom_in_step(batch_index_, iteration_, *oom);
    }
    zero_grad();
    ++steps_;
    fire(Event::AfterStep);
  }
}


// After the catch block: the batch's tensors go, caches are released, then the policy decides
// (OomError, or a retry at half the micro-batch).
void Learner::recover_from_oom(const OomEvent& e) {
  micro_.count_oom();
  x_ = torch::Tensor();
  y_ = torch::Tensor();
  pred_ = torch::Tensor();
  loss_ = torch::Tensor();
  // A failed backward may have added part of the micro-batch to some gradients: the batch's
  // gradients go, and the batch starts over (the caller resets its position).
  if (e.phase == OomError::Phase::Backward) zero_grad();
  std::string veto;
  for (const auto& c : callbacks_) {
    const std::string why = call_guarded(*c, "retry_veto", [&] { return c->retry_veto(*this); });
    if (!why.empty() && veto.empty()) veto = c->name() + ": " + why;
  }
  release_caches();
  if (!veto.empty())
    throw OomError("out of memory in " + describe(e) + ", not retried (" + veto + "): " + e.message,
                   e.phase, e.iteration);
  const OomRetry r = decide_oom_retry(oom_, e);
  micro_.retried(r);
  spdlog::warn("out of memory in {}: retrying with micro-batches of {} ({})", describe(e), r.to,
               e.message);
}

void Learner::cursor_at(int64_t stage, int64_t epoch, int64_t data_epoch) {
  next_ = FitPosition{stage, epoch, 0, data_epoch, iteration_, steps_};
}

void Learner::advance_cursor() {
  next_.batch = batch_index_ + 1;
  next_.iteration = iteration_ + 1;
  next_.steps = steps_;
}

// ---------------------------------------------------------------- validation

double Learner::validate() {
  live();
  if (!valid_) return -1;
  WindowScope window(phase_window_);
  const bool was_training = model_->is_training();
  model_->eval();
  fire(Event::BeforeValidate);
  // Sharded parameters: a rank without rows of a batch still takes part in its gathers.
  valid_sums_ = score(
      *valid_, [this](const torch::Tensor& x) { return forward(x); }, device_,
      [this] {
        if (shards_) shards_->skip_forward();
      });
  sum_across_ranks(collective(), valid_sums_);  // data parallel: each rank scored its shard
  fire(Event::AfterValidate);
  if (was_training) model_->train();
  return valid_accuracy();
}

// ---------------------------------------------------------------- micro-batch probe

ProbeResult Learner::probe_micro_batch(const Batch& b, int64_t m) {
  const int64_t n = b.size();
  // Two micro-batches when the batch splits: from the second on, gradients are held while
  // the next backward runs, which the first does not show.
  const int64_t passes = m < n ? 2 : 1;
  ProbeResult r;
  MemoryWindow window = memory().open_window();
  r.oom = catch_oom([&] {
            for (int64_t k = 0; k < passes; ++k) {
              const int64_t begin = k * m, len = std::min(m, n - begin);
              torch::Tensor pred = forward(b.x.narrow(0, begin, len));
              torch::Tensor loss = loss_fn_(pred, b.y.narrow(0, begin, len));
              (loss * (static_cast<double>(len) / static_cast<double>(n))).backward();
            }
            r.after_backward = memory().current();
          }).has_value();
  r.peak = window.peak();
  zero_grad();
  release_caches();
  return r;
}

int64_t Learner::find_micro_batch() {
  live();
  const int64_t budget = memory().budget();
  if (budget <= 0)
    throw_usage_error("find_micro_batch needs a memory budget (run.memory_budget, "
                      "OomPolicy::budget or MemoryMeter::set_budget)");
  if (train_.num_batches() == 0) return 0;
  const Batch b = train_.batch(0);
  const int64_t n = b.size();
  // The probe runs as a training forward would (train mode, training() true for the forward
  // wrappers) and leaves no trace: gradients held before are set aside, RNG and buffers restored.
  RunState state(*model_, device_);
  const bool was_training = training_;
  training_ = true;
  model_->train();
  StepNeeds needs = optimizer_step_needs(*model_, *optimizer_, optimizer_options_);
  if (state_offloaded_) needs.state = 0;  // made on disk, not in the budget
  // From the batch's own split (or the whole batch) down.
  const int64_t start = micro_.size() > 0 ? std::min(micro_.size(), n) : n;
  ProbeSearch found;
  try {
    found = largest_fitting(
        start, [&](int64_t m) {
          ProbeResult r = probe_micro_batch(b, m);
          // The probe's backward syncs nothing. The copy is live during backward (overlap) or
          // right after it (the peak covers both), before the step's state and temporaries.
          r.peak += sync_reserve_;
          return probe_fits(r, needs, budget);
        });
  } catch (...) {
    state.restore(*model_);
    training_ = was_training;
    throw;
  }
  state.restore(*model_);
  training_ = was_training;
  // Data parallel: every rank runs the size that fits on all of them (a rank that fits none
  // fails them all: its error says so, the others' collectives end at the timeout or launcher).
  found.size = collective().min(found.size);
  if (found.size == 0) throw oom_in_probe(budget, memory().current(), needs.state, iteration_);
  micro_.set_cap(found.size < start ? found.size : 0);
  spdlog::info("micro_batch = auto: {} of {} samples fit run.memory_budget = {} ({} probes{})",
               found.size, n, format_bytes(budget), found.probes,
               sync_reserve_ > 0 ? ", " + format_bytes(sync_reserve_) + " kept for the gradient sync" : "");
  return found.size;
}

}  // namespace frugal
