#include "frugal/memory.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <nlohmann/json.hpp>

#include "frugal/compat.h"
#include "frugal/error.h"
#include "frugal/options.h"

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
       {"data", b.data},               {"other", b.other},             {"total", b.total()}};
}

namespace {

// ---- the tracking CPU allocator ----
// Live bytes are the sum over a pointer -> size map, kept under one mutex. Peaks are kept
// for the process (slot kWindows) and for each window slot.
struct Tracker {
  std::mutex m;
  std::unordered_map<void*, size_t> sizes;
  int64_t current = 0;
  int64_t allocations = 0;
  std::array<int64_t, MemoryMeter::kWindows + 1> peaks{};  // last = process peak
  int64_t budget = 0;  // 0 = none
  int64_t refused = 0;

  // Counts n bytes as live before they are allocated, so the budget check and the count are
  // one step (two threads cannot both pass the check). False, with the live bytes, when the
  // budget refuses them.
  bool reserve(size_t n, int64_t* live, int64_t* limit) {
    std::lock_guard<std::mutex> g(m);
    if (budget > 0 && current + static_cast<int64_t>(n) > budget) {
      ++refused;
      *live = current;
      *limit = budget;
      return false;
    }
    current += static_cast<int64_t>(n);
    ++allocations;
    for (auto& pk : peaks) pk = std::max(pk, current);
    return true;
  }
  void unreserve(size_t n) {
    std::lock_guard<std::mutex> g(m);
    current -= static_cast<int64_t>(n);
  }
  void commit(void* p, size_t n) {
    std::lock_guard<std::mutex> g(m);
    sizes.emplace(p, n);
  }
  void remove(void* p) {
    std::lock_guard<std::mutex> g(m);
    auto it = sizes.find(p);
    if (it == sizes.end()) return;  // allocated before install by another allocator's path
    current -= static_cast<int64_t>(it->second);
    sizes.erase(it);
  }
};

Tracker& tracker() {
  static auto* t = new Tracker();  // never destroyed: tensors may die after main returns
  return *t;
}

void tracked_delete(void* p) {
  if (!p) return;
  tracker().remove(p);
  c10::free_cpu(p);
}

class TrackingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) FRUGAL_ALLOCATE_CONST override {
    if (n == 0) return {nullptr, nullptr, &tracked_delete, c10::Device(c10::DeviceType::CPU)};
    int64_t live = 0, budget = 0;
    if (!tracker().reserve(n, &live, &budget)) refuse(n, live, budget);
    void* p = nullptr;
    try {
      p = c10::alloc_cpu(n);
    } catch (...) {
      tracker().unreserve(n);
      throw;
    }
    tracker().commit(p, n);
    // The context is the data pointer and raw_deleter() is set: raw_allocate works
    // (oneDNN's bfloat16 kernels call it).
    return {p, p, &tracked_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }
  FRUGAL_ALLOCATOR_COPY_DATA

 private:
  // The message reads like CUDA's caching allocator's, and the type is the one it throws.
  [[noreturn]] static void refuse(size_t n, int64_t live, int64_t budget) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "frugal: out of memory: tried to allocate ",
                     format_bytes(static_cast<int64_t>(n)), "; ", format_bytes(live),
                     " live of budget ", format_bytes(budget), " (run.memory_budget)");
    std::abort();  // unreachable: TORCH_CHECK_WITH(.., false, ..) throws
  }
};

std::once_flag g_install_once;
bool g_installed = false;

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
  for (const auto& p : m.parameters()) total += static_cast<int64_t>(p.nbytes());
  for (const auto& b : m.buffers()) total += static_cast<int64_t>(b.nbytes());
  return total;
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

void MemoryMeter::install() {
  std::call_once(g_install_once, [] {
    static auto* alloc = new TrackingAllocator();
    c10::SetCPUAllocator(alloc, /*priority=*/100);
    g_installed = true;
  });
}

bool MemoryMeter::installed() { return g_installed; }

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
  std::lock_guard<std::mutex> g(tracker().m);
  return tracker().current;
}

int64_t MemoryMeter::peak() const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().peak(std::max<int>(device_.index(), 0), kWindows);
#endif
  std::lock_guard<std::mutex> g(tracker().m);
  return tracker().peaks[kWindows];
}

void MemoryMeter::reset_peak() {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().reset_slot(std::max<int>(device_.index(), 0), kWindows);
#endif
  std::lock_guard<std::mutex> g(tracker().m);
  tracker().peaks[kWindows] = tracker().current;
}

int64_t MemoryMeter::reserved() const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return compat::cuda_stats(std::max<int>(device_.index(), 0)).reserved;
#endif
  return current();
}

int64_t MemoryMeter::allocations() const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return compat::cuda_stats(std::max<int>(device_.index(), 0)).allocations;
#endif
  std::lock_guard<std::mutex> g(tracker().m);
  return tracker().allocations;
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
  std::lock_guard<std::mutex> g(tracker().m);
  tracker().peaks[static_cast<size_t>(slot)] = tracker().current;
}

int64_t MemoryMeter::window_peak(int slot) const {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) return cuda_windows().peak(std::max<int>(device_.index(), 0), slot);
#endif
  std::lock_guard<std::mutex> g(tracker().m);
  return tracker().peaks[static_cast<size_t>(slot)];
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

void MemoryMeter::empty_cache() {
#ifdef FRUGAL_WITH_CUDA
  if (device_.is_cuda()) compat::cuda_empty_cache();
#endif
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
  std::lock_guard<std::mutex> g(tracker().m);
  tracker().budget = bytes;
  budget_ = bytes;
}

int64_t MemoryMeter::refused() const {
  std::lock_guard<std::mutex> g(tracker().m);
  return tracker().refused;
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
