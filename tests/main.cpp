// The test runner: installs the tracking allocator before any tensor exists, so the memory
// meter counts every allocation the tests make.
#include <gtest/gtest.h>

#include "frugal/memory/memory.h"

int main(int argc, char** argv) {
  frugal::MemoryMeter::install();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
