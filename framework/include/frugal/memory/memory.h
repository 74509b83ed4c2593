#pragma once
/// Memory meter: live and peak bytes, per phase and per stage, and the steady state split
/// into parameters, gradients, optimizer state and activations.
///
/// On CPU the meter counts through frugal's caching CPU allocator, installed with
/// c10::SetCPUAllocator: shaped like CUDA's caching allocator (512-byte rounding, a small pool
/// of 2 MiB segments and a large pool, block splitting and merging), so steady-state training
/// asks the system for no memory. Live ("allocated") bytes are exactly what tensors asked for;
/// "reserved" bytes are the segments held, cache included, as on CUDA. FRUGAL_CPU_CACHE=0
/// turns caching off. Tensors allocated before install() are not counted.
/// On CUDA it reads the caching allocator's statistics (allocated, reserved, peaks).
#include <array>
#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>
#include <torch/torch.h>

namespace frugal {

/// Where in a step the bytes were live. Peaks are kept per phase.
enum class Phase { Forward, Backward, Step, Validate };
inline constexpr std::array<Phase, 4> kAllPhases = {Phase::Forward, Phase::Backward, Phase::Step,
                                                    Phase::Validate};
std::string_view to_string(Phase p);

/// Bytes held by each kind of tensor at one moment.
struct MemoryBreakdown {
  int64_t parameters = 0;       ///< parameters and buffers of the model
  int64_t gradients = 0;        ///< .grad of every parameter
  int64_t optimizer_state = 0;  ///< the optimizer's per-parameter state (moments, momentum)
  int64_t activations = 0;      ///< peak bytes the forward pass added over the step's start
  int64_t data = 0;             ///< the datasets held in memory
  int64_t callbacks = 0;        ///< held by callbacks: the sum of their held_bytes() (an EMA)
  int64_t other = 0;            ///< live bytes in none of the categories above (batch, caches)
  int64_t total() const {
    return parameters + gradients + optimizer_state + activations + data + callbacks + other;
  }
};
void to_json(nlohmann::json& j, const MemoryBreakdown& b);

/// Bytes of tensor storage reachable from a module's parameters and buffers, and their grads;
/// parameters that are not resident (a shard another rank holds) count nothing.
int64_t parameter_bytes(const torch::nn::Module& m);
int64_t gradient_bytes(const torch::nn::Module& m);
/// Bytes of the optimizer's state tensors in memory (resident). Declared (and documented) with
/// the optimizer registry in optimizers.h; repeated here for the meter's users.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);

/// Storage whose bytes live outside memory: a plugin that backs tensors by its own means (the
/// offload plugin's memory-mapped files) registers the deleter of their DataPtrs, once. Such
/// tensors are not resident: the meter never counted them, and optimizer_state_bytes, the
/// report's optimizer_state and the micro-batch search leave them out. At most 8 deleters.
void register_offloaded_deleter(c10::DeleterFnPtr deleter);
/// Whether `t`'s bytes are in memory: defined, its storage not freed to 0 bytes (zero stage 3
/// frees the parameters another rank owns between uses) and its deleter not a registered one.
bool resident(const torch::Tensor& t);

/// What the allocator holds besides the live bytes (MemoryMeter::allocator_stats()).
struct AllocatorStats {
  int64_t allocated = 0;           ///< live bytes (== MemoryMeter::current())
  int64_t reserved = 0;            ///< bytes held from the system (live + cached + rounding)
  int64_t reserved_peak = 0;       ///< highest reserved since install (CPU) or reset (CUDA)
  int64_t segments = 0;            ///< CPU: segments held now
  int64_t system_allocations = 0;  ///< CPU: segments ever asked from the system
  int64_t system_frees = 0;        ///< CPU: segments ever given back
  bool caching = true;             ///< CPU: false when FRUGAL_CPU_CACHE=0
};

/// The highest live bytes over a region of the run: a forward, a stage, a check. A handle from
/// MemoryMeter::open_window() holds one of the meter's window slots and gives it back when it
/// is destroyed (or closed). Move-only; a default-constructed window is closed.
///
///   MemoryWindow w = MemoryMeter::get().open_window();
///   ... work ...
///   int64_t peak = w.peak();  // the highest live bytes since open (or the last reset)
class MemoryWindow {
 public:
  MemoryWindow() = default;
  ~MemoryWindow() { close(); }
  MemoryWindow(MemoryWindow&& o) noexcept : slot_(o.slot_) { o.slot_ = -1; }
  MemoryWindow& operator=(MemoryWindow&& o) noexcept;
  MemoryWindow(const MemoryWindow&) = delete;
  MemoryWindow& operator=(const MemoryWindow&) = delete;

  bool is_open() const { return slot_ >= 0; }
  /// The highest live bytes since the window opened or was last reset. Throws UsageError when
  /// closed.
  int64_t peak() const;
  /// Starts the window over: its peak becomes the live bytes now.
  void reset();
  /// Gives the slot back; a closed window stays closed.
  void close() noexcept;

 private:
  friend class MemoryMeter;
  explicit MemoryWindow(int slot) : slot_(slot) {}
  int slot_ = -1;
};

/// Process-wide meter (the allocator is process-wide). Thread-safe.
class MemoryMeter {
 public:
  static MemoryMeter& get();

  /// Installs the tracking CPU allocator; idempotent. Call before creating tensors to count.
  static void install();
  static bool installed();

  /// Chooses which device's bytes current()/peak() report: CPU (tracked) or a CUDA device.
  void set_device(const torch::Device& d);
  const torch::Device& device() const { return device_; }

  /// Live bytes now, and the highest since the last reset_peak().
  int64_t current() const;
  int64_t peak() const;
  void reset_peak();
  /// Bytes the allocator holds from the system or driver: live bytes, cached free blocks and
  /// rounding. >= current().
  int64_t reserved() const;
  AllocatorStats allocator_stats() const;
  /// Allocation count since install (CPU) or the allocator's count (CUDA).
  int64_t allocations() const;

  /// At most this many windows are open at once (the Learner's fit holds two).
  static constexpr int kWindows = 8;
  /// Opens a window (see MemoryWindow) whose peak starts at current(). Throws UsageError when
  /// kWindows are open.
  MemoryWindow open_window();

  /// Gives the allocator's cached free segments back to the system (CUDA's empty_cache, and
  /// the same on CPU); returns the reserved bytes released.
  int64_t empty_cache();

  /// A memory budget in bytes (0 = none). On CPU it bounds the live bytes (what the planner
  /// predicts and the report's peaks show): an allocation that would take them past it throws
  /// c10::OutOfMemoryError, as LibTorch does on CUDA, so out-of-memory handling runs (and is
  /// tested) without a GPU. The CPU cache is given back before a new segment would make the
  /// reserved bytes pass the budget, so reserved stays within it unless live blocks are
  /// fragmented. On CUDA it sets the caching allocator's memory fraction to budget / device
  /// memory (that limit applies to reserved bytes, cache included). Applies to the device chosen
  /// by set_device(); process-wide, like the allocator.
  void set_budget(int64_t bytes);
  int64_t budget() const { return budget_; }
  /// Allocations the CPU budget refused since install.
  int64_t refused() const;

 private:
  friend class MemoryWindow;
  MemoryMeter() = default;
  void reset_window(int slot);
  int64_t window_peak(int slot) const;
  void close_window(int slot);
  torch::Device device_{torch::kCPU};
  int64_t budget_ = 0;
};

/// Sets the meter's budget for a scope and restores the previous one after (budgets are
/// process-wide: a fit, a test, a probe sets one and must not leak it).
class ScopedMemoryBudget {
 public:
  explicit ScopedMemoryBudget(int64_t bytes) : previous_(MemoryMeter::get().budget()) {
    MemoryMeter::get().set_budget(bytes);
  }
  ~ScopedMemoryBudget() {
    try {
      MemoryMeter::get().set_budget(previous_);
    } catch (...) {  // a destructor does not throw; restoring a previous budget cannot fail
    }
  }
  ScopedMemoryBudget(const ScopedMemoryBudget&) = delete;
  ScopedMemoryBudget& operator=(const ScopedMemoryBudget&) = delete;

 private:
  int64_t previous_;
};

/// Formats bytes for people: "1.5 MiB".
std::string format_bytes(int64_t bytes);
/// Parses "512MiB", "2GiB", "1.5GB", "1000" (bytes) as ByteSize does, "" refused; throws
/// ConfigError naming `what`. Options read sizes as ByteSize fields instead.
int64_t parse_bytes(const std::string& text, const std::string& what);

}  // namespace frugal
