// Datasets in memory, IDX files, synthetic data and the seeded batch loader.
#include "frugal/data/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>

#include "frugal/base/error.h"

namespace frugal {
namespace {

namespace F = torch::nn::functional;

struct GzCloser {
  void operator()(gzFile f) const {
    if (f) gzclose(f);
  }
};
using GzFile = std::unique_ptr<std::remove_pointer_t<gzFile>, GzCloser>;

/// Reads up to `n` bytes; returns how many were read (fewer at the end of the file).
int64_t read_some(gzFile f, void* dst, int64_t n, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  int64_t total = 0;
  while (total < n) {
    // Small chunks: a gzip stream that ends early loses only the chunk it ends in.
    const auto chunk = static_cast<unsigned>(std::min<int64_t>(n - total, 1 << 20));
    int got = gzread(f, p + total, chunk);
    if (got < 0) {
      int errnum = 0;
      const char* msg = gzerror(f, &errnum);
      throw_data_error("cannot read '" + path + "': " + (msg ? msg : "zlib error"));
    }
    if (got == 0) break;
    total += got;
  }
  return total;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// A uniform integer in [0, bound] from raw mt19937_64 output, by rejection, so the result is
/// the same with every standard library (std::uniform_int_distribution is not).
uint64_t uniform_upto(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t range = bound + 1;
  if (range == 0) return rng();  // bound == max: every value is fine
  const uint64_t limit =
      std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % range;
  uint64_t v;
  do v = rng();
  while (v >= limit);
  return v % range;
}

/// Mean and standard deviation of uint8 images scaled to [0, 1].
std::pair<double, double> image_stats(const torch::Tensor& images_u8) {
  auto x = images_u8.to(torch::kDouble).div_(255.0);
  double mean = x.mean().item<double>();
  double std = x.std().item<double>();
  return {mean, std > 1e-12 ? std : 1.0};
}

}  // namespace

Dataset Dataset::head(int64_t n) const {
  if (n <= 0 || n >= size()) return *this;
  Dataset d = *this;
  if (is_text()) {  // the first n windows; the corpus keeps only the bytes they read
    d.windows = n;
    if (n * block_size + 1 < tokens.numel()) d.tokens = tokens.narrow(0, 0, n * block_size + 1).clone();
    return d;
  }
  // clone() so the rest of the full dataset can be freed.
  if (images.defined()) d.images = images.narrow(0, 0, n).clone();
  if (features.defined()) d.features = features.narrow(0, 0, n).clone();
  d.labels = labels.narrow(0, 0, n).clone();
  return d;
}

namespace {

/// An IDX file opened and its header read and checked (what read_idx documents): the sizes, and
/// the bytes of data they claim (0 when a size is 0).
struct IdxHeader {
  GzFile file;
  std::vector<int64_t> sizes;
  int64_t count = 0;
};

IdxHeader read_idx_header(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw_data_error("cannot read '" + path + "': no such file");
  GzFile f(gzopen(path.c_str(), "rb"));
  if (!f) throw_data_error("cannot open '" + path + "' for reading");

  std::array<unsigned char, 4> magic{};
  int64_t got = read_some(f.get(), magic.data(), 4, path);
  const bool ok = got == 4 && magic[0] == 0 && magic[1] == 0 && magic[2] == 0x08 && magic[3] >= 1 &&
                  magic[3] <= 4;
  if (!ok) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%02X%02X%02X%02X", magic[0], magic[1], magic[2], magic[3]);
    throw_data_error("'" + path + "' is not an IDX file of uint8 (magic " + hex +
                     "); expected 0x000008 followed by 1 to 4 dimensions");
  }
  const int ndims = magic[3];
  std::vector<unsigned char> dims_raw(4 * ndims);
  got = read_some(f.get(), dims_raw.data(), 4 * ndims, path);
  if (got != 4 * ndims)
    throw_data_error("'" + path + "' is truncated: expected " + std::to_string(4 * ndims) +
                     " bytes of header sizes, got " + std::to_string(got));
  std::vector<int64_t> sizes(ndims);
  // The most data the file can hold: its own size, or gzip's best ratio (1032:1) of it. A
  // header that claims more is corrupt; refused before any allocation.
  const auto on_disk = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  const int64_t most = ec ? std::numeric_limits<int64_t>::max() : on_disk * 1032 + 1024;
  // The product of the sizes other than 0: LibTorch refuses a shape whose sizes multiply past
  // 2^63 even when one of them is 0 (a c10::Error before this check counted them).
  int64_t count = 1;
  bool empty = false;
  std::string shape;
  for (int d = 0; d < ndims; ++d) {
    const unsigned char* b = &dims_raw[4 * d];
    uint32_t v = (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | b[3];
    if (v > uint32_t(std::numeric_limits<int32_t>::max()))
      throw_data_error("'" + path + "' has a negative size in dimension " + std::to_string(d));
    sizes[d] = v;
    shape += (d ? " x " : "") + std::to_string(v);
    // count stays <= most (< 2^63 / 2^31) before each multiplication: no overflow.
    if (v == 0) empty = true;
    else if (count > most / static_cast<int64_t>(v)) count = most + 1;
    else count *= sizes[d];
  }
  if (count > most)
    throw_data_error("'" + path + "' is corrupt: its header claims " + shape +
                     (empty ? ", sizes " : " bytes of data, ") + "more than a file of " +
                     std::to_string(on_disk) + " bytes can hold");
  if (empty) count = 0;
  return {std::move(f), std::move(sizes), count};
}

}  // namespace

std::vector<int64_t> idx_shape(const std::string& path) { return read_idx_header(path).sizes; }

torch::Tensor read_idx(const std::string& path) {
  IdxHeader h = read_idx_header(path);
  auto out = torch::empty(h.sizes, torch::kUInt8);
  const int64_t got = read_some(h.file.get(), out.data_ptr<uint8_t>(), h.count, path);
  if (got != h.count)
    throw_data_error("'" + path + "' is truncated: expected " + std::to_string(h.count) +
                     " bytes of data, got " + std::to_string(got));
  return out;
}

void write_idx(const std::string& path, const torch::Tensor& data) {
  if (data.dim() < 1 || data.dim() > 4)
    throw_data_error("cannot write '" + path + "': IDX takes 1 to 4 dimensions, got " +
                     std::to_string(data.dim()));
  auto t = data.to(torch::kCPU, torch::kUInt8).contiguous();
  std::vector<unsigned char> header = {0, 0, 0x08, static_cast<unsigned char>(t.dim())};
  for (int64_t s : t.sizes()) {
    const auto v = static_cast<uint32_t>(s);
    header.insert(header.end(),
                  {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                   static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)});
  }
  // "wT" writes a plain file through the same interface.
  GzFile f(gzopen(path.c_str(), ends_with(path, ".gz") ? "wb" : "wT"));
  if (!f) throw_data_error("cannot open '" + path + "' for writing");
  auto write_all = [&](const void* p, int64_t n) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const auto chunk = static_cast<unsigned>(std::min<int64_t>(n, 1 << 30));
      int put = gzwrite(f.get(), c, chunk);
      if (put <= 0) throw_data_error("cannot write '" + path + "'");
      c += put;
      n -= put;
    }
  };
  write_all(header.data(), static_cast<int64_t>(header.size()));
  write_all(t.data_ptr<uint8_t>(), t.numel());
  if (gzclose(f.release()) != Z_OK) throw_data_error("cannot finish writing '" + path + "'");
}

namespace {
std::string fashion_file(const std::string& dir, bool train, const char* what) {
  return dir + "/" + (train ? "train" : "t10k") + "-" + what + "-ubyte.gz";
}

void check_split(const std::string& dir, bool train) {
  for (const char* what : {"images-idx3", "labels-idx1"}) {
    const std::string file = fashion_file(dir, train, what);
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec))
      throw_data_error("Fashion-MNIST not found: '" + file +
                       "' is missing. Install it with `apt-get install dataset-fashion-mnist`, "
                       "or set data.path");
  }
}
}  // namespace

std::string fashion_mnist_images(const std::string& dir, bool train) {
  return fashion_file(dir, train, "images-idx3");
}

void check_fashion_mnist(const std::string& dir) {
  check_split(dir, true);
  check_split(dir, false);
}

Dataset load_fashion_mnist(const std::string& dir, bool train) {
  check_split(dir, train);
  const std::string image_file = fashion_file(dir, train, "images-idx3");
  const std::string label_file = fashion_file(dir, train, "labels-idx1");
  auto images = read_idx(image_file);
  auto labels = read_idx(label_file);
  if (images.dim() != 3)
    throw_data_error("'" + image_file + "' should hold images [N, H, W], got " +
                     std::to_string(images.dim()) + " dimensions");
  if (labels.dim() != 1)
    throw_data_error("'" + label_file + "' should hold labels [N], got " +
                     std::to_string(labels.dim()) + " dimensions");
  if (images.size(0) != labels.size(0))
    throw_data_error("Fashion-MNIST: '" + image_file + "' holds " + std::to_string(images.size(0)) +
                     " images but '" + label_file + "' holds " + std::to_string(labels.size(0)) +
                     " labels");
  if (labels.numel() > 0 && labels.max().item<int64_t>() >= 10)
    throw_data_error("'" + label_file + "' has a label >= 10 (Fashion-MNIST has 10 classes)");
  Dataset d;
  d.images = images.unsqueeze(1);
  d.labels = labels.to(torch::kLong);
  d.num_classes = 10;
  d.mean = 0.2860;
  d.std = 0.3530;
  d.classes = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};  // its README's
  d.name = "fashion-mnist";
  return d;
}

constexpr double kScale = 50.0;  // synthetic pixels: 127.5 + kScale * N(0, 1), clamped

Dataset make_synthetic(int64_t n, int64_t channels, int64_t height, int64_t width,
                       int64_t num_classes, uint64_t seed) {
  if (n < 1 || channels < 1 || height < 1 || width < 1 || num_classes < 1)
    throw_data_error("synthetic data needs n, channels, height, width and classes >= 1; got n=" +
                     std::to_string(n) + ", channels=" + std::to_string(channels) +
                     ", height=" + std::to_string(height) + ", width=" + std::to_string(width) +
                     ", classes=" + std::to_string(num_classes));
  torch::NoGradGuard no_grad;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  // Smooth images: a 2 x 2 random grid, upsampled, plus a little pixel noise.
  const int64_t gh = std::min<int64_t>(2, height), gw = std::min<int64_t>(2, width);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto coarse = torch::randn({n, channels, gh, gw}, gen, f32);
  auto img = F::interpolate(coarse, F::InterpolateFuncOptions()
                                        .size(std::vector<int64_t>{height, width})
                                        .mode(torch::kBilinear)
                                        .align_corners(false));
  img.add_(torch::randn({n, channels, height, width}, gen, f32), 0.15);
  auto images = img.mul_(kScale).add_(127.5).clamp_(0, 255).round_().to(torch::kUInt8);

  // The label is the nearest of `num_classes` fixed prototypes to the image's quadrant means,
  // a linear rule: argmax_k f.p_k - |p_k|^2 / 2. It depends only on the shapes, never on
  // `seed`, so every split shares it; coarse features keep it easy for a pooled CNN too.
  auto rule_gen = at::make_generator<at::CPUGeneratorImpl>(0x5EED'F00DULL);
  auto protos = torch::randn({num_classes, channels * gh * gw}, rule_gen, f32).mul_(0.5);
  auto features = F::adaptive_avg_pool2d(images.to(torch::kFloat).sub_(127.5).div_(kScale),
                                         F::AdaptiveAvgPool2dFuncOptions({gh, gw}))
                      .reshape({n, -1});
  auto scores = features.matmul(protos.t()).sub_(protos.pow(2).sum(1).mul_(0.5));
  Dataset d;
  d.images = images;
  d.labels = scores.argmax(1).to(torch::kLong);
  d.num_classes = num_classes;
  std::tie(d.mean, d.std) = image_stats(images);
  d.name = "synthetic";
  return d;
}

DataLoader::DataLoader(Dataset data, int64_t batch_size, bool shuffle, uint64_t seed,
                       torch::Device device, bool drop_last)
    : data_(std::move(data)),
      batch_size_(batch_size),
      shuffle_(shuffle),
      seed_(seed),
      device_(device),
      drop_last_(drop_last) {
  if (batch_size_ < 1)
    throw_usage_error("DataLoader: batch_size must be >= 1, got " + std::to_string(batch_size_));
  set_epoch(0);
}

namespace {
/// One epoch's flip bits and crop offsets, position by position (see DataLoader).
template <class Draw>
std::vector<Draw> draw_augment(const Augment& a, int64_t n, uint64_t seed) {
  std::vector<Draw> out(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  const auto span = static_cast<uint64_t>(2 * a.crop_padding);
  for (auto& d : out) {
    // The flip bit is drawn whether or not it is used: turning flips on or off leaves the
    // crops of every position as they were.
    const bool coin = (rng() >> 63) != 0;
    d.flip = a.flip && coin;
    d.dy = static_cast<int32_t>(a.crop_padding > 0 ? uniform_upto(rng, span) : 0);
    d.dx = static_cast<int32_t>(a.crop_padding > 0 ? uniform_upto(rng, span) : 0);
  }
  return out;
}
}  // namespace

void DataLoader::set_epoch(int64_t epoch) {
  const int64_t n = data_.size();
  if (data_.is_text()) {
    order_ = text_window_starts(data_, shuffle_, seed_ + static_cast<uint64_t>(epoch));
    return;
  }
  augment_.clear();
  if (data_.augment.active() && data_.images.defined())
    augment_ = draw_augment<AugmentDraw>(data_.augment, n,
                                         seed_ + static_cast<uint64_t>(epoch) + kAugmentStream);
  order_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order_[i] = i;
  if (!shuffle_) return;
  // Fisher-Yates, written out so every platform draws the same permutation.
  std::mt19937_64 rng(seed_ + static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_upto(rng, static_cast<uint64_t>(i)));
    std::swap(order_[i], order_[j]);
  }
}

int64_t DataLoader::num_batches() const {
  const int64_t n = data_.size();
  if (drop_last_) return n / batch_size_;
  const int64_t full = n / batch_size_, rest = n % batch_size_;
  // Sharded: a last batch smaller than the world would leave some rank without a sample.
  return full + (rest > 0 && (rest >= shard_world_ || shard_every_sample_) ? 1 : 0);
}

int64_t DataLoader::rows(int64_t i) const {
  const int64_t count = batch_samples(i);
  if (shard_world_ <= 1) return count;
  return count * (shard_rank_ + 1) / shard_world_ - count * shard_rank_ / shard_world_;
}

void DataLoader::set_shard(int rank, int world, bool every_sample) {
  if (world < 1 || rank < 0 || rank >= world)
    throw_usage_error("DataLoader::set_shard: rank " + std::to_string(rank) + " of " +
                      std::to_string(world));
  if (batch_size_ < world)
    throw_config_error("data.batch_size = " + std::to_string(batch_size_) + " is smaller than the " +
                       std::to_string(world) + " ranks: every rank needs a sample of each batch");
  shard_rank_ = rank;
  shard_world_ = world;
  shard_every_sample_ = every_sample;
}

int64_t DataLoader::batch_samples(int64_t i) const {
  return std::max<int64_t>(0, std::min(batch_size_, data_.size() - i * batch_size_));
}

namespace {
// A CPU batch at the native size: gathered and normalized in one pass over the bytes, no
// intermediate tensors (index_select, a float copy, then two in-place passes cost more than the
// arithmetic on a small batch). The same float operations in the same order as
// prepare_images, so the values are the same bits. `order`: the batch's sample indices, or null
// for samples start.. in order.
bool gather_on_cpu(const Dataset& data, const int64_t* order, int64_t start, int64_t count,
                   const torch::Device& device, int64_t image_size, Batch& b) {
  const torch::Tensor& images = data.images;
  if (!device.is_cpu() || images.dim() != 4 || images.scalar_type() != torch::kByte ||
      !images.is_contiguous() || data.labels.scalar_type() != torch::kLong ||
      !data.labels.is_contiguous() || data.labels.dim() != 1 ||
      data.labels.size(0) != images.size(0))
    return false;
  const int64_t c = images.size(1), h = images.size(2), w = images.size(3), per = c * h * w;
  if (image_size != 0 && (h != image_size || w != image_size)) return false;  // resized: the op path
  torch::Tensor x = torch::empty({count, c, h, w}, torch::kFloat);
  torch::Tensor y = torch::empty({count}, torch::kLong);
  const auto* src = images.data_ptr<uint8_t>();
  const auto* labels = data.labels.data_ptr<int64_t>();
  float* dst = x.data_ptr<float>();
  int64_t* out = y.data_ptr<int64_t>();
  const auto scale = static_cast<float>(1.0 / (255.0 * data.std));
  const auto shift = static_cast<float>(data.mean / data.std);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t sample = order ? order[i] : start + i;
    const uint8_t* from = src + sample * per;
    float* to = dst + i * per;
    for (int64_t j = 0; j < per; ++j) to[j] = static_cast<float>(from[j]) * scale - shift;
    out[i] = labels[sample];
  }
  b.x = std::move(x);
  b.y = std::move(y);
  return true;
}

}  // namespace

Batch DataLoader::batch(int64_t i) const {
  if (i < 0 || i >= num_batches())
    throw_usage_error("DataLoader: batch " + std::to_string(i) +
                      " is out of range; this epoch has " + std::to_string(num_batches()) +
                      " batches");
  int64_t start = i * batch_size_;
  int64_t count = std::min(batch_size_, data_.size() - start);
  const int64_t total = count;
  if (shard_world_ > 1) {  // this rank's rows of the batch
    const int64_t lo = count * shard_rank_ / shard_world_;
    const int64_t hi = count * (shard_rank_ + 1) / shard_world_;
    start += lo;
    count = hi - lo;
  }
  Batch b = batch_rows(start, count);
  if (shard_world_ > 1) b.total = total;
  return b;
}

Batch DataLoader::batch_rows(int64_t start, int64_t count) const {
  if (data_.is_text()) return text_batch(start, count);
  if (data_.is_tabular()) return tabular_batch(start, count);
  if (Batch b; gather_on_cpu(data_, shuffle_ ? order_.data() + start : nullptr, start, count,
                              device_, image_size_, b)) {
    augment_batch(b.x, start);
    return b;
  }
  torch::Tensor images, labels;
  if (shuffle_) {
    auto idx = torch::from_blob(const_cast<int64_t*>(order_.data()) + start, {count}, torch::kLong);
    images = data_.images.index_select(0, idx);
    labels = data_.labels.index_select(0, idx);
  } else {
    images = data_.images.narrow(0, start, count);
    labels = data_.labels.narrow(0, start, count);
  }
  // Move the compact uint8 images, then convert on the device.
  Batch b;
  b.x = prepare_images(images.to(device_), data_.mean, data_.std, image_size_);
  augment_batch(b.x, start);
  // A batch never aliases the dataset (a callback may edit it in place): index_select
  // already copied; a narrow view is copied here.
  b.y = shuffle_ ? labels.to(device_) : labels.to(device_, /*non_blocking=*/false, /*copy=*/true);
  return b;
}

Batch DataLoader::tabular_batch(int64_t start, int64_t count) const {
  Batch b;
  if (shuffle_) {
    auto idx = torch::from_blob(const_cast<int64_t*>(order_.data()) + start, {count}, torch::kLong);
    b.x = data_.features.index_select(0, idx).to(device_);
    b.y = data_.labels.index_select(0, idx).to(device_);
  } else {  // copies: a batch never aliases the dataset
    b.x = data_.features.narrow(0, start, count).to(device_, false, /*copy=*/true);
    b.y = data_.labels.narrow(0, start, count).to(device_, false, /*copy=*/true);
  }
  return b;
}

void DataLoader::augment_batch(torch::Tensor& x, int64_t start) const {
  if (augment_.empty()) return;
  const auto n = static_cast<size_t>(x.size(0));
  std::vector<bool> flip(n);
  std::vector<int32_t> dy(n), dx(n);
  for (size_t i = 0; i < n; ++i) {
    const AugmentDraw& d = augment_[static_cast<size_t>(start) + i];
    flip[i] = d.flip;
    dy[i] = d.dy;
    dx[i] = d.dx;
  }
  // A padded pixel is a black one (0) after normalization.
  augment_images(x, flip, dy, dx, data_.augment.crop_padding, -data_.mean / data_.std);
}

void augment_images(torch::Tensor& x, const std::vector<bool>& flip, const std::vector<int32_t>& dy,
                    const std::vector<int32_t>& dx, int64_t padding, double pad_value) {
  torch::NoGradGuard no_grad;
  const int64_t h = x.size(2), w = x.size(3);
  for (int64_t i = 0; i < x.size(0); ++i) {
    const auto k = static_cast<size_t>(i);
    torch::Tensor img = x[i];
    if (flip[k]) img.copy_(img.flip({2}));
    if (padding <= 0 || (dy[k] == padding && dx[k] == padding)) continue;
    const torch::Tensor padded =
        F::pad(img.unsqueeze(0), F::PadFuncOptions({padding, padding, padding, padding})
                                     .mode(torch::kConstant)
                                     .value(pad_value));
    img.copy_(padded[0].narrow(1, dy[k], h).narrow(2, dx[k], w));
  }
}

void DataLoader::clear() {
  data_ = Dataset{};
  std::vector<int64_t>().swap(order_);
  std::vector<AugmentDraw>().swap(augment_);
}

torch::Tensor prepare_images(const torch::Tensor& images_u8, double mean, double std,
                             int64_t size) {
  // Always a copy: the in-place ops below must not touch the caller's tensor.
  auto x = images_u8.to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (size > 0 && (x.size(-1) != size || x.size(-2) != size))
    x = F::interpolate(x, F::InterpolateFuncOptions()
                              .size(std::vector<int64_t>{size, size})
                              .mode(torch::kBilinear)
                              .align_corners(false));
  // (x / 255 - mean) / std in one pass.
  return x.mul_(1.0 / (255.0 * std)).sub_(mean / std);
}

}  // namespace frugal
