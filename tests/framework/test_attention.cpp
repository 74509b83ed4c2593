// The fused CPU causal attention against the plain kernel: values and gradients, on shapes
// that cut the query blocks and the vector lanes anywhere; causality; when it applies; the gpt
// on it and on the plain kernel.
#include <array>
#include <limits>
#include <set>

#include <gtest/gtest.h>

#include "frugal/frugal.h"
#include "frugal/models/attention.h"
#include "gpt_fixture.h"

namespace frugal::test {
namespace {

struct Attended {
  torch::Tensor y, grad;
};

// y = attention(proj), and d(sum(y * w)) / d proj.
template <class Kernel>
Attended attend(const torch::Tensor& proj, const torch::Tensor& w, Kernel&& kernel) {
  auto x = proj.detach().clone().requires_grad_(true);
  auto y = kernel(x);
  (y * w).sum().backward();
  return {y.detach(), x.grad()};
}

// The plain kernel, as the gpt runs it where the fused one does not apply.
torch::Tensor plain_from_projection(const torch::Tensor& proj, int64_t heads) {
  return attention_from_projection(proj, heads, AttentionKernel{}, 0, true, /*fused=*/false);
}

double relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

TEST(FusedAttention, EqualsThePlainKernelInValuesAndGradients) {
  if (!fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) GTEST_SKIP() << "no BLAS sgemm here";
  // (B, T, heads, D): T past, at and under a query block (32) and the 8 lanes; one head; D odd
  for (const auto& [b, t, h, d] : std::vector<std::array<int64_t, 4>>{
           {2, 37, 3, 8}, {1, 128, 4, 32}, {3, 5, 1, 4}, {2, 70, 2, 7}, {1, 1, 2, 3}, {2, 64, 4, 16}}) {
    const int64_t heads = h;  // a lambda cannot capture a structured binding in C++17 (clang)
    torch::manual_seed(b * 1000 + t);
    const auto proj = torch::randn({b, t, 3 * h * d}) * 2;
    const auto w = torch::randn({b, t, h * d});
    const auto fused = attend(proj, w, [&](const torch::Tensor& x) { return fused_causal_attention(x, heads); });
    const auto plain = attend(proj, w, [&](const torch::Tensor& x) { return plain_from_projection(x, heads); });
    SCOPED_TRACE("B " + std::to_string(b) + " T " + std::to_string(t) + " H " + std::to_string(h) + " D " +
                 std::to_string(d));
    EXPECT_EQ(fused.y.sizes(), plain.y.sizes());
    EXPECT_LT(relative_diff(fused.y, plain.y), 2e-6);
    for (int64_t part = 0; part < 3; ++part) {  // q, k and v each (one part's error cannot hide)
      SCOPED_TRACE("gradient of part " + std::to_string(part));
      const int64_t c = h * d;
      EXPECT_LT(relative_diff(fused.grad.narrow(2, part * c, c), plain.grad.narrow(2, part * c, c)), 5e-6);
    }
  }
}

// Leaves freed memory the size of B x H x T x T floats full of NaN, so a probability the kernel
// did not write (the future's zeros) would show (with the caching allocator, its next block of
// that size is this one).
void poison_probabilities(int64_t b, int64_t h, int64_t t) {
  auto junk = torch::full({b, h, t, t}, std::numeric_limits<float>::quiet_NaN());
  junk.reset();
}

TEST(FusedAttention, WritesEveryProbabilityAndGradientItUses) {
  if (!fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) GTEST_SKIP() << "no BLAS sgemm here";
  torch::manual_seed(5);
  const auto proj = torch::randn({2, 96, 3 * 32});
  const auto w = torch::randn({2, 96, 32});
  const auto plain = attend(proj, w, [&](const torch::Tensor& x) { return plain_from_projection(x, 2); });
  const auto fused = attend(proj, w, [&](const torch::Tensor& x) {
    poison_probabilities(2, 2, 96);
    return fused_causal_attention(x, 2);
  });
  EXPECT_TRUE(torch::isfinite(fused.y).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(fused.grad).all().item<bool>());
  EXPECT_LT(relative_diff(fused.y, plain.y), 2e-6);
  EXPECT_LT(relative_diff(fused.grad, plain.grad), 5e-6);
}

TEST(FusedAttention, NoPositionSeesOrGetsAGradientFromTheFuture) {
  if (!fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) GTEST_SKIP() << "no BLAS sgemm here";
  torch::manual_seed(6);
  const auto proj = torch::randn({2, 70, 3 * 16});
  for (int64_t i : {20, 45, 69}) {  // in the first query block, in the second, the last row
    SCOPED_TRACE("position " + std::to_string(i));
    auto changed = proj.clone();
    changed.select(1, i).add_(1.0);
    const auto a = fused_causal_attention(proj, 2), b = fused_causal_attention(changed, 2);
    EXPECT_TRUE(torch::equal(a.narrow(1, 0, i), b.narrow(1, 0, i)));
    // a loss on the outputs before i gives no gradient to the projection at i and after
    auto x = proj.clone().requires_grad_(true);
    fused_causal_attention(x, 2).narrow(1, 0, i).sum().backward();
    EXPECT_EQ(x.grad().narrow(1, i, 70 - i).abs().max().item<float>(), 0.0f);
    EXPECT_GT(x.grad().narrow(1, 0, i).abs().max().item<float>(), 0.0f);
  }
}

TEST(FusedAttention, ANanStaysInItsPairAndTheResultsRepeatBitwise) {
  if (!fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) GTEST_SKIP() << "no BLAS sgemm here";
  torch::manual_seed(7);
  const auto proj = torch::randn({2, 40, 3 * 24});  // 3 heads of 8
  auto bad = proj.clone();
  bad[1][5][8] = std::numeric_limits<float>::quiet_NaN();  // batch 1, position 5, head 1's q
  const auto y = fused_causal_attention(proj, 3), z = fused_causal_attention(bad, 3);
  EXPECT_TRUE(torch::isnan(z[1][5].narrow(0, 8, 8)).all().item<bool>()) << "the row that read it";
  EXPECT_TRUE(torch::equal(z[0], y[0])) << "another batch";
  EXPECT_TRUE(torch::equal(z[1].narrow(1, 0, 8), y[1].narrow(1, 0, 8))) << "another head";
  // again, and on one thread: the same bits (what activation checkpointing's recompute needs)
  EXPECT_TRUE(torch::equal(fused_causal_attention(proj, 3), y));
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = fused_causal_attention(proj, 3);
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one, y));
}

TEST(FusedAttention, GradientsOfAnyShapeAndModes) {
  if (!fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) GTEST_SKIP() << "no BLAS sgemm here";
  torch::manual_seed(8);
  const auto proj = torch::randn({2, 33, 3 * 8});
  // y.sum(): the incoming gradient is an expanded (stride 0) tensor
  auto a = proj.clone().requires_grad_(true), b = proj.clone().requires_grad_(true);
  fused_causal_attention(a, 2).sum().backward();
  plain_from_projection(b, 2).sum().backward();
  EXPECT_LT(relative_diff(a.grad(), b.grad()), 5e-6);
  {
    torch::NoGradGuard g;
    EXPECT_NO_THROW(fused_causal_attention(a, 2));
  }
  {
    c10::InferenceMode g;
    EXPECT_NO_THROW(fused_causal_attention(torch::randn({2, 33, 3 * 8}), 2));
  }
  // the projection changed in place after the forward: backward refuses, as LibTorch's do
  auto x = proj.clone().requires_grad_(true);
  auto in = x * 1.0;
  auto y = fused_causal_attention(in, 2);
  in.add_(1.0);
  EXPECT_THROW(y.sum().backward(), c10::Error);
  // no second derivative
  auto u = proj.clone().requires_grad_(true);
  EXPECT_THROW(torch::autograd::grad({fused_causal_attention(u, 2).pow(2).sum()}, {u}, {}, true, true),
               c10::Error);
}

TEST(FusedAttention, TakesAStridedProjectionAndKeepsCausality) {
  torch::manual_seed(3);
  // the first half of each row of a wider tensor: not contiguous
  const auto wide = torch::randn({2, 40, 2 * 3 * 16});
  const auto proj = wide.narrow(2, 0, 3 * 16);
  ASSERT_FALSE(proj.is_contiguous());
  const auto w = torch::randn({2, 40, 16});
  const auto fused = attend(proj, w, [&](const torch::Tensor& x) { return fused_causal_attention(x, 2); });
  const auto plain = attend(proj, w, [&](const torch::Tensor& x) { return plain_from_projection(x, 2); });
  EXPECT_LT(relative_diff(fused.y, plain.y), 2e-6);
  EXPECT_LT(relative_diff(fused.grad, plain.grad), 5e-6);
  // a change at position 20 (its q, k and v) changes no output before it, and the ones after
  auto changed = proj.clone();
  changed.select(1, 20).add_(1.0);
  const auto a = fused_causal_attention(proj, 2), b = fused_causal_attention(changed, 2);
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 20), b.narrow(1, 0, 20)));
  EXPECT_GT((a.narrow(1, 20, 20) - b.narrow(1, 20, 20)).abs().min().item<double>(), 0.0);
}

TEST(FusedAttention, AppliesToFloatOnTheCpuWithoutDropout) {
  const auto f = torch::zeros({1, 4, 6});
  EXPECT_TRUE(fused_attention_applies(f, 0.0, true));
  EXPECT_TRUE(fused_attention_applies(f, 0.1, false)) << "dropout is off in eval";
  EXPECT_FALSE(fused_attention_applies(f, 0.1, true));
  EXPECT_FALSE(fused_attention_applies(f.to(torch::kBFloat16), 0.0, true));
  EXPECT_FALSE(fused_attention_applies(f.to(torch::kDouble), 0.0, true));
  EXPECT_THROW(fused_causal_attention(torch::zeros({1, 4, 7}), 2), c10::Error);
}

// Whether the graph behind `t` holds the fused kernel's node.
bool graph_has_fused_attention(const torch::Tensor& t) {
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    if (n->name().find("FusedAttentionFn") != std::string::npos) return true;
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return false;
}

TEST(FusedAttention, TheGptTakesItForFloatWithoutDropoutOnly) {
  if (!fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) GTEST_SKIP() << "no BLAS sgemm here";
  TinyGpt s;
  const auto x = torch::randint(0, 256, {2, 8}, torch::kLong);
  auto plain = make_model(gpt_options(s), gpt_input(s));
  EXPECT_TRUE(graph_has_fused_attention(plain->forward(x)));
  auto o = gpt_options(s);
  o.dropout = 0.1;
  auto dropped = make_model(o, gpt_input(s));
  dropped->train();
  EXPECT_FALSE(graph_has_fused_attention(dropped->forward(x))) << "dropout on the probabilities";
  AttentionKernel chunked;
  chunked.query_chunk = 4;
  ASSERT_GT(set_attention_kernel(*plain, chunked), 0);
  EXPECT_FALSE(graph_has_fused_attention(plain->forward(x))) << "the chunked kernel set by a plugin";
}

TEST(FusedAttention, TheGptTrainsTheSameOnTheFusedAndThePlainKernel) {
  TinyGpt s;
  torch::manual_seed(1);
  auto fused = make_model(gpt_options(s), gpt_input(s));
  torch::manual_seed(1);
  auto plain = make_model(gpt_options(s), gpt_input(s));
  ASSERT_TRUE(torch::equal(fused->parameters()[3], plain->parameters()[3]));
  torch::manual_seed(0);
  const auto x = torch::randint(0, 256, {3, 12}, torch::kLong);
  // the same weights in double take the plain kernel (the fused one is float only)
  plain->to(torch::kDouble);
  const auto lf = fused->forward(x).logsumexp(-1).sum();
  const auto lp = plain->forward(x).logsumexp(-1).sum();
  lf.backward();
  lp.backward();
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-4 * std::abs(lp.item<double>()));
  const auto gp = plain->named_parameters();
  for (const auto& p : fused->named_parameters()) {
    SCOPED_TRACE(p.key());
    const auto ref = gp[p.key()].grad().to(torch::kFloat);
    EXPECT_LT(relative_diff(p.value().grad(), ref), 1e-4);
  }
}

}  // namespace
}  // namespace frugal::test
