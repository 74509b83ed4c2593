// Tokenizers: bytes, SentencePiece (lossless on any bytes, saved and loaded, deterministic) and
// GPT-2's byte-level BPE (ids equal to a Python reference of encoder.py), and their errors.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "frugal/base/error.h"
#include "frugal/data/data.h"
#include "frugal/data/tokenizer.h"

// An AddressSanitizer build cannot load SentencePiece (its shim needs RTLD_DEEPBIND, which the
// sanitizer refuses; data/tokenizer.cpp says so in its error).
#if defined(__SANITIZE_ADDRESS__)
#define FRUGAL_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FRUGAL_TEST_ASAN 1
#endif
#endif
#ifdef FRUGAL_TEST_ASAN
#define SKIP_WITHOUT_SENTENCEPIECE() GTEST_SKIP() << "no SentencePiece in an AddressSanitizer build"
#else
#define SKIP_WITHOUT_SENTENCEPIECE() static_cast<void>(0)
#endif

namespace frugal {
namespace {
namespace fs = std::filesystem;

/// A fresh folder under gtest's temp dir, removed with everything in it.
struct TempFolder {
  TempFolder() {
    std::string tmpl = (fs::path(::testing::TempDir()) / "frugal_tokenizer_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path = tmpl;
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path) / name).string(); }
  std::string path;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not a DataError) ") + e.what();
  }
  return "(no error)";
}

/// Every byte value, twice: in order and reversed.
std::string all_bytes() {
  std::string s;
  for (int b = 0; b < 256; ++b) s += static_cast<char>(b);
  return s + std::string(s.rbegin(), s.rend());
}

/// What a tokenizer must get back byte for byte: lines, tabs, runs of spaces, trailing spaces,
/// CRLF, accents, CJK, emoji, U+2581 (SentencePiece's space), U+2047 (its <unk>), invalid UTF-8.
std::string tricky_text() {
  return "\nFirst line.\n\tTabbed\tline\t\n  two leading, three trailing   \n\n\n"
         "Windows\r\nline\r\n caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80!"
         " \xE2\x96\x81 lower-eighth \xE2\x81\x87 unk\n"
         "bad \xFF\xFE bytes \xC3 ( \xED\xA0\x80 \xF4\x90\x80\x80 end   ";
}

/// The training corpus: the first 100 KB of Debian's fortunes (text files, not *.dat or *.u8), or
/// as much generated text.
const std::string& corpus() {
  static const std::string text = [] {
    std::string s;
    std::error_code ec;
    std::vector<fs::path> files;
    for (fs::directory_iterator it("/usr/share/games/fortunes", ec), end; !ec && it != end; it.increment(ec))
      if (it->is_regular_file(ec) && it->path().extension() != ".dat" && it->path().extension() != ".u8")
        files.push_back(it->path());
    std::sort(files.begin(), files.end());
    for (size_t i = 0; i < files.size() && s.size() < 100000; ++i) s += read_bytes(files[i].string());
    const char* words[] = {"the",
                           "cat",
                           "sat",
                           "on",
                           "a",
                           "mat",
                           "and",
                           "it's",
                           "1984",
                           "caf\xC3\xA9",
                           "\xE6\x97\xA5\xE6\x9C\xAC",
                           "don't",
                           "x",
                           "(",
                           ")",
                           "--"};
    std::mt19937 rng(7);
    while (s.size() < 100000) {
      s += words[rng() % 16];
      s += rng() % 9 == 0 ? "\n" : rng() % 13 == 0 ? "\t" : rng() % 11 == 0 ? "  " : " ";
    }
    return s.substr(0, 100000);
  }();
  return text;
}

const std::map<std::string, int64_t> kVocab = {{"bpe", 1000}, {"unigram", 500}};

/// One trained model per type, shared by the tests (unigram training is the slow part).
const Tokenizer& trained(const std::string& type) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> models;
  auto& m = models[type];
  if (!m) m = train_sentencepiece(corpus(), kVocab.at(type), type);
  return *m;
}

TEST(Tokenizer, BytesAreTheirOwnIds) {
  const auto t = byte_tokenizer();
  EXPECT_EQ(t->kind(), "bytes");
  EXPECT_EQ(t->vocab_size(), 256);
  EXPECT_EQ(t->encode(std::string("A\0\xFF", 3)), (std::vector<int32_t>{65, 0, 255}));
  const std::string text = all_bytes() + tricky_text();
  EXPECT_EQ(t->decode(t->encode(text)), text);
  const std::string e = error_of([&] { t->decode({1, 256}); });
  EXPECT_NE(e.find("id 256"), std::string::npos) << e;
  EXPECT_NE(e.find("vocab size 256"), std::string::npos) << e;
  EXPECT_TRUE(t->save(::testing::TempDir()).empty());
  EXPECT_EQ(load_tokenizer("bytes", "")->encode("hi"), (std::vector<int32_t>{'h', 'i'}));
}

TEST(Tokenizer, SentencePieceRoundTripsAnyBytes) {
  SKIP_WITHOUT_SENTENCEPIECE();
  for (const std::string type : {"bpe", "unigram"}) {
    SCOPED_TRACE(type);
    const Tokenizer& t = trained(type);
    EXPECT_EQ(t.kind(), "sentencepiece");
    EXPECT_EQ(t.vocab_size(), kVocab.at(type));
    for (const std::string& text : {tricky_text(), all_bytes(), corpus().substr(0, 20000), std::string()}) {
      const auto ids = t.encode(text);
      for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < t.vocab_size()) << id;
      EXPECT_EQ(t.decode(ids), text);
    }
    // It learned pieces: the corpus takes fewer tokens than bytes.
    const std::string sample = corpus().substr(0, 20000);
    EXPECT_LT(t.encode(sample).size(), sample.size() * 8 / 10);
    const std::string e = error_of([&] { t.decode({0, static_cast<int32_t>(t.vocab_size())}); });
    EXPECT_NE(e.find("id " + std::to_string(t.vocab_size())), std::string::npos) << e;
    EXPECT_NE(e.find("vocab size " + std::to_string(t.vocab_size())), std::string::npos) << e;
  }
}

TEST(Tokenizer, SentencePieceSavedAndLoadedGivesTheSameIds) {
  SKIP_WITHOUT_SENTENCEPIECE();
  const std::string text = tricky_text() + corpus().substr(0, 5000);
  for (const std::string type : {"bpe", "unigram"}) {
    SCOPED_TRACE(type);
    TempFolder dir;
    const Tokenizer& t = trained(type);
    EXPECT_EQ(t.save(dir.file("tok")), std::vector<std::string>{"tokenizer.model"});
    const auto back = load_tokenizer("sentencepiece", dir.file("tok"));
    EXPECT_EQ(back->kind(), "sentencepiece");
    EXPECT_EQ(back->vocab_size(), t.vocab_size());
    EXPECT_EQ(back->encode(text), t.encode(text));
    EXPECT_EQ(back->decode(back->encode(text)), text);
  }
}

TEST(Tokenizer, SentencePieceTrainingIsDeterministic) {
  SKIP_WITHOUT_SENTENCEPIECE();
  const std::string text = tricky_text() + corpus().substr(0, 20000);
  for (const std::string type : {"bpe", "unigram"}) {
    SCOPED_TRACE(type);
    TempFolder dir;
    const auto again = train_sentencepiece(corpus(), kVocab.at(type), type);
    EXPECT_EQ(again->encode(text), trained(type).encode(text));
    again->save(dir.file("a"));
    trained(type).save(dir.file("b"));
    EXPECT_EQ(read_bytes(dir.file("a/tokenizer.model")), read_bytes(dir.file("b/tokenizer.model")));
  }
}

TEST(Tokenizer, SentencePieceErrorsSayWhatIsAllowed) {
  SKIP_WITHOUT_SENTENCEPIECE();
  std::string e = error_of([] { train_sentencepiece(corpus(), 1000, "word"); });
  EXPECT_NE(e.find("'word'"), std::string::npos) << e;
  EXPECT_NE(e.find("\"bpe\", \"unigram\""), std::string::npos) << e;
  e = error_of([] { train_sentencepiece(corpus(), 100, "bpe"); });
  EXPECT_NE(e.find("vocab_size 100"), std::string::npos) << e;
  EXPECT_NE(e.find("minimum is 260"), std::string::npos) << e;
  e = error_of([] { train_sentencepiece("ab ab ab\n", 300, "bpe"); });  // too few pieces to learn
  EXPECT_NE(e.find("failed"), std::string::npos) << e;
  TempFolder dir;
  e = error_of([&] { load_tokenizer("sentencepiece", dir.path); });
  EXPECT_NE(e.find(dir.file("tokenizer.model")), std::string::npos) << e;
  write_bytes(dir.file("tokenizer.model"), "not a model");
  e = error_of([&] { load_sentencepiece(dir.file("tokenizer.model")); });
  EXPECT_NE(e.find(dir.file("tokenizer.model")), std::string::npos) << e;
  e = error_of([&] { load_tokenizer("wordpiece", dir.path); });
  EXPECT_NE(e.find("\"bytes\", \"sentencepiece\", \"gpt2\""), std::string::npos) << e;
}

/// GPT-2's bytes_to_unicode, as UTF-8.
std::array<std::string, 256> byte_symbols() {
  std::array<std::string, 256> out;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    out[b] = cp < 0x80
                 ? std::string(1, static_cast<char>(cp))
                 : std::string{static_cast<char>(0xC0 | cp >> 6), static_cast<char>(0x80 | (cp & 0x3F))};
  }
  return out;
}

/// encoder.json (the byte symbols, ids 0..255 by byte value, then `extra`) and vocab.bpe
/// (`merges`) in `dir`; returns the encoder.
nlohmann::json write_gpt2_files(const TempFolder& dir, const std::vector<std::string>& extra,
                                const std::vector<std::string>& merges) {
  nlohmann::json enc = nlohmann::json::object();
  const auto sym = byte_symbols();
  for (int b = 0; b < 256; ++b) enc[sym[b]] = b;
  for (const auto& e : extra) enc[e] = static_cast<int>(enc.size());
  write_bytes(dir.file("encoder.json"), enc.dump());
  std::string bpe = "#version: 0.2\n";
  for (const auto& m : merges) bpe += m + "\n";
  write_bytes(dir.file("vocab.bpe"), bpe);
  return enc;
}

TEST(Tokenizer, Gpt2MergesByRankWithinPreTokens) {
  TempFolder dir;
  // "Ġ" is the space's symbol: " the" is Ġ t h e -> Ġ t he (rank 0) -> Ġt he (1) -> Ġthe (2).
  const auto enc = write_gpt2_files(dir, {"he", "\xC4\xA0t", "\xC4\xA0the", "<|endoftext|>"},
                                    {"h e", "\xC4\xA0 t", "\xC4\xA0t he"});
  const auto t = load_gpt2_bpe(dir.file("encoder.json"), dir.file("vocab.bpe"));
  EXPECT_EQ(t->kind(), "gpt2");
  EXPECT_EQ(t->vocab_size(), 260);
  const int32_t the = enc.at("\xC4\xA0the"), he = enc.at("he"), space = ' ', q = '\'';
  // " the cat's,the" -> " the" | " cat" | "'s" | "," | "the" (no space: t he).
  EXPECT_EQ(t->encode(" the cat's,the"),
            (std::vector<int32_t>{the, space, 'c', 'a', 't', q, 's', ',', 't', he}));
  // "<|endoftext|>" in text is plain text: never its id.
  const auto ids = t->encode("a<|endoftext|>b");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 259), 0);
  EXPECT_EQ(t->decode(ids), "a<|endoftext|>b");
  EXPECT_EQ(t->decode({259}), "<|endoftext|>");
}

/// Runs `command`; its stdout, or nullopt if it failed.
std::optional<std::string> run(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  if (!p) return std::nullopt;
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  return pclose(p) == 0 ? std::optional<std::string>(out) : std::nullopt;
}

std::string reference_script() {
#ifdef FRUGAL_TEST_SOURCE_DIR
  return std::string(FRUGAL_TEST_SOURCE_DIR) + "/tests/framework/gpt2_bpe_reference.py";
#else
  const char* root = std::getenv("FRUGAL_SOURCE_DIR");
  return root ? std::string(root) + "/tests/framework/gpt2_bpe_reference.py" : "";
#endif
}

TEST(Tokenizer, Gpt2IdsEqualThePythonReference) {
  const std::string script = reference_script();
  if (script.empty() || !fs::exists(script)) GTEST_SKIP() << "gpt2_bpe_reference.py not found: " << script;
  if (!fs::exists("/usr/bin/python3") || !run("/usr/bin/python3 -c 'import regex' 2>/dev/null"))
    GTEST_SKIP() << "needs /usr/bin/python3 with the regex module (Debian: python3-regex)";
  TempFolder dir;
  const std::string text =
      "I'm sure they'll say it's John's; we've 3.14 and 42 apples, 1,000,000 too. DON'T 'S 'd'll\n"
      "  Multiple   spaces\there\t\ttabs  \n\n\nU\xCC\x88nicode: \xC3\x9C"
      "ber na\xC3\xAFve caf\xC3\xA9 "
      "\xCE\xB1\xCE\xB2\xCE\xB3 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xD9\xA1\xD9\xA2 \xC2\xB2\xE2\x85\xA3 "
      "\xF0\x9F\x98\x80\xC2\xA0nbsp\xE3\x80\x80ideographic \xE2\x80\x83"
      "em <|endoftext|> \xE2\x96\x81\n"
      "bad bytes \xFF\xC3( \xED\xA0\x80 end   \n   ";
  write_bytes(dir.file("text.txt"), text);
  std::string contractions;  // frequent enough that each becomes one token: "'" "ll" would differ
  for (int i = 0; i < 40; ++i) contractions += "we'll it's we're they've I'd I'm don't\n";
  write_bytes(dir.file("train.txt"), corpus().substr(0, 10000) + text + contractions);
  const std::string py = "/usr/bin/python3 " + script + " ";
  ASSERT_TRUE(run(py + "learn " + dir.file("train.txt") + " 200 " + dir.file("vocab")));
  const std::string enc = dir.file("vocab/encoder.json"), bpe = dir.file("vocab/vocab.bpe");
  const auto out = run(py + "encode " + enc + " " + bpe + " " + dir.file("text.txt"));
  ASSERT_TRUE(out);
  const auto want = nlohmann::json::parse(*out).get<std::vector<int32_t>>();
  const auto t = load_gpt2_bpe(enc, bpe);
  const auto ids = t->encode(text);
  EXPECT_EQ(ids, want);
  EXPECT_LT(ids.size(), text.size());  // merges happened
  EXPECT_EQ(t->decode(ids), text);
  EXPECT_EQ(t->decode(t->encode(all_bytes())), all_bytes());
  // Saved and loaded back: the same files, the same ids.
  EXPECT_EQ(t->save(dir.file("saved")), (std::vector<std::string>{"encoder.json", "vocab.bpe"}));
  EXPECT_EQ(read_bytes(dir.file("saved/vocab.bpe")), read_bytes(bpe));
  EXPECT_EQ(load_tokenizer("gpt2", dir.file("saved"))->encode(text), want);
}

TEST(Tokenizer, Gpt2ErrorsNameTheFile) {
  TempFolder dir;
  write_gpt2_files(dir, {"he"}, {"h e", "h x\xC4\xA0"});
  const std::string enc = dir.file("encoder.json"), bpe = dir.file("vocab.bpe");
  std::string e = error_of([&] { load_gpt2_bpe(enc, bpe); });  // line 3: "xĠ" is no symbol
  EXPECT_NE(e.find(bpe + "' line 3"), std::string::npos) << e;
  EXPECT_NE(e.find("\"x\xC4\xA0\""), std::string::npos) << e;
  EXPECT_NE(e.find(enc), std::string::npos) << e;
  e = error_of([&] { load_gpt2_bpe(enc, dir.file("missing.bpe")); });
  EXPECT_NE(e.find(dir.file("missing.bpe")), std::string::npos) << e;
  write_bytes(enc, "{\"a\": 0, \"b\": \"one\"}");
  e = error_of([&] { load_gpt2_bpe(enc, bpe); });
  EXPECT_NE(e.find(enc), std::string::npos) << e;
  EXPECT_NE(e.find("key \"b\""), std::string::npos) << e;
  write_bytes(enc, "{\"a\": 0,");
  e = error_of([&] { load_gpt2_bpe(enc, bpe); });
  EXPECT_NE(e.find(enc + "' is not valid JSON"), std::string::npos) << e;
  write_gpt2_files(dir, {"he"}, {"h e", "he"});
  e = error_of([&] { load_gpt2_bpe(enc, bpe); });
  EXPECT_NE(e.find("line 3: expected a merge"), std::string::npos) << e;
}

}  // namespace
}  // namespace frugal

namespace frugal {
namespace {

/// A protobuf varint at s[i]: its value; i moves past it.
uint64_t varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0; i < s.size(); shift += 7) {
    const auto b = static_cast<uint8_t>(s[i++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) break;
  }
  return v;
}

/// Moves i past a field's value of wire type `tag & 7` (varint, 64-bit, length-delimited, 32-bit).
void skip_value(const std::string& s, uint64_t tag, size_t& i) {
  const uint64_t type = tag & 7;
  if (type == 0) {
    varint(s, i);
  } else if (type == 2) {
    i += varint(s, i);
  } else {
    i += type == 1 ? 8 : 4;
  }
}

/// A model file whose normalizer adds a dummy prefix (as Llama's does): our trained model with
/// NormalizerSpec.add_dummy_prefix (ModelProto field 3, its field 3) flipped from false to true.
std::string with_dummy_prefix(std::string proto) {
  for (size_t i = 0; i < proto.size();) {
    const uint64_t tag = varint(proto, i);
    if (tag != ((3 << 3) | 2)) {
      skip_value(proto, tag, i);
      continue;
    }
    const size_t end = i + varint(proto, i);  // normalizer_spec's bytes
    for (size_t k = i; k + 1 < end;) {
      const uint64_t t = varint(proto, k);
      if (t == (3 << 3) && proto[k] == 0) {
        proto[k] = 1;
        return proto;
      }
      skip_value(proto, t, k);
    }
    i = end;
  }
  ADD_FAILURE() << "no add_dummy_prefix = false in the model";
  return proto;
}

TEST(Tokenizer, ALossySentencePieceModelIsRefusedSayingWhatItChanges) {
  SKIP_WITHOUT_SENTENCEPIECE();
  TempFolder dir;
  trained("bpe").save(dir.file("ok"));
  fs::create_directories(dir.file("lossy"));
  std::ofstream(dir.file("lossy/tokenizer.model"), std::ios::binary)
      << with_dummy_prefix(read_bytes(dir.file("ok/tokenizer.model")));
  EXPECT_NO_THROW(load_tokenizer("sentencepiece", dir.file("ok")));
  const std::string e = error_of([&] { load_tokenizer("sentencepiece", dir.file("lossy")); });
  EXPECT_NE(e.find("changes text"), std::string::npos) << e;
  EXPECT_NE(e.find("add_dummy_prefix=false"), std::string::npos) << e;
}

/// A corpus past the text dataset's encoding piece (1 MiB) is encoded piece by piece, cut only
/// where no token can span the cut: the same ids as encoding it whole.
TEST(Tokenizer, ATextDatasetEncodesLongTextInPiecesAsItWouldWhole) {
  SKIP_WITHOUT_SENTENCEPIECE();
  std::string big;
  while (big.size() < 2600000) big += corpus();
  const std::shared_ptr<const Tokenizer> tok = train_sentencepiece(corpus(), 400, "bpe");
  const Dataset d = text_dataset(big, 16, 0, true, "big", tok);
  const auto whole = tok->encode(std::string_view(big).substr(0, big.size() - big.size() / 10));
  ASSERT_EQ(d.tokens.numel(), static_cast<int64_t>(whole.size()));
  EXPECT_TRUE(std::equal(whole.begin(), whole.end(), d.tokens.data_ptr<int32_t>()));
  EXPECT_EQ(d.tokens.scalar_type(), torch::kInt);
  EXPECT_EQ(d.num_classes, 400);
  // Each token's bytes: a sum over the ids is the text's length.
  EXPECT_EQ(d.token_bytes.index_select(0, d.tokens.to(torch::kLong)).sum().item<double>(),
            static_cast<double>(big.size() - big.size() / 10));
}

}  // namespace
}  // namespace frugal
