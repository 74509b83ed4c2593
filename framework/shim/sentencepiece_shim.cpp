// libfrugal_sentencepiece.so: SentencePiece behind a C interface (see sentencepiece_shim.h).
#include "sentencepiece_shim.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

char* copy(const std::string& s) {
  auto* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p) std::memcpy(p, s.c_str(), s.size() + 1);
  return p;
}

/// The lines of a corpus, without their newlines.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(std::string_view text) : rest_(text) { Next(); }
  bool done() const override { return done_; }
  void Next() override {
    done_ = rest_.empty();
    const size_t end = std::min(rest_.find('\n'), rest_.size());
    line_.assign(rest_.substr(0, end));
    rest_.remove_prefix(std::min(end + 1, rest_.size()));
  }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  std::string_view rest_;
  bool done_ = false;
  std::string line_;
};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int frugal_spm_train(const char* const* keys, const char* const* values, int n,
                                                            const char* corpus, size_t corpus_len, unsigned seed,
                                                            char** model, size_t* model_len, char** err) {
  std::unordered_map<std::string, std::string> args;
  for (int i = 0; i < n; ++i) args[keys[i]] = values[i];
  sentencepiece::SetRandomGeneratorSeed(seed);
  LineIterator lines(std::string_view(corpus, corpus_len));
  std::string proto;
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &proto);
  if (!st.ok()) {
    *err = copy(st.ToString());
    return 1;
  }
  *model = copy(proto);
  *model_len = proto.size();
  return 0;
}

__attribute__((visibility("default"))) void* frugal_spm_load(const char* proto, size_t len, char** err) {
  auto* p = new sentencepiece::SentencePieceProcessor();
  const auto st = p->LoadFromSerializedProto(std::string_view(proto, len));
  if (st.ok()) return p;
  *err = copy(st.ToString());
  delete p;
  return nullptr;
}

__attribute__((visibility("default"))) int frugal_spm_size(const void* processor) {
  return static_cast<const sentencepiece::SentencePieceProcessor*>(processor)->GetPieceSize();
}

__attribute__((visibility("default"))) int frugal_spm_piece(const void* processor, int id, const char** piece,
                                                            size_t* len) {
  const auto* p = static_cast<const sentencepiece::SentencePieceProcessor*>(processor);
  const std::string& s = p->IdToPiece(id);
  *piece = s.data();
  *len = s.size();
  if (p->IsByte(id)) return kFrugalSpmByte;
  if (p->IsControl(id) || p->IsUnknown(id) || p->IsUnused(id)) return kFrugalSpmControl;
  return kFrugalSpmNormal;
}

__attribute__((visibility("default"))) int frugal_spm_encode(const void* processor, const char* text, size_t len,
                                                             int** ids, size_t* n, char** err) {
  std::vector<int> got;
  const auto st = static_cast<const sentencepiece::SentencePieceProcessor*>(processor)->Encode(
      std::string_view(text, len), &got);
  if (!st.ok()) {
    *err = copy(st.ToString());
    return 1;
  }
  *n = got.size();
  *ids = static_cast<int*>(std::malloc(std::max<size_t>(1, got.size()) * sizeof(int)));
  if (!got.empty()) std::memcpy(*ids, got.data(), got.size() * sizeof(int));
  return 0;
}

__attribute__((visibility("default"))) void frugal_spm_free(void* processor) {
  delete static_cast<sentencepiece::SentencePieceProcessor*>(processor);
}

__attribute__((visibility("default"))) void frugal_spm_release(void* buffer) { std::free(buffer); }
}
