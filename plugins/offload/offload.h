#pragma once
/// offload: the optimizer's state kept in memory-mapped files on disk instead of the process's
/// memory (ZeRO-Infinity's NVMe offload, for the CPU). After each optimizer step, every state
/// tensor not on disk yet (the first step creates them; a resume loads them) is copied into a
/// file-backed shared mapping and the tensor is pointed at it (Tensor::set_, so the optimizer
/// keeps the same tensor and steps it in place, the fused step included). The mapped pages are
/// the page cache's: the kernel writes them back and drops them under pressure, and with
/// drop_pages they leave the process after each step. What the memory budget counts (the
/// allocator's live bytes) no longer holds the state; the disk does.
///
/// `to = "cpu"` is the same cure for a CUDA run (host_step.h): the optimizer steps host copies
/// of the parameters, its state in pinned host memory.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

#include "host_step.h"

namespace frugal::offload {

/// What one move_to_disk did.
struct Moved {
  int64_t tensors = 0;
  int64_t bytes = 0;
};

/// Moves the CPU tensors of `ts` whose bytes are not in a packed segment yet (in memory, or each
/// in a scratch segment of its own: what a redirected step allocated) into one new segment: a
/// file created in `dir`, its blocks reserved (posix_fallocate: a full disk is an error here,
/// not a SIGBUS at a later page fault), mapped shared and unlinked at once (nothing is left on
/// disk after the last tensor using it dies, or a crash). Each tensor's bytes are copied, then
/// the tensor points at them (contiguous, same sizes and dtype); the segment lives while any
/// of its tensors does. Throws Error naming `dir` when the file cannot be made.
Moved move_to_disk(const std::vector<torch::Tensor>& ts, const std::string& dir);
/// Whether `t`'s bytes live in a segment (packed or scratch).
bool on_disk(const torch::Tensor& t);
/// Whether they live in a packed one (what move_to_disk makes).
bool packed_on_disk(const torch::Tensor& t);
/// Bytes of the segments alive now (on disk, resident or not).
int64_t disk_bytes();
/// Drops every live segment's pages from this process (madvise MADV_DONTNEED: the data stays in
/// the file and the page cache, and comes back on the next touch). Returns the bytes advised.
int64_t drop_pages();

/// The state tensors of one parameter's state, for the built-in optimizers (adam, adamw, sgd,
/// rmsprop, adagrad, adafactor, adam8bit); nullopt for a state type it does not know.
std::optional<std::vector<torch::Tensor>> state_tensors(torch::optim::OptimizerParamState& s);

/// Bytes of an optimizer's state tensors (of the types state_tensors knows), on disk and not.
struct StateBytes {
  int64_t on_disk = 0;
  int64_t in_memory = 0;
};
StateBytes state_bytes(torch::optim::Optimizer& opt);

/// [plugins.offload]: TOML keys are the field names.
struct OffloadOptions : frugal::Options {
  std::string to = "disk";  ///< "disk" (a CPU run); "cpu" (a CUDA run: the step on the host)
  std::string dir;          ///< default "": <run.out_dir>/offload, or the system's temp folder
  bool drop_pages = true;   ///< after each step, the state's pages leave the process
  bool parameters = false;  ///< the parameters this rank steps go to disk too (ZeRO-Infinity's)
  void visit(frugal::FieldVisitor& v) override;
  /// The disk keys (dir, drop_pages, parameters) with to = "cpu": refused, named.
  void check() const override;
};

/// The plugin's callback.
class Offload : public frugal::Callback {
 public:
  Offload(const OffloadOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "offload"; }
  ~Offload() override;
  /// Above every other callback (kProgress + 100): its before_step is the last hook before the
  /// optimizer steps and its after_step the first after, so the redirect of the first step's
  /// allocations (below) covers the step alone.
  int order() const override { return frugal::order::kProgress + 100; }
  /// to = "cpu" steps between before_step and after_step: step_in_backward, which steps inside
  /// backward, conflicts.
  frugal::CallbackRelations relations() const override;
  /// Refuses a device the target is not for (before any fit, so `frugal check` does too):
  /// "disk" is for a CPU run, "cpu" for a CUDA one.
  void attach(frugal::Learner& l) override;

  /// "disk": resolves the folder (created if missing); with `parameters`, the parameters the
  /// optimizer steps (with zero, this rank's share) move to disk. "cpu": the host step starts.
  void before_fit(frugal::Learner& l) override;
  /// "disk", the first step of each optimizer: the step's CPU allocations on this thread (its
  /// new state, and for a non-fused optimizer that step's temporaries) come from segments of
  /// their own, not the allocator's memory, so even that step's peak does not hold the state.
  /// "cpu", every step: the parameters point at their host masters (HostStep::to_host).
  void before_step(frugal::Learner& l) override;
  /// "cpu": the new values go back to the device (HostStep::to_device).
  void after_step(frugal::Learner& l) override;
  /// A stage may unfreeze parameters whose state its first step makes: that step is redirected
  /// too (the micro-batch search reserved nothing for it: Learner::optimizer_state_offloaded).
  void before_stage(frugal::Learner& l) override;
  /// At the end of every batch (a step may have run in it, also one step_in_backward took
  /// inside backward): moves the state created or loaded since (and with `parameters`, a new
  /// optimizer's parameters) to disk; drops the pages.
  void after_batch(frugal::Learner& l) override;
  /// After an out-of-memory error: the redirect ends (the step did not reach after_step); the
  /// parameters that pointed at their host masters point at their device storage again.
  void release_caches(frugal::Learner& l) override;
  /// Logs the tensors and bytes on disk and what stayed in memory.
  void after_fit(frugal::Learner& l) override;

  /// What after_batch moved over the fit, and how many states of a type it does not know it
  /// met (left in memory).
  const Moved& moved() const { return moved_; }
  /// The parameters `parameters = true` moved to disk over the fit.
  const Moved& parameters_moved() const { return parameters_moved_; }
  int64_t unknown_states() const { return unknown_; }
  const std::string& folder() const { return dir_; }
  /// to = "cpu": the host step (null before the fit, and with "disk").
  const HostStep* host_step() const { return host_ ? &*host_ : nullptr; }
  /// A CPU run refuses to = "cpu" (host copies of host memory save nothing). Tests set this to
  /// run that path on the CPU all the same: the same code, plain memory for pinned, copies
  /// that block.
  void allow_host_step_on_cpu() { host_on_cpu_ = true; }

 private:
  OffloadOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  std::string dir_;
  Moved moved_, parameters_moved_;
  int64_t parameters_at_ = -1;  // the optimizer_changes() whose parameters were moved
  int64_t unknown_ = 0;
  int64_t redirected_for_ = -1;  // the optimizer_changes() whose first step was redirected
  std::pair<int64_t, int64_t> scanned_at_{-1, -1};  // steps(), optimizer_changes() at the last scan
  std::optional<HostStep> host_;  // to = "cpu"
  int64_t host_for_ = -1;         // the optimizer_changes() its masters are for
  bool host_on_cpu_ = false;
  bool host() const { return o_.to == "cpu"; }
  void move_parameters(frugal::Learner& l);
  void begin_redirect();
  void end_redirect();
  void back_to_device();
};

}  // namespace frugal::offload
