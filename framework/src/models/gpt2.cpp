// Hugging Face's GPT-2: its config.json, its tensor names, and make_gpt's blocks in its maths.
#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "models/gpt.h"

namespace frugal {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string num(int64_t v) { return std::to_string(v); }

/// The config.json of a Hugging Face folder (model.init_from), or null when there is none.
json read_hf_config(const std::string& init_from) {
  std::error_code ec;
  if (init_from.empty() || !fs::exists(init_from, ec)) return nullptr;
  // A folder's config.json, or the one beside a .safetensors file.
  const fs::path file = (fs::is_directory(init_from, ec) ? fs::path(init_from) : fs::path(init_from).parent_path()) /
                        "config.json";
  if (!fs::is_regular_file(file, ec)) return nullptr;
  std::ifstream in(file);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    throw_config_error("model.init_from: " + file.string() + " is not JSON (a Hugging Face config.json)");
  if (j.value("model_type", "gpt2") != "gpt2")
    throw_config_error("model.init_from: " + file.string() + " describes a '" + j.value("model_type", "") +
                       "' model; model.arch = \"gpt2\" reads GPT-2's");
  return j;
}

int64_t config_int(const json& j, const char* key, const std::string& file) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() <= 0)
    throw_config_error("model.init_from: " + file + ": '" + key + "' must be a positive integer");
  return it->get<int64_t>();
}

/// A key of [model] set away from its default must agree with the file.
void agree(const char* key, int64_t set, int64_t dflt, int64_t file_value, const std::string& file) {
  if (set != dflt && set != file_value)
    throw_config_error("model." + std::string(key) + " = " + num(set) + " but " + file + " says " +
                       num(file_value) + ": remove model." + key + " (the checkpoint's config decides)");
}

/// GPT-2's maths, refused when the config asks for something else (a silent difference would
/// load the weights and compute another function).
GptStyle gpt2_style(const json& j, const std::string& file) {
  GptStyle s;
  s.layout = WeightLayout::InOut;
  s.tied = true;
  s.gelu = "tanh";
  if (j.is_null()) return s;
  const std::string act = j.value("activation_function", "gelu_new");
  if (act == "gelu") s.gelu = "none";
  else if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    throw_config_error("model.init_from: " + file + ": activation_function '" + act +
                       "' (allowed: gelu_new, gelu_pytorch_tanh, gelu)");
  if (!j.value("tie_word_embeddings", true))
    throw_config_error("model.init_from: " + file + ": tie_word_embeddings = false; gpt2 ties its head");
  if (!j.value("scale_attn_weights", true))
    throw_config_error("model.init_from: " + file + ": scale_attn_weights = false is not supported");
  for (const char* flag : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"})
    if (j.value(flag, false))
      throw_config_error("model.init_from: " + file + ": " + flag + " = true is not supported");
  if (j.contains("n_inner") && !j["n_inner"].is_null())
    throw_config_error("model.init_from: " + file + ": n_inner is set; gpt2 uses 4 * n_embd");
  if (j.contains("layer_norm_epsilon") && j["layer_norm_epsilon"].is_number())
    s.eps = j["layer_norm_epsilon"].get<double>();
  return s;
}

}  // namespace

torch::nn::Sequential make_gpt2(const ModelOptions& o, const ModelInput& in) {
  if (in.block_size <= 0)
    throw_config_error("model 'gpt2' takes text: set data.dataset = \"text\" with data.tokenizer = \"gpt2\"");
  const json j = read_hf_config(o.init_from);
  const std::string file = j.is_null() ? "" : (fs::path(o.init_from) / "config.json").string();
  const ModelOptions d;
  GptShape g{o.n_layer, o.n_head, o.n_embd, in.num_classes, o.block_size > 0 ? o.block_size : in.block_size,
             o.dropout};
  if (!j.is_null()) {
    g.n_layer = config_int(j, "n_layer", file);
    g.n_head = config_int(j, "n_head", file);
    g.n_embd = config_int(j, "n_embd", file);
    g.vocab = config_int(j, "vocab_size", file);
    g.block = config_int(j, "n_positions", file);
    agree("n_layer", o.n_layer, d.n_layer, g.n_layer, file);
    agree("n_head", o.n_head, d.n_head, g.n_head, file);
    agree("n_embd", o.n_embd, d.n_embd, g.n_embd, file);
    agree("block_size", o.block_size, d.block_size, g.block, file);
    if (g.vocab < in.num_classes)
      throw_config_error("model 'gpt2': " + file + " has vocab_size " + num(g.vocab) + ", fewer than the " +
                         num(in.num_classes) + " tokens of data.tokenizer");
  }
  if (g.block < in.block_size)
    throw_config_error("model 'gpt2': " + num(g.block) + " positions, shorter than data.block_size = " +
                       num(in.block_size));
  if (g.n_embd % g.n_head != 0)
    throw_config_error("model 'gpt2': n_head = " + num(g.n_head) + " must divide n_embd = " + num(g.n_embd));
  return build_gpt(g, gpt2_style(j, file), in.seed);
}

WeightNames gpt2_weight_names() {
  WeightNames n;
  n.to_file = [](const std::string& name) {
    static const std::regex block(R"(^block(\d+)\.(.*)$)");
    std::smatch m;
    if (std::regex_match(name, m, block)) return "transformer.h." + m[1].str() + "." + m[2].str();
    if (name.rfind("embed.", 0) == 0) return "transformer." + name.substr(6);
    if (name.rfind("ln_f.", 0) == 0) return "transformer." + name;
    return name;
  };
  n.from_file = [](const std::string& file_name) -> std::string {
    // Saved from GPT2LMHeadModel ("transformer.h.0...") or from GPT2Model ("h.0...", the Hub's gpt2).
    const std::string name = file_name.rfind("transformer.", 0) == 0 ? file_name.substr(12) : file_name;
    static const std::regex block(R"(^h\.(\d+)\.(.*)$)");
    static const std::regex mask(R"(^h\.\d+\.attn\.(bias|masked_bias)$)");  // the causal mask, not weights
    std::smatch m;
    if (std::regex_match(name, mask)) return "";
    if (std::regex_match(name, m, block)) return "block" + m[1].str() + "." + m[2].str();
    if (name.rfind("wte.", 0) == 0 || name.rfind("wpe.", 0) == 0) return "embed." + name;
    if (name == "lm_head.weight") return "embed.wte.weight";  // tied: must equal wte
    return name;
  };
  n.config_json = [](const torch::nn::Module& model) {
    const auto p = model.named_parameters();
    int64_t layers = 0;
    while (p.contains("block" + num(layers) + ".ln_1.weight")) ++layers;
    const auto& wte = p["embed.wte.weight"];
    double eps = 1e-5;
    std::string act = "gelu_new";
    for (const auto& child : model.modules(/*include_self=*/false)) {
      if (const auto* ln = dynamic_cast<const torch::nn::LayerNormImpl*>(child.get())) eps = ln->options.eps();
      if (const auto* g = dynamic_cast<const torch::nn::GELUImpl*>(child.get()))
        act = g->options.approximate() == "tanh" ? "gelu_new" : "gelu";
    }
    json j = {{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}}, {"n_layer", layers},
              {"n_head", gpt_heads(model)}, {"n_embd", wte.size(1)}, {"vocab_size", wte.size(0)},
              {"n_positions", p["embed.wpe.weight"].size(0)}, {"n_ctx", p["embed.wpe.weight"].size(0)},
              {"layer_norm_epsilon", eps}, {"activation_function", act}, {"tie_word_embeddings", true}};
    return j.dump(2) + "\n";
  };
  return n;
}

}  // namespace frugal
