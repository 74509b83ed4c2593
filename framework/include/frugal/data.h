#pragma once
/// Datasets held in memory: uint8 images [N, C, H, W] with int64 labels [N], or a byte corpus
/// (text) read as windows of tokens; a loader that yields batches in a seeded order, resized to
/// the stage's image size or cut to the stage's sequence length.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal {

struct Dataset {
  torch::Tensor images;  ///< uint8 [N, C, H, W]
  torch::Tensor labels;  ///< int64 [N]
  int64_t num_classes = 0;  ///< classes, or the vocabulary (256 bytes) of a text dataset
  double mean = 0.0;  ///< normalization applied to images / 255
  double std = 1.0;
  std::string name;
  // A text dataset: a sample is a window of block_size tokens and the tokens that follow.
  torch::Tensor tokens;     ///< uint8 [L], the byte corpus of this split
  int64_t block_size = 0;   ///< tokens per window
  int64_t windows = 0;      ///< samples: windows per epoch (train) or in the split (validation)

  bool is_text() const { return tokens.defined(); }
  int64_t size() const { return is_text() ? windows : labels.defined() ? labels.size(0) : 0; }
  int64_t channels() const { return images.size(1); }
  int64_t height() const { return images.size(2); }
  int64_t width() const { return images.size(3); }
  /// First `n` samples (or all when n <= 0 or n >= size()).
  Dataset head(int64_t n) const;
};

/// Reads one IDX file (gzip'd or plain): uint8 data with 1 to 4 dimensions. Throws DataError
/// naming the file on a missing file, a wrong magic number or a truncated body.
torch::Tensor read_idx(const std::string& path);
/// The sizes an IDX file's header gives, checked as read_idx checks them, without reading the
/// data (what a config's data will hold, before it is loaded).
std::vector<int64_t> idx_shape(const std::string& path);
/// Writes an IDX file, gzip'd when the path ends in .gz (used by tests and tools).
void write_idx(const std::string& path, const torch::Tensor& data);

/// The default place of Debian's dataset-fashion-mnist package.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
/// Fashion-MNIST's train (60k) or test (10k) split from `dir`; the error names the package
/// to install when the files are missing.
Dataset load_fashion_mnist(const std::string& dir, bool train);
/// Throws the same DataError as load_fashion_mnist when any of the four files is missing.
void check_fashion_mnist(const std::string& dir);
/// The images file of Fashion-MNIST's train or test split in `dir`.
std::string fashion_mnist_images(const std::string& dir, bool train);

/// Random images of any shape and class count; labels depend on the images (a fixed random
/// linear rule), so a model can learn them. Same seed, same data.
Dataset make_synthetic(int64_t n, int64_t channels, int64_t height, int64_t width,
                       int64_t num_classes, uint64_t seed);

/// The bytes of `paths` as one text corpus: files as named, folders' regular files recursively
/// in path order (symbolic links and binary files, with a NUL byte in their first 8 KiB,
/// skipped). The last tenth is the validation split; training
/// draws `windows` random windows of `block_size` tokens per epoch (0 = train bytes /
/// block_size), validation reads consecutive windows. Throws DataError naming the path for a
/// missing or unreadable file, an empty corpus or one shorter than a window in either split.
Dataset load_text(const std::vector<std::string>& paths, int64_t block_size, int64_t windows,
                  bool train);
/// The same split of corpus bytes held in memory; `source` names them in errors.
Dataset text_dataset(const std::string& corpus, int64_t block_size, int64_t windows, bool train,
                     const std::string& source = "the corpus");
/// The files load_text reads for `paths`, in order (a folder's regular files, recursively,
/// sorted; symbolic links and binary files skipped). Throws DataError for a path that does not exist.
std::vector<std::string> text_files(const std::vector<std::string>& paths);

/// The window starts of one epoch of a text dataset (see DataLoader).
std::vector<int64_t> text_window_starts(const Dataset& d, bool shuffle, uint64_t seed);

struct Batch {
  torch::Tensor x;  ///< float [B, C, S, S] normalized images, or int64 [B, T] tokens; on the
                    ///< loader's device
  torch::Tensor y;  ///< int64 [B], or int64 [B, T]: the tokens that follow each of x's
  int64_t size() const { return y.size(0); }
  /// Data parallel: the samples of the whole batch, every rank's shard together (0 = size()).
  int64_t total = 0;
  int64_t total_size() const { return total > 0 ? total : size(); }
};

/// Yields batches of a Dataset. The order of epoch e is a permutation drawn from seed + e
/// (std::mt19937_64), the same on every platform and LibTorch version. A shuffled text
/// dataset's epoch e draws its window starts with torch::randint(0, train bytes - block_size,
/// {windows}) from a CPU generator seeded with seed + e (what torch.randint with a Generator
/// seeded the same draws in Python); batch i takes windows i*B .. i*B+B-1 of them, cut to the
/// sequence length. Unshuffled text reads window i at i * block_size.
class DataLoader {
 public:
  DataLoader(Dataset data, int64_t batch_size, bool shuffle, uint64_t seed,
             torch::Device device = torch::kCPU, bool drop_last = false);

  /// Sets the epoch whose order batch() follows and the image size (0 = native).
  void set_epoch(int64_t epoch);
  void set_image_size(int64_t size) { image_size_ = size; }
  int64_t image_size() const { return image_size_; }
  /// Text: tokens per window (0 = the dataset's block_size); at most block_size.
  void set_seq_len(int64_t n) { seq_len_ = n; }
  int64_t seq_len() const { return seq_len_; }
  void set_device(torch::Device d) { device_ = d; }

  int64_t num_batches() const;
  /// The i-th batch of the current epoch (this rank's shard of it, when sharded).
  Batch batch(int64_t i) const;

  /// Data parallel (DistributedSampler's semantics on batches): every rank follows the same
  /// seeded order; rank r of `world` takes rows [n*r/world, n*(r+1)/world) of each batch of n
  /// samples, so data.batch_size stays the batch of a step across ranks, shards differ by at
  /// most one sample, and no sample is repeated. A last batch with fewer samples than ranks is
  /// dropped (every rank runs the same number of batches, none of them empty).
  void set_shard(int rank, int world);
  int shard_rank() const { return shard_rank_; }
  int shard_world() const { return shard_world_; }
  /// Samples in batch i across every rank.
  int64_t batch_samples(int64_t i) const;

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
  int64_t seq_len_ = 0;
  std::vector<int64_t> order_;  ///< sample indices, or a text epoch's window starts
  int shard_rank_ = 0, shard_world_ = 1;

  Batch text_batch(int64_t start, int64_t count) const;
  Batch batch_rows(int64_t start, int64_t count) const;
};

/// Normalizes uint8 images and resizes them to size x size (bilinear; 0 keeps the size).
torch::Tensor prepare_images(const torch::Tensor& images_u8, double mean, double std,
                             int64_t size);

}  // namespace frugal
