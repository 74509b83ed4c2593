#pragma once
// The built-in decoder-only transformer (registered as model "gpt" in models.cpp).
#include <torch/torch.h>

#include "frugal/models/registry.h"

namespace frugal {

/// nanoGPT's layout as a Sequential of named blocks: embed (wte, wpe), block0..block<n-1>
/// (ln_1, attn {c_attn, c_proj}, ln_2, mlp {c_fc, act, c_proj}), ln_f and head (no bias).
/// Maps int64 tokens [B, T] (T <= block_size) to logits [B, T, vocabulary]. Initialised in
/// named_parameters() order from a generator seeded with in.seed: LayerNorm weights 1, biases
/// 0, c_proj weights N(0, 0.02 / sqrt(2 n_layer)) (GPT-2's residual scaling), the others
/// N(0, 0.02); the same draws as torch.Generator().manual_seed(seed) in Python.
torch::nn::Sequential make_gpt(const ModelOptions& o, const ModelInput& in);

}  // namespace frugal
