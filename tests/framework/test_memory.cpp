// The memory meter counts what the caching CPU allocator serves, exactly.
#include <atomic>
#include <thread>
#include <vector>

#include <c10/core/CPUAllocator.h>

#include "frugal/base/error.h"
#include "frugal/memory/memory.h"
#include "learner_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

TEST(MemoryMeter, CountsAKnownAllocationExactly) {
  ASSERT_TRUE(MemoryMeter::installed());
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t base = mm.current();
  mm.reset_peak();
  {
    torch::Tensor t = torch::empty({1000}, torch::kFloat);
    EXPECT_EQ(mm.current() - base, 4000);
    torch::Tensor u = torch::empty({250, 2}, torch::kDouble);
    EXPECT_EQ(mm.current() - base, 8000);
  }
  EXPECT_EQ(mm.current(), base);
  EXPECT_EQ(mm.peak() - base, 8000);
}

TEST(MemoryMeter, WindowsMeasureThePeakOfARegion) {
  MemoryMeter& mm = MemoryMeter::get();
  { torch::Tensor big = torch::empty({1 << 16}, torch::kFloat); }  // a peak before the window
  const int64_t base = mm.current();
  MemoryWindow w = mm.open_window();
  EXPECT_EQ(w.peak(), base);
  {
    torch::Tensor t = torch::empty({100}, torch::kByte);
  }
  EXPECT_EQ(w.peak() - base, 100);
  w.reset();
  EXPECT_EQ(w.peak(), base);
}

TEST(MemoryMeter, WindowsGiveTheirSlotBackWhenDestroyed) {
  MemoryMeter& mm = MemoryMeter::get();
  std::vector<MemoryWindow> all;
  while (all.size() < static_cast<size_t>(MemoryMeter::kWindows)) {
    try {
      all.push_back(mm.open_window());
    } catch (const UsageError&) {
      break;  // windows another part of the process holds
    }
  }
  ASSERT_FALSE(all.empty());
  EXPECT_THROW(mm.open_window(), UsageError);  // every slot is taken
  all.pop_back();
  MemoryWindow again = mm.open_window();  // the destroyed window's slot
  EXPECT_TRUE(again.is_open());
  MemoryWindow moved = std::move(again);
  EXPECT_FALSE(again.is_open());
  EXPECT_TRUE(moved.is_open());
  moved.close();
  EXPECT_THROW((void)moved.peak(), UsageError);
}

TEST(MemoryMeter, ServesRawAllocate) {
  // oneDNN's bfloat16 path calls raw_allocate: the allocator must give a raw_deleter.
  c10::Allocator* a = c10::GetCPUAllocator();
  ASSERT_NE(a->raw_deleter(), nullptr);
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t base = mm.current();
  void* p = a->raw_allocate(4096);
  EXPECT_EQ(mm.current() - base, 4096);
  a->raw_deallocate(p);
  EXPECT_EQ(mm.current(), base);
}

TEST(MemoryMeter, Bfloat16MatmulRunsUnderTheTrackingAllocator) {
  auto a = torch::randn({64, 64}).to(torch::kBFloat16);
  auto c = torch::matmul(a, a);
  EXPECT_EQ(c.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(c.to(torch::kFloat), torch::matmul(a.to(torch::kFloat), a.to(torch::kFloat)),
                              0.1, 0.5));
}

TEST(MemoryMeter, CountsOptimizerStateOfKnownOptimizers) {
  auto lin = torch::nn::Linear(10, 10);
  auto loss = lin->forward(torch::randn({4, 10})).sum();
  loss.backward();
  const int64_t params = parameter_bytes(*lin);
  EXPECT_EQ(params, (100 + 10) * 4);
  EXPECT_EQ(gradient_bytes(*lin), params);
  torch::optim::Adam adam(lin->parameters());
  adam.step();
  EXPECT_EQ(optimizer_state_bytes(adam), 2 * params);
  torch::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  sgd.step();
  EXPECT_EQ(optimizer_state_bytes(sgd), params);
  torch::optim::SGD plain(lin->parameters(), torch::optim::SGDOptions(0.1));
  plain.step();
  EXPECT_EQ(optimizer_state_bytes(plain), 0);
}

TEST(MemoryBytes, FormatsAndParsesSizes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3 * 1048576LL), "3.00 MiB");
  EXPECT_EQ(parse_bytes("2GiB", "run.memory_budget"), 2LL << 30);
  EXPECT_EQ(parse_bytes("512 MiB", "x"), 512LL << 20);
  EXPECT_EQ(parse_bytes("1.5GB", "x"), 1500000000LL);
  EXPECT_EQ(parse_bytes("1000", "x"), 1000);
  try {
    parse_bytes("lots", "run.memory_budget");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("run.memory_budget"), std::string::npos);
  }
  EXPECT_THROW(parse_bytes("3 parsecs", "x"), ConfigError);
}

}  // namespace
}  // namespace frugal::test

// ---- the caching CPU allocator under the meter ----

namespace frugal::test {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(CachingCpuAllocator, LiveBytesStayExactAndReservedHoldsThem) {
  MemoryMeter& mm = MemoryMeter::get();
  ASSERT_TRUE(mm.allocator_stats().caching) << "FRUGAL_CPU_CACHE=0 is set for this test run";
  const int64_t base = mm.current();
  std::vector<torch::Tensor> held;
  int64_t asked = 0;
  for (int64_t n : {1, 7, 513, 4096, 100000, 1 << 20, 3 << 20, 25 << 20}) {  // both pools
    held.push_back(torch::empty({n}, torch::kByte));
    asked += n;
    EXPECT_EQ(mm.current() - base, asked) << "after " << n << " bytes";
    EXPECT_GE(mm.reserved(), mm.current());
  }
  held.clear();
  EXPECT_EQ(mm.current(), base);
  EXPECT_GE(mm.reserved() - mm.current(), 25 << 20) << "freed blocks stay cached";
}

TEST(CachingCpuAllocator, ASteadyStateLoopAsksTheSystemForNothing) {
  MemoryMeter& mm = MemoryMeter::get();
  auto step = [] {  // a forward/backward/step's worth of allocations of varied sizes
    torch::Tensor a = torch::randn({64, 3000}, torch::requires_grad());
    torch::Tensor w = torch::randn({3000, 500}, torch::requires_grad());
    torch::Tensor loss = torch::relu(a.matmul(w)).sum();
    loss.backward();
    return loss.item<float>();
  };
  for (int i = 0; i < 3; ++i) step();  // the pools settle (the first steps start them empty)
  const AllocatorStats before = mm.allocator_stats();
  for (int i = 0; i < 20; ++i) step();
  const AllocatorStats after = mm.allocator_stats();
  EXPECT_EQ(after.system_allocations, before.system_allocations);
  EXPECT_EQ(after.system_frees, before.system_frees);
  EXPECT_EQ(after.reserved, before.reserved);
}

TEST(CachingCpuAllocator, EmptyCacheGivesCachedSegmentsBack) {
  MemoryMeter& mm = MemoryMeter::get();
  { torch::Tensor big = torch::empty({30 * kMiB}, torch::kByte); }
  const int64_t cached = mm.reserved() - mm.current();
  ASSERT_GE(cached, 30 * kMiB);
  const int64_t frees = mm.allocator_stats().system_frees;
  const int64_t released = mm.empty_cache();
  EXPECT_GE(released, 30 * kMiB);
  EXPECT_EQ(mm.reserved() - mm.current(), cached - released);
  EXPECT_GT(mm.allocator_stats().system_frees, frees);
  EXPECT_EQ(mm.empty_cache(), 0) << "nothing is left to give back";
}

TEST(CachingCpuAllocator, FreedNeighboursMergeIntoOneBlock) {
  MemoryMeter& mm = MemoryMeter::get();
  mm.empty_cache();
  const int64_t segments = mm.allocator_stats().system_allocations;
  char* first = nullptr;
  {  // three 4 MiB blocks cut from one 20 MiB segment, freed in an order that needs both merges
    torch::Tensor a = torch::empty({4 * kMiB}, torch::kByte);
    torch::Tensor b = torch::empty({4 * kMiB}, torch::kByte);
    torch::Tensor c = torch::empty({4 * kMiB}, torch::kByte);
    first = static_cast<char*>(a.data_ptr());
    const int64_t block = 4 * kMiB + 512;  // rounded to 512 bytes with the 64-byte header
    ASSERT_EQ(static_cast<char*>(b.data_ptr()), first + block);
    ASSERT_EQ(static_cast<char*>(c.data_ptr()), first + 2 * block);
    a.reset();
    c.reset();
  }
  EXPECT_EQ(mm.allocator_stats().system_allocations, segments + 1);
  {  // 19 MiB fits in the segment only once a, b, c and the rest are one block again
    torch::Tensor whole = torch::empty({19 * kMiB}, torch::kByte);
    EXPECT_EQ(static_cast<char*>(whole.data_ptr()), first);
  }
  EXPECT_EQ(mm.allocator_stats().system_allocations, segments + 1);
  EXPECT_GE(mm.empty_cache(), 20 * kMiB) << "the merged segment is whole again";
}

TEST(CachingCpuAllocator, APurgeGivesTheCacheBackOnCpuToo) {
  auto l = make_tiny_learner();
  l->fit(1);
  { torch::Tensor stale = torch::empty({30 * kMiB}, torch::kByte); }  // freed, still cached
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t before = mm.reserved();
  l->purge();
  EXPECT_LE(mm.reserved(), before - 30 * kMiB);
}

TEST(CachingCpuAllocator, TheBudgetBoundsLiveBytesAndTheCacheYieldsToIt) {
  MemoryMeter& mm = MemoryMeter::get();
  mm.empty_cache();
  { torch::Tensor t = torch::empty({30 * kMiB}, torch::kByte); }  // 32 MiB cached
  const int64_t budget = mm.current() + 64 * kMiB;
  ScopedMemoryBudget scope(budget);
  const int64_t refused = mm.refused();
  EXPECT_THROW(torch::empty({65 * kMiB}, torch::kByte), c10::OutOfMemoryError);
  EXPECT_EQ(mm.refused(), refused + 1);
  const int64_t frees = mm.allocator_stats().system_frees;
  torch::Tensor fits = torch::empty({50 * kMiB}, torch::kByte);  // needs a new 50 MiB segment
  EXPECT_GT(mm.allocator_stats().system_frees, frees) << "the cached 32 MiB went back first";
  EXPECT_LE(mm.reserved(), budget);
}

TEST(CachingCpuAllocator, ManyThreadsAllocatingAtOnceKeepTheCountExact) {
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t base = mm.current();
  MemoryWindow w = mm.open_window();
  constexpr int kThreads = 8, kRounds = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([t] {
      std::vector<torch::Tensor> keep;
      for (int i = 0; i < kRounds; ++i) {
        const int64_t n = 1 + (i * 7919 + t * 104729) % (3 * kMiB);
        keep.push_back(torch::empty({n}, torch::kByte));
        if (keep.size() > 4) keep.erase(keep.begin() + (i % 4));
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mm.current(), base);
  EXPECT_GT(w.peak(), base);
  EXPECT_LE(w.peak() - base, kThreads * 5 * 3 * kMiB);  // at most 5 live per thread
  {  // under a budget, threads racing for the last bytes never take the live bytes past it
    ScopedMemoryBudget scope(base + 8 * kMiB);
    w.reset();
    std::atomic<int> refused{0};
    threads.clear();
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&refused] {
        for (int i = 0; i < 50; ++i) try {
            torch::Tensor x = torch::empty({3 * kMiB}, torch::kByte);
          } catch (const c10::OutOfMemoryError&) {
            ++refused;
          }
      });
    for (auto& th : threads) th.join();
    EXPECT_LE(w.peak(), base + 8 * kMiB);
  }
  EXPECT_EQ(mm.current(), base);
}

}  // namespace
}  // namespace frugal::test
