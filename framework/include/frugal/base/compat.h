#pragma once
/// Every difference between LibTorch 1.13 (Debian) and 2.x lives here.
#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/autocast_mode.h>

#ifdef FRUGAL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

/// True when this LibTorch is at least major.minor.
#define FRUGAL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

/// LibTorch 2.3 made Allocator::allocate non-const and added a pure copy_data.
#if FRUGAL_TORCH_AT_LEAST(2, 3)
#define FRUGAL_ALLOCATE_CONST
#define FRUGAL_ALLOCATOR_COPY_DATA \
  void copy_data(void* dest, const void* src, std::size_t n) const override { \
    default_copy_data(dest, src, n);                                            \
  }
#else
#define FRUGAL_ALLOCATE_CONST const
#define FRUGAL_ALLOCATOR_COPY_DATA
#endif

namespace frugal::compat {

inline const char* torch_version() { return TORCH_VERSION; }

/// Turns autocast on or off for a device type, with the given lower-precision dtype.
inline void set_autocast(c10::DeviceType device, bool enabled, at::ScalarType dtype) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

inline bool autocast_enabled(c10::DeviceType device) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled()
                                        : at::autocast::is_enabled();
#endif
}

/// The lower-precision dtype autocast uses for a device type (CPU or CUDA).
inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
#endif
}

/// Autocast off for a device type while it lives, back as it was after: for a kernel that picks
/// its own dtypes (its backward, run outside autocast, must recompute what its forward did).
class AutocastOff {
 public:
  explicit AutocastOff(c10::DeviceType d) : device_(d), was_(autocast_enabled(d)), dtype_(autocast_dtype(d)) {
    if (was_) set_autocast(d, false, dtype_);
  }
  ~AutocastOff() {
    if (was_) set_autocast(device_, true, dtype_);
  }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  c10::DeviceType device_;
  bool was_;
  at::ScalarType dtype_;
};

/// Drops autocast's cast cache (weights cast to low precision).
inline void clear_autocast_cache() { at::autocast::clear_cache(); }

#ifdef FRUGAL_WITH_CUDA
/// The caching allocator's statistics for `device` (aggregate pool).
struct CudaStats {
  int64_t allocated = 0, allocated_peak = 0, reserved = 0, reserved_peak = 0;
  int64_t active = 0, num_alloc_retries = 0, num_ooms = 0, allocations = 0;
};
inline CudaStats cuda_stats(int device) {
  namespace ca = c10::cuda::CUDACachingAllocator;
  auto s = ca::getDeviceStats(device);
  constexpr size_t agg = 0;  // StatType::AGGREGATE
  CudaStats out;
  out.allocated = s.allocated_bytes[agg].current;
  out.allocated_peak = s.allocated_bytes[agg].peak;
  out.reserved = s.reserved_bytes[agg].current;
  out.reserved_peak = s.reserved_bytes[agg].peak;
  out.active = s.active_bytes[agg].current;
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.allocations = s.allocation[agg].allocated;
  return out;
}
inline void cuda_reset_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
}
inline void cuda_empty_cache() { c10::cuda::CUDACachingAllocator::emptyCache(); }
/// Caps what the caching allocator may reserve on `device` at `bytes` (0 = the whole device):
/// past it, allocations throw c10::OutOfMemoryError.
inline void cuda_set_memory_budget(int64_t bytes, int device) {
  const double total = static_cast<double>(at::cuda::getDeviceProperties(device)->totalGlobalMem);
  const double fraction = bytes > 0 ? std::min(1.0, static_cast<double>(bytes) / total) : 1.0;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device);
}
#endif

/// The key of a parameter's entry in Optimizer::state(): LibTorch 1.13 keys it by the
/// TensorImpl's address as a string; later versions may key it by the address itself.
using OptimizerStateKey =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
template <class Tensor = at::Tensor>  // a template, so the branch not taken is not compiled
OptimizerStateKey optimizer_state_key(const Tensor& p) {
  if constexpr (std::is_same_v<OptimizerStateKey, std::string>)
    return c10::guts::to_string(p.unsafeGetTensorImpl());
  else
    return p.unsafeGetTensorImpl();
}

}  // namespace frugal::compat
