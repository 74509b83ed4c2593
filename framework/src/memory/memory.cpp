#include "frugal/memory/memory.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <iomanip>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "memory/counting_offloaded.h"
#include "memory/cpu_allocator.h"

#include "frugal/base/compat.h"
#include "frugal/base/error.h"
#include "frugal/base/options.h"

namespace frugal {

std::string_view to_string(Phase p) {
  switch (p) {
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Step: return "step";
    case Phase::Validate: return "validate";
  }
  return "unknown";
}

void to_json(nlohmann::json& j, const MemoryBreakdown& b) {
  j = {{"parameters", b.parameters},   {"gradients", b.gradients},
       {"optimizer_state", b.optimizer_state}, {"activations", b.activations},
       {"data", b.data},               {"callbacks", b.callbacks},
       {"other", b.other},             {"total", b.total()}};
}

namespace {

#ifdef FRUGAL_WITH_CUDA
// The caching allocator has one peak statistic; windows are kept exact by folding that peak
// into every slot before each reset.
struct CudaWindows {
  std::mutex m;
  std::array<int64_t, MemoryMeter::kWindows + 1> stored{};
  void reset_slot(int device, int slot) {
    std::lock_guard<std::mutex> g(m);
    auto s = compat::cuda_stats(device);
    for (auto& v : stored) v = std::max(v, s.allocated_peak);
    compat::cuda_reset_peak(device);
    stored[slot] = s.allocated;
  }
  int64_t peak(int device, int slot) {
    std::lock_guard<std::mutex> g(m);
    return std::max(stored[slot], compat::cuda_stats(device).allocated_peak);
  }
};
CudaWindows& cuda_windows() {
  static CudaWindows w;
  return w;
}
#endif

}  // namespace

// ---- byte accounting of module, gradient and optimizer tensors ----

int64_t parameter_bytes(const torch::nn::Module& m) {
  int64_t total = 0;
  for (const auto& p : m.parameters())
    if (resident(p)) total += static_cast<int64_t>(p.nbytes());
  for (const auto& b : m.buffers()) total += static_cast<int64_t>(b.nbytes());
  return total;
}

namespace {
constexpr size_t kOffloadedDeleters = 8;
std::array<std::atomic<c10::DeleterFnPtr>, kOffloadedDeleters>& offloaded_deleters() {
  static std::array<std::atomic<c10::DeleterFnPtr>, kOffloadedDeleters> d{};
  return d;
}
thread_local bool tl_count_offloaded = false;  // detail::CountingOffloaded
}  // namespace

void register_offloaded_deleter(c10::DeleterFnPtr deleter) {
  if (!deleter) throw UsageError("register_offloaded_deleter: a null deleter");
  for (auto& slot : offloaded_deleters()) {
    c10::DeleterFnPtr seen = nullptr;
    // Filled in order, never emptied: resident() stops at the first empty slot.
    if (slot.compare_exchange_strong(seen, deleter) || seen == deleter) return;
  }
  throw UsageError("register_offloaded_deleter: at most " + std::to_string(kOffloadedDeleters) +
                   " deleters");
}

namespace detail {
CountingOffloaded::CountingOffloaded() : previous_(tl_count_offloaded) { tl_count_offloaded = true; }
CountingOffloaded::~CountingOffloaded() { tl_count_offloaded = previous_; }
}  // namespace detail

bool resident(const torch::Tensor& t) {
  if (!t.defined()) return false;
  if (!t.has_storage() || tl_count_offloaded) return true;
  if (t.storage().nbytes() == 0 && t.numel() > 0) return false;  // freed (zero stage 3's shards)
  const c10::DeleterFnPtr mine = t.storage().data_ptr().get_deleter();
  for (const auto& slot : offloaded_deleters()) {
    const c10::DeleterFnPtr d = slot.load(std::memory_order_acquire);
    if (!d) break;
    if (d == mine) return false;
  }
  return true;
}

int64_t gradient_bytes(const torch::nn::Module& m) {
  int64_t total = 0;
  for (const auto& p : m.parameters())
    if (p.grad().defined()) total += static_cast<int64_t>(p.grad().nbytes());
  return total;
}

// ---- MemoryMeter ----

MemoryMeter& MemoryMeter::get() {
  static auto* m = new MemoryMeter();
  return *m;
}

void MemoryMeter::install() { detail::install_cpu_allocator(); }

bool MemoryMeter::installed() { return detail::cpu_allocator_installed(); }

void MemoryMeter::set_device(const torch::Device& d) {
#ifndef FRUGAL_WITH_CUDA
  if (d.is_cuda())
    throw_usage_error("this frugal was built with a LibTorch without CUDA; use device = \"cpu\"");
#endif
  device_ = d;
}

int64_t MemoryMeter::current() const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return compat::cuda_stats(device_.index() < 0 ? 0 : device_.index()).allocated;
#endif
  return detail::cpu_counters().allocated.load();
}

int64_t MemoryMeter::peak() const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().peak(std::max<int>(device_.index(), 0), kWindows);
#endif
  return detail::cpu_counters().peaks[kWindows].load();
}

static_assert(detail::CpuAllocatorCounters::kSlots == MemoryMeter::kWindows + 1);

void MemoryMeter::reset_peak() {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().reset_slot(std::max<int>(device_.index(), 0), kWindows);
#endif
  auto& c = detail::cpu_counters();
  c.peaks[kWindows] = c.allocated.load();
}

int64_t MemoryMeter::reserved() const { return allocator_stats().reserved; }

AllocatorStats MemoryMeter::allocator_stats() const {
  AllocatorStats out;
  out.allocated = current();
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) {
    auto s = compat::cuda_stats(std::max<int>(device_.index(), 0));
    out.reserved = s.reserved;
    out.reserved_peak = s.reserved_peak;
    return out;
  }
#endif
  auto s = detail::cpu_cache_stats();
  out.reserved = s.reserved;
  out.reserved_peak = s.reserved_peak;
  out.segments = s.segments;
  out.system_allocations = s.system_allocations;
  out.system_frees = s.system_frees;
  out.caching = s.caching;
  return out;
}

int64_t MemoryMeter::allocations() const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return compat::cuda_stats(std::max<int>(device_.index(), 0)).allocations;
#endif
  return detail::cpu_counters().allocations.load();
}

namespace {
// Which window slots are open; a slot's peak lives in the tracker (or CudaWindows).
struct WindowSlots {
  std::mutex m;
  std::array<bool, MemoryMeter::kWindows> open{};
};
WindowSlots& window_slots() {
  static auto* w = new WindowSlots();  // never destroyed: windows may close after main returns
  return *w;
}
}  // namespace

MemoryWindow MemoryMeter::open_window() {
  int slot = -1;
  {
    WindowSlots& w = window_slots();
    std::lock_guard<std::mutex> g(w.m);
    for (int i = 0; i < kWindows && slot < 0; ++i)
      if (!w.open[static_cast<size_t>(i)]) slot = i;
    if (slot < 0)
      throw_usage_error("all " + std::to_string(kWindows) +
                        " memory windows are open: close one (a MemoryWindow gives its slot "
                        "back when destroyed) before opening another");
    w.open[static_cast<size_t>(slot)] = true;
  }
  reset_window(slot);
  return MemoryWindow(slot);
}

void MemoryMeter::reset_window(int slot) {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().reset_slot(std::max<int>(device_.index(), 0), slot);
#endif
  auto& c = detail::cpu_counters();
  c.peaks[static_cast<size_t>(slot)] = c.allocated.load();
}

int64_t MemoryMeter::window_peak(int slot) const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().peak(std::max<int>(device_.index(), 0), slot);
#endif
  return detail::cpu_counters().peaks[static_cast<size_t>(slot)].load();
}

void MemoryMeter::close_window(int slot) {
  WindowSlots& w = window_slots();
  std::lock_guard<std::mutex> g(w.m);
  w.open[static_cast<size_t>(slot)] = false;
}

MemoryWindow& MemoryWindow::operator=(MemoryWindow&& o) noexcept {
  if (this != &o) {
    close();
    slot_ = o.slot_;
    o.slot_ = -1;
  }
  return *this;
}

int64_t MemoryWindow::peak() const {
  if (!is_open()) throw_usage_error("MemoryWindow::peak: the window is closed");
  return MemoryMeter::get().window_peak(slot_);
}

void MemoryWindow::reset() {
  if (!is_open()) throw_usage_error("MemoryWindow::reset: the window is closed");
  MemoryMeter::get().reset_window(slot_);
}

void MemoryWindow::close() noexcept {
  if (!is_open()) return;
  MemoryMeter::get().close_window(slot_);
  slot_ = -1;
}

int64_t MemoryMeter::empty_cache() {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) {
    const int64_t before = reserved();
    compat::cuda_empty_cache();
    return before - reserved();
  }
#endif
  return detail::cpu_empty_cache();
}

void MemoryMeter::set_budget(int64_t bytes) {
  if (bytes < 0) throw_usage_error("memory budget must be >= 0 (0 = none), got " + std::to_string(bytes));
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) {
    compat::cuda_set_memory_budget(bytes, std::max<int>(device_.index(), 0));
    budget_ = bytes;
    return;
  }
#endif
  detail::cpu_counters().budget = bytes;
  budget_ = bytes;
}

int64_t MemoryMeter::refused() const {
  return detail::cpu_counters().refused.load();
}

// ---- formatting ----

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes < 0 ? -bytes : bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream os;
  if (bytes < 0) os << '-';
  if (u == 0)
    os << static_cast<int64_t>(v) << " B";
  else
    os << std::fixed << std::setprecision(v < 10 ? 2 : 1) << v << ' ' << units[u];
  return os.str();
}

int64_t parse_bytes(const std::string& text, const std::string& what) {
  int64_t bytes = 0;
  std::string why = "must be a size such as \"512MiB\" or \"2GiB\", got \"" + text + "\"";
  const bool blank = text.find_first_not_of(" \t\n\r") == std::string::npos;  // ByteSize's 0
  if (!blank && ByteSize::parse(text, bytes, why)) return bytes;
  throw_config_error("'" + what + "' " + why);
}

}  // namespace frugal
