// Text datasets: a byte corpus from files and folders, cut into windows of tokens.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "frugal/base/error.h"
#include "frugal/data/data.h"

namespace frugal {
namespace fs = std::filesystem;

namespace {
/// A NUL byte in the first 8 KiB: a binary file (git's and grep's rule), such as the index
/// files (*.dat) beside Debian's fortunes.
bool looks_binary(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char buf[8192];
  in.read(buf, sizeof buf);
  return std::find(buf, buf + in.gcount(), '\0') != buf + in.gcount();
}
}  // namespace

std::vector<std::string> text_files(const std::vector<std::string>& paths) {
  if (paths.empty()) throw_data_error("text data needs data.paths: files or folders of text");
  std::vector<std::string> files;
  for (const auto& p : paths) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
      continue;
    }
    if (!fs::is_directory(p, ec))
      throw_data_error("text data: '" + p + "' does not exist" +
                       (p.find("fortunes") != std::string::npos
                            ? " (install Debian's fortunes package: apt-get install fortunes)"
                            : ""));
    std::vector<std::string> found;
    for (fs::recursive_directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec))
      if (!it->is_symlink(ec) && it->is_regular_file(ec) && !looks_binary(it->path().string()))
        found.push_back(it->path().string());
    if (ec) throw_data_error("text data: cannot list '" + p + "': " + ec.message());
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

namespace {

std::string read_corpus(const std::vector<std::string>& files) {
  std::string all;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw_data_error("text data: cannot read '" + f + "'");
    all.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) throw_data_error("text data: error reading '" + f + "'");
  }
  return all;
}

std::string joined(const std::vector<std::string>& paths) {
  std::string s;
  for (const auto& p : paths) s += (s.empty() ? "'" : ", '") + p + "'";
  return s;
}

}  // namespace

namespace {

std::string too_short(const std::string& source, int64_t n, int64_t block_size, const std::string& split,
                      int64_t need) {
  return "text data: " + source + " hold " + std::to_string(n) + " bytes, too few for windows of "
         "block_size " + std::to_string(block_size) + ": " + split + " needs " + std::to_string(need) +
         "; use more text or a smaller block_size";
}

/// `count` bytes of `corpus` from `first` as training (random windows) or validation
/// (consecutive windows) tokens.
Dataset text_windows(const std::string& corpus, int64_t first, int64_t count, int64_t block_size,
                     int64_t windows, bool train) {
  Dataset d;
  d.tokens = torch::empty({count}, torch::kUInt8);
  std::copy_n(corpus.data() + first, count, d.tokens.data_ptr<uint8_t>());
  d.block_size = block_size;
  d.windows = train ? (windows > 0 ? windows : count / block_size) : (count - 1) / block_size;
  d.num_classes = 256;
  d.name = "text";
  return d;
}

}  // namespace

Dataset text_dataset(const std::string& corpus, int64_t block_size, int64_t windows, bool train,
                     const std::string& source) {
  if (block_size < 2) throw_data_error("text data: block_size must be >= 2");
  const auto n = static_cast<int64_t>(corpus.size());
  if (n == 0) throw_data_error("text data: " + source + " hold no bytes");
  const int64_t n_valid = n / 10, n_train = n - n_valid;
  // A training window needs block_size + 1 bytes (its targets run one further) and one start to
  // draw; validation needs one whole window.
  if (n_train < block_size + 2 || n_valid < block_size + 1)
    throw_data_error(too_short(source, n, block_size, "the training split (the first 90%) needs " +
                               std::to_string(block_size + 2) + " and the validation split (the last "
                               "10%)", block_size + 1));
  return train ? text_windows(corpus, 0, n_train, block_size, windows, true)
               : text_windows(corpus, n_train, n_valid, block_size, 0, false);
}

Dataset load_text(const std::vector<std::string>& paths, int64_t block_size, int64_t windows,
                  bool train) {
  return text_dataset(read_corpus(text_files(paths)), block_size, windows, train, joined(paths));
}

Dataset load_text(const std::vector<std::string>& paths, const std::vector<std::string>& valid_paths,
                  int64_t block_size, int64_t windows, bool train) {
  if (block_size < 2) throw_data_error("text data: block_size must be >= 2");
  const std::vector<std::string>& from = train ? paths : valid_paths;
  const std::string corpus = read_corpus(text_files(from));
  const auto n = static_cast<int64_t>(corpus.size());
  const int64_t need = train ? block_size + 2 : block_size + 1;
  if (n < need)
    throw_data_error(too_short(joined(from), n, block_size,
                               train ? "training" : "validation (data.valid_path)", need));
  return text_windows(corpus, 0, n, block_size, windows, train);
}

std::vector<int64_t> text_window_starts(const Dataset& d, bool shuffle, uint64_t seed) {
  std::vector<int64_t> starts(static_cast<size_t>(d.windows));
  if (!shuffle) {  // consecutive windows, wrapping around when there are more than fit
    const int64_t fit = (d.tokens.numel() - 1) / d.block_size;
    for (int64_t i = 0; i < d.windows; ++i) starts[i] = (i % fit) * d.block_size;
    return starts;
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t span = d.tokens.numel() - d.block_size;  // starts in [0, span): targets fit
  auto t = torch::randint(0, span, {d.windows}, gen, torch::kLong);
  std::copy_n(t.data_ptr<int64_t>(), d.windows, starts.data());
  return starts;
}

Batch DataLoader::text_batch(int64_t start, int64_t count) const {
  const int64_t t = seq_len_ > 0 ? std::min(seq_len_, data_.block_size) : data_.block_size;
  auto x = torch::empty({count, t}, torch::kUInt8), y = torch::empty({count, t}, torch::kUInt8);
  const uint8_t* src = data_.tokens.data_ptr<uint8_t>();
  uint8_t *xs = x.data_ptr<uint8_t>(), *ys = y.data_ptr<uint8_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = order_[static_cast<size_t>(start + i)];
    std::copy_n(src + s, t, xs + i * t);
    std::copy_n(src + s + 1, t, ys + i * t);
  }
  Batch b;
  b.x = x.to(device_, torch::kLong);  // one copy: to the device and to int64 together
  b.y = y.to(device_, torch::kLong);
  return b;
}

}  // namespace frugal
