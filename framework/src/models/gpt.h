#pragma once
// The built-in decoder-only transformer (registered as model "gpt" in models.cpp).
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "frugal/models/linear.h"
#include "frugal/models/registry.h"

namespace frugal {

/// nanoGPT's layout as a Sequential of named blocks: embed (wte, wpe), block0..block<n-1>
/// (ln_1, attn {c_attn, c_proj}, ln_2, mlp {c_fc, act, c_proj}), ln_f and head (an LmHead:
/// no bias; the chunked_loss plugin hands its input to the loss). The attention modules are
/// frugal::AttentionModule (the chunked_attention plugin switches their kernel).
/// Maps int64 tokens [B, T] (T <= block_size) to logits [B, T, vocabulary]. Initialised in
/// named_parameters() order from a generator seeded with in.seed: LayerNorm weights 1, biases
/// 0, c_proj weights N(0, 0.02 / sqrt(2 n_layer)) (GPT-2's residual scaling), the others
/// N(0, 0.02); the same draws as torch.Generator().manual_seed(seed) in Python.
torch::nn::Sequential make_gpt(const ModelOptions& o, const ModelInput& in);

/// Hugging Face's GPT-2 (registered as model "gpt2"): make_gpt's layout with GPT-2's maths
/// (Conv1D weights [in, out], tanh GELU, the head tied to wte), its shape from the config.json
/// of the model.init_from folder or from model.n_layer/n_head/n_embd. gpt2.cpp.
torch::nn::Sequential make_gpt2(const ModelOptions& o, const ModelInput& in);

/// The attention heads of a make_gpt model's blocks (1 when it has none).
int64_t gpt_heads(const torch::nn::Module& model);

/// Hugging Face's names for gpt2's tensors, and its config.json.
WeightNames gpt2_weight_names();

/// The sizes of a gpt.
struct GptShape {
  int64_t n_layer, n_head, n_embd, vocab, block;
  double dropout;
};
/// What tells nanoGPT's layout from Hugging Face GPT-2's.
struct GptStyle {
  WeightLayout layout = WeightLayout::OutIn;  ///< GPT-2's Conv1D: InOut
  std::string gelu = "none";                  ///< GPT-2's gelu_new: "tanh"
  bool tied = false;                          ///< the head's weight is wte's
  double eps = 1e-5;                          ///< LayerNorm
};
/// embed, block0.., ln_f, head; initialised as make_gpt says.
torch::nn::Sequential build_gpt(const GptShape& shape, const GptStyle& style, uint64_t seed);

/// The keys and values a gpt computed for a context, per block ([B, heads, length, head size]),
/// so generation computes one new position per byte instead of the whole context again.
struct GptCache {
  std::vector<torch::Tensor> k, v;
  int64_t length = 0;
};

/// The logits [B, T, vocabulary] of `tokens` [B, T] as the continuation of the context `cache`
/// holds (positions cache.length ..), their keys and values appended to it: the same as the
/// plain forward of the whole sequence at those positions, in eval mode. nullopt when `model`
/// is not make_gpt's. The caller keeps cache.length + T <= block_size.
std::optional<torch::Tensor> gpt_forward_cached(torch::nn::Sequential& model, const torch::Tensor& tokens,
                                                GptCache& cache);

}  // namespace frugal
