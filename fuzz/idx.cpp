// The IDX reader (read_idx: plain or gzip'd) and the Fashion-MNIST loader on top of it.
//
// Input: one IDX file; or an images file, the line "--labels--", a labels file (the pair
// load_fashion_mnist reads). Documented outcomes: a tensor no larger than the file can hold
// (1032:1, gzip's best ratio), or a DataError naming the file. Anything else is a finding.
#include <cstdint>
#include <string>

#include "frugal/base/error.h"
#include "frugal/data/data.h"
#include "fuzz_support.h"

namespace {

const std::string kLabelsMarker = "\n--labels--\n";

void read_one(const std::string& path, size_t size) {
  try {
    const torch::Tensor t = frugal::read_idx(path);
    if (t.scalar_type() != torch::kUInt8 || t.dim() < 1 || t.dim() > 4)
      frugal::fuzz::finding("read_idx returned " + c10::str(t.scalar_type(), t.sizes()));
    if (t.numel() > static_cast<int64_t>(size) * 1032 + 1024)
      frugal::fuzz::finding("a file of " + std::to_string(size) + " bytes gave " +
                            std::to_string(t.numel()) + " values");
  } catch (const frugal::DataError& e) {
    frugal::fuzz::expect_names(e, path);
  }
}

void read_pair(const frugal::fuzz::TempDir& dir, const std::string& images, const std::string& labels) {
  const std::string image_file = dir.file("train-images-idx3-ubyte.gz");
  const std::string label_file = dir.file("train-labels-idx1-ubyte.gz");
  frugal::fuzz::write_file(image_file, reinterpret_cast<const uint8_t*>(images.data()), images.size());
  frugal::fuzz::write_file(label_file, reinterpret_cast<const uint8_t*>(labels.data()), labels.size());
  try {
    const frugal::Dataset d = frugal::load_fashion_mnist(dir.path(), /*train=*/true);
    if (d.images.dim() != 4 || d.images.size(1) != 1 || d.labels.dim() != 1 ||
        d.images.size(0) != d.labels.size(0) ||
        (d.labels.numel() > 0 && (d.labels.min().item<int64_t>() < 0 || d.labels.max().item<int64_t>() > 9)))
      frugal::fuzz::finding("load_fashion_mnist returned images " + c10::str(d.images.sizes()) +
                            " and labels " + c10::str(d.labels.sizes()));
  } catch (const frugal::DataError& e) {
    const std::string msg = e.what();
    if (msg.find(image_file) == std::string::npos && msg.find(label_file) == std::string::npos)
      frugal::fuzz::finding("the error names neither file: " + msg);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const frugal::fuzz::TempDir dir;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find(kLabelsMarker);
  if (cut == std::string::npos) {
    const std::string path = dir.file("data.idx");
    frugal::fuzz::write_file(path, data, size);
    read_one(path, size);
  } else {
    read_pair(dir, input.substr(0, cut), input.substr(cut + kLabelsMarker.size()));
  }
  return 0;
}
