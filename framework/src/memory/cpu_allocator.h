#pragma once
// The caching CPU allocator behind the memory meter (internal to libfrugal).
//
// Shaped like LibTorch's CUDA caching allocator: a request is rounded up to 512 bytes (header
// included); requests up to 1 MiB come from a small pool of 2 MiB segments, larger ones from a
// large pool (20 MiB segments for requests under 10 MiB, else the request rounded up to
// 2 MiB); a free block bigger than the request is split, and a freed block merges with its
// free neighbours. Freed blocks stay cached, so steady-state training asks the system for no
// memory: no mmap/munmap per step, no page faults on reused tensors. empty_cache() returns
// whole free segments to the system.
//
// Live ("allocated") bytes count exactly what tensors asked for, with atomics (no lock); the
// pools take one mutex per allocation and per free. Each block starts with a 64-byte header
// holding its Block*, so a free finds its block from the data pointer alone (no map), and the
// DataPtr's context is the data pointer (raw_allocate works: oneDNN's bfloat16 path uses it).
//
// FRUGAL_CPU_CACHE=0 in the environment turns caching off (every block is its own segment,
// returned to the system when freed), for comparisons and for memory checkers. Under
// AddressSanitizer cached blocks are poisoned, so a use after free is still reported.
#include <array>
#include <atomic>
#include <cstdint>

namespace frugal::detail {

/// The counters the meter reads. Slots [0, kSlots-1) are the meter's windows; the last is the
/// process peak.
struct CpuAllocatorCounters {
  static constexpr int kSlots = 9;
  std::atomic<int64_t> allocated{0};    ///< live bytes, as requested
  std::atomic<int64_t> allocations{0};  ///< allocations served (cache hits included)
  std::atomic<int64_t> refused{0};      ///< allocations the budget refused
  std::atomic<int64_t> budget{0};       ///< live-byte budget, 0 = none
  std::array<std::atomic<int64_t>, kSlots> peaks{};
};

struct CpuCacheStats {
  int64_t reserved = 0;            ///< bytes of segments held from the system
  int64_t reserved_peak = 0;       ///< highest reserved since the last reset_reserved_peak()
  int64_t segments = 0;            ///< segments held now
  int64_t system_allocations = 0;  ///< segments ever asked from the system
  int64_t system_frees = 0;        ///< segments ever given back
  bool caching = true;             ///< false when FRUGAL_CPU_CACHE=0
};

/// Installs the allocator as LibTorch's CPU allocator (priority 100); idempotent.
void install_cpu_allocator();
bool cpu_allocator_installed();
CpuAllocatorCounters& cpu_counters();
CpuCacheStats cpu_cache_stats();
void reset_cpu_reserved_peak();
/// Gives every wholly free segment back to the system; returns the bytes released.
int64_t cpu_empty_cache();

}  // namespace frugal::detail
