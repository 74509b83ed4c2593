// Checkpoints and saved models as they are on disk: most changes meet the seal (file_seal.h);
// an archive without a comment (written before seals) goes to LibTorch's reader directly.
// checkpoint_target.h: what is read and what counts as a finding.
#include "checkpoint_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return frugal::fuzz::fuzz_checkpoint(data, size, /*reseal=*/false);
}
