#pragma once
/// Sampling text from a trained byte-level language model (`frugal generate`).
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace frugal {

struct SampleOptions {
  int64_t tokens = 200;       ///< bytes to generate after the prompt
  double temperature = 0.8;   ///< divides the logits; 0 = always the most likely byte
  int64_t top_k = 40;         ///< sample among the k most likely bytes; 0 = all
  /// Nucleus sampling: among the most likely bytes whose probabilities sum to top_p (the first
  /// always kept), after top_k; 1 = all.
  double top_p = 1.0;
  /// The continuation ends before the first of these it produces (not included); {} = none.
  std::vector<std::string> stop;
  uint64_t seed = 0;          ///< the sampler's own generator: the same seed, the same text
  int64_t block_size = 256;   ///< the longest context the model takes (its position table)
  /// The zoo's gpt keeps its keys and values (GptCache): one new position per byte while the
  /// context fits block_size, instead of the whole context; the same logits to float rounding.
  bool kv_cache = true;
};

/// Continues `prompt` (bytes; an empty prompt starts from "\n") by `o.tokens` bytes drawn one at
/// a time from `model`, which maps (1, T) int64 byte ids to (1, T, 256) logits. The context is
/// the last `o.block_size` bytes. Runs without gradients in eval mode. Returns the continuation
/// only. Throws std::invalid_argument for options out of range.
std::string generate_text(torch::nn::Sequential& model, const std::string& prompt,
                          const SampleOptions& o);

}  // namespace frugal
