#pragma once
// A tiny GPT on a tiny corpus made in memory: the language-model twin of learner_fixture.h.
#include <memory>
#include <string>

#include "frugal/data/task.h"
#include "frugal/frugal.h"

namespace frugal::test {

struct TinyGpt {
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 16;
  int64_t block_size = 16;
  int64_t windows = 32;  ///< training windows per epoch
  int64_t batch_size = 8;
  int64_t valid_windows = 4;
  double dropout = 0.0;
  std::string optimizer = "adam";
  double lr = 1e-2;
  bool shuffle = true;
  uint64_t seed = 0;
};

/// A repetitive corpus a tiny model learns quickly (sentences drawn from a few words).
inline std::string tiny_corpus(int64_t bytes = 4096, uint64_t seed = 7) {
  static const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dog ", "ran.\n"};
  std::string s;
  uint64_t x = seed;
  while (static_cast<int64_t>(s.size()) < bytes) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    s += words[(x >> 33) % 8];
  }
  s.resize(static_cast<size_t>(bytes));
  return s;
}

inline ModelOptions gpt_options(const TinyGpt& s) {
  ModelOptions mo;
  mo.arch = "gpt";
  mo.n_layer = s.n_layer;
  mo.n_head = s.n_head;
  mo.n_embd = s.n_embd;
  mo.dropout = s.dropout;
  return mo;
}

inline ModelInput gpt_input(const TinyGpt& s) {
  ModelInput in;
  in.block_size = s.block_size;
  in.num_classes = 256;
  in.seed = s.seed;
  return in;
}

inline std::unique_ptr<Learner> make_tiny_gpt_learner(const TinyGpt& s = {}) {
  torch::manual_seed(s.seed);
  const std::string corpus = tiny_corpus();
  std::optional<DataLoader> valid;
  if (s.valid_windows > 0)
    valid.emplace(text_dataset(corpus, s.block_size, 0, false).head(s.valid_windows), 4, false, 0);
  OptimizerOptions oo;
  oo.name = s.optimizer;
  oo.lr = s.lr;
  return std::make_unique<Learner>(
      make_model(gpt_options(s), gpt_input(s)),
      DataLoader(text_dataset(corpus, s.block_size, s.windows, true), s.batch_size, s.shuffle, s.seed),
      std::move(valid), oo, make_loss(LossOptions{}));
}

}  // namespace frugal::test
