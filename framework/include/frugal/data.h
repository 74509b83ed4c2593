#pragma once
/// Datasets held in memory as uint8 images [N, C, H, W] and int64 labels [N]; a loader that
/// yields normalized float batches in a seeded order, resized to the stage's image size.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal {

struct Dataset {
  torch::Tensor images;  ///< uint8 [N, C, H, W]
  torch::Tensor labels;  ///< int64 [N]
  int64_t num_classes = 0;
  double mean = 0.0;  ///< normalization applied to images / 255
  double std = 1.0;
  std::string name;

  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
  int64_t channels() const { return images.size(1); }
  int64_t height() const { return images.size(2); }
  int64_t width() const { return images.size(3); }
  /// First `n` samples (or all when n <= 0 or n >= size()).
  Dataset head(int64_t n) const;
};

/// Reads one IDX file (gzip'd or plain): uint8 data with 1 to 4 dimensions. Throws DataError
/// naming the file on a missing file, a wrong magic number or a truncated body.
torch::Tensor read_idx(const std::string& path);
/// Writes an IDX file, gzip'd when the path ends in .gz (used by tests and tools).
void write_idx(const std::string& path, const torch::Tensor& data);

/// The default place of Debian's dataset-fashion-mnist package.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
/// Fashion-MNIST's train (60k) or test (10k) split from `dir`; the error names the package
/// to install when the files are missing.
Dataset load_fashion_mnist(const std::string& dir, bool train);
/// Throws the same DataError as load_fashion_mnist when any of the four files is missing.
void check_fashion_mnist(const std::string& dir);

/// Random images of any shape and class count; labels depend on the images (a fixed random
/// linear rule), so a model can learn them. Same seed, same data.
Dataset make_synthetic(int64_t n, int64_t channels, int64_t height, int64_t width,
                       int64_t num_classes, uint64_t seed);

struct Batch {
  torch::Tensor x;  ///< float [B, C, S, S], normalized, on the loader's device
  torch::Tensor y;  ///< int64 [B]
  int64_t size() const { return y.size(0); }
};

/// Yields batches of a Dataset. The order of epoch e is a permutation drawn from seed + e
/// (std::mt19937_64), the same on every platform and LibTorch version.
class DataLoader {
 public:
  DataLoader(Dataset data, int64_t batch_size, bool shuffle, uint64_t seed,
             torch::Device device = torch::kCPU, bool drop_last = false);

  /// Sets the epoch whose order batch() follows and the image size (0 = native).
  void set_epoch(int64_t epoch);
  void set_image_size(int64_t size) { image_size_ = size; }
  int64_t image_size() const { return image_size_; }
  void set_device(torch::Device d) { device_ = d; }

  int64_t num_batches() const;
  /// The i-th batch of the current epoch.
  Batch batch(int64_t i) const;

  const Dataset& dataset() const { return data_; }
  int64_t batch_size() const { return batch_size_; }
  /// Releases the dataset's memory (Learner::destroy).
  void clear();

 private:
  Dataset data_;
  int64_t batch_size_;
  bool shuffle_;
  uint64_t seed_;
  torch::Device device_;
  bool drop_last_;
  int64_t image_size_ = 0;
  std::vector<int64_t> order_;
};

/// Normalizes uint8 images and resizes them to size x size (bilinear; 0 keeps the size).
torch::Tensor prepare_images(const torch::Tensor& images_u8, double mean, double std,
                             int64_t size);

}  // namespace frugal
