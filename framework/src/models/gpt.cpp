// A GPT-style decoder-only transformer over byte tokens.
#include "models/gpt.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "frugal/models/attention.h"
#include "frugal/models/linear.h"
#include "frugal/models/lm_head.h"
#include "models/script_builtins.h"

namespace frugal {
namespace {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

std::string gpt_str(int64_t v) { return std::to_string(v); }

torch::Tensor drop(const torch::Tensor& x, double p, bool training) {
  return p > 0 ? F::dropout(x, F::DropoutFuncOptions().p(p).training(training)) : x;
}

/// Token plus position embeddings.
struct EmbedImpl : nn::Module {
  EmbedImpl(int64_t vocab, int64_t block, int64_t width, double dropout)
      : p(dropout),
        wte(register_module("wte", nn::Embedding(vocab, width))),
        wpe(register_module("wpe", nn::Embedding(block, width))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t t = tokens.size(1);
    TORCH_CHECK(t <= wpe->weight.size(0), "gpt: a sequence of ", t,
                " tokens is longer than the model's block_size ", wpe->weight.size(0));
    auto pos = torch::arange(t, tokens.options().dtype(torch::kLong));
    return drop(wte(tokens) + wpe(pos), p, is_training());
  }
  double p;
  nn::Embedding wte, wpe;
};
TORCH_MODULE(Embed);

/// Multi-head causal self-attention written with matmuls (the same in LibTorch 1.13 and 2.x).
struct CausalSelfAttentionImpl : nn::Module, AttentionModule {
  CausalSelfAttentionImpl(int64_t width, int64_t n_head, double dropout, WeightLayout layout)
      : heads(n_head),
        p(dropout),
        c_attn(register_module("c_attn", AdaptableLinear(width, 3 * width, true, layout))),
        c_proj(register_module("c_proj", AdaptableLinear(width, width, true, layout))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    // the kernel a plugin may have set (chunked_attention); fused on the CPU where it applies
    return drop(c_proj(attention_from_projection(c_attn(x), heads, kernel_, p, is_training())), p, is_training());
  }
  int64_t heads;
  double p;
  AdaptableLinear c_attn, c_proj;
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : nn::Module {
  MlpImpl(int64_t width, double dropout, const GptStyle& s)
      : p(dropout),
        c_fc(register_module("c_fc", AdaptableLinear(width, 4 * width, true, s.layout))),
        act(register_module("act", nn::GELU(nn::GELUOptions().approximate(s.gelu)))),
        c_proj(register_module("c_proj", AdaptableLinear(4 * width, width, true, s.layout))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return drop(c_proj(act(c_fc(x))), p, is_training());
  }
  double p;
  AdaptableLinear c_fc;
  nn::GELU act;
  AdaptableLinear c_proj;
};
TORCH_MODULE(Mlp);

/// Pre-LayerNorm block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
struct GptBlockImpl : nn::Module {
  GptBlockImpl(int64_t width, int64_t heads, double p, const GptStyle& s)
      : ln_1(register_module("ln_1", nn::LayerNorm(nn::LayerNormOptions({width}).eps(s.eps)))),
        attn(register_module("attn", CausalSelfAttention(width, heads, p, s.layout))),
        ln_2(register_module("ln_2", nn::LayerNorm(nn::LayerNormOptions({width}).eps(s.eps)))),
        mlp(register_module("mlp", Mlp(width, p, s))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  nn::LayerNorm ln_1;
  CausalSelfAttention attn;
  nn::LayerNorm ln_2;
  Mlp mlp;
};
TORCH_MODULE(GptBlock);

// ---- the TorchScript forms (script.h): the same operators, in eval mode --------------------
// (dtypes by number, as TorchScript compiled in C++ knows no torch.long: 4 long, 11 bool)

std::string embed_script(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& e = dynamic_cast<const EmbedImpl&>(m);
  const auto pos = w.let("torch.arange(" + x + ".size(1), dtype=4, device=" + x + ".device)", "pos");
  return w.let(w.call(*e.wte, at + ".wte", x) + " + " + w.call(*e.wpe, at + ".wpe", pos));
}

std::string attention_script(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& a = dynamic_cast<const CausalSelfAttentionImpl&>(m);
  const int64_t width = a.c_proj->out_features, d = width / a.heads;
  const auto b = w.let(x + ".size(0)", "b"), t = w.let(x + ".size(1)", "t");
  const auto qkv = w.let(w.call(*a.c_attn, at + ".c_attn", x) + ".reshape([" + b + ", " + t + ", 3, " +
                         gpt_str(a.heads) + ", " + gpt_str(d) + "]).permute([2, 0, 3, 1, 4])");
  const auto future = w.let("torch.ones([" + t + ", " + t + "], dtype=11, device=" + x + ".device).triu(1)");
  const auto att = w.let("torch.softmax((torch.matmul(" + qkv + "[0], " + qkv + "[1].transpose(-2, -1)) * " +
                         ScriptWriter::number(1.0 / std::sqrt(static_cast<double>(d))) + ").masked_fill(" +
                         future + ", float(\"-inf\")), -1)");
  const auto y = w.let("torch.matmul(" + att + ", " + qkv + "[2]).transpose(1, 2).reshape([" + b + ", " + t +
                       ", " + gpt_str(width) + "])");
  return w.call(*a.c_proj, at + ".c_proj", y);
}

std::string head_script(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  // A tied head holds no weight of its own: it is the embedding's (make_gpt's layout).
  const std::string weight = dynamic_cast<const LmHeadImpl&>(m).tied()
                                 ? at.substr(0, at.rfind('.')) + ".embed.wte.weight" : at + ".weight";
  return w.let("torch.matmul(" + x + ", " + weight + ".t())");
}

std::string linear_script(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& l = dynamic_cast<const AdaptableLinearImpl&>(m);
  if (l.adapter()) throw std::invalid_argument("an adapted linear layer (merge its adapter first)");
  const std::string bias = l.bias.defined() ? at + ".bias" : "None";
  if (l.layout == WeightLayout::OutIn) return w.let("torch.linear(" + x + ", " + at + ".weight, " + bias + ")");
  return w.let("torch.matmul(" + x + ", " + at + ".weight)" + (l.bias.defined() ? " + " + bias : ""));
}

std::string mlp_script(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& p = dynamic_cast<const MlpImpl&>(m);
  return w.call(*p.c_proj, at + ".c_proj", w.call(*p.act, at + ".act", w.call(*p.c_fc, at + ".c_fc", x)));
}

std::string block_script(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& b = dynamic_cast<const GptBlockImpl&>(m);
  const auto x1 = w.let(x + " + " + w.call(*b.attn, at + ".attn", w.call(*b.ln_1, at + ".ln_1", x)));
  return w.let(x1 + " + " + w.call(*b.mlp, at + ".mlp", w.call(*b.ln_2, at + ".ln_2", x1)));
}

bool gpt_ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void init_gpt(nn::Sequential& m, int64_t n_layer, uint64_t seed) {
  torch::NoGradGuard g;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layer));
  for (auto& np : m->named_parameters()) {
    const std::string& name = np.key();
    torch::Tensor& p = np.value();
    const bool norm = name.find("ln_") != std::string::npos;
    if (gpt_ends_with(name, ".bias")) {
      p.zero_();
    } else if (norm) {
      p.fill_(1.0);
    } else {
      // Drawn on the CPU, so a CUDA model starts from the same weights.
      auto w = torch::empty(p.sizes(), torch::kFloat);
      w.normal_(0.0, gpt_ends_with(name, "c_proj.weight") ? residual_std : 0.02, gen);
      p.copy_(w);
    }
  }
}

}  // namespace

void add_gpt_scripts(const ScriptAdder& add) {
  add(typeid(EmbedImpl), embed_script);
  add(typeid(CausalSelfAttentionImpl), attention_script);
  add(typeid(MlpImpl), mlp_script);
  add(typeid(GptBlockImpl), block_script);
  add(typeid(LmHeadImpl), head_script);
  add(typeid(AdaptableLinearImpl), linear_script);
}

namespace {
/// One block's attention over the cached keys and values and the new positions' own.
torch::Tensor attention_cached(CausalSelfAttentionImpl& a, const torch::Tensor& x, torch::Tensor& k_cache,
                               torch::Tensor& v_cache, int64_t past) {
  const int64_t b = x.size(0), t = x.size(1), w = x.size(2), d = w / a.heads;
  auto qkv = a.c_attn(x).reshape({b, t, 3, a.heads, d}).permute({2, 0, 3, 1, 4});
  auto q = qkv[0];
  k_cache = k_cache.defined() ? torch::cat({k_cache, qkv[1]}, 2) : qkv[1].contiguous();
  v_cache = v_cache.defined() ? torch::cat({v_cache, qkv[2]}, 2) : qkv[2].contiguous();
  auto att = torch::matmul(q, k_cache.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
  // New position j (absolute past + j) sees the keys up to past + j.
  auto future = torch::ones({t, past + t}, x.options().dtype(torch::kBool)).triu(past + 1);
  att = torch::softmax(att.masked_fill(future, -INFINITY), -1);
  return a.c_proj(torch::matmul(att, v_cache).transpose(1, 2).reshape({b, t, w}));
}
}  // namespace

std::optional<torch::Tensor> gpt_forward_cached(nn::Sequential& model, const torch::Tensor& tokens,
                                                GptCache& cache) {
  if (model->size() < 3) return std::nullopt;
  auto* embed = dynamic_cast<EmbedImpl*>(model->ptr(0).get());
  if (!embed) return std::nullopt;
  torch::NoGradGuard g;
  const int64_t past = cache.length, t = tokens.size(1);
  auto pos = torch::arange(past, past + t, tokens.options().dtype(torch::kLong));
  torch::Tensor x = embed->wte(tokens) + embed->wpe(pos);
  size_t block = 0;
  for (size_t i = 1; i < model->size(); ++i) {
    const std::shared_ptr<nn::Module> m = model->ptr(i);
    if (auto* b = dynamic_cast<GptBlockImpl*>(m.get())) {
      if (cache.k.size() <= block) cache.k.resize(block + 1), cache.v.resize(block + 1);
      x = x + attention_cached(*b->attn, b->ln_1(x), cache.k[block], cache.v[block], past);
      x = x + b->mlp(b->ln_2(x));
      ++block;
    } else if (auto* n = dynamic_cast<nn::LayerNormImpl*>(m.get())) {
      x = n->forward(x);
    } else if (auto* h = dynamic_cast<LmHeadImpl*>(m.get())) {
      x = torch::matmul(x, h->weight.t());
    } else {
      return std::nullopt;  // not make_gpt's layout (a plugin changed it)
    }
  }
  cache.length = past + t;
  return x;
}

int64_t gpt_heads(const nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/false))
    if (const auto* a = dynamic_cast<const CausalSelfAttentionImpl*>(m.get())) return a->heads;
  return 1;
}

nn::Sequential build_gpt(const GptShape& g, const GptStyle& style, uint64_t seed) {
  nn::Sequential m;
  auto embed = Embed(g.vocab, g.block, g.n_embd, g.dropout);
  m->push_back("embed", embed);
  for (int64_t i = 0; i < g.n_layer; ++i)
    m->push_back("block" + gpt_str(i), GptBlock(g.n_embd, g.n_head, g.dropout, style));
  m->push_back("ln_f", nn::LayerNorm(nn::LayerNormOptions({g.n_embd}).eps(style.eps)));
  m->push_back("head", style.tied ? LmHead(embed->wte->weight) : LmHead(g.n_embd, g.vocab));
  init_gpt(m, g.n_layer, seed);
  return m;
}

nn::Sequential make_gpt(const ModelOptions& o, const ModelInput& in) {
  if (in.block_size <= 0)
    throw_config_error("model 'gpt' takes text: set data.dataset = \"text\" (tokens, not images)");
  const int64_t block = o.block_size > 0 ? o.block_size : in.block_size;
  if (block < in.block_size)
    throw_config_error("model 'gpt': model.block_size = " + gpt_str(block) +
                       " is shorter than the data's windows (data.block_size = " +
                       gpt_str(in.block_size) + "); make it at least that, or 0 to follow the data");
  if (o.n_embd % o.n_head != 0)
    throw_config_error("model 'gpt': model.n_head = " + gpt_str(o.n_head) +
                       " must divide model.n_embd = " + gpt_str(o.n_embd));
  return build_gpt({o.n_layer, o.n_head, o.n_embd, in.num_classes, block, o.dropout}, GptStyle{}, in.seed);
}

}  // namespace frugal
