#pragma once
/// Datasets held in memory: uint8 images [N, C, H, W] with int64 labels [N], float tabular
/// features [N, F] (csv) with int64 labels or float regression targets [N], or a byte corpus
/// (text) read as windows of tokens; a loader that yields batches in a seeded order, resized to
/// the stage's image size or cut to the stage's sequence length, images augmented by a seeded
/// per-epoch draw.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal {

class Tokenizer;
struct DataOptions;

/// Seeded image augmentations of a training split (make_dataset sets them from data.flip and
/// data.crop_padding for the training split only; validation is never augmented).
struct Augment {
  bool flip = false;         ///< mirror left-right with probability 1/2
  int64_t crop_padding = 0;  ///< pad every side by this many pixels (value 0), crop back at random
  bool active() const { return flip || crop_padding > 0; }
};

struct Dataset {
  torch::Tensor images;  ///< uint8 [N, C, H, W]
  torch::Tensor labels;  ///< int64 [N] classes, or float [N] regression targets
  /// Tabular data (csv): float [N, F], each column standardized with the training split's mean
  /// and standard deviation. A batch's x is [B, F]; channels() is F and the image size 1, so an
  /// mlp (flatten, Linear(F, ...)) takes it as it is.
  torch::Tensor features;
  int64_t num_classes = 0;  ///< classes, the vocabulary (256 bytes) of a text dataset, or 1
                            ///< (the one output) of a regression
  double mean = 0.0;  ///< normalization applied to images / 255
  double std = 1.0;
  std::string name;
  // A text dataset: a sample is a window of block_size tokens and the tokens that follow.
  torch::Tensor tokens;     ///< uint8 [L] (bytes) or int32 [L] (subword tokens) of this split
  /// float [vocabulary]: the bytes each token stands for (1 for every byte token), so validation
  /// reports bits per byte, comparable between tokenizers. Undefined: 1 byte per token.
  torch::Tensor token_bytes;
  /// The tokenizer of a subword corpus (saved into the run folder); null for bytes.
  std::shared_ptr<const Tokenizer> tokenizer;
  int64_t block_size = 0;   ///< tokens per window
  int64_t windows = 0;      ///< samples: windows per epoch (train) or in the split (validation)
  Augment augment;          ///< applied to the training batches of an image dataset
  /// Class names in label order (image_folder: the sub-folders; csv classification: the label
  /// values); empty when the labels are only numbers.
  std::vector<std::string> classes;
  /// Tabular data: the feature columns' names and the training split's mean and standard
  /// deviation of each (what a prediction standardizes a new row with).
  std::vector<std::string> feature_names;
  std::vector<double> feature_mean, feature_std;

  bool is_text() const { return tokens.defined(); }
  bool is_tabular() const { return features.defined(); }
  /// Float targets: a regression (the task is Regression, the loss mse).
  bool is_regression() const { return labels.defined() && labels.is_floating_point(); }
  int64_t size() const { return is_text() ? windows : labels.defined() ? labels.size(0) : 0; }
  int64_t channels() const { return is_tabular() ? features.size(1) : images.size(1); }
  int64_t height() const { return is_tabular() ? 1 : images.size(2); }
  int64_t width() const { return is_tabular() ? 1 : images.size(3); }
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

/// One PNG or JPEG file as uint8 [channels, size, size] (converted and resized as image_folder
/// does). Throws DataError naming the file.
torch::Tensor decode_image(const std::string& file, int64_t channels, int64_t size);

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
/// With a tokenizer (null = bytes) the split's text is encoded (int32 tokens) and the sizes
/// above count tokens.
Dataset load_text(const std::vector<std::string>& paths, int64_t block_size, int64_t windows,
                  bool train, std::shared_ptr<const Tokenizer> tokenizer = nullptr);
/// A held-out corpus: training reads every byte of `paths` (no tenth kept back) and validation
/// every byte of `valid_paths` (data.valid_path), in consecutive windows.
Dataset load_text(const std::vector<std::string>& paths, const std::vector<std::string>& valid_paths,
                  int64_t block_size, int64_t windows, bool train,
                  std::shared_ptr<const Tokenizer> tokenizer = nullptr);
/// The tokenizer data.tokenizer names: null for "bytes"; sentencepiece loaded from
/// data.tokenizer_path or trained on the training text (the first 90% of data.paths, or all of
/// it with a data.valid_path), gpt2 from data.tokenizer_path. Built once per process for the
/// same options (training and validation share it). Throws DataError naming what failed.
std::shared_ptr<const Tokenizer> text_tokenizer(const DataOptions& o);
/// The vocabulary data.tokenizer gives (256 for bytes; a trained sentencepiece's vocab_size, an
/// existing one's pieces) without reading the corpus.
int64_t text_vocab_size(const DataOptions& o);
/// The same split of corpus bytes held in memory; `source` names them in errors.
Dataset text_dataset(const std::string& corpus, int64_t block_size, int64_t windows, bool train,
                     const std::string& source = "the corpus",
                     std::shared_ptr<const Tokenizer> tokenizer = nullptr);
/// The files load_text reads for `paths`, in order (a folder's regular files, recursively,
/// sorted; symbolic links and binary files skipped). Throws DataError for a path that does not exist.
std::vector<std::string> text_files(const std::vector<std::string>& paths);

/// An image folder: one sub-folder of `dir` per class, its PNG and JPEG files (.png, .jpg, .jpeg,
/// any case; other files are skipped) the class's images. Classes are the sub-folder names
/// sorted; label i is the i-th. Decoded with stb_image (libstb-dev), converted to `channels` (1 =
/// grey, 3 = RGB), resized to size x size with stb_image_resize, and CACHED IN MEMORY as uint8
/// [N, C, size, size]: frugal does not stream images. The bytes needed are checked against the
/// machine's physical memory before any file is decoded; more than it has is a DataError naming
/// the folder, the count and the bytes (lower data.image_size or use fewer images).
/// `classes`: the class names to use (a validation folder takes the training folder's: a
/// sub-folder not among them is an error; a class with no folder has no samples); empty = the
/// folder's own. Throws DataError naming the folder or the file (and what is wrong: no class
/// sub-folders, an image outside one, a class without images, a file that does not decode).
Dataset load_image_folder(const std::string& dir, int64_t channels, int64_t size,
                          const std::vector<std::string>& classes = {});
/// The files load_image_folder reads and their labels, without decoding them.
struct ImageFolderListing {
  std::vector<std::string> classes;
  std::vector<std::string> files;
  std::vector<int64_t> labels;
};
ImageFolderListing list_image_folder(const std::string& dir,
                                     const std::vector<std::string>& classes = {});

/// How load_csv reads a file.
struct CsvSpec {
  std::string label_column;  ///< the label's header name; "" = the last column
  bool regression = false;   ///< float targets, else class labels
};
/// A CSV file with a header row: numeric feature columns and one label column (RFC 4180
/// fields: quoted fields may hold commas and "" quotes; blank lines are skipped). Features are
/// standardized with the mean and standard deviation of `train_path`'s columns (the same file
/// for the training split). Classification: each distinct label value (text) is a class; classes
/// are sorted (numerically when every label is a number) from `train_path`'s labels.
/// Regression: the label is a float target. Throws DataError naming file:line (and column
/// number and name) for a row with the wrong field count, a field that is not a finite number,
/// a validation label not in the training classes, a missing label column or an empty file.
Dataset load_csv(const std::string& path, const CsvSpec& spec, const std::string& train_path);
/// What a CSV's training split gave: its feature columns, their means and standard deviations,
/// its classes (a run folder's data.json keeps them).
struct CsvStats {
  std::vector<std::string> names;
  std::vector<double> mean, sd;
  std::vector<std::string> classes;  ///< empty for a regression
};
/// The same, standardized and labelled with `train` instead of reading the training file (a
/// run folder scored after its training data moved).
Dataset load_csv(const std::string& path, const CsvSpec& spec, const CsvStats& train);
/// What load_csv would hold for `path`, read without building tensors: rows, feature columns
/// and (classification) distinct labels. Same errors as load_csv.
struct CsvShape {
  int64_t rows = 0, features = 0, classes = 0;
};
CsvShape csv_shape(const std::string& path, const CsvSpec& spec);

/// The window starts of one epoch of a text dataset (see DataLoader).
std::vector<int64_t> text_window_starts(const Dataset& d, bool shuffle, uint64_t seed);

struct Batch {
  torch::Tensor x;  ///< float [B, C, S, S] normalized images, float [B, F] features, or int64
                    ///< [B, T] tokens; on the loader's device
  torch::Tensor y;  ///< int64 [B], float [B] targets, or int64 [B, T]: the tokens that follow
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
/// An image dataset with an active Augment draws, for epoch e, a flip bit and a crop offset
/// (dy, dx in [0, 2 * crop_padding]) for every position of the epoch from its own mt19937_64
/// seeded with seed + e + kAugmentStream; batch i augments positions i*B .. i*B+B-1 after
/// normalizing and resizing. The draw is a function of (seed, epoch, position) only, so a
/// resumed run (set_epoch(e), then batch i) sees the same augmented batches as one that never
/// stopped, and there is no augmentation state to checkpoint.
class DataLoader {
 public:
  /// Keeps augmentation's draws apart from the shuffle's (seed + e).
  static constexpr uint64_t kAugmentStream = 0xA06D'E7A1'5EED'0001ULL;

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
  /// dropped (every rank runs the same number of batches, none of them empty) unless
  /// `every_sample` (validation: a rank may then have no row of that batch; rows(i) says).
  void set_shard(int rank, int world, bool every_sample = false);
  /// This rank's rows of batch i (0 only for a last batch kept by every_sample).
  int64_t rows(int64_t i) const;
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
  /// This epoch's augmentation per position: flip bit, crop offsets (empty: none).
  struct AugmentDraw {
    bool flip;
    int32_t dy, dx;
  };
  std::vector<AugmentDraw> augment_;
  int shard_rank_ = 0, shard_world_ = 1;
  bool shard_every_sample_ = false;

  Batch text_batch(int64_t start, int64_t count) const;
  Batch tabular_batch(int64_t start, int64_t count) const;
  void augment_batch(torch::Tensor& x, int64_t start) const;
  Batch batch_rows(int64_t start, int64_t count) const;
};

/// Augments a float batch [B, C, H, W] in place: sample i flipped left-right when flip[i], then
/// padded by `padding` pixels of value `pad_value` on every side and cropped back to H x W at
/// (dy[i], dx[i]) of the padded image (an offset of `padding` is the identity).
void augment_images(torch::Tensor& x, const std::vector<bool>& flip, const std::vector<int32_t>& dy,
                    const std::vector<int32_t>& dx, int64_t padding, double pad_value);

/// Normalizes uint8 images and resizes them to size x size (bilinear; 0 keeps the size).
torch::Tensor prepare_images(const torch::Tensor& images_u8, double mean, double std,
                             int64_t size);

}  // namespace frugal
