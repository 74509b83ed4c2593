#pragma once
// The TorchScript emitters of the model zoo's own module types (script.h), added once when the
// emitter table is first built. Internal to libfrugal.
#include <functional>
#include <typeindex>

#include "frugal/models/script.h"

namespace frugal {

using ScriptAdder = std::function<void(std::type_index, ScriptEmitter)>;

/// BasicBlock, PatchEmbed, TransformerBlock, TokenHead (models.cpp).
void add_model_scripts(const ScriptAdder& add);
/// The gpt's Embed, CausalSelfAttention, Mlp and GptBlock (gpt.cpp).
void add_gpt_scripts(const ScriptAdder& add);

}  // namespace frugal
