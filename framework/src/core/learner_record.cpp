// The recorder: what each event opens or closes in the fit's statistics (FitStats) and memory
// windows, before any callback's hook (record_before) and after the last (record_after). The
// loop fires events; the measurements are kept here, in one place.
#include <algorithm>
#include <chrono>

#include "frugal/core/learner.h"

namespace frugal {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

void Learner::record_before(Event e) {
  switch (e) {
    case Event::BeforeStage:  // a resumed stage continues its statistics
      stats_.begin_stage(static_cast<size_t>(stage_index_), stages_[static_cast<size_t>(stage_index_)].name);
      break;
    case Event::BeforeBatch:
      rec_.batch_started = Clock::now();
      rec_.stage_batch = static_cast<int64_t>(stats_.stage().step_seconds.size());
      rec_.mem = BatchMemory{};
      rec_.stepping = false;
      break;
    case Event::BeforeForward:
      rec_.forward_live = memory().current();
      phase_window_.reset();
      break;
    case Event::BeforeBackward:
    case Event::BeforeValidate:
      phase_window_.reset();
      break;
    case Event::BeforeStep:
      if (stats_.wants_steady()) rec_.mem.gradients = gradient_bytes(*model_);
      phase_window_.reset();
      rec_.stepping = true;
      break;
    case Event::AfterBatch: {
      // The step's phase ends with the step, taken or skipped (after_step fires only when taken).
      if (rec_.stepping) note_phase_peak(Phase::Step, phase_window_.peak());
      StageStats& st = stats_.stage();
      st.step_seconds.push_back(seconds_since(rec_.batch_started));
      st.samples += rec_.batch_samples;
      break;
    }
    case Event::AfterTrain:
      stats_.stage().train_seconds += seconds_since(train_started_);
      stats_.stage().last_epoch_loss = epoch_loss();
      stats_.end_epoch();
      break;
    case Event::AfterStage:
      stats_.note_stage_peak(stage_window_.peak());
      break;
    default:
      break;
  }
}

void Learner::record_after(Event e) {
  switch (e) {
    case Event::BeforeStage:
      // The stage's peak is what the stage holds from here: what a before_stage hook released
      // (a purge, an optimizer swap) is not charged to the new stage.
      stage_window_.reset();
      break;
    case Event::BeforeBatch:  // what before_batch's hooks left, before the first forward
      rec_.mem.live_before_forward = memory().current();
      break;
    case Event::AfterLoss: {
      const int64_t forward_peak = phase_window_.peak();
      note_phase_peak(Phase::Forward, forward_peak);
      rec_.mem.forward_peak = std::max(rec_.mem.forward_peak,
                                       forward_peak - rec_.forward_live + rec_.mem.live_before_forward);
      break;
    }
    case Event::AfterBackward:
      note_phase_peak(Phase::Backward, phase_window_.peak());
      break;
    case Event::AfterValidate:
      note_phase_peak(Phase::Validate, phase_window_.peak());
      if (stage_window_.is_open() && !stats_.stages().empty()) {  // in a fit: the stage's scores
        stats_.stage().valid_accuracy = valid_accuracy();
        stats_.stage().valid_loss = valid_sums_.mean_loss();
      }
      break;
    case Event::AfterBatch:
      if (stats_.wants_steady() && !skip_batch_ && rec_.mem.forward_peak > 0) measure_steady();
      break;
    default:
      break;
  }
}

// The steady state: nothing is walked once the stage has it.
void Learner::measure_steady() {
  int64_t held = 0;  // callbacks' histories and caches: a column, not part of "other"
  for (const auto& cb : callbacks_) held += cb->held_bytes();
  stats_.offer_steady(steady_breakdown(rec_.mem, parameter_bytes(*model_),
                                       optimizer_state_bytes(*optimizer_), data_bytes(), held),
                      rec_.stage_batch);
}

}  // namespace frugal
