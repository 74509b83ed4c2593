#pragma once
/// Sampling text from a trained language model (`frugal generate`), one sample or a batch.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal {

struct SampleOptions {
  int64_t tokens = 200;       ///< tokens (bytes, for a byte model) to generate after the prompt
  double temperature = 0.8;   ///< divides the logits; 0 = always the most likely token
  int64_t top_k = 40;         ///< sample among the k most likely tokens; 0 = all
  /// Nucleus sampling: among the most likely tokens whose probabilities sum to top_p (the first
  /// always kept), after top_k; 1 = all.
  double top_p = 1.0;
  /// A sample ends before the first of these its text produces (not included); {} = none.
  std::vector<std::string> stop;
  uint64_t seed = 0;          ///< the sampler's own generator: the same seed, the same text
  int64_t block_size = 256;   ///< the longest context the model takes (its position table)
  /// The zoo's gpt keeps its keys and values (GptCache): one new position per token while the
  /// context fits block_size, instead of the whole context; the same logits to float rounding.
  bool kv_cache = true;
  /// Samples drawn at once, as one batch [samples, T] (one forward per token for all). They
  /// share the generator: sample 0 of a batch is not the text of samples = 1 with that seed,
  /// but the same seed and count give the same texts.
  int64_t samples = 1;
};

/// One continuation: its token ids and their text (the tokens' bytes, cut before a stop string).
struct Sample {
  std::vector<int64_t> ids;
  std::string text;
};

/// Continues the token ids `prompt` (not empty) by up to `o.tokens` tokens per sample, drawn from
/// `model`, which maps (B, T) int64 ids to (B, T, vocabulary) logits. The context is the last
/// `o.block_size` tokens. `token_text(id)` gives a token's bytes (for the text and the stop
/// strings); generation ends early once every sample has met a stop string. Runs without
/// gradients in eval mode. Throws std::invalid_argument for options out of range.
std::vector<Sample> generate_tokens(torch::nn::Sequential& model, const std::vector<int64_t>& prompt,
                                    const SampleOptions& o,
                                    const std::function<std::string(int64_t)>& token_text);

/// A byte-level model: continues `prompt` (bytes; an empty prompt starts from "\n") by
/// `o.tokens` bytes and returns the continuation of the first sample.
std::string generate_text(torch::nn::Sequential& model, const std::string& prompt, const SampleOptions& o);

}  // namespace frugal
