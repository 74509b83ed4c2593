#pragma once
/// Tokenizers for language models: text (bytes) to token ids and back. Three kinds: bytes (an id
/// per byte), SentencePiece (trained here on a corpus, or loaded) and GPT-2's byte-level BPE
/// (encoder.json + vocab.bpe). Torch-free: ids are plain int32 vectors.
///
/// Every kind is lossless on the texts it is meant for: decode(encode(t)) == t byte for byte.
/// Errors are DataError naming the file and what is wrong with it.
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace frugal {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// "bytes", "sentencepiece" or "gpt2": the kind load_tokenizer takes back.
  virtual std::string kind() const = 0;
  /// Ids run over [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  /// The ids of `text` (any bytes, not only UTF-8).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  /// The bytes of `ids`; an id outside [0, vocab_size()) throws DataError naming it and the vocab size.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  /// The bytes one id stands for; "" for an id no token has (a gap in a GPT-2 encoder.json).
  std::string token_text(int32_t id) const {
    try {
      return decode({id});
    } catch (const std::exception&) {
      return {};
    }
  }
  /// Writes the files that load_tokenizer(kind(), folder) reads back (creating `folder`); returns
  /// their names (bytes: none). A failed write throws Error naming the file.
  virtual std::vector<std::string> save(const std::string& folder) const = 0;
};

/// Bytes as tokens: id = byte value, vocab 256.
std::unique_ptr<Tokenizer> byte_tokenizer();

/// A SentencePiece model (Debian's libsentencepiece 0.1.97) trained on the text `corpus` (the
/// bytes themselves, not a path; fed line by line, newline a piece of its own).
/// model_type "bpe" | "unigram"; exactly vocab_size pieces, at least 260 (256 byte pieces, <unk>,
/// <s>, </s>, newline) plus the corpus's common characters (the error says how many).
/// Lossless: decode(encode(t)) == t byte for byte for ANY bytes (byte fallback, identity
/// normalization, no dummy prefix, whitespace kept). Invalid UTF-8 bytes and U+2581 (which
/// SentencePiece uses for space) are encoded as byte pieces.
/// encode() takes the text line by line (no trained piece spans a newline): a text's ids are its lines' ids.
/// Deterministic: the same corpus, vocab_size and model_type give the same model (fixed seed, 2 threads).
/// Training takes ~3 s (bpe) or ~10 s (unigram) on 2.6 MB at vocab_size 4096 (2 cores).
/// Throws DataError for a bad vocab_size or model_type, or when SentencePiece's training fails.
std::unique_ptr<Tokenizer> train_sentencepiece(const std::string& corpus, int64_t vocab_size,
                                               const std::string& model_type);
/// A SentencePiece model file (tokenizer.model, as save() writes it). It must have the 256 byte
/// pieces <0x00>..<0xFF> (trained with byte_fallback) and be lossless (no dummy prefix, no
/// normalization, whitespace kept: checked on a probe text, else DataError saying what it
/// changed); decoding spells pieces with U+2581 as space.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_file);

/// GPT-2's byte-level BPE from encoder.json + vocab.bpe (as downloaded from Hugging Face / OpenAI):
/// ids equal to GPT-2's encoder.py for any UTF-8 input; "<|endoftext|>" in text is NOT special
/// (plain text). Bytes that are not valid UTF-8 each count as one punctuation-like character and
/// encode as their byte (what encoder.py does on text decoded with errors="surrogateescape").
/// vocab.bpe: a "#version" first line, then "a b" per merge (rank = line order, empty lines skipped).
/// vocab_size() is the largest id + 1. Throws DataError naming the file: missing, malformed JSON,
/// a non-integer id (naming its key), a merge naming a symbol not in encoder.json (naming the line).
std::unique_ptr<Tokenizer> load_gpt2_bpe(const std::string& encoder_json, const std::string& vocab_bpe);

/// kind "bytes" (no files) | "sentencepiece" (folder/tokenizer.model) | "gpt2" (folder/encoder.json
/// + folder/vocab.bpe); another kind throws DataError listing these.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& kind, const std::string& folder);

}  // namespace frugal
