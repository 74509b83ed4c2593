// Causal self-attention, plain and chunked (FlashAttention's algorithm in LibTorch operators).
#include "frugal/models/attention.h"

#include "frugal/base/compat.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace frugal {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor plain_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     double p, bool training) {
  const int64_t t = q.size(2), d = q.size(3);
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
  auto future = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
  att = torch::softmax(att.masked_fill(future, -INFINITY), -1);
  if (p > 0) att = F::dropout(att, F::DropoutFuncOptions().p(p).training(training));
  return torch::matmul(att, v);
}

namespace {

/// One chunk pair's geometry: queries [i0, i0 + nq), keys [j0, j0 + nk).
struct Tile {
  int64_t i0, nq, j0, nk;
};

/// What the forward and the backward share: the inputs, the sizes, and the dropout replay. The
/// matrix products run in the inputs' dtype (bf16 under amp: its speed) and the softmax's
/// statistics and the accumulators in float (`wt`), as FlashAttention's kernels do; autocast is
/// off inside (compat::AutocastOff), so the backward recomputes exactly the forward's scores.
struct Chunking {
  torch::Tensor q, k, v;  // [B, H, T, D]
  int64_t qc, kc, t;
  double scale, p;
  int64_t seed;  // < 0: no dropout
  torch::ScalarType wt;

  /// The keys a query chunk sees are those before its end; the tiles that hold any.
  template <class Fn>
  void for_each_tile(int64_t i0, Fn&& fn) const {
    const int64_t nq = std::min(qc, t - i0), end = i0 + nq;
    for (int64_t j0 = 0; j0 < end; j0 += kc) fn(Tile{i0, nq, j0, std::min(kc, end - j0)});
  }

  /// q_c kᵀ * scale (in wt) with the future keys at -inf.
  torch::Tensor scores(const torch::Tensor& qi, const Tile& a) const {
    auto s = torch::matmul(qi, k.narrow(2, a.j0, a.nk).transpose(-2, -1)).to(wt) * scale;
    if (a.j0 + a.nk - 1 <= a.i0) return s;  // every key of the tile is at or before every query
    auto idx = torch::TensorOptions().dtype(torch::kLong).device(q.device());
    auto future = torch::arange(a.j0, a.j0 + a.nk, idx).unsqueeze(0) >
                  torch::arange(a.i0, a.i0 + a.nq, idx).unsqueeze(1);
    return s.masked_fill(future, -std::numeric_limits<double>::infinity());
  }

  /// The tile's dropout mask, scaled by 1 / (1 - p): the same draws in the forward and backward.
  torch::Tensor mask(const Tile& a) const {
    const auto key = static_cast<uint64_t>(seed) ^ (static_cast<uint64_t>(a.i0) * 0x9E3779B97F4A7C15ULL) ^
                     (static_cast<uint64_t>(a.j0) * 0xC2B2AE3D27D4EB4FULL);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(key);
    auto m = torch::empty({q.size(0), q.size(1), a.nq, a.nk}, torch::kFloat).bernoulli_(1.0 - p, gen);
    return m.div_(1.0 - p).to(q.device(), wt);
  }

  /// a @ b in the inputs' dtype, the result in wt.
  torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) const {
    return torch::matmul(a.to(q.scalar_type()), b.to(q.scalar_type())).to(wt);
  }
};

torch::ScalarType working_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

/// One query chunk of the forward: its output rows and log-sum-exp per row.
std::pair<torch::Tensor, torch::Tensor> forward_rows(const Chunking& c, int64_t i0) {
  const int64_t nq = std::min(c.qc, c.t - i0);
  const auto qi = c.q.narrow(2, i0, nq);
  auto m = torch::full({c.q.size(0), c.q.size(1), nq, 1}, -std::numeric_limits<double>::infinity(),
                       c.q.options().dtype(c.wt));
  auto l = torch::zeros_like(m), acc = torch::zeros_like(qi, c.q.options().dtype(c.wt));
  c.for_each_tile(i0, [&](const Tile& a) {
    auto s = c.scores(qi, a);
    auto m_new = torch::maximum(m, s.amax(-1, true));  // finite: key 0 is in the first tile
    auto pr = torch::exp(s - m_new), corr = torch::exp(m - m_new);
    l = l * corr + pr.sum(-1, true);
    if (c.seed >= 0) pr = pr * c.mask(a);
    acc = acc * corr + c.mm(pr, c.v.narrow(2, a.j0, a.nk));
    m = m_new;
  });
  return {acc / l, (m + torch::log(l)).squeeze(-1)};
}

struct ChunkedAttentionFn : torch::autograd::Function<ChunkedAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t qc, int64_t kc, double p, int64_t seed) {
    compat::AutocastOff no_autocast(q.device().type());
    Chunking c{q, k.to(q.scalar_type()), v.to(q.scalar_type()), qc, kc, q.size(2),
               1.0 / std::sqrt(static_cast<double>(q.size(3))), p, seed, working_type(q)};
    // Laid out [B, T, H, D] and seen as [B, H, T, D]: the usual transpose(1, 2).reshape of the
    // output to [B, T, H * D] is then a view, not a copy that the next Linear keeps for backward.
    auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options().dtype(c.wt)).transpose(1, 2);
    auto lse = torch::empty({q.size(0), q.size(1), c.t}, q.options().dtype(c.wt));
    for (int64_t i0 = 0; i0 < c.t; i0 += qc) {
      auto [rows, row_lse] = forward_rows(c, i0);
      out.narrow(2, i0, rows.size(2)).copy_(rows);
      lse.narrow(2, i0, rows.size(2)).copy_(row_lse);
    }
    auto result = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, result, lse});
    ctx->saved_data["qc"] = qc;
    ctx->saved_data["kc"] = kc;
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    compat::AutocastOff no_autocast(q.device().type());
    Chunking c{q, saved[1].to(q.scalar_type()), saved[2].to(q.scalar_type()), ctx->saved_data["qc"].toInt(),
               ctx->saved_data["kc"].toInt(), q.size(2), 1.0 / std::sqrt(static_cast<double>(q.size(3))),
               ctx->saved_data["p"].toDouble(), ctx->saved_data["seed"].toInt(), working_type(q)};
    const auto d_out = grads[0].to(c.wt);
    const auto row_dot = (d_out * saved[3].to(c.wt)).sum(-1, true);  // D_i = sum_d dO_id O_id
    const auto& lse = saved[4];
    const auto acc = q.options().dtype(c.wt);
    auto dq = torch::zeros(q.sizes(), acc), dk = torch::zeros(q.sizes(), acc), dv = torch::zeros(q.sizes(), acc);
    for (int64_t i0 = 0; i0 < c.t; i0 += c.qc) {
      const int64_t nq = std::min(c.qc, c.t - i0);
      const auto qi = c.q.narrow(2, i0, nq), doi = d_out.narrow(2, i0, nq);
      const auto lse_i = lse.narrow(2, i0, nq).unsqueeze(-1), di = row_dot.narrow(2, i0, nq);
      auto dqi = dq.narrow(2, i0, nq);
      c.for_each_tile(i0, [&](const Tile& a) {
        const auto kj = c.k.narrow(2, a.j0, a.nk), vj = c.v.narrow(2, a.j0, a.nk);
        auto pr = torch::exp(c.scores(qi, a) - lse_i);  // the forward's probabilities
        auto dp = c.mm(doi, vj.transpose(-2, -1));
        torch::Tensor dropped = pr;
        if (c.seed >= 0) {
          const auto m = c.mask(a);
          dropped = pr * m;
          dp = dp * m;
        }
        dv.narrow(2, a.j0, a.nk).add_(c.mm(dropped.transpose(-2, -1), doi));
        const auto ds = pr * (dp - di) * c.scale;
        dqi.add_(c.mm(ds, kj));
        dk.narrow(2, a.j0, a.nk).add_(c.mm(ds.transpose(-2, -1), qi));
      });
    }
    return {dq.to(q.scalar_type()), dk.to(saved[1].scalar_type()), dv.to(saved[2].scalar_type()),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor chunked_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       int64_t query_chunk, int64_t key_chunk, double p, bool training) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "chunked_causal_attention: q, k and v must be [B, H, T, D] of one shape");
  TORCH_CHECK(query_chunk > 0 && key_chunk > 0, "chunked_causal_attention: chunks must be >= 1");
  int64_t seed = -1;
  if (p > 0 && training)  // from the default generator, so torch::manual_seed decides the masks
    seed = torch::randint(std::numeric_limits<int64_t>::max(), {1}, torch::kLong).item<int64_t>();
  const int64_t t = q.size(2);
  return ChunkedAttentionFn::apply(q, k, v, std::min(query_chunk, t), std::min(key_chunk, t), p, seed);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const AttentionKernel& kernel, double p, bool training) {
  return kernel.chunked()
             ? chunked_causal_attention(q, k, v, kernel.query_chunk, kernel.key_chunk > 0 ? kernel.key_chunk
                                                                                          : kernel.query_chunk,
                                        p, training)
             : plain_causal_attention(q, k, v, p, training);
}

torch::Tensor attention_from_projection(const torch::Tensor& proj, int64_t heads, const AttentionKernel& kernel,
                                        double p, bool training, bool fused) {
  if (fused && !kernel.chunked() && fused_attention_applies(proj, p, training))
    return fused_causal_attention(proj, heads);
  const int64_t b = proj.size(0), t = proj.size(1), w = proj.size(2) / 3, d = w / heads;
  // q, k, v [B, H, T, D], views of the projection: unbind's backward stacks their gradients
  // into one tensor (indexing each would zero-fill a whole [3, B, H, T, D] per part, then sum)
  const auto qkv = proj.reshape({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4}).unbind(0);
  return causal_attention(qkv[0], qkv[1], qkv[2], kernel, p, training).transpose(1, 2).reshape({b, t, w});
}

int64_t set_attention_kernel(torch::nn::Module& model, const AttentionKernel& kernel) {
  int64_t n = 0;
  if (auto* a = dynamic_cast<AttentionModule*>(&model)) {
    a->attention_kernel() = kernel;
    ++n;
  }
  for (const auto& child : model.modules(/*include_self=*/false))
    if (auto* a = dynamic_cast<AttentionModule*>(child.get())) {
      a->attention_kernel() = kernel;
      ++n;
    }
  return n;
}

}  // namespace frugal
