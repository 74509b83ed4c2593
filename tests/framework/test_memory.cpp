// The memory meter counts what the tracking allocator serves, exactly.
#include <c10/core/CPUAllocator.h>

#include "frugal/error.h"
#include "frugal/memory.h"
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
