// The fused CPU causal attention against the plain kernel: values and gradients, on shapes
// that cut the query blocks and the vector lanes anywhere; causality; when it applies; the gpt
// on it and on the plain kernel.
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

torch::Tensor plain_from_projection(const torch::Tensor& proj, int64_t heads) {
  const int64_t b = proj.size(0), t = proj.size(1), c = proj.size(2) / 3, d = c / heads;
  const auto qkv = proj.reshape({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4}).unbind(0);
  return plain_causal_attention(qkv[0], qkv[1], qkv[2], 0, true).transpose(1, 2).reshape({b, t, c});
}

double relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

TEST(FusedAttention, EqualsThePlainKernelInValuesAndGradients) {
  ASSERT_TRUE(fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) << "no sgemm_ in the process";
  // (B, T, heads, D): T past, at and under a query block (32) and the 8 lanes; one head; D odd
  for (const auto& [b, t, h, d] : std::vector<std::array<int64_t, 4>>{
           {2, 37, 3, 8}, {1, 128, 4, 32}, {3, 5, 1, 4}, {2, 70, 2, 7}, {1, 1, 2, 3}, {2, 64, 4, 16}}) {
    torch::manual_seed(b * 1000 + t);
    const auto proj = torch::randn({b, t, 3 * h * d}) * 2;
    const auto w = torch::randn({b, t, h * d});
    const auto fused = attend(proj, w, [&](const torch::Tensor& x) { return fused_causal_attention(x, h); });
    const auto plain = attend(proj, w, [&](const torch::Tensor& x) { return plain_from_projection(x, h); });
    SCOPED_TRACE("B " + std::to_string(b) + " T " + std::to_string(t) + " H " + std::to_string(h) + " D " +
                 std::to_string(d));
    EXPECT_EQ(fused.y.sizes(), plain.y.sizes());
    EXPECT_LT(relative_diff(fused.y, plain.y), 2e-6);
    EXPECT_LT(relative_diff(fused.grad, plain.grad), 5e-6);
  }
}

TEST(FusedAttention, TakesAStridedProjectionAndKeepsCausality) {
  torch::manual_seed(3);
  // every other row of a wider tensor: not contiguous
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
