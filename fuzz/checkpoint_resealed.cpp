// Checkpoints and saved models sealed anew after the fuzzer's change: the seal always passes,
// so every change reaches LibTorch's zip and pickle readers and frugal's checks behind them
// (format record, resume record, shapes, optimizer state). What a file damaged before it was
// sealed, or made by hand, looks like. checkpoint_target.h: what counts as a finding.
#include "checkpoint_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return frugal::fuzz::fuzz_checkpoint(data, size, /*reseal=*/true);
}
