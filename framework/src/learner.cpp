#include "frugal/learner.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <ATen/CPUGeneratorImpl.h>

#include <spdlog/spdlog.h>

#ifdef FRUGAL_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "frugal/compat.h"
#include "frugal/error.h"
#include "frugal/report.h"
#include "frugal/rng.h"

namespace frugal {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kStageWindow = 0;
constexpr int kPhaseWindow = 1;
constexpr size_t kMaxOomRecords = 100;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double pos = q * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(pos);
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// An error from the model's own forward, so that callbacks wrapping the forward do not
// claim it as theirs.
class ModelForwardError : public Error {
 public:
  using Error::Error;
};

int64_t dataset_bytes(const Dataset& d) {
  int64_t n = 0;
  if (d.images.defined()) n += static_cast<int64_t>(d.images.nbytes());
  if (d.labels.defined()) n += static_cast<int64_t>(d.labels.nbytes());
  return n;
}

// Writes an archive straight to its temp file (a checkpoint is never buffered whole in
// memory), then renames it over `path`.
void write_archive(torch::serialize::OutputArchive& archive, const std::string& path) {
  const std::filesystem::path target(path);
  try {
    if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path());
    write_file_atomic(path, [&](const std::string& tmp) { archive.save_to(tmp); });
  } catch (const c10::Error& e) {
    throw CheckpointError("cannot write checkpoint '" + path + "': " + first_line(e.what_without_backtrace()));
  } catch (const std::filesystem::filesystem_error& e) {
    throw CheckpointError("cannot write checkpoint '" + path + "': " + e.code().message());
  } catch (const Error& e) {
    throw CheckpointError(e.what());
  }
}

// Opens a frugal checkpoint; every way it can be unreadable is a CheckpointError naming it.
void open_archive(const std::string& path, const torch::Device& device,
                  torch::serialize::InputArchive& archive) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw CheckpointError("checkpoint '" + path + "' does not exist");
  if (!std::filesystem::is_regular_file(path, ec))
    throw CheckpointError("checkpoint '" + path + "' is not a file");
  try {
    archive.load_from(path, device);
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint '" + path +
                          "' is unreadable (truncated, or not a checkpoint): " +
                          first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint '" + path +
                          "' is unreadable (truncated, or not a checkpoint): " + first_line(e.what()));
  }
  c10::IValue format;
  if (!archive.try_read("frugal.format", format))
    throw CheckpointError("'" + path + "' is not a frugal checkpoint (it has no frugal.format record)");
  if (!format.isInt() || format.toInt() != 1)
    throw CheckpointError("checkpoint '" + path + "' has format " + format.tagKind() +
                          " " + (format.isInt() ? std::to_string(format.toInt()) : "") +
                          "; this frugal reads format 1");
}

// LibTorch's Module::load replaces a tensor of another shape without a word: every shape is
// checked first, so a checkpoint of another model is refused before anything changes.
void check_shapes(torch::nn::Module& m, torch::serialize::InputArchive& a, const std::string& prefix,
                  const std::string& path) {
  auto check = [&](const std::string& key, const torch::Tensor& now, bool buffer) {
    torch::Tensor saved;
    if (!a.try_read(key, saved, buffer))
      throw CheckpointError("checkpoint '" + path + "' does not fit this model: it has no '" +
                            prefix + key + "'");
    if (saved.sizes() != now.sizes())
      throw CheckpointError("checkpoint '" + path + "' does not fit this model: '" + prefix + key +
                            "' is " + c10::str(saved.sizes()) + " there, " + c10::str(now.sizes()) +
                            " here");
  };
  for (const auto& p : m.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : m.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& c : m.named_children()) {
    torch::serialize::InputArchive sub;
    if (!a.try_read(c.key(), sub))
      throw CheckpointError("checkpoint '" + path + "' does not fit this model: it has no module '" +
                            prefix + c.key() + "'");
    check_shapes(*c.value(), sub, prefix + c.key() + ".", path);
  }
}

void load_model(torch::nn::Module& model, torch::serialize::InputArchive& archive,
                const std::string& path) {
  torch::serialize::InputArchive model_archive;
  if (!archive.try_read("model", model_archive))
    throw CheckpointError("checkpoint '" + path + "' has no model");
  check_shapes(model, model_archive, "", path);
  try {
    model.load(model_archive);
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint '" + path + "' does not fit this model: " +
                          first_line(e.what_without_backtrace()));
  }
}

// The "frugal.resume" record: position, statistics, names; JSON text in the archive.
nlohmann::json read_resume_record(torch::serialize::InputArchive& archive, const std::string& path) {
  c10::IValue text;
  if (!archive.try_read("frugal.resume", text) || !text.isString())
    throw CheckpointError("checkpoint '" + path +
                          "' holds no resume state (Learner::save wrote it): load it with load()");
  try {
    auto j = nlohmann::json::parse(text.toStringRef());
    // Every field fit() reads, checked here so that a damaged record fails before any work.
    const auto& p = j.at("position");
    for (const char* k : {"stage", "epoch", "batch", "data_epoch", "iteration", "steps"})
      if (p.at(k).get<int64_t>() < 0) throw std::out_of_range(std::string("negative ") + k);
    for (const char* k : {"stop_epoch", "stop_fit", "done"}) (void)p.at(k).get<bool>();
    (void)j.at("stages").get<std::vector<std::string>>();
    (void)j.at("callbacks").get<std::vector<std::string>>();
    (void)j.at("optimizer").get<std::string>();
    (void)j.at("loss_count").get<int64_t>();
    if (!j.at("stats").is_array()) throw std::out_of_range("stats is not an array");
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError("checkpoint '" + path + "' has a damaged resume record: " + e.what());
  } catch (const std::out_of_range& e) {
    throw CheckpointError("checkpoint '" + path + "' has a damaged resume record: " + e.what());
  }
}

// JSON has no NaN (a diverged loss): it is stored as null.
double number(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : std::nan("");
}

nlohmann::json stats_to_json(const StageStats& s) {
  nlohmann::json steady = s.steady;
  return {{"name", s.name},
          {"peak_bytes", s.peak_bytes},
          {"phase_peaks", s.phase_peaks},
          {"steady", steady},
          {"steady_measured", s.steady_measured},
          {"step_seconds", s.step_seconds},
          {"samples", s.samples},
          {"train_seconds", s.train_seconds},
          {"last_epoch_loss", s.last_epoch_loss},
          {"valid_accuracy", s.valid_accuracy}};
}

StageStats stats_from_json(const nlohmann::json& j) {
  StageStats s;
  s.name = j.at("name").get<std::string>();
  s.peak_bytes = j.at("peak_bytes").get<int64_t>();
  s.phase_peaks = j.at("phase_peaks").get<std::array<int64_t, 4>>();
  const auto& b = j.at("steady");
  s.steady.parameters = b.value("parameters", int64_t{0});
  s.steady.gradients = b.value("gradients", int64_t{0});
  s.steady.optimizer_state = b.value("optimizer_state", int64_t{0});
  s.steady.activations = b.value("activations", int64_t{0});
  s.steady.data = b.value("data", int64_t{0});
  s.steady.other = b.value("other", int64_t{0});
  s.steady_measured = j.at("steady_measured").get<bool>();
  for (const auto& t : j.at("step_seconds")) s.step_seconds.push_back(t.is_number() ? t.get<double>() : 0.0);
  s.samples = j.at("samples").get<int64_t>();
  s.train_seconds = number(j, "train_seconds");
  s.last_epoch_loss = number(j, "last_epoch_loss");
  s.valid_accuracy = number(j, "valid_accuracy");
  return s;
}

// The default generators whose draws a run makes (dropout, random augmentations).
at::Generator cpu_generator() { return at::detail::getDefaultCPUGenerator(); }

}  // namespace

struct Learner::PendingResume {
  torch::serialize::InputArchive archive;
  nlohmann::json record;
  FitPosition position;
  std::string path;
};

Learner::Learner(torch::nn::Sequential model, DataLoader train, std::optional<DataLoader> valid,
                 OptimizerOptions optimizer, LossFn loss, torch::Device device)
    : model_(std::move(model)),
      optimizer_options_(std::move(optimizer)),
      loss_fn_(std::move(loss)),
      train_(std::move(train)),
      valid_(std::move(valid)),
      device_(device) {
  if (!loss_fn_) throw_usage_error("Learner needs a loss function");
  model_->to(device_);
  train_.set_device(device_);
  if (valid_) valid_->set_device(device_);
  optimizer_ = make_optimizer(optimizer_options_, model_->parameters());
}

Learner::~Learner() {
  // Callbacks (possibly from plugin libraries) go first, while everything they may touch lives.
  callbacks_.clear();
  forward_wrappers_.clear();
}

Learner& Learner::live() {
  if (destroyed_) throw_usage_error("this Learner was destroyed; create a new one");
  return *this;
}
const Learner& Learner::live() const {
  if (destroyed_) throw_usage_error("this Learner was destroyed; create a new one");
  return *this;
}

// ---------------------------------------------------------------- composition

void Learner::add_callback(std::shared_ptr<Callback> cb) {
  live();
  if (!cb) throw_usage_error("add_callback: null callback");
  auto pos = std::upper_bound(callbacks_.begin(), callbacks_.end(), cb,
                              [](const auto& a, const auto& b) { return a->order() < b->order(); });
  callbacks_.insert(pos, std::move(cb));
  rebuild_forward_wrappers();
}

void Learner::rebuild_forward_wrappers() {
  forward_wrappers_.clear();
  for (auto& c : callbacks_)
    if (c->wraps_forward()) forward_wrappers_.push_back(c.get());
}

size_t Learner::remove_callback(const std::string& name) {
  size_t before = callbacks_.size();
  callbacks_.erase(std::remove_if(callbacks_.begin(), callbacks_.end(),
                                  [&](const auto& c) { return c->name() == name; }),
                   callbacks_.end());
  rebuild_forward_wrappers();
  return before - callbacks_.size();
}

void Learner::clear_callbacks() {
  callbacks_.clear();
  forward_wrappers_.clear();
}

void Learner::fire(Event e) {
  event_ = e;
  const bool reverse = is_after(e);
  const size_t n = callbacks_.size();
  for (size_t k = 0; k < n && k < callbacks_.size(); ++k) {
    Callback& cb = *callbacks_[reverse ? callbacks_.size() - 1 - k : k];
    try {
      cb.dispatch(e, *this);
    } catch (const CallbackError&) {
      throw;  // already names its callback (an event fired from inside a hook)
    } catch (const c10::OutOfMemoryError&) {
      throw;  // keeps its type: the loop retries it (on_oom = "retry")
    } catch (const c10::Error& err) {
      throw CallbackError(cb.name(), std::string(to_string(e)), err.what_without_backtrace());
    } catch (const std::exception& err) {
      // Copy the message: the exception object may belong to a plugin's library.
      throw CallbackError(cb.name(), std::string(to_string(e)), err.what());
    } catch (...) {
      throw CallbackError(cb.name(), std::string(to_string(e)), "unknown exception");
    }
  }
}

torch::Tensor Learner::forward(const torch::Tensor& x) { return live().forward_from(0, x); }

torch::Tensor Learner::forward_from(size_t index, const torch::Tensor& x) {
  if (index >= forward_wrappers_.size()) {
    try {
      return model_->forward(x);
    } catch (const c10::OutOfMemoryError&) {
      throw;  // keeps its type: the loop retries it
    } catch (const c10::Error& err) {
      throw ModelForwardError("model forward failed: " + first_line(err.what_without_backtrace()));
    }
  }
  Callback* cb = forward_wrappers_[index];
  try {
    return cb->wrap_forward(*this, x, ForwardNext(*this, index + 1));
  } catch (const Error&) {
    throw;  // ours: a CallbackError from a later wrapper, or the model's own error
  } catch (const c10::OutOfMemoryError&) {
    throw;  // keeps its type: the loop retries it
  } catch (const c10::Error& err) {
    throw CallbackError(cb->name(), "wrap_forward", err.what_without_backtrace());
  } catch (const std::exception& err) {
    throw CallbackError(cb->name(), "wrap_forward", err.what());
  }
}

// ---------------------------------------------------------------- optimizer

void Learner::set_optimizer(std::unique_ptr<torch::optim::Optimizer> opt, OptimizerOptions o) {
  live();
  if (!opt) throw_usage_error("set_optimizer: null optimizer");
  optimizer_.reset();  // free the old state before the new one lives
  optimizer_ = std::move(opt);
  optimizer_options_ = std::move(o);
  ++optimizer_changes_;
}

void Learner::set_optimizer(const OptimizerOptions& o) {
  live();
  optimizer_.reset();
  optimizer_ = make_optimizer(o, model_->parameters());
  optimizer_options_ = o;
  ++optimizer_changes_;
}

void Learner::zero_grad() {
  // Set to none rather than zeroed: no gradient memory between steps.
  for (auto& p : model_->parameters()) p.mutable_grad().reset();
}

void Learner::backward() {
  if (!loss_.defined()) throw_usage_error("backward: no loss in this batch");
  const double factor = loss_scale_ * micro_weight_ * batch_weight_;
  if (factor == 1.0)
    loss_.backward();
  else
    (loss_ * factor).backward();
}

void Learner::set_micro_batch_size(int64_t n) {
  if (n < 0) throw_usage_error("micro-batch size must be >= 0 (0 = whole batch), got " + std::to_string(n));
  micro_batch_size_ = n;
}

void Learner::set_oom_policy(const OomPolicy& p) {
  if (p.budget < 0) throw_usage_error("memory budget must be >= 0 (0 = none), got " + std::to_string(p.budget));
  if (p.max_retries < 1)
    throw_usage_error("oom retries must be >= 1, got " + std::to_string(p.max_retries));
  oom_ = p;
}

void Learner::set_micro_batch_cap(int64_t n) {
  if (n < 0) throw_usage_error("micro-batch cap must be >= 0 (0 = none), got " + std::to_string(n));
  micro_cap_ = n;
}

int64_t Learner::effective_micro_batch(int64_t n) const {
  int64_t m = micro_batch_size_ > 0 ? std::min(micro_batch_size_, n) : n;
  if (micro_cap_ > 0) m = std::min(m, micro_cap_);
  return std::max<int64_t>(m, 1);
}

// ---------------------------------------------------------------- the loop

void Learner::reset_batch_state() {
  x_ = torch::Tensor();
  y_ = torch::Tensor();
  pred_ = torch::Tensor();
  loss_ = torch::Tensor();
  loss_scale_ = 1.0;
  micro_index_ = 0;
  micro_count_ = 1;
  micro_weight_ = 1.0;
  batch_weight_ = 1.0;
  skip_step_ = false;
  skip_batch_ = false;
}

void Learner::fit(int64_t epochs) {
  Stage s;
  s.name = "fit";
  s.epochs = epochs;
  fit(std::vector<Stage>{s});
}

void Learner::fit(const std::vector<Stage>& stages) {
  live();
  if (stages.empty()) throw_usage_error("fit: no stages");
  // Everything checkable is checked before any work.
  std::vector<std::string> names;
  for (const auto& np : model_->named_parameters()) names.push_back(np.key());
  for (const auto& s : stages) {
    if (s.epochs < 0)
      throw_config_error("stage '" + s.name + "': epochs must be >= 0, got " + std::to_string(s.epochs));
    if (s.image_size < 0)
      throw_config_error("stage '" + s.name + "': image_size must be >= 0, got " +
                         std::to_string(s.image_size));
    for (const auto& prefix : s.freeze) {
      bool hit = std::any_of(names.begin(), names.end(),
                             [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
      if (!hit) {
        std::vector<std::string> blocks;
        for (const auto& c : model_->named_children()) blocks.push_back(c.key());
        std::string list;
        for (const auto& b : blocks) list += (list.empty() ? "" : ", ") + b;
        const std::string near = nearest(prefix, blocks);
        throw_config_error("stage '" + s.name + "': freeze prefix '" + prefix +
                           "' matches no parameter" +
                           (near.empty() ? "" : "; did you mean '" + near + "'?") +
                           " The model's blocks: " + list);
      }
    }
  }

  stages_ = stages;
  stage_stats_.clear();
  iteration_ = steps_ = 0;
  size_t first_stage = 0;
  if (resume_) first_stage = prepare_resume();
  stop_fit_ = stop_epoch_ = false;
  next_ = FitPosition{static_cast<int64_t>(first_stage), 0, 0, global_epoch_, iteration_, steps_};
  memory().clear_records();
  model_->train();

  // The budget holds for the fit only: it is process-wide, and a test or a later fit must not
  // inherit it.
  std::optional<ScopedMemoryBudget> budget;
  if (oom_.budget > 0) budget.emplace(oom_.budget);
  micro_cap_ = oom_count_ = last_micro_batch_ = 0;
  oom_retries_.clear();
  auto_micro_batches_.clear();
  if (memory().budget() > 0 && memory().current() > memory().budget())
    throw OomError("run.memory_budget = " + format_bytes(memory().budget()) +
                   " is less than what the model, the optimizer and the data already hold (" +
                   format_bytes(memory().current()) + " live): raise the budget");

  std::string oom;
  try {
    fire(Event::BeforeFit);
    if (resume_ && first_stage >= stages_.size()) apply_resume();  // the fit had ended
    for (size_t i = first_stage; i < stages_.size() && !stop_fit_; ++i) {
      stage_index_ = static_cast<int64_t>(i);
      run_stage(stages_[i]);
    }
  } catch (const c10::OutOfMemoryError& e) {
    // Out of memory where no retry applies (a callback's hook, validation): the loop's own
    // places throw OomError with more context.
    oom = first_line(e.what_without_backtrace());
  }
  if (!oom.empty()) {
    reset_batch_state();
    ++oom_count_;
    throw OomError("out of memory in event '" + std::string(to_string(event_)) + "' (iteration " +
                   std::to_string(iteration_) + "): " + oom +
                   ". Retries cover the forward and backward of training batches only");
  }
  reset_batch_state();
  next_.done = true;
  fire(Event::AfterFit);
}

void Learner::run_stage(const Stage& s) {
  unfreeze();
  if (!s.freeze.empty()) freeze(s.freeze);
  train_.set_image_size(s.image_size);
  if (valid_) valid_->set_image_size(s.image_size);
  if (s.has_optimizer) set_optimizer(s.optimizer);

  // A resumed stage continues the statistics its checkpoint holds.
  if (static_cast<int64_t>(stage_stats_.size()) <= stage_index_) {
    stage_stats_.emplace_back();
    stage_stats_.back().name = s.name;
  }
  last_probe_ = {};  // a short stage falls back to its own last batch, not the previous stage's

  fire(Event::BeforeStage);
  // The stage's peak is what the stage holds from here: what a before_stage hook released (a
  // purge, an optimizer swap) is not charged to the new stage.
  memory().open_window(kStageWindow);
  if (oom_.auto_micro_batch) {
    auto_micro_batches_.emplace_back(s.name, find_micro_batch());
    // The probe's failed attempts touch the budget: they are not the stage's peak.
    memory().open_window(kStageWindow);
  }
  const int64_t first_epoch = resume_ ? resume_epoch() : 0;
  if (resume_ && first_epoch >= s.epochs) apply_resume();  // only after_stage was left
  for (int64_t e = first_epoch; e < s.epochs && !stop_fit_; ++e) {
    epoch_ = e;
    run_epoch();
  }
  StageStats& st = stage_stats_.back();
  st.peak_bytes = std::max(st.peak_bytes, memory().window_peak(kStageWindow));
  memory().record_stage_peak(s.name, st.peak_bytes);
  next_ = FitPosition{stage_index_ + 1, 0, 0, global_epoch_, iteration_, steps_};
  fire(Event::AfterStage);
}

void Learner::run_epoch() {
  StageStats& st = stage_stats_.back();
  fire(Event::BeforeEpoch);
  train_.set_epoch(global_epoch_++);
  model_->train();
  training_ = true;
  loss_sum_ = torch::zeros({}, torch::TensorOptions().device(device_));
  loss_count_ = 0;
  stop_epoch_ = false;
  num_batches_ = train_.num_batches();

  next_ = FitPosition{stage_index_, epoch_, 0, global_epoch_ - 1, iteration_, steps_};

  fire(Event::BeforeTrain);
  int64_t first = 0;
  bool run = true;
  if (resume_) {
    first = apply_resume();
    run = !stop_epoch_ && !stop_fit_;  // the checkpointed batch had ended the epoch or the fit
  }
  auto t_train = Clock::now();
  for (int64_t i = first; run && i < num_batches_; ++i) {
    batch_index_ = i;
    Batch b;
    bool oom = false;
    std::string message;
    try {
      b = train_.batch(i);
    } catch (const c10::OutOfMemoryError& e) {
      oom = true;
      message = first_line(e.what_without_backtrace());
    }
    if (oom)  // micro-batches cannot help: the loader builds the whole batch
      throw OomError("out of memory loading training batch " + std::to_string(i) + " of " +
                     std::to_string(train_.batch_size()) + " samples: " + message +
                     ". The batch itself must fit: raise run.memory_budget or lower "
                     "data.batch_size");
    train_batch(b);
    ++iteration_;
    if (max_steps_ > 0 && iteration_ >= max_steps_) stop_fit_ = true;
    if (stop_epoch_ || stop_fit_) break;
  }
  st.train_seconds += seconds_since(t_train);
  st.last_epoch_loss = epoch_loss();
  reset_batch_state();
  if (!st.steady_measured && last_probe_.valid) {
    st.steady = last_probe_.breakdown;
    st.steady_measured = true;
  }
  fire(Event::AfterTrain);
  training_ = false;

  if (valid_ && !stop_fit_) st.valid_accuracy = validate();
  next_ = FitPosition{stage_index_, epoch_ + 1, 0, global_epoch_, iteration_, steps_};
  next_.stop_fit = stop_fit_;
  fire(Event::AfterEpoch);
}

void Learner::train_batch(const Batch& b) {
  StageStats& st = stage_stats_.back();
  MemoryMeter& mm = memory();
  reset_batch_state();
  x_ = b.x;
  y_ = b.y;
  const int64_t stage_batch = static_cast<int64_t>(st.step_seconds.size());
  const auto t0 = Clock::now();

  fire(Event::BeforeBatch);
  int64_t live_before_forward = 0, forward_peak = 0, grads = 0;
  if (!skip_batch_) {
    // The batch (as before_batch left it) runs as one or several micro-batches.
    const torch::Tensor bx = x_, by = y_;
    const int64_t n = by.size(0);
    torch::Tensor batch_loss;  // the batch's mean loss, for logging
    live_before_forward = mm.current();
    // Gradients of earlier batches (accumulation): a failed backward cannot be undone then.
    bool grads_at_start = false;
    if (oom_.retry)
      for (const auto& p : model_->parameters()) grads_at_start = grads_at_start || p.grad().defined();
    int64_t begin = 0, failures = 0;
    while (begin < n && !skip_batch_) {
      // The size is taken at each micro-batch: a retry lowers the cap mid-batch.
      const int64_t mbs = effective_micro_batch(n);
      const int64_t len = std::min(mbs, n - begin);
      micro_count_ = micro_index_ + (n - begin + mbs - 1) / mbs;
      x_ = len == n ? bx : bx.narrow(0, begin, len);
      y_ = len == n ? by : by.narrow(0, begin, len);
      micro_weight_ = static_cast<double>(len) / static_cast<double>(n);
      loss_scale_ = 1.0;
      pred_ = torch::Tensor();
      loss_ = torch::Tensor();

      Phase phase = Phase::Forward;
      bool oom = false;
      std::string oom_message;
      try {
        const int64_t live = mm.current();
        mm.open_window(kPhaseWindow);
        fire(Event::BeforeForward);
        pred_ = forward(x_);
        fire(Event::AfterForward);
        loss_ = loss_fn_(pred_, y_);
        fire(Event::AfterLoss);
        const int64_t fpeak = mm.window_peak(kPhaseWindow);
        note_phase_peak(Phase::Forward, fpeak);
        forward_peak = std::max(forward_peak, fpeak - live + live_before_forward);
        if (skip_batch_) break;

        mm.open_window(kPhaseWindow);
        fire(Event::BeforeBackward);
        phase = Phase::Backward;  // from here gradients may hold part of this micro-batch
        backward();
        fire(Event::AfterBackward);
        note_phase_peak(Phase::Backward, mm.window_peak(kPhaseWindow));
      } catch (const c10::OutOfMemoryError& e) {
        // Only noted here: the recovery allocates and frees, which waits for the exception
        // object (and whatever it holds) to be gone.
        oom = true;
        oom_message = first_line(e.what_without_backtrace());
      }
      if (oom) {
        recover_from_oom(phase, mbs, n, grads_at_start, ++failures, oom_message);
        if (phase == Phase::Backward) {
          begin = 0;  // recover_from_oom dropped the batch's gradients
          micro_index_ = 0;
          batch_loss = torch::Tensor();
        }
        continue;
      }
      torch::Tensor weighted = loss_.detach().to(torch::kFloat) * micro_weight_;
      batch_loss = batch_loss.defined() ? batch_loss + weighted : weighted;
      begin += len;
      ++micro_index_;
      last_micro_batch_ = mbs;
    }
    micro_index_ = std::max<int64_t>(0, std::min(micro_index_, micro_count_ - 1));
    x_ = bx;
    y_ = by;
    if (batch_loss.defined()) loss_ = batch_loss;  // the batch's loss, as one pass would give it
    if (!st.steady_measured) grads = gradient_bytes(*model_);  // only the probe below needs it
  }
  if (!skip_batch_) {
    mm.open_window(kPhaseWindow);
    fire(Event::BeforeStep);
    if (!skip_step_ && !skip_batch_) {
      bool oom = false;
      std::string message;
      try {
        optimizer_->step();
      } catch (const c10::OutOfMemoryError& e) {
        oom = true;
        message = first_line(e.what_without_backtrace());
      }
      if (oom) {
        ++oom_count_;
        zero_grad();
        throw OomError("out of memory in the optimizer step of batch " +
                       std::to_string(batch_index_) + " (iteration " + std::to_string(iteration_) +
                       "): " + message + ". Smaller micro-batches do not shrink the step (it "
                       "holds the parameters, their gradients and the optimizer's state): raise "
                       "run.memory_budget or use a lighter optimizer");
      }
      zero_grad();
      ++steps_;
      fire(Event::AfterStep);
    }
    note_phase_peak(Phase::Step, mm.window_peak(kPhaseWindow));
  }
  if (loss_.defined()) {
    loss_sum_ += loss_.detach().to(torch::kFloat);
    ++loss_count_;
  }
  complete_batch(b, seconds_since(t0));
  fire(Event::AfterBatch);
  if (!st.steady_measured && !skip_batch_ && forward_peak > 0) {
    // The steady state: fastai's observation is that from the second batch on memory is
    // constant; the stage's third batch (or its last, if shorter) is measured. Nothing is
    // walked once the stage has it.
    MemoryBreakdown m;
    m.parameters = parameter_bytes(*model_);
    m.gradients = grads;
    m.optimizer_state = optimizer_state_bytes(*optimizer_);
    m.activations = std::max<int64_t>(0, forward_peak - live_before_forward);
    m.data = data_bytes();
    m.other = std::max<int64_t>(
        0, live_before_forward - m.parameters - m.optimizer_state - m.data);
    last_probe_ = {true, m};
    if (!st.steady_measured && stage_batch >= 2) {
      st.steady = m;
      st.steady_measured = true;
    }
  }
}

void Learner::recover_from_oom(Phase phase, int64_t mbs, int64_t n, bool grads_at_start,
                               int64_t failures, const std::string& message) {
  ++oom_count_;
  x_ = torch::Tensor();
  y_ = torch::Tensor();
  pred_ = torch::Tensor();
  loss_ = torch::Tensor();
  // A failed backward may have added part of the micro-batch to some gradients: the batch's
  // gradients go, and the batch starts over (the caller resets its position).
  if (phase == Phase::Backward) zero_grad();
  compat::clear_autocast_cache();
  memory().empty_cache();

  const std::string where = std::string(to_string(phase)) + " of batch " +
                            std::to_string(batch_index_) + " (iteration " +
                            std::to_string(iteration_) + ", micro-batch " + std::to_string(mbs) +
                            " of " + std::to_string(n) + " samples)";
  const std::string budget =
      memory().budget() > 0 ? "run.memory_budget = " + format_bytes(memory().budget())
                            : "no run.memory_budget (the device's memory)";
  if (!oom_.retry)
    throw OomError("out of memory in " + where + ": " + message + ". With run.on_oom = "
                   "\"retry\" the batch is retried with smaller micro-batches; or raise " +
                   "run.memory_budget, or lower data.batch_size");
  if (phase == Phase::Backward && grads_at_start)
    throw OomError("out of memory in " + where + ": " + message +
                   ". Gradients of earlier batches were being accumulated into this step "
                   "(grad_accum mode = \"accumulate\"), and a failed backward may have added "
                   "part of the batch to them, so the step cannot be retried exactly. Use "
                   "grad_accum mode = \"split\" (or a larger " + budget + ")");
  if (mbs <= 1)
    throw OomError("out of memory in " + where + " even at micro-batch size 1, with " + budget +
                   ": " + message + ". The model, its gradients and the optimizer's state do "
                   "not fit: raise the budget or use a technique that shrinks them");
  if (failures > oom_.max_retries)
    throw OomError("out of memory in " + where + ": " + std::to_string(failures) +
                   " out-of-memory errors on this batch (run.oom_retries = " +
                   std::to_string(oom_.max_retries) + "), with " + budget + ": " + message);
  const int64_t to = (mbs + 1) / 2;
  micro_cap_ = to;
  if (oom_retries_.size() < kMaxOomRecords)
    oom_retries_.push_back({iteration_, phase, mbs, to, phase == Phase::Backward});
  spdlog::warn("out of memory in {}: retrying with micro-batches of {} ({})", where, to, message);
}

void Learner::note_phase_peak(Phase p, int64_t bytes) {
  memory().record_phase_peak(p, bytes);
  if (!stage_stats_.empty()) {
    auto& v = stage_stats_.back().phase_peaks[static_cast<size_t>(p)];
    v = std::max(v, bytes);
  }
}

int64_t Learner::data_bytes() const {
  return dataset_bytes(live().train_.dataset()) + (valid_ ? dataset_bytes(valid_->dataset()) : 0);
}

double Learner::epoch_loss() const {
  if (loss_count_ == 0 || !loss_sum_.defined()) return 0;
  return loss_sum_.item<double>() / static_cast<double>(loss_count_);
}

double Learner::validate() {
  live();
  if (!valid_) return -1;
  MemoryMeter& mm = memory();
  const bool was_training = model_->is_training();
  model_->eval();
  mm.open_window(kPhaseWindow);
  fire(Event::BeforeValidate);
  torch::Tensor correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kLong).device(device_));
  int64_t total = 0;
  {
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < valid_->num_batches(); ++i) {
      Batch b = valid_->batch(i);
      torch::Tensor p = forward(b.x);
      correct += p.argmax(1).eq(b.y).sum();
      total += b.size();
    }
  }
  valid_accuracy_ = total ? static_cast<double>(correct.item<int64_t>()) / static_cast<double>(total) : 0;
  fire(Event::AfterValidate);
  note_phase_peak(Phase::Validate, mm.window_peak(kPhaseWindow));
  if (was_training) model_->train();
  return valid_accuracy_;
}

torch::Tensor Learner::predict(const torch::Tensor& x) {
  live();
  const bool was_training = model_->is_training();
  model_->eval();
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = forward(x.to(device_));
  }
  if (was_training) model_->train();
  return out;
}

torch::Tensor Learner::predict(const DataLoader& data) {
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i < data.num_batches(); ++i) outs.push_back(predict(data.batch(i).x));
  return outs.empty() ? torch::Tensor() : torch::cat(outs);
}

// ---------------------------------------------------------------- micro-batch probe

namespace {

// What the probe must leave as it found it: the RNG (dropout draws) and the buffers
// (BatchNorm's running statistics).
struct RunState {
  RngState rng;
  std::vector<torch::Tensor> buffers;

  RunState(torch::nn::Module& m, const torch::Device& d) : rng(RngState::capture(d)) {
    torch::NoGradGuard g;
    for (const auto& b : m.buffers()) buffers.push_back(b.clone());
  }
  void restore(torch::nn::Module& m) {
    rng.restore();
    torch::NoGradGuard g;
    auto bs = m.buffers();
    for (size_t i = 0; i < bs.size() && i < buffers.size(); ++i) bs[i].copy_(buffers[i]);
  }
};

}  // namespace

Learner::ProbeResult Learner::probe_micro_batch(const Batch& b, int64_t m) {
  MemoryMeter& mm = memory();
  const int64_t n = b.size();
  // Two micro-batches when the batch splits: from the second on, gradients are held while
  // the next backward runs, which the first does not show.
  const int64_t passes = m < n ? 2 : 1;
  ProbeResult r;
  mm.open_window(kPhaseWindow);
  try {
    for (int64_t k = 0; k < passes; ++k) {
      const int64_t begin = k * m, len = std::min(m, n - begin);
      torch::Tensor pred = forward(b.x.narrow(0, begin, len));
      torch::Tensor loss = loss_fn_(pred, b.y.narrow(0, begin, len));
      (loss * (static_cast<double>(len) / static_cast<double>(n))).backward();
    }
    r.after_backward = mm.current();
  } catch (const c10::OutOfMemoryError&) {
    r.oom = true;
  }
  r.peak = mm.window_peak(kPhaseWindow);
  zero_grad();
  compat::clear_autocast_cache();
  mm.empty_cache();
  return r;
}

int64_t Learner::find_micro_batch() {
  live();
  MemoryMeter& mm = memory();
  const int64_t budget = mm.budget();
  if (budget <= 0)
    throw_usage_error("find_micro_batch needs a memory budget (run.memory_budget, "
                      "OomPolicy::budget or MemoryMeter::set_budget)");
  if (train_.num_batches() == 0) return 0;
  const Batch b = train_.batch(0);
  const int64_t n = b.size();

  // The probe runs as a training forward would (train mode, training() true for the forward
  // wrappers) and leaves no trace: gradients held before are set aside, RNG and buffers restored.
  std::vector<torch::Tensor> held_grads;
  for (auto& p : model_->parameters()) {
    held_grads.push_back(p.grad());
    p.mutable_grad().reset();
  }
  RunState state(*model_, device_);
  const bool was_training = training_, module_training = model_->is_training();
  training_ = true;
  model_->train();
  const StepNeeds needs = optimizer_step_needs(*model_, *optimizer_, optimizer_options_);
  // Slack for the loop's own scalars (the logged loss and its sums: a few bytes).
  constexpr int64_t kSlack = 256;
  std::map<int64_t, bool> tried;
  auto fits = [&](int64_t m) {
    auto it = tried.find(m);
    if (it != tried.end()) return it->second;
    const ProbeResult r = probe_micro_batch(b, m);
    const bool ok = !r.oom && r.peak + needs.state + kSlack <= budget &&
                    r.after_backward + needs.state + needs.temporaries + kSlack <= budget;
    tried[m] = ok;
    return ok;
  };
  auto restore = [&] {
    state.restore(*model_);
    auto ps = model_->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = held_grads[i];
    training_ = was_training;
    if (!module_training) model_->eval();
  };

  // From the batch's own split (grad_accum's, or the whole batch) down by halves, then a
  // binary search between the largest size that fits and the smallest that did not.
  const int64_t start = micro_batch_size_ > 0 ? std::min(micro_batch_size_, n) : n;
  int64_t lo = 0, hi = start + 1;  // lo fits (0: none yet), hi does not
  try {
    for (int64_t m = start; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) {
      if (fits(m)) {
        lo = m;
        break;
      }
      hi = m;
    }
    while (lo > 0 && hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (fits(mid) ? lo : hi) = mid;
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
  if (lo == 0)
    throw OomError("run.micro_batch = \"auto\": not even 1 sample fits run.memory_budget = " +
                   format_bytes(budget) + " (" + format_bytes(mm.current()) +
                   " live before the probe, " + format_bytes(needs.state) +
                   " for the optimizer's state): raise the budget");
  micro_cap_ = lo < start ? lo : 0;
  spdlog::info("micro_batch = auto: {} of {} samples fit run.memory_budget = {} ({} probes)", lo,
               n, format_bytes(budget), tried.size());
  return lo;
}

// ---------------------------------------------------------------- model management

void Learner::freeze(const std::vector<std::string>& prefixes) {
  for (auto& np : live().model_->named_parameters()) {
    for (const auto& prefix : prefixes) {
      if (np.key().rfind(prefix, 0) == 0) {
        np.value().set_requires_grad(false);
        np.value().mutable_grad().reset();
        break;
      }
    }
  }
}

void Learner::unfreeze() {
  for (auto& p : live().model_->parameters()) p.set_requires_grad(true);
}

std::vector<std::string> Learner::frozen() const {
  std::vector<std::string> out;
  for (const auto& np : live().model_->named_parameters())
    if (!np.value().requires_grad()) out.push_back(np.key());
  return out;
}

void Learner::save(const std::string& path, bool with_opt) {
  live();
  torch::serialize::OutputArchive archive;
  archive.write("frugal.format", c10::IValue(int64_t{1}));
  torch::serialize::OutputArchive model_archive;
  model_->save(model_archive);
  archive.write("model", model_archive);
  if (with_opt) {
    torch::serialize::OutputArchive opt_archive;
    optimizer_->save(opt_archive);
    archive.write("optimizer", opt_archive);
    archive.write("optimizer.name", c10::IValue(optimizer_options_.name));
  }
  write_archive(archive, path);
}

void Learner::load(const std::string& path, bool with_opt) {
  live();
  torch::serialize::InputArchive archive;
  open_archive(path, device_, archive);
  load_model(*model_, archive, path);
  if (!with_opt) return;
  torch::serialize::InputArchive opt_archive;
  if (!archive.try_read("optimizer", opt_archive))
    throw CheckpointError("checkpoint '" + path +
                          "' was saved without optimizer state; load it with with_opt = false");
  c10::IValue name;
  if (archive.try_read("optimizer.name", name) && name.isString() &&
      name.toStringRef() != optimizer_options_.name)
    throw CheckpointError("checkpoint '" + path + "' holds the state of optimizer '" +
                          name.toStringRef() + "', this learner uses '" + optimizer_options_.name +
                          "'; load it with with_opt = false");
  try {
    optimizer_->load(opt_archive);
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint '" + path + "': optimizer state does not fit: " +
                          first_line(e.what_without_backtrace()));
  }
}

// ---------------------------------------------------------------- checkpoint and resume

void Learner::complete_batch(const Batch& b, double seconds) {
  StageStats& st = stage_stats_.back();
  st.step_seconds.push_back(seconds);
  st.samples += b.size();
  next_.batch = batch_index_ + 1;
  next_.iteration = iteration_ + 1;
  next_.steps = steps_;
}

FitPosition Learner::position() const {
  FitPosition p = next_;
  if (training_) {
    // A batch that failed after its optimizer step counts as done: replaying it would step
    // twice.
    if (steps_ > p.steps) {
      p.batch = batch_index_ + 1;
      p.iteration = iteration_ + 1;
      p.steps = steps_;
    }
    p.stop_epoch = stop_epoch_;
    p.stop_fit = stop_fit_;
  } else if (stop_fit_) {
    p.done = true;  // between epochs or stages: nothing of a stopped fit is left
  }
  return p;
}

void Learner::save_checkpoint(const std::string& path, const nlohmann::json& info) {
  live();
  using nlohmann::json;
  const FitPosition p = position();
  json record;
  record["position"] = {{"stage", p.stage},         {"epoch", p.epoch},
                        {"batch", p.batch},         {"data_epoch", p.data_epoch},
                        {"iteration", p.iteration}, {"steps", p.steps},
                        {"stop_epoch", p.stop_epoch}, {"stop_fit", p.stop_fit},
                        {"done", p.done}};
  json stage_names = json::array(), stats = json::array(), callback_names = json::array();
  for (const auto& s : stages_) stage_names.push_back(s.name);
  for (const auto& s : stage_stats_) stats.push_back(stats_to_json(s));
  for (const auto& c : callbacks_) callback_names.push_back(c->name());
  record["stages"] = stage_names;
  record["stats"] = stats;
  record["callbacks"] = callback_names;
  record["optimizer"] = optimizer_options_.name;
  // The running loss belongs to the position's epoch only while it trains; between epochs it
  // is the finished epoch's.
  record["loss_count"] = training_ ? loss_count_ : 0;
  record["valid_accuracy"] = valid_accuracy_;
  record["info"] = info;

  torch::serialize::OutputArchive archive;
  archive.write("frugal.format", c10::IValue(int64_t{1}));
  archive.write("frugal.resume", c10::IValue(record.dump()));
  torch::serialize::OutputArchive model_archive;
  model_->save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive opt_archive;
  optimizer_->save(opt_archive);
  archive.write("optimizer", opt_archive);
  archive.write("optimizer.name", c10::IValue(optimizer_options_.name));
  for (const auto& c : callbacks_) {
    torch::serialize::OutputArchive sub;
    try {
      c->save_state(sub);
    } catch (const c10::Error& e) {
      throw CallbackError(c->name(), "save_state", e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw CallbackError(c->name(), "save_state", e.what());
    }
    archive.write("callbacks." + c->name(), sub);
  }
  if (training_ && loss_sum_.defined()) archive.write("loss_sum", loss_sum_);
  {
    at::Generator gen = cpu_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng.cpu", gen.get_state());
  }
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) {
    at::Generator gen = at::globalContext().defaultGenerator(device_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng.cuda", gen.get_state());
  }
#endif
  write_archive(archive, path);
}

nlohmann::json Learner::read_checkpoint(const std::string& path) {
  torch::serialize::InputArchive archive;
  open_archive(path, torch::kCPU, archive);
  return read_resume_record(archive, path);
}

nlohmann::json Learner::load_checkpoint(const std::string& path) {
  live();
  auto r = std::make_unique<PendingResume>();
  r->path = path;
  open_archive(path, device_, r->archive);
  r->record = read_resume_record(r->archive, path);
  const auto& p = r->record["position"];
  r->position = FitPosition{p["stage"].get<int64_t>(),      p["epoch"].get<int64_t>(),
                            p["batch"].get<int64_t>(),      p["data_epoch"].get<int64_t>(),
                            p["iteration"].get<int64_t>(),  p["steps"].get<int64_t>(),
                            p["stop_epoch"].get<bool>(),    p["stop_fit"].get<bool>(),
                            p["done"].get<bool>()};
  load_model(*model_, r->archive, path);
  nlohmann::json info = r->record["info"];
  resume_ = std::move(r);
  return info;
}

std::optional<FitPosition> Learner::pending_resume() const {
  if (!resume_) return std::nullopt;
  return resume_->position;
}

// Before before_fit: the stages must be the checkpoint's; counters and statistics continue.
size_t Learner::prepare_resume() {
  const PendingResume& r = *resume_;
  const auto saved = r.record["stages"].get<std::vector<std::string>>();
  std::vector<std::string> now;
  for (const auto& s : stages_) now.push_back(s.name);
  auto list = [](const std::vector<std::string>& v) {
    std::string out;
    for (const auto& n : v) out += (out.empty() ? "" : ", ") + n;
    return "[" + out + "]";
  };
  if (saved != now)
    throw CheckpointError("checkpoint '" + r.path + "' was saved by a fit with stages " +
                          list(saved) + "; this fit has " + list(now) +
                          ": resume with the same stages");
  const FitPosition& p = r.position;
  std::vector<StageStats> stats;
  try {
    for (const auto& j : r.record["stats"]) stats.push_back(stats_from_json(j));
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError("checkpoint '" + r.path + "' has damaged stage statistics: " + e.what());
  }
  const size_t first = p.done ? stages_.size() : static_cast<size_t>(p.stage);
  if (first > stages_.size() || stats.size() > stages_.size() ||
      (!p.done && stats.size() < first))
    throw CheckpointError("checkpoint '" + r.path + "' has an impossible position (stage " +
                          std::to_string(p.stage) + " of " + std::to_string(stages_.size()) + ")");
  // The optimizer of the last stage before the position that set its own (the resumed stage
  // sets its own again in run_stage).
  for (size_t i = std::min(first + 1, stages_.size()); i-- > 0;) {
    if (stages_[i].has_optimizer) {
      set_optimizer(stages_[i].optimizer);
      break;
    }
  }
  stage_stats_ = std::move(stats);
  iteration_ = p.iteration;
  steps_ = p.steps;
  global_epoch_ = p.data_epoch;
  valid_accuracy_ = number(r.record, "valid_accuracy");
  if (std::isnan(valid_accuracy_)) valid_accuracy_ = -1;
  return first;
}

int64_t Learner::resume_epoch() const {
  return resume_->position.stage == stage_index_ ? resume_->position.epoch : 0;
}

// At the resumed position, after its before_* events: callbacks, optimizer, running loss,
// flags and, last, the random generators. Returns the batch to continue with.
int64_t Learner::apply_resume() {
  std::unique_ptr<PendingResume> r = std::move(resume_);
  const std::string& path = r->path;
  const FitPosition& p = r->position;
  for (const auto& name : r->record["callbacks"].get<std::vector<std::string>>()) {
    const bool present = std::any_of(callbacks_.begin(), callbacks_.end(),
                                     [&](const auto& c) { return c->name() == name; });
    torch::serialize::InputArchive sub;
    if (!present && r->archive.try_read("callbacks." + name, sub) && !sub.keys().empty())
      throw CheckpointError("checkpoint '" + path + "' holds the state of callback '" + name +
                            "', which this run does not have (is its plugin configured?)");
  }
  for (auto& c : callbacks_) {
    torch::serialize::InputArchive sub;
    if (!r->archive.try_read("callbacks." + c->name(), sub)) continue;
    try {
      c->load_state(*this, sub);
    } catch (const c10::Error& e) {
      throw CallbackError(c->name(), "load_state", e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw CallbackError(c->name(), "load_state", e.what());
    }
  }
  // A stage with its own optimizer starts it fresh: nothing saved before its start applies.
  const bool fresh_optimizer = !p.done && p.epoch == 0 && p.batch == 0 &&
                               p.stage < static_cast<int64_t>(stages_.size()) &&
                               stages_[static_cast<size_t>(p.stage)].has_optimizer;
  const std::string saved_opt = r->record["optimizer"].get<std::string>();
  if (!fresh_optimizer && saved_opt != optimizer_options_.name)
    throw CheckpointError("checkpoint '" + path + "' holds the state of optimizer '" + saved_opt +
                          "', this run uses '" + optimizer_options_.name + "' at that point");
  torch::serialize::InputArchive opt_archive;
  if (!r->archive.try_read("optimizer", opt_archive))
    throw CheckpointError("checkpoint '" + path + "' has no optimizer state");
  if (!fresh_optimizer) {
    try {
      optimizer_->load(opt_archive);
    } catch (const c10::Error& e) {
      throw CheckpointError("checkpoint '" + path + "': optimizer state does not fit: " +
                            first_line(e.what_without_backtrace()));
    }
  }
  if (training_ && p.batch > num_batches_)
    throw CheckpointError("checkpoint '" + path + "' stopped at batch " + std::to_string(p.batch) +
                          " of an epoch that now has " + std::to_string(num_batches_) +
                          ": the data changed");
  torch::Tensor sum;
  loss_sum_ = r->archive.try_read("loss_sum", sum) && training_
                  ? sum.to(device_)
                  : torch::zeros({}, torch::TensorOptions().device(device_));
  loss_count_ = training_ ? r->record["loss_count"].get<int64_t>() : 0;
  stop_epoch_ = p.stop_epoch;
  stop_fit_ = p.stop_fit || p.done || (max_steps_ > 0 && iteration_ >= max_steps_);
  torch::Tensor state;
  if (r->archive.try_read("rng.cpu", state)) {
    at::Generator gen = cpu_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.to(torch::kCPU));
  }
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda() && r->archive.try_read("rng.cuda", state)) {
    at::Generator gen = at::globalContext().defaultGenerator(device_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.to(torch::kCPU));
  }
#endif
  next_ = p;
  next_.stop_epoch = next_.stop_fit = false;
  return p.batch;
}

int64_t Learner::purge(bool clear_opt) {
  live();
  MemoryMeter& mm = memory();
  const int64_t before = mm.current();
  reset_batch_state();
  loss_sum_ = torch::Tensor();
  loss_count_ = 0;
  zero_grad();
  if (clear_opt) optimizer_->state().clear();
  compat::clear_autocast_cache();
  mm.empty_cache();
  return before - mm.current();
}

void Learner::destroy() {
  if (destroyed_) return;
  callbacks_.clear();
  forward_wrappers_.clear();
  reset_batch_state();
  loss_sum_ = torch::Tensor();
  optimizer_.reset();
  model_ = torch::nn::Sequential(nullptr);
  train_.clear();
  valid_.reset();
  stages_.clear();
  destroyed_ = true;
  compat::clear_autocast_cache();
  memory().empty_cache();
}

// ---------------------------------------------------------------- report

nlohmann::json Learner::report() const {
  using nlohmann::json;
  json stages = json::array();
  int64_t peak = 0;
  double total_seconds = 0;
  int64_t total_samples = 0;
  std::vector<double> all_steps;
  for (const auto& s : stage_stats_) {
    json phases;
    for (Phase p : kAllPhases) phases[std::string(to_string(p))] = s.phase_peaks[static_cast<size_t>(p)];

    // Warm-up: the first batches of a stage allocate caches; they are left out of the times.
    const size_t warm = std::min(static_cast<size_t>(warmup_batches_), s.step_seconds.size());
    std::vector<double> steady(s.step_seconds.begin() + static_cast<std::ptrdiff_t>(warm),
                               s.step_seconds.end());
    if (steady.empty()) steady = s.step_seconds;
    all_steps.insert(all_steps.end(), steady.begin(), steady.end());
    json j = {{"name", s.name},
              {"peak_bytes", s.peak_bytes},
              {"phase_peaks", phases},
              {"steady", s.steady},
              {"batches", s.step_seconds.size()},
              {"samples", s.samples},
              {"train_seconds", s.train_seconds},
              {"samples_per_second", s.train_seconds > 0 ? s.samples / s.train_seconds : 0.0},
              {"step_seconds", {{"median", percentile(steady, 0.5)},
                                {"p10", percentile(steady, 0.1)},
                                {"p90", percentile(steady, 0.9)}}},
              {"loss", s.last_epoch_loss}};
    if (s.valid_accuracy >= 0) j["valid_accuracy"] = s.valid_accuracy;
    stages.push_back(j);
    peak = std::max(peak, s.peak_bytes);
    total_seconds += s.train_seconds;
    total_samples += s.samples;
  }
  json phases;
  const auto& pp = MemoryMeter::get().phase_peaks();
  for (Phase p : kAllPhases) phases[std::string(to_string(p))] = pp[static_cast<size_t>(p)];
  json out = {{"stages", stages},
              {"peak_bytes", peak},
              {"phase_peaks", phases},
              {"iterations", iteration_},
              {"optimizer_steps", steps_},
              {"train_seconds", total_seconds},
              {"samples_per_second", total_seconds > 0 ? total_samples / total_seconds : 0.0},
              {"step_seconds", {{"median", percentile(all_steps, 0.5)},
                                {"p10", percentile(all_steps, 0.1)},
                                {"p90", percentile(all_steps, 0.9)}}},
              {"final_loss", stage_stats_.empty() ? 0.0 : stage_stats_.back().last_epoch_loss}};
  if (valid_accuracy_ >= 0) out["valid_accuracy"] = valid_accuracy_;
  if (oom_.budget > 0 || oom_.retry || oom_.auto_micro_batch || oom_count_ > 0) {
    json retries = json::array();
    for (const auto& r : oom_retries_)
      retries.push_back({{"iteration", r.iteration}, {"phase", std::string(to_string(r.phase))},
                         {"from", r.from}, {"to", r.to}, {"restarted", r.restarted}});
    json autos = json::array();
    for (const auto& [stage, m] : auto_micro_batches_)
      autos.push_back({{"stage", stage}, {"micro_batch", m}});
    out["oom"] = {{"budget", oom_.budget},
                  {"on_oom", oom_.retry ? "retry" : "fail"},
                  {"count", oom_count_},
                  {"micro_batch", last_micro_batch_},  // as the last batch ran
                  {"retries", retries},
                  {"auto", autos}};
  }
  return out;
}

}  // namespace frugal
