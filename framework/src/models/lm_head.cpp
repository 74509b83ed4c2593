// The language model's output layer and the chunked cross-entropy it can hand its input to.
#include "frugal/models/lm_head.h"

#include <algorithm>

#include "frugal/base/compat.h"

namespace frugal {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

/// One chunk's logits in float: h_c w^T in h's dtype (w already cast to it), then float.
torch::Tensor chunk_logits(const torch::Tensor& h, const torch::Tensor& w, int64_t first, int64_t n) {
  return torch::matmul(h.narrow(0, first, n), w.t()).to(torch::kFloat);
}

struct ChunkedCrossEntropyFn : torch::autograd::Function<ChunkedCrossEntropyFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h, const torch::Tensor& w,
                               const torch::Tensor& y, int64_t chunk) {
    compat::AutocastOff no_autocast(h.device().type());
    const int64_t n = h.size(0);
    const auto wh = w.to(h.scalar_type());  // once, not per chunk
    auto lse = torch::empty({n}, h.options().dtype(torch::kFloat));
    auto total = torch::zeros({}, h.options().dtype(torch::kDouble));
    for (int64_t first = 0; first < n; first += chunk) {
      const int64_t rows = std::min(chunk, n - first);
      const auto logits = chunk_logits(h, wh, first, rows);
      const auto l = logits.logsumexp(1);
      lse.narrow(0, first, rows).copy_(l);
      total += (l - logits.gather(1, y.narrow(0, first, rows).unsqueeze(1)).squeeze(1)).sum().to(torch::kDouble);
    }
    ctx->save_for_backward({h, w, y, lse});
    ctx->saved_data["chunk"] = chunk;
    return (total / static_cast<double>(n)).to(torch::kFloat);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &h = saved[0], &w = saved[1], &y = saved[2], &lse = saved[3];
    compat::AutocastOff no_autocast(h.device().type());
    const int64_t n = h.size(0), chunk = ctx->saved_data["chunk"].toInt();
    const auto scale = grads[0].to(torch::kFloat) / static_cast<double>(n);  // d mean / d row loss
    const auto wh = w.to(h.scalar_type());
    // A frozen head (lora's, tied to a frozen embedding) needs no dW: not a V x C float buffer.
    const bool want_dh = ctx->needs_input_grad(0), want_dw = ctx->needs_input_grad(1);
    auto dh = want_dh ? torch::empty_like(h) : torch::Tensor();
    auto dw = want_dw ? torch::zeros(w.sizes(), w.options().dtype(torch::kFloat)) : torch::Tensor();
    for (int64_t first = 0; first < n; first += chunk) {
      const int64_t rows = std::min(chunk, n - first);
      // softmax - one_hot(y), times the upstream gradient over N
      auto g = torch::exp(chunk_logits(h, wh, first, rows) - lse.narrow(0, first, rows).unsqueeze(1));
      g.scatter_add_(1, y.narrow(0, first, rows).unsqueeze(1), torch::full({rows, 1}, -1.0f, g.options()));
      g.mul_(scale);
      const auto gh = g.to(h.scalar_type());
      if (want_dh) dh.narrow(0, first, rows).copy_(torch::matmul(gh, wh));
      if (want_dw) dw.add_(torch::matmul(gh.t(), h.narrow(0, first, rows)).to(torch::kFloat));
    }
    return {dh, want_dw ? dw.to(w.scalar_type()) : torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& h, const torch::Tensor& w, const torch::Tensor& y,
                                           int64_t chunk) {
  TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1),
              "chunked_linear_cross_entropy: h [N, C] and w [V, C] with the same C");
  TORCH_CHECK(y.dim() == 1 && y.size(0) == h.size(0), "chunked_linear_cross_entropy: y [N] for h [N, C]");
  TORCH_CHECK(chunk >= 1, "chunked_linear_cross_entropy: chunk must be >= 1");
  return ChunkedCrossEntropyFn::apply(h, w, y.to(torch::kLong), chunk);
}

LmHeadImpl::LmHeadImpl(int64_t in_features, int64_t vocabulary)
    : weight(register_parameter("weight", torch::empty({vocabulary, in_features}))) {
  // nn::Linear's initialisation (Kaiming uniform, a = sqrt(5)): the gpt draws its own after.
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
}

LmHeadImpl::LmHeadImpl(torch::Tensor embedding) : weight(std::move(embedding)), tied_(true) {}

torch::Tensor LmHeadImpl::forward(const torch::Tensor& h) {
  if (fused_ && is_training() && torch::GradMode::is_enabled()) {
    pending_ = h;
    auto shape = h.sizes().vec();
    shape.back() = weight.size(0);
    return torch::zeros({1}, h.options()).expand(shape);  // the logits' shape, no memory
  }
  return torch::matmul(h, weight.t());
}

torch::Tensor LmHeadImpl::take_input() {
  torch::Tensor h = std::move(pending_);
  pending_ = torch::Tensor();
  return h;
}

}  // namespace frugal
