// Tokenizers: bytes, SentencePiece (trained with byte fallback, lossless) and GPT-2's byte-level BPE.
#include "frugal/data/tokenizer.h"

#include <dlfcn.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <climits>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_map>

#include "frugal/base/error.h"
#include "sentencepiece_shim.h"

#if defined(__SANITIZE_ADDRESS__)
#define FRUGAL_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FRUGAL_ASAN 1
#endif
#endif

namespace frugal {
namespace {

std::string read_whole(const std::string& path, const std::string& who) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_data_error(who + ": cannot read '" + path + "' (missing or unreadable)");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw_data_error(who + ": error reading '" + path + "'");
  return s;
}

std::string save_file(const std::string& folder, const std::string& name, const std::string& bytes) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) throw_data_error("tokenizer: cannot create folder '" + folder + "': " + ec.message());
  // Written beside, then renamed over: a reader never sees half a file.
  const std::string path = (std::filesystem::path(folder) / name).string(), part = path + ".part";
  {
    std::ofstream out(part, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw_data_error("tokenizer: cannot write '" + part + "'");
  }
  std::filesystem::rename(part, path, ec);
  if (ec) throw_data_error("tokenizer: cannot rename '" + part + "' to '" + path + "': " + ec.message());
  return name;
}

/// `id`, if in [0, vocab); else throws naming it and the vocab size.
int32_t check_id(int32_t id, int64_t vocab, const std::string& kind) {
  if (id < 0 || id >= vocab)
    throw_data_error(kind + " tokenizer: cannot decode id " + std::to_string(id) + ": ids run over [0, " +
                     std::to_string(vocab) + ") (vocab size " + std::to_string(vocab) + ")");
  return id;
}

/// The UTF-8 character at s[i]: its length in bytes; *cp is its code point, or -1 for a byte that
/// does not start a well-formed sequence (Unicode's table 3-7: no overlongs, surrogates or
/// code points past U+10FFFF), which counts as a character of its own (length 1).
int utf8_char(std::string_view s, size_t i, int32_t* cp) {
  const auto at = [&](size_t k) { return i + k < s.size() ? static_cast<uint8_t>(s[i + k]) : 0; };
  const uint8_t c = at(0);
  *cp = c < 0x80 ? c : -1;
  if (c < 0x80) return 1;
  const int n = c < 0xC2 ? 0 : c <= 0xDF ? 2 : c <= 0xEF ? 3 : c <= 0xF4 ? 4 : 0;
  if (n == 0) return 1;
  // the second byte's range: no overlongs (E0, F0), surrogates (ED) or code points past U+10FFFF (F4)
  const uint8_t lo = c == 0xE0 ? 0xA0 : (c == 0xF0 ? 0x90 : 0x80);
  const uint8_t hi = c == 0xED ? 0x9F : (c == 0xF4 ? 0x8F : 0xBF);
  int32_t v = c & (0x7F >> n);
  for (int k = 1; k < n; ++k) {
    const uint8_t d = at(k);  // 0 past the end: not a continuation byte
    if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) return 1;
    v = (v << 6) | (d & 0x3F);
  }
  *cp = v;
  return n;
}

class ByteTokenizer : public Tokenizer {
 public:
  std::string kind() const override { return "bytes"; }
  int64_t vocab_size() const override { return 256; }
  std::vector<int32_t> encode(std::string_view text) const override {
    const auto* p = reinterpret_cast<const uint8_t*>(text.data());
    return std::vector<int32_t>(p, p + text.size());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) s[i] = static_cast<char>(check_id(ids[i], 256, "bytes"));
    return s;
  }
  std::vector<std::string> save(const std::string&) const override { return {}; }
};

const std::string kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space

/// libfrugal_sentencepiece.so's functions (framework/shim/sentencepiece_shim.h says why frugal
/// reaches SentencePiece only through it). Loaded once, from FRUGAL_SENTENCEPIECE_LIBRARY if set,
/// else from the folder libfrugal itself was loaded from.
struct Spm {
  decltype(&frugal_spm_train) train;
  decltype(&frugal_spm_load) load;
  decltype(&frugal_spm_size) size;
  decltype(&frugal_spm_piece) piece;
  decltype(&frugal_spm_encode) encode;
  decltype(&frugal_spm_free) free;
  decltype(&frugal_spm_release) release;

  /// A message from the shim, released.
  std::string take(char* err) const {
    std::string m = err ? err : "unknown error";
    release(err);
    return m;
  }
};

std::string shim_path() {
  if (const char* p = std::getenv("FRUGAL_SENTENCEPIECE_LIBRARY"); p && *p) return p;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&byte_tokenizer), &info) && info.dli_fname)
    return (std::filesystem::path(info.dli_fname).parent_path() / "libfrugal_sentencepiece.so").string();
  return "libfrugal_sentencepiece.so";
}

template <class F>
void bind(void* lib, const char* name, F& f, const std::string& path) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) throw_data_error("sentencepiece: '" + path + "' has no " + name + ": not frugal's shim");
}

const Spm& spm() {
  static const Spm s = [] {
#ifdef FRUGAL_ASAN
    throw_data_error("sentencepiece: not available in an AddressSanitizer build (its library is loaded with "
                     "RTLD_DEEPBIND, which the sanitizer refuses); use data.tokenizer = \"bytes\" or \"gpt2\"");
#endif
    const std::string path = shim_path();
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!lib)
      throw_data_error("sentencepiece: cannot load '" + path + "' (" + dlerror() +
                       "); it is built and installed beside libfrugal (Debian's libsentencepiece0 must be present)");
    Spm r{};
    bind(lib, "frugal_spm_train", r.train, path);
    bind(lib, "frugal_spm_load", r.load, path);
    bind(lib, "frugal_spm_size", r.size, path);
    bind(lib, "frugal_spm_piece", r.piece, path);
    bind(lib, "frugal_spm_encode", r.encode, path);
    bind(lib, "frugal_spm_free", r.free, path);
    bind(lib, "frugal_spm_release", r.release, path);
    return r;
  }();
  return s;
}

class SentencePieceTokenizer : public Tokenizer {
 public:
  /// `source` names the model in errors (a file, or "the trained model").
  SentencePieceTokenizer(std::string proto, const std::string& source) : proto_(std::move(proto)) {
    char* err = nullptr;
    sp_.reset(spm().load(proto_.data(), proto_.size(), &err));
    if (!sp_) throw_data_error("sentencepiece: " + source + " is not a SentencePiece model: " + spm().take(err));
    const int size = spm().size(sp_.get());
    surface_.resize(static_cast<size_t>(size));
    byte_id_.fill(-1);
    for (int id = 0; id < size; ++id) surface_[id] = spell(id);
    const auto missing = std::find(byte_id_.begin(), byte_id_.end(), -1);
    if (missing != byte_id_.end())
      throw_data_error("sentencepiece: " + source + " has no piece for byte " +
                       std::to_string(missing - byte_id_.begin()) + ": train it with byte_fallback=true");
    check_lossless(source);
  }
  std::string kind() const override { return "sentencepiece"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(surface_.size()); }

  std::vector<int32_t> encode(std::string_view text) const override {
    // SentencePiece would turn an invalid byte into U+FFFD and read U+2581 as a space: those
    // go straight to byte pieces; the runs between them go to SentencePiece.
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 2);
    size_t run = 0;
    for (size_t i = 0; i < text.size();) {
      int32_t cp = 0;
      const int len = utf8_char(text, i, &cp);
      if (cp >= 0 && cp != 0x2581) {
        i += len;
        continue;
      }
      encode_run(text.substr(run, i - run), ids);
      for (int k = 0; k < len; ++k) ids.push_back(byte_id_[static_cast<uint8_t>(text[i + k])]);
      i += len;
      run = i;
    }
    encode_run(text.substr(run), ids);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (const int32_t id : ids) s += surface_[check_id(id, vocab_size(), "sentencepiece")];
    return s;
  }
  std::vector<std::string> save(const std::string& folder) const override {
    return {save_file(folder, "tokenizer.model", proto_)};
  }

 private:
  /// The bytes piece `id` stands for: a byte piece its byte, <unk> and control pieces nothing,
  /// others their text with U+2581 as a space.
  std::string spell(int id) {
    const char* at = nullptr;
    size_t len = 0;
    const int kind = spm().piece(sp_.get(), id, &at, &len);
    const std::string piece(at, len);
    if (kind == kFrugalSpmByte) {
      const int b = std::stoi(piece.substr(3, 2), nullptr, 16);  // "<0xAB>"
      byte_id_[b] = id;
      return std::string(1, static_cast<char>(b));
    }
    if (kind == kFrugalSpmControl) return "";
    if (piece != "\n" && piece.find('\n') != std::string::npos) split_lines_ = false;
    std::string s = piece;
    for (size_t p; (p = s.find(kSpaceSymbol)) != std::string::npos;) s.replace(p, kSpaceSymbol.size(), " ");
    return s;
  }
  /// SentencePiece's ids of `run`, line by line when no piece spans a newline (the same ids, and
  /// SentencePiece's BPE is 5x faster on short inputs).
  void encode_run(std::string_view run, std::vector<int32_t>& ids) const {
    for (size_t pos = 0; pos < run.size();) {
      const size_t nl = split_lines_ ? run.find('\n', pos) : std::string_view::npos;
      const size_t end = nl == std::string_view::npos ? run.size() : nl + 1;
      int* got = nullptr;
      size_t n = 0;
      char* err = nullptr;
      if (spm().encode(sp_.get(), run.data() + pos, end - pos, &got, &n, &err) != 0)
        throw_data_error("sentencepiece: cannot encode text: " + spm().take(err));
      ids.insert(ids.end(), got, got + n);
      spm().release(got);
      pos = end;
    }
  }

  /// A model that adds a dummy prefix, normalizes or collapses whitespace changes the text: its
  /// tokens' bytes would not be the text's (bits per byte, generation). Refused.
  void check_lossless(const std::string& source) const {
    const std::string probe = "Ab c\n  d\te\u00e9 12.\n\nz";
    const std::string back = decode(encode(probe));
    if (back != probe)
      throw_data_error("sentencepiece: " + source + " changes text (\"" + probe + "\" comes back as \"" + back +
                       "\": a dummy prefix, normalization or collapsed whitespace); frugal needs a lossless "
                       "model (identity normalization, add_dummy_prefix=false, remove_extra_whitespaces=false, "
                       "byte_fallback=true): leave data.tokenizer_path empty to train one");
  }

  std::string proto_;  ///< the serialized model: what tokenizer.model holds
  struct Free {
    void operator()(void* p) const { spm().free(p); }
  };
  std::unique_ptr<void, Free> sp_;  ///< the shim's processor
  std::vector<std::string> surface_;    ///< id -> its bytes
  std::array<int32_t, 256> byte_id_{};  ///< byte -> its byte piece
  bool split_lines_ = true;             ///< no piece but "\n" holds a newline
};

/// GPT-2's bytes_to_unicode: the code point that stands for each byte in encoder.json and vocab.bpe
/// (printable Latin-1 stands for itself; the other 68 bytes for U+0100.. in byte order).
std::array<int32_t, 256> byte_to_unicode() {
  std::array<int32_t, 256> m{};
  int32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    m[b] = printable ? b : next++;
  }
  return m;
}

/// The UTF-8 of a code point below U+0800 (bytes_to_unicode's range).
std::string utf8(int32_t cp) {
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return {static_cast<char>(0xC0 | cp >> 6), static_cast<char>(0x80 | (cp & 0x3F))};
}

/// The bytes an encoder.json key stands for; a character outside GPT-2's byte alphabet (as in
/// added special tokens) stands for its own UTF-8.
std::string key_bytes(std::string_view key) {
  static const auto from = [] {
    std::array<int16_t, 512> f;
    f.fill(-1);
    const auto to = byte_to_unicode();
    for (int b = 0; b < 256; ++b) f[to[b]] = static_cast<int16_t>(b);
    return f;
  }();
  std::string s;
  for (size_t i = 0; i < key.size();) {
    int32_t cp = 0;
    const int len = utf8_char(key, i, &cp);
    if (cp >= 0 && cp < 512 && from[cp] >= 0)
      s += static_cast<char>(from[cp]);
    else
      s.append(key.substr(i, len));
    i += len;
  }
  return s;
}

/// What GPT-2's pattern tells apart: \p{L}, \p{N}, \s (Unicode White_Space, as Python's regex
/// module) and the rest (an invalid UTF-8 byte is the rest).
enum CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

CharClass char_class(int32_t cp) {
  if (cp < 0) return kOther;
  if (u_isUWhiteSpace(cp)) return kSpace;
  const uint32_t m = U_GET_GC_MASK(cp);
  return (m & U_GC_L_MASK) ? kLetter : (m & U_GC_N_MASK) ? kNumber : kOther;
}

/// A text as characters: where each starts (byte offset; the text's size last) and its class.
struct Chars {
  std::vector<size_t> at;
  std::vector<uint8_t> cls;
};

Chars split_chars(std::string_view text) {
  Chars c;
  c.at.reserve(text.size() + 1);
  c.cls.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    int32_t cp = 0;
    const int len = utf8_char(text, i, &cp);
    c.at.push_back(i);
    c.cls.push_back(char_class(cp));
    i += len;
  }
  c.at.push_back(text.size());
  return c;
}

/// The end (a character index) of the match of GPT-2's pattern at character i:
/// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t gpt2_match(const Chars& c, std::string_view text, size_t i) {
  const size_t n = c.cls.size();
  const auto is = [&](size_t k, char ch) {
    return k < n && c.at[k + 1] - c.at[k] == 1 && text[c.at[k]] == ch;
  };
  if (is(i, '\'')) {
    for (const char* s : {"s", "t", "re", "ve", "m", "ll", "d"}) {
      size_t k = 0;
      while (s[k] && is(i + 1 + k, s[k])) ++k;
      if (!s[k]) return i + 1 + k;
    }
  }
  const size_t j = is(i, ' ') && i + 1 < n && c.cls[i + 1] != kSpace ? i + 1 : i;
  if (c.cls[j] != kSpace) {  // a run of letters, numbers or the rest, after an optional space
    size_t k = j + 1;
    while (k < n && c.cls[k] == c.cls[j]) ++k;
    return k;
  }
  size_t r = i + 1;
  while (r < n && c.cls[r] == kSpace) ++r;
  return r < n && r - i >= 2 ? r - 1 : r;  // \s+(?!\S) leaves the space before a word to it
}

class Gpt2Tokenizer : public Tokenizer {
 public:
  Gpt2Tokenizer(const std::string& encoder_json, const std::string& vocab_bpe) {
    read_encoder(encoder_json);
    read_merges(vocab_bpe, encoder_json);
  }
  std::string kind() const override { return "gpt2"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(token_.size()); }

  std::vector<int32_t> encode(std::string_view text) const override {
    const Chars c = split_chars(text);
    std::unordered_map<std::string_view, std::vector<int32_t>> cache;  // per call: thread-safe
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3);
    for (size_t i = 0; i < c.cls.size();) {
      const size_t j = gpt2_match(c, text, i);
      const std::string_view word = text.substr(c.at[i], c.at[j] - c.at[i]);
      auto it = cache.find(word);
      if (it == cache.end()) it = cache.emplace(word, bpe(word)).first;
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      i = j;
    }
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (const int32_t id : ids) {
      if (!known_[check_id(id, vocab_size(), "gpt2")])
        throw_data_error("gpt2 tokenizer: cannot decode id " + std::to_string(id) +
                         ": encoder.json has no such id");
      s += token_[id];
    }
    return s;
  }
  std::vector<std::string> save(const std::string& folder) const override {
    return {save_file(folder, "encoder.json", encoder_text_), save_file(folder, "vocab.bpe", merges_text_)};
  }

 private:
  void read_encoder(const std::string& path);
  void read_merges(const std::string& path, const std::string& encoder_path);

  /// GPT-2's bpe(): merges the lowest-ranked adjacent pair, every occurrence left to right, until
  /// no pair has a rank.
  std::vector<int32_t> bpe(std::string_view word) const {
    std::vector<int32_t> w(word.size());
    for (size_t i = 0; i < word.size(); ++i) w[i] = byte_id_[static_cast<uint8_t>(word[i])];
    while (w.size() > 1) {
      int32_t best = INT32_MAX, a = 0, b = 0, ab = 0;
      for (size_t i = 0; i + 1 < w.size(); ++i) {
        const auto it = merge_.find(pair_key(w[i], w[i + 1]));
        if (it != merge_.end() && it->second.first < best)
          std::tie(best, a, b, ab) = std::make_tuple(it->second.first, w[i], w[i + 1], it->second.second);
      }
      if (best == INT32_MAX) break;
      size_t o = 0;
      for (size_t i = 0; i < w.size();) {
        const bool pair = i + 1 < w.size() && w[i] == a && w[i + 1] == b;
        w[o++] = pair ? ab : w[i];
        i += pair ? 2 : 1;
      }
      w.resize(o);
    }
    return w;
  }
  static uint64_t pair_key(int32_t a, int32_t b) {
    return static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 | static_cast<uint32_t>(b);
  }

  std::string encoder_text_, merges_text_;          ///< the files as read: what save() writes
  std::vector<std::string> token_;                  ///< id -> its bytes
  std::vector<bool> known_;                         ///< id -> encoder.json has it
  std::unordered_map<std::string, int32_t> id_of_;  ///< encoder.json key -> id
  std::array<int32_t, 256> byte_id_{};              ///< byte -> id of its one-byte token
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merge_;  ///< pair -> (rank, merged id)
};

void Gpt2Tokenizer::read_encoder(const std::string& path) {
  encoder_text_ = read_whole(path, "gpt2 tokenizer");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(encoder_text_);
  } catch (const nlohmann::json::exception& e) {
    throw_data_error("gpt2 tokenizer: '" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object())
    throw_data_error("gpt2 tokenizer: '" + path + "' must be a JSON object of token: id, not " +
                     j.type_name());
  int64_t max_id = -1;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& v = it.value();
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= INT32_MAX)
      throw_data_error("gpt2 tokenizer: '" + path + "': key \"" + it.key() + "\" has id " + v.dump() +
                       "; ids must be integers in [0, 2^31 - 1)");
    id_of_.emplace(it.key(), v.get<int32_t>());
    max_id = std::max<int64_t>(max_id, v.get<int64_t>());
  }
  token_.assign(static_cast<size_t>(max_id + 1), "");
  known_.assign(token_.size(), false);
  for (const auto& [key, id] : id_of_) {
    if (known_[id])
      throw_data_error("gpt2 tokenizer: '" + path + "': key \"" + key + "\" has id " + std::to_string(id) +
                       ", which another key has too");
    token_[id] = key_bytes(key);
    known_[id] = true;
  }
  const auto to = byte_to_unicode();
  for (int b = 0; b < 256; ++b) {
    const auto it = id_of_.find(utf8(to[b]));
    if (it == id_of_.end())
      throw_data_error("gpt2 tokenizer: '" + path + "' has no token for byte " + std::to_string(b) + " (\"" +
                       utf8(to[b]) + "\"): not a GPT-2 byte-level encoder");
    byte_id_[b] = it->second;
  }
}

void Gpt2Tokenizer::read_merges(const std::string& path, const std::string& encoder_path) {
  merges_text_ = read_whole(path, "gpt2 tokenizer");
  std::string_view rest = merges_text_;
  for (int32_t line_no = 1, rank = 0; !rest.empty(); ++line_no) {
    const size_t end = std::min(rest.find('\n'), rest.size());
    std::string_view line = rest.substr(0, end);
    rest.remove_prefix(std::min(end + 1, rest.size()));
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.substr(0, 8) == "#version")) continue;
    const std::string where = "gpt2 tokenizer: '" + path + "' line " + std::to_string(line_no) + ": ";
    const size_t sp = line.find(' ');
    if (sp == 0 || sp == line.npos || sp + 1 == line.size() || line.find(' ', sp + 1) != line.npos)
      throw_data_error(where + "expected a merge \"a b\" (two symbols, one space), got \"" +
                       std::string(line) + "\"");
    const std::string a(line.substr(0, sp)), b(line.substr(sp + 1)), sym[3] = {a, b, a + b};
    int32_t id[3];
    for (int k = 0; k < 3; ++k) {
      const auto it = id_of_.find(sym[k]);
      if (it == id_of_.end())
        throw_data_error(where + "merge \"" + std::string(line) + "\" names " +
                         (k < 2 ? "the symbol \"" : "(as its result) \"") + sym[k] + "\", which '" +
                         encoder_path + "' does not have");
      id[k] = it->second;
    }
    merge_[pair_key(id[0], id[1])] = {rank++, id[2]};  // a repeated merge keeps its last rank, as encoder.py
  }
}

}  // namespace

std::unique_ptr<Tokenizer> byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> train_sentencepiece(const std::string& corpus, int64_t vocab_size,
                                               const std::string& model_type) {
  if (model_type != "bpe" && model_type != "unigram")
    throw_data_error("sentencepiece: unknown model_type '" + model_type + "'; allowed: \"bpe\", \"unigram\"");
  constexpr int64_t kMinVocab = 256 + 4;  // byte pieces, <unk>, <s>, </s>, newline
  if (vocab_size < kMinVocab)
    throw_data_error("sentencepiece: vocab_size " + std::to_string(vocab_size) +
                     " is too small: the minimum is " + std::to_string(kMinVocab) +
                     " (256 bytes, <unk>, <s>, </s>, newline) + the corpus's characters");
  if (corpus.find_first_not_of('\n') == std::string::npos)
    throw_data_error("sentencepiece: the training corpus holds no text");
  // Lossless: no normalization, no dummy prefix, spaces kept, unseen characters as bytes.
  // minloglevel is process-wide in SentencePiece: its INFO lines are not shown from here on.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", model_type},     {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},  {"remove_extra_whitespaces", "false"},
      {"user_defined_symbols", "\n"}, {"allow_whitespace_only_pieces", "true"},
      {"num_threads", "2"},           {"max_sentence_length", "65536"},
      {"minloglevel", "1"},
  };
  std::vector<const char*> keys, values;
  for (const auto& [k, v] : args) keys.push_back(k.c_str()), values.push_back(v.c_str());
  char *model = nullptr, *err = nullptr;
  size_t model_len = 0;
  if (spm().train(keys.data(), values.data(), static_cast<int>(keys.size()), corpus.data(), corpus.size(), 20240101,
                  &model, &model_len, &err) != 0)
    throw_data_error("sentencepiece: training a " + model_type + " model of " + std::to_string(vocab_size) +
                     " pieces on a corpus of " + std::to_string(corpus.size()) + " bytes failed: " + spm().take(err));
  std::string proto(model, model_len);
  spm().release(model);
  return std::make_unique<SentencePieceTokenizer>(std::move(proto), "the trained model");
}

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_file) {
  return std::make_unique<SentencePieceTokenizer>(read_whole(model_file, "sentencepiece"),
                                                  "'" + model_file + "'");
}

std::unique_ptr<Tokenizer> load_gpt2_bpe(const std::string& encoder_json, const std::string& vocab_bpe) {
  return std::make_unique<Gpt2Tokenizer>(encoder_json, vocab_bpe);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind, const std::string& folder) {
  const auto in = [&](const char* name) { return (std::filesystem::path(folder) / name).string(); };
  if (kind == "bytes") return byte_tokenizer();
  if (kind == "sentencepiece") return load_sentencepiece(in("tokenizer.model"));
  if (kind == "gpt2") {
    // OpenAI's names, or Hugging Face's for the same two files (a downloaded GPT-2 folder).
    const bool hf = !std::filesystem::exists(in("encoder.json")) && std::filesystem::exists(in("vocab.json"));
    return hf ? load_gpt2_bpe(in("vocab.json"), in("merges.txt")) : load_gpt2_bpe(in("encoder.json"), in("vocab.bpe"));
  }
  throw_data_error("tokenizer: unknown kind '" + kind + "'; allowed: \"bytes\", \"sentencepiece\", \"gpt2\"");
}

}  // namespace frugal
