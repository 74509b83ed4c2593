#include "frugal/memory/fit_stats.h"

#include <algorithm>

namespace frugal {

MemoryBreakdown steady_breakdown(const BatchMemory& b, int64_t parameters, int64_t optimizer_state,
                                 int64_t data, int64_t callbacks) {
  MemoryBreakdown m;
  m.parameters = parameters;
  m.gradients = b.gradients;
  m.optimizer_state = optimizer_state;
  m.activations = std::max<int64_t>(0, b.forward_peak - b.live_before_forward);
  m.data = data;
  m.callbacks = callbacks;
  m.other = std::max<int64_t>(0, b.live_before_forward - m.parameters - m.optimizer_state - m.data -
                                     m.callbacks);
  return m;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double pos = q * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(pos);
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

void FitStats::start(std::vector<StageStats> resumed) {
  stages_ = std::move(resumed);
  phase_peaks_.fill(0);
  last_valid_ = false;
}

void FitStats::begin_stage(size_t index, const std::string& name) {
  if (stages_.size() <= index) {
    stages_.emplace_back();
    stages_.back().name = name;
  }
  last_valid_ = false;  // a short stage falls back to its own last batch, not the previous stage's
}

void FitStats::note_phase_peak(Phase p, int64_t bytes) {
  const auto i = static_cast<size_t>(p);
  phase_peaks_[i] = std::max(phase_peaks_[i], bytes);
  if (!stages_.empty()) stages_.back().phase_peaks[i] = std::max(stages_.back().phase_peaks[i], bytes);
}

void FitStats::note_stage_peak(int64_t bytes) {
  StageStats& st = stages_.back();
  st.peak_bytes = std::max(st.peak_bytes, bytes);
}

void FitStats::offer_steady(const MemoryBreakdown& m, int64_t stage_batch) {
  // fastai's observation: from the second batch on memory is constant; the stage's third batch
  // (or its last, if shorter) is measured.
  last_ = m;
  last_valid_ = true;
  if (wants_steady() && stage_batch >= 2) {
    stages_.back().steady = m;
    stages_.back().steady_measured = true;
  }
}

void FitStats::end_epoch() {
  if (!wants_steady() || !last_valid_) return;
  stages_.back().steady = last_;
  stages_.back().steady_measured = true;
}

namespace {

nlohmann::json phases_json(const std::array<int64_t, 4>& peaks) {
  nlohmann::json j;
  for (Phase p : kAllPhases) j[std::string(to_string(p))] = peaks[static_cast<size_t>(p)];
  return j;
}

nlohmann::json step_seconds_json(const std::vector<double>& steps) {
  return {{"median", percentile(steps, 0.5)},
          {"p10", percentile(steps, 0.1)},
          {"p90", percentile(steps, 0.9)},
          {"count", steps.size()}};
}

// The step times after warm-up (the first batches of a stage allocate caches); a stage with no
// more batches than that keeps them all.
std::vector<double> steady_steps(const StageStats& s, int64_t warmup) {
  const size_t warm = std::min(static_cast<size_t>(warmup), s.step_seconds.size());
  std::vector<double> steady(s.step_seconds.begin() + static_cast<std::ptrdiff_t>(warm),
                             s.step_seconds.end());
  return steady.empty() ? s.step_seconds : steady;
}

nlohmann::json stage_json(const StageStats& s, const std::vector<double>& steps) {
  nlohmann::json j = {
      {"name", s.name},
      {"peak_bytes", s.peak_bytes},
      {"phase_peaks", phases_json(s.phase_peaks)},
      {"steady", s.steady},
      {"batches", s.step_seconds.size()},
      {"samples", s.samples},
      {"train_seconds", s.train_seconds},
      {"samples_per_second", s.train_seconds > 0 ? s.samples / s.train_seconds : 0.0},
      {"step_seconds", step_seconds_json(steps)},
      {"loss", s.last_epoch_loss}};
  if (s.valid_accuracy >= 0) j["valid_accuracy"] = s.valid_accuracy;
  if (s.valid_loss >= 0) j["valid_loss"] = s.valid_loss;
  return j;
}

}  // namespace

double FitStats::final_loss() const {
  // The last stage that trained: a last stage of 0 epochs (or one a stop never reached) has no loss.
  for (auto s = stages_.rbegin(); s != stages_.rend(); ++s)
    if (s->samples > 0) return s->last_epoch_loss;
  return 0.0;
}

nlohmann::json FitStats::report(int64_t warmup, int64_t iterations, int64_t steps,
                                double valid_accuracy) const {
  nlohmann::json stages = nlohmann::json::array();
  int64_t peak = 0, total_samples = 0;
  double total_seconds = 0;
  std::vector<double> all_steps;
  for (const auto& s : stages_) {
    const std::vector<double> steady = steady_steps(s, warmup);
    all_steps.insert(all_steps.end(), steady.begin(), steady.end());
    stages.push_back(stage_json(s, steady));
    peak = std::max(peak, s.peak_bytes);
    total_seconds += s.train_seconds;
    total_samples += s.samples;
  }
  nlohmann::json out = {
      {"stages", stages},
      {"peak_bytes", peak},
      {"phase_peaks", phases_json(phase_peaks_)},
      {"iterations", iterations},
      {"optimizer_steps", steps},
      {"train_seconds", total_seconds},
      {"samples_per_second", total_seconds > 0 ? total_samples / total_seconds : 0.0},
      {"step_seconds", step_seconds_json(all_steps)},
      {"final_loss", final_loss()}};
  if (valid_accuracy >= 0) out["valid_accuracy"] = valid_accuracy;
  return out;
}

}  // namespace frugal
