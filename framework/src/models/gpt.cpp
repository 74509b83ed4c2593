// A GPT-style decoder-only transformer over byte tokens.
#include "models/gpt.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "frugal/models/attention.h"
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
  CausalSelfAttentionImpl(int64_t width, int64_t n_head, double dropout)
      : heads(n_head),
        p(dropout),
        c_attn(register_module("c_attn", nn::Linear(width, 3 * width))),
        c_proj(register_module("c_proj", nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), w = x.size(2), d = w / heads;
    auto qkv = c_attn(x).reshape({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4});
    // q, k, v [B, H, T, D]; the kernel a plugin may have set (chunked_attention)
    auto y = causal_attention(qkv[0], qkv[1], qkv[2], kernel_, p, is_training()).transpose(1, 2).reshape({b, t, w});
    return drop(c_proj(y), p, is_training());
  }
  int64_t heads;
  double p;
  nn::Linear c_attn, c_proj;
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : nn::Module {
  MlpImpl(int64_t width, double dropout)
      : p(dropout),
        c_fc(register_module("c_fc", nn::Linear(width, 4 * width))),
        act(register_module("act", nn::GELU())),
        c_proj(register_module("c_proj", nn::Linear(4 * width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return drop(c_proj(act(c_fc(x))), p, is_training());
  }
  double p;
  nn::Linear c_fc;
  nn::GELU act;
  nn::Linear c_proj;
};
TORCH_MODULE(Mlp);

/// Pre-LayerNorm block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
struct GptBlockImpl : nn::Module {
  GptBlockImpl(int64_t width, int64_t heads, double p)
      : ln_1(register_module("ln_1", nn::LayerNorm(nn::LayerNormOptions({width})))),
        attn(register_module("attn", CausalSelfAttention(width, heads, p))),
        ln_2(register_module("ln_2", nn::LayerNorm(nn::LayerNormOptions({width})))),
        mlp(register_module("mlp", Mlp(width, p))) {}
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
  const int64_t width = a.c_proj->options.out_features(), d = width / a.heads;
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

std::string head_script(const nn::Module&, const std::string& at, const std::string& x, ScriptWriter& w) {
  return w.let("torch.matmul(" + x + ", " + at + ".weight.t())");
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
  nn::Sequential m;
  m->push_back("embed", Embed(in.num_classes, block, o.n_embd, o.dropout));
  for (int64_t i = 0; i < o.n_layer; ++i)
    m->push_back("block" + gpt_str(i), GptBlock(o.n_embd, o.n_head, o.dropout));
  m->push_back("ln_f", nn::LayerNorm(nn::LayerNormOptions({o.n_embd})));
  m->push_back("head", LmHead(o.n_embd, in.num_classes));
  init_gpt(m, o.n_layer, in.seed);
  return m;
}

}  // namespace frugal
