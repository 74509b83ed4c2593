#pragma once
// The checkpoint reader, for checkpoint.cpp (the bytes as they are) and checkpoint_resealed.cpp
// (the bytes sealed anew, so a change reaches the reader behind the seal).
//
// Each input is opened once (archive::open: the seal, LibTorch's reader, the format record;
// LibTorch's load is most of an input's time) and then every record is read as the Learner
// reads it (learner_checkpoint.cpp): the resume record (load_checkpoint), the model into a
// learner whose model fits the seeds (load, load_checkpoint), the optimizer's state (load
// with_opt, a resumed fit), the running loss and the random generator's state, restored (a
// resumed fit). Documented outcome of each: success, or a CheckpointError naming the file.
// Anything else (another exception, a crash, a sanitizer report) is a finding.
#include <cstdint>
#include <functional>
#include <string>
#include <typeinfo>

#include "io/archive.h"
#include "io/file_seal.h"
#include "fuzz_support.h"

namespace frugal::fuzz {

/// Writes `bytes` to `path` without their zip comment (the seal, or anything else), then
/// seals them as archive::write_file does. False when they are no zip archive to seal.
inline bool write_resealed(const std::string& path, std::string bytes) {
  constexpr size_t kEnd = 22;  // the end-of-central-directory record without its comment
  if (bytes.size() < kEnd) return false;
  const size_t lowest = bytes.size() > kEnd + 0xFFFF ? bytes.size() - kEnd - 0xFFFF : 0;
  for (size_t i = bytes.size() - kEnd + 1; i-- > lowest;) {
    if (bytes.compare(i, 4, "PK\x05\x06", 4) != 0) continue;
    bytes.resize(i + kEnd);
    bytes[i + 20] = bytes[i + 21] = 0;  // no comment
    write_file(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    try {
      seal::seal_zip(path);
      return true;
    } catch (const CheckpointError&) {
      return false;
    }
  }
  return false;
}

inline void expect_checkpoint_error(const std::string& path, const std::function<void()>& read) {
  try {
    read();
  } catch (const CheckpointError& e) {
    expect_names(e, path);
  } catch (const std::exception& e) {
    finding(std::string("not a CheckpointError but ") + typeid(e).name() + ": " + e.what());
  }
}

inline int fuzz_checkpoint(const uint8_t* data, size_t size, bool reseal) {
  static const TempDir dir;
  static const std::unique_ptr<Learner> learner = make_learner();
  const std::string path = dir.file("fuzz.ckpt");
  if (!reseal) {
    write_file(path, data, size);
  } else if (!write_resealed(path, std::string(reinterpret_cast<const char*>(data), size))) {
    return -1;  // no zip: checkpoint.cpp covers those; not kept in the corpus
  }
  archive::InputArchive a;
  bool opened = false;
  expect_checkpoint_error(path, [&] {
    archive::open(path, torch::kCPU, a);
    opened = true;
  });
  if (!opened) return 0;
  expect_checkpoint_error(path, [&] { archive::read_resume(a, path); });
  expect_checkpoint_error(path, [&] { archive::load_model(*learner->model(), a, path); });
  expect_checkpoint_error(path, [&] {
    archive::load_optimizer(learner->optimizer(), "adam", a, path, "");
  });
  expect_checkpoint_error(path, [&] {
    torch::Tensor sum;
    if (archive::read_loss_sum(a, sum, path)) (void)sum.item<double>();
    if (auto rng = archive::read_rng(a, torch::kCPU, 0, path)) rng->restore();
  });
  return 0;
}

}  // namespace frugal::fuzz
