#include "memory/cpu_allocator.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "frugal/base/compat.h"
#include "frugal/memory/memory.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define FRUGAL_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define FRUGAL_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define FRUGAL_POISON(p, n) ((void)(p), (void)(n))
#define FRUGAL_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace frugal::detail {
namespace {

constexpr size_t kHeader = 64;               // c10's CPU alignment; holds the Block*
constexpr size_t kRound = 512;               // every block is a multiple of this
constexpr size_t kSmallSize = 1 << 20;       // blocks up to 1 MiB come from the small pool
constexpr size_t kSmallSegment = 2 << 20;    // small pool segments
constexpr size_t kLargeSegment = 20 << 20;   // large pool segment for requests under 10 MiB
constexpr size_t kMinLargeAlloc = 10 << 20;  // from here a segment is the request rounded...
constexpr size_t kRoundLarge = 2 << 20;      // ...up to 2 MiB
constexpr size_t kMinLargeSplit = 1 << 20;   // a large block splits when 1 MiB would remain

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct Block {
  char* ptr;            // the block's first byte (its header)
  size_t size;          // bytes, header included
  size_t requested = 0;  // bytes the tensor asked for, while allocated
  bool small;
  bool allocated = false;
  Block* prev = nullptr;  // neighbours in the same segment
  Block* next = nullptr;
  Block(char* p, size_t s, bool sm) : ptr(p), size(s), small(sm) {}
  char* data() const { return ptr + kHeader; }
  bool whole_segment() const { return prev == nullptr && next == nullptr; }
};

struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};

void write_header(Block* b) {
  FRUGAL_UNPOISON(b->ptr, kHeader);
  std::memcpy(b->ptr, &b, sizeof(b));
}
Block* read_header(void* data) {
  Block* b = nullptr;
  std::memcpy(&b, static_cast<char*>(data) - kHeader, sizeof(b));
  return b;
}

class Cache {
 public:
  Cache() {
    const char* env = std::getenv("FRUGAL_CPU_CACHE");
    caching_ = !(env && std::string(env) == "0");
  }

  void* allocate(size_t n) {
    const size_t size = round_up(n + kHeader, kRound);
    const bool small = size <= kSmallSize;
    std::lock_guard<std::mutex> g(m_);
    Block* b = take_free(size, small);
    if (b == nullptr) b = new_segment(size, small);
    split(b, size);
    b->allocated = true;
    b->requested = n;
    FRUGAL_UNPOISON(b->data(), n);
    return b->data();
  }

  void free(void* data) {
    std::lock_guard<std::mutex> g(m_);
    Block* b = read_header(data);
    b->allocated = false;
    FRUGAL_POISON(b->data(), b->size - kHeader);
    b = merge(b, b->prev);
    b = merge(b, b->next);
    if (!caching_ && b->whole_segment()) return release(b);
    pool(b->small).insert(b);
  }

  int64_t empty() {
    std::lock_guard<std::mutex> g(m_);
    return release_free_segments();
  }

  CpuCacheStats stats() {
    std::lock_guard<std::mutex> g(m_);
    CpuCacheStats s = stats_;
    s.caching = caching_;
    return s;
  }
  void reset_reserved_peak() {
    std::lock_guard<std::mutex> g(m_);
    stats_.reserved_peak = stats_.reserved;
  }

 private:
  std::set<Block*, BySize>& pool(bool small) { return small ? small_ : large_; }

  // The smallest free block of the pool that holds `size` bytes, taken out of the pool.
  Block* take_free(size_t size, bool small) {
    auto& p = pool(small);
    Block key(nullptr, size, small);
    auto it = p.lower_bound(&key);
    if (it == p.end()) return nullptr;
    Block* b = *it;
    p.erase(it);
    return b;
  }

  Block* new_segment(size_t size, bool small) {
    size_t bytes = size;
    if (caching_) bytes = small ? kSmallSegment : size < kMinLargeAlloc ? kLargeSegment : round_up(size, kRoundLarge);
    // The budget bounds live bytes; the cache is given back before it would make the process
    // hold more than the budget, and a segment that would still pass it is cut to the request.
    const int64_t budget = cpu_counters().budget.load(std::memory_order_relaxed);
    if (budget > 0 && stats_.reserved + static_cast<int64_t>(bytes) > budget) {
      release_free_segments();
      if (stats_.reserved + static_cast<int64_t>(bytes) > budget) bytes = size;
    }
    char* p = nullptr;
    try {
      p = static_cast<char*>(c10::alloc_cpu(bytes));
    } catch (...) {  // the system said no: give back what is cached, then ask once more
      if (release_free_segments() == 0) throw;
      p = static_cast<char*>(c10::alloc_cpu(bytes));
    }
    FRUGAL_POISON(p, bytes);
    auto* b = new Block(p, bytes, small);
    write_header(b);
    stats_.reserved += static_cast<int64_t>(bytes);
    stats_.reserved_peak = std::max(stats_.reserved_peak, stats_.reserved);
    ++stats_.segments;
    ++stats_.system_allocations;
    return b;
  }

  // Cuts b to `size` when enough remains to be worth a block; the rest goes back to the pool.
  void split(Block* b, size_t size) {
    const size_t rest = b->size - size;
    if (rest < (b->small ? kRound : kMinLargeSplit) || !caching_) return;
    auto* r = new Block(b->ptr + size, rest, b->small);
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = size;
    write_header(r);
    pool(r->small).insert(r);
  }

  // Joins the free neighbour n into b (or b into n); returns the surviving block.
  Block* merge(Block* b, Block* n) {
    if (n == nullptr || n->allocated) return b;
    pool(n->small).erase(n);
    Block* first = n == b->prev ? n : b;
    Block* second = first == b ? n : b;
    first->size += second->size;
    first->next = second->next;
    if (second->next) second->next->prev = first;
    FRUGAL_POISON(second->ptr, kHeader);
    delete second;
    write_header(first);
    return first;
  }

  void release(Block* b) {
    stats_.reserved -= static_cast<int64_t>(b->size);
    --stats_.segments;
    ++stats_.system_frees;
    FRUGAL_UNPOISON(b->ptr, b->size);
    c10::free_cpu(b->ptr);
    delete b;
  }

  int64_t release_free_segments() {
    int64_t released = 0;
    for (auto* p : {&small_, &large_}) {
      for (auto it = p->begin(); it != p->end();) {
        Block* b = *it;
        if (!b->whole_segment()) {
          ++it;
          continue;
        }
        it = p->erase(it);
        released += static_cast<int64_t>(b->size);
        release(b);
      }
    }
    return released;
  }

  std::mutex m_;
  std::set<Block*, BySize> small_, large_;
  CpuCacheStats stats_;
  bool caching_ = true;
};

Cache& cache() {
  static auto* c = new Cache();  // never destroyed: tensors may die after main returns
  return *c;
}

void raise_peaks(int64_t live) {
  for (auto& pk : cpu_counters().peaks) {
    int64_t seen = pk.load(std::memory_order_relaxed);
    while (seen < live && !pk.compare_exchange_weak(seen, live, std::memory_order_relaxed)) {
    }
  }
}

[[noreturn]] void refuse(int64_t bytes, int64_t live, int64_t budget) {
  // The message reads like CUDA's caching allocator's, and the type is the one it throws.
  TORCH_CHECK_WITH(OutOfMemoryError, false, "frugal: out of memory: tried to allocate ",
                   format_bytes(bytes), "; ", format_bytes(live), " live",
                   budget > 0 ? " of budget " + format_bytes(budget) + " (run.memory_budget)" : "");
  std::abort();  // unreachable: TORCH_CHECK_WITH(.., false, ..) throws
}

// Counts n bytes as live before they are allocated, so the budget check and the count are one
// step (two threads cannot both pass the check). Returns the live bytes with them.
int64_t count_or_refuse(size_t n) {
  auto& c = cpu_counters();
  // No size near the address space's: the rounding below would wrap (c10 refuses these too).
  constexpr size_t kMost = static_cast<size_t>(PTRDIFF_MAX) / 2;
  if (n > kMost) refuse(static_cast<int64_t>(kMost), c.allocated.load(), c.budget.load());
  const auto bytes = static_cast<int64_t>(n);
  int64_t live = c.allocated.load(std::memory_order_relaxed);
  int64_t next = 0;
  do {
    const int64_t budget = c.budget.load(std::memory_order_relaxed);
    if (budget > 0 && live + bytes > budget) {
      c.refused.fetch_add(1, std::memory_order_relaxed);
      refuse(bytes, live, budget);
    }
    next = live + bytes;
  } while (!c.allocated.compare_exchange_weak(live, next, std::memory_order_relaxed));
  return next;
}

// Only pointers this allocator served come here (their DataPtr carries this deleter; raw
// pointers reach raw_deleter only from raw_allocate after install()).
void cached_delete(void* data) {
  if (data == nullptr) return;
  const auto n = static_cast<int64_t>(read_header(data)->requested);
  cpu_counters().allocated.fetch_sub(n, std::memory_order_relaxed);  // first: live, not cached
  cache().free(data);
}

class CachingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) FRUGAL_ALLOCATE_CONST override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &cached_delete, cpu};
    const int64_t live = count_or_refuse(n);
    void* p = nullptr;
    try {
      p = cache().allocate(n);
    } catch (...) {
      cpu_counters().allocated.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
      throw;
    }
    cpu_counters().allocations.fetch_add(1, std::memory_order_relaxed);
    raise_peaks(live);  // only bytes that exist reach a peak
    return {p, p, &cached_delete, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &cached_delete; }
  FRUGAL_ALLOCATOR_COPY_DATA
};

std::once_flag g_once;
std::atomic<bool> g_installed{false};

}  // namespace

void install_cpu_allocator() {
  std::call_once(g_once, [] {
    static auto* alloc = new CachingCpuAllocator();
    c10::SetCPUAllocator(alloc, /*priority=*/100);
    g_installed = true;
  });
}
bool cpu_allocator_installed() { return g_installed; }

CpuAllocatorCounters& cpu_counters() {
  static auto* c = new CpuAllocatorCounters();
  return *c;
}
CpuCacheStats cpu_cache_stats() { return cache().stats(); }
void reset_cpu_reserved_peak() { cache().reset_reserved_peak(); }
int64_t cpu_empty_cache() { return cache().empty(); }

}  // namespace frugal::detail

#undef FRUGAL_POISON
#undef FRUGAL_UNPOISON
