// Text datasets: a byte corpus from files and folders, cut into windows of tokens.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <map>
#include <mutex>

#include <spdlog/spdlog.h>

#include "frugal/base/error.h"
#include "frugal/config/sections.h"
#include "frugal/data/data.h"
#include "frugal/data/tokenizer.h"

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
                      int64_t need, const char* unit = "bytes") {
  return "text data: " + source + " hold " + std::to_string(n) + " " + unit + ", too few for windows of "
         "block_size " + std::to_string(block_size) + ": " + split + " needs " + std::to_string(need) +
         "; use more text or a smaller block_size";
}

/// The bytes each token of `tok` stands for.
torch::Tensor token_byte_counts(const Tokenizer& tok) {
  auto t = torch::empty({tok.vocab_size()}, torch::kFloat);
  auto* p = t.data_ptr<float>();
  for (int32_t id = 0; id < tok.vocab_size(); ++id) p[id] = static_cast<float>(tok.token_text(id).size());
  return t;
}

/// The tokens of one split as training (random windows) or validation (consecutive windows).
Dataset text_windows(torch::Tensor tokens, int64_t block_size, int64_t windows, bool train,
                     const std::shared_ptr<const Tokenizer>& tok) {
  const int64_t count = tokens.numel();
  Dataset d;
  d.tokens = std::move(tokens);
  d.block_size = block_size;
  d.windows = train ? (windows > 0 ? windows : count / block_size) : (count - 1) / block_size;
  d.num_classes = tok ? tok->vocab_size() : 256;
  d.name = "text";
  if (tok) {
    d.tokenizer = tok;
    d.token_bytes = token_byte_counts(*tok);
  }
  return d;
}

bool printable_ascii(char c) { return c > ' ' && c < 0x7F; }

/// Where the next piece of `text` from `from` ends: past `from + 1 MiB`, after a newline between
/// two printable ASCII characters ("a\nb"). No token of SentencePiece (line by line) or GPT-2's
/// pattern (a lone newline between non-spaces is a token of its own) spans such a cut, so the
/// pieces encode as the whole would, and the encoder's working memory stays a piece's.
size_t piece_end(std::string_view text, size_t from) {
  constexpr size_t kPiece = size_t{1} << 20;
  for (size_t i = from + kPiece; i + 1 < text.size(); ++i)
    if (text[i] == '\n' && printable_ascii(text[i - 1]) && printable_ascii(text[i + 1])) return i + 1;
  return text.size();
}

/// `count` bytes of `corpus` from `first`: bytes (uint8) or, with a tokenizer, its ids (int32).
torch::Tensor split_tokens(const std::string& corpus, int64_t first, int64_t count, const Tokenizer* tok) {
  if (!tok) {
    auto t = torch::empty({count}, torch::kUInt8);
    std::copy_n(corpus.data() + first, count, t.data_ptr<uint8_t>());
    return t;
  }
  const std::string_view text = std::string_view(corpus).substr(first, count);
  std::vector<int32_t> ids;
  for (size_t at = 0; at < text.size();) {
    const size_t end = piece_end(text, at);
    const std::vector<int32_t> piece = tok->encode(text.substr(at, end - at));
    ids.insert(ids.end(), piece.begin(), piece.end());
    at = end;
  }
  auto t = torch::empty({static_cast<int64_t>(ids.size())}, torch::kInt);
  std::copy(ids.begin(), ids.end(), t.data_ptr<int32_t>());
  return t;
}

/// A split's tokens, refused when too few for its windows (a training window needs block_size +
/// 1 tokens and one start to draw; validation one whole window).
torch::Tensor enough_tokens(torch::Tensor t, const std::shared_ptr<const Tokenizer>& tok, int64_t block_size,
                            bool train, const std::string& source, const std::string& split) {
  const int64_t need = train ? block_size + 2 : block_size + 1;
  if (t.numel() < need)
    throw_data_error(too_short(source, t.numel(), block_size, split, need, tok ? "tokens" : "bytes"));
  return t;
}

}  // namespace

Dataset text_dataset(const std::string& corpus, int64_t block_size, int64_t windows, bool train,
                     const std::string& source, std::shared_ptr<const Tokenizer> tokenizer) {
  if (block_size < 2) throw_data_error("text data: block_size must be >= 2");
  const auto n = static_cast<int64_t>(corpus.size());
  if (n == 0) throw_data_error("text data: " + source + " hold no bytes");
  const int64_t n_valid = n / 10, n_train = n - n_valid;
  if (!tokenizer && (n_train < block_size + 2 || n_valid < block_size + 1))
    throw_data_error(too_short(source, n, block_size, "the training split (the first 90%) needs " +
                               std::to_string(block_size + 2) + " and the validation split (the last "
                               "10%)", block_size + 1));
  // Each split is encoded on its own: no token spans the cut.
  const int64_t first = train ? 0 : n_train, count = train ? n_train : n_valid;
  auto tokens = enough_tokens(split_tokens(corpus, first, count, tokenizer.get()), tokenizer, block_size, train,
                              source, train ? "the training split (the first 90%)" : "the validation split (the last 10%)");
  return text_windows(std::move(tokens), block_size, train ? windows : 0, train, tokenizer);
}

Dataset load_text(const std::vector<std::string>& paths, int64_t block_size, int64_t windows, bool train,
                  std::shared_ptr<const Tokenizer> tokenizer) {
  return text_dataset(read_corpus(text_files(paths)), block_size, windows, train, joined(paths),
                      std::move(tokenizer));
}

Dataset load_text(const std::vector<std::string>& paths, const std::vector<std::string>& valid_paths,
                  int64_t block_size, int64_t windows, bool train, std::shared_ptr<const Tokenizer> tokenizer) {
  if (block_size < 2) throw_data_error("text data: block_size must be >= 2");
  const std::vector<std::string>& from = train ? paths : valid_paths;
  const std::string corpus = read_corpus(text_files(from));
  const auto n = static_cast<int64_t>(corpus.size());
  auto tokens = enough_tokens(split_tokens(corpus, 0, n, tokenizer.get()), tokenizer, block_size, train, joined(from),
                              train ? "training" : "validation (data.valid_path)");
  return text_windows(std::move(tokens), block_size, windows, train, tokenizer);
}

namespace {

/// A sentencepiece model named by data.tokenizer_path: the file, or tokenizer.model in the folder.
std::string sentencepiece_file(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) ? (fs::path(path) / "tokenizer.model").string() : path;
}

std::shared_ptr<const Tokenizer> build_tokenizer(const DataOptions& o) {
  if (o.tokenizer == "gpt2")
    return load_tokenizer("gpt2", o.tokenizer_path);
  if (!o.tokenizer_path.empty()) return load_sentencepiece(sentencepiece_file(o.tokenizer_path));
  // Trained on the training text only: the held-out tenth stays unseen.
  std::string corpus = read_corpus(text_files(o.paths));
  if (o.valid_path.empty()) corpus.resize(corpus.size() - corpus.size() / 10);
  spdlog::info("training a sentencepiece {} tokenizer of {} pieces on {} bytes of text", o.tokenizer_model,
               o.vocab_size, corpus.size());
  return train_sentencepiece(corpus, o.vocab_size, o.tokenizer_model);
}

}  // namespace

std::shared_ptr<const Tokenizer> text_tokenizer(const DataOptions& o) {
  if (o.tokenizer == "bytes") return nullptr;
  static std::mutex m;
  static std::map<std::string, std::shared_ptr<const Tokenizer>> built;
  std::string key = o.tokenizer + "|" + o.tokenizer_path + "|";
  if (o.tokenizer_path.empty())  // trained: on which text, how
    key += o.tokenizer_model + "|" + std::to_string(o.vocab_size) + "|" + std::to_string(o.valid_path.empty()) + "|" +
           joined(o.paths);
  std::lock_guard<std::mutex> g(m);
  auto& t = built[key];
  if (!t) t = build_tokenizer(o);
  return t;
}

int64_t text_vocab_size(const DataOptions& o) {
  if (o.tokenizer == "bytes") return 256;
  if (o.tokenizer == "sentencepiece" && o.tokenizer_path.empty()) return o.vocab_size;
  return text_tokenizer(o)->vocab_size();
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

namespace {
template <class T>
void gather_windows(const torch::Tensor& tokens, const std::vector<int64_t>& order, int64_t start, int64_t count,
                    int64_t t, torch::Tensor& x, torch::Tensor& y) {
  const T* src = tokens.data_ptr<T>();
  T *xs = x.data_ptr<T>(), *ys = y.data_ptr<T>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = order[static_cast<size_t>(start + i)];
    std::copy_n(src + s, t, xs + i * t);
    std::copy_n(src + s + 1, t, ys + i * t);
  }
}
}  // namespace

Batch DataLoader::text_batch(int64_t start, int64_t count) const {
  const int64_t t = seq_len_ > 0 ? std::min(seq_len_, data_.block_size) : data_.block_size;
  const auto type = data_.tokens.scalar_type();  // uint8 bytes or int32 subword ids
  auto x = torch::empty({count, t}, type), y = torch::empty({count, t}, type);
  if (type == torch::kUInt8)
    gather_windows<uint8_t>(data_.tokens, order_, start, count, t, x, y);
  else
    gather_windows<int32_t>(data_.tokens, order_, start, count, t, x, y);
  Batch b;
  b.x = x.to(device_, torch::kLong);  // one copy: to the device and to int64 together
  b.y = y.to(device_, torch::kLong);
  return b;
}

}  // namespace frugal
