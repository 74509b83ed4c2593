#include "frugal/callbacks/trace.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "frugal/core/learner.h"
#include "frugal/io/file_writer.h"

namespace frugal {

namespace {
constexpr const char* kSpanNames[] = {"batch", "forward", "backward", "step", "validate"};
}  // namespace

TraceCallback::TraceCallback(std::string path, size_t reserve) : path_(std::move(path)) {
  records_.reserve(reserve);
}

TraceCallback::~TraceCallback() {
  // A fit that threw never reached after_fit: its timeline is still worth having.
  if (!started_ || written_) return;
  try {
    write();
  } catch (const std::exception& e) {
    spdlog::warn("trace: {}", e.what());
  }
}

int64_t TraceCallback::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0_).count();
}

void TraceCallback::sample(int64_t t, int64_t step) {
  Record r;
  r.start_ns = t;
  r.bytes = MemoryMeter::get().current();
  r.step = step;
  r.kind = Kind::Counter;
  records_.push_back(r);
}

void TraceCallback::open(Kind k, int64_t step) {
  const auto i = static_cast<size_t>(k);
  const int64_t t = now_ns();
  open_start_[i] = t;
  open_step_[i] = step;
  sample(t, step);
}

void TraceCallback::close(Kind k, int64_t phase_peak) {
  const auto i = static_cast<size_t>(k);
  if (open_start_[i] < 0) return;
  const int64_t t = now_ns();
  Record r;
  r.start_ns = open_start_[i];
  r.dur_ns = t - open_start_[i];
  r.step = open_step_[i];
  r.kind = k;
  if (k == Kind::Batch) {
    // A batch's peak is the highest of its phases' (each closed before the batch).
    for (size_t j = records_.size(); j-- > 0 && records_[j].start_ns >= r.start_ns;)
      if (records_[j].kind != Kind::Counter) r.bytes = std::max(r.bytes, records_[j].bytes);
  } else {
    r.bytes = phase_peak;
  }
  records_.push_back(r);
  open_start_[i] = -1;
  sample(t, r.step);
}

void TraceCallback::before_fit(Learner&) {
  t0_ = Clock::now();
  started_ = true;
  written_ = false;
  records_.clear();
  sample(0, 0);
}

void TraceCallback::before_batch(Learner& l) { open(Kind::Batch, l.iteration()); }
void TraceCallback::before_forward(Learner& l) { open(Kind::Forward, l.iteration()); }
// The Learner's phase peak, read at a phase's end, is the phase's peak so far.
void TraceCallback::after_loss(Learner& l) { close(Kind::Forward, l.phase_peak()); }
void TraceCallback::before_backward(Learner& l) { open(Kind::Backward, l.iteration()); }
void TraceCallback::after_backward(Learner& l) { close(Kind::Backward, l.phase_peak()); }
void TraceCallback::before_step(Learner& l) { open(Kind::Step, l.iteration()); }
void TraceCallback::after_batch(Learner& l) {
  // The step span ends with the batch: after_step does not fire for a skipped step.
  close(Kind::Step, l.phase_peak());
  close(Kind::Batch);
}
void TraceCallback::before_validate(Learner& l) { open(Kind::Validate, l.iteration()); }
void TraceCallback::after_validate(Learner& l) { close(Kind::Validate, l.phase_peak()); }
void TraceCallback::after_fit(Learner&) { write(); }

std::string TraceCallback::json() const {
  std::string out;
  out.reserve(records_.size() * 120 + 256);
  out += "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":1,\"args\":{\"name\":\"frugal\"}}";
  char buf[256];
  for (const Record& r : records_) {
    const double ts = static_cast<double>(r.start_ns) / 1000.0;  // microseconds
    if (r.kind == Kind::Counter) {
      std::snprintf(buf, sizeof buf,
                    ",\n{\"name\":\"live memory\",\"ph\":\"C\",\"pid\":1,\"tid\":1,\"ts\":%.3f,"
                    "\"args\":{\"live_bytes\":%lld}}",
                    ts, static_cast<long long>(r.bytes));
    } else {
      std::snprintf(buf, sizeof buf,
                    ",\n{\"name\":\"%s\",\"cat\":\"phase\",\"ph\":\"X\",\"pid\":1,\"tid\":1,"
                    "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"step\":%lld,\"peak_bytes\":%lld}}",
                    kSpanNames[static_cast<size_t>(r.kind)], ts,
                    static_cast<double>(r.dur_ns) / 1000.0, static_cast<long long>(r.step),
                    static_cast<long long>(r.bytes));
    }
    out += buf;
  }
  out += "\n]}\n";
  return out;
}

void TraceCallback::write() {
  const auto parent = std::filesystem::path(path_).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  write_file_atomic(path_, json());
  written_ = true;
}

}  // namespace frugal
