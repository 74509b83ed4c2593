// The chunked attention kernel against the plain one (outputs and gradients), its dropout replay
// against finite differences, the bytes it saves in a gpt's step, and the plugin in a fit.
#include <gtest/gtest.h>

#include "chunked_attention.h"
#include "frugal/base/compat.h"
#include "frugal/app/plugin_host.h"
#include "frugal/memory/memory.h"
#include "frugal/models/attention.h"
#include "frugal/models/registry.h"
#include "learner_fixture.h"
#include "log_capture.h"
#include "gpt_fixture.h"

namespace frugal::test {
namespace {

struct Qkv {
  torch::Tensor q, k, v;
};

Qkv random_qkv(std::vector<int64_t> shape, torch::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  auto make = [&] { return torch::randn(shape, torch::TensorOptions().dtype(dtype)).requires_grad_(); };
  Qkv r;
  r.q = make(), r.k = make(), r.v = make();
  return r;
}

double attention_max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

/// Output and the gradients of sum(out * w) in q, k and v.
std::vector<torch::Tensor> attend_and_grad(const Qkv& in, const std::function<torch::Tensor(const Qkv&)>& attend,
                               const torch::Tensor& w) {
  for (auto* t : {&in.q, &in.k, &in.v})
    if (t->grad().defined()) const_cast<torch::Tensor&>(t->grad()).zero_();
  auto out = attend(in);
  (out * w).sum().backward();
  return {out.detach().clone(), in.q.grad().clone(), in.k.grad().clone(), in.v.grad().clone()};
}

TEST(ChunkedAttentionKernel, OutputsAndGradientsEqualThePlainKernelForEveryTiling) {
  const Qkv in = random_qkv({2, 3, 37, 8}, torch::kFloat, 1);
  const torch::Tensor w = torch::randn({2, 3, 37, 8});
  const auto plain = attend_and_grad(in, [](const Qkv& a) { return plain_causal_attention(a.q, a.k, a.v, 0, true); }, w);
  // Tiles smaller than T, not dividing it, wider than tall, and one tile bigger than T.
  for (const auto& tile : std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {5, 11}, {16, 3}, {1, 37}, {64, 64}}) {
    const int64_t qc = tile.first, kc = tile.second;  // not a structured binding: clang's lambdas cannot capture one
    const auto chunked =
        attend_and_grad(in, [&](const Qkv& a) { return chunked_causal_attention(a.q, a.k, a.v, qc, kc, 0, true); }, w);
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_LT(attention_max_diff(plain[i], chunked[i]), 1e-5) << "tiles " << qc << "x" << kc << ", tensor " << i;
  }
}

TEST(ChunkedAttentionKernel, Bfloat16InputsKeepFloatStatisticsAndStayCloseToFloat) {
  const Qkv f = random_qkv({1, 2, 24, 8}, torch::kFloat, 2);
  auto out_f = plain_causal_attention(f.q, f.k, f.v, 0, false);
  auto out_b = chunked_causal_attention(f.q.to(torch::kBFloat16), f.k.to(torch::kBFloat16),
                                        f.v.to(torch::kBFloat16), 8, 8, 0, false);
  EXPECT_EQ(out_b.scalar_type(), torch::kBFloat16);
  EXPECT_LT(attention_max_diff(out_f, out_b.to(torch::kFloat)), 3e-2);
}

/// Under amp the backward (outside autocast) must recompute exactly the forward's scores: the
/// kernel turns autocast off and picks its own dtypes, so autocast changes nothing in it.
TEST(ChunkedAttentionKernel, AutocastChangesNothingInsideTheKernel) {
  const Qkv f = random_qkv({1, 2, 20, 8}, torch::kFloat, 6);
  auto bf = [&](const torch::Tensor& t) { return t.detach().to(torch::kBFloat16).requires_grad_(); };
  const torch::Tensor w = torch::randn({1, 2, 20, 8});
  auto grads = [&](bool autocast) {
    Qkv in{bf(f.q), bf(f.k), bf(f.v)};
    compat::set_autocast(torch::kCPU, autocast, torch::kBFloat16);
    auto out = chunked_causal_attention(in.q, in.k, in.v, 8, 4, 0, true);
    compat::set_autocast(torch::kCPU, false, torch::kBFloat16);
    (out.to(torch::kFloat) * w).sum().backward();
    return std::vector<torch::Tensor>{out.detach(), in.q.grad(), in.k.grad(), in.v.grad()};
  };
  const auto plain = grads(false), under_amp = grads(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], under_amp[i])) << "tensor " << i;
}

/// The dropout masks the forward drew are the ones the backward replays: its gradient equals
/// central differences of the forward (same seed, so the same masks) in double.
TEST(ChunkedAttentionKernel, DropoutGradientsMatchFiniteDifferencesOfTheSameMasks) {
  const Qkv in = random_qkv({1, 2, 9, 4}, torch::kDouble, 3);
  const torch::Tensor w = torch::randn({1, 2, 9, 4}, torch::kDouble);
  auto f = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    torch::manual_seed(99);
    return (chunked_causal_attention(q, k, v, 4, 3, 0.4, true) * w).sum();
  };
  f(in.q, in.k, in.v).backward();
  torch::NoGradGuard g;
  const double eps = 1e-6;
  for (int which = 0; which < 3; ++which) {
    const torch::Tensor& x = which == 0 ? in.q : which == 1 ? in.k : in.v;
    for (int64_t e : {0, 7, 19, 35, 50, 71}) {
      auto plus = x.detach().clone(), minus = x.detach().clone();
      plus.view(-1)[e] += eps;
      minus.view(-1)[e] -= eps;
      auto args = [&](const torch::Tensor& t) {
        return std::array<torch::Tensor, 3>{which == 0 ? t : in.q.detach(), which == 1 ? t : in.k.detach(),
                                            which == 2 ? t : in.v.detach()};
      };
      const auto a = args(plus), b = args(minus);
      const double numeric = (f(a[0], a[1], a[2]) - f(b[0], b[1], b[2])).item<double>() / (2 * eps);
      EXPECT_NEAR(x.grad().view(-1)[e].item<double>(), numeric, 1e-6) << "input " << which << " element " << e;
    }
  }
  // And the masks did drop something: the output differs from the kernel without dropout.
  torch::manual_seed(99);
  auto dropped = chunked_causal_attention(in.q, in.k, in.v, 4, 3, 0.4, true);
  EXPECT_GT(attention_max_diff(dropped, chunked_causal_attention(in.q, in.k, in.v, 4, 3, 0.0, true)), 1e-3);
}

torch::nn::Sequential tiny_gpt(int64_t block) {
  ModelOptions o;
  o.arch = "gpt";
  o.n_layer = 2;
  o.n_head = 4;
  o.n_embd = 32;
  ModelInput in;
  in.num_classes = 256;
  in.block_size = block;
  return make_model(o, in);
}

/// The peak bytes of one forward + backward above what was alive before it.
int64_t step_peak(torch::nn::Sequential& m, const torch::Tensor& x) {
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t before = mm.current();
  MemoryWindow window = mm.open_window();
  m->forward(x).sum().backward();
  return window.peak() - before;
}

TEST(ChunkedAttentionKernel, TheGptsStepPeakDropsAndItsGradientsStayTheSame) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  auto m = tiny_gpt(256);
  torch::manual_seed(4);
  const auto x = torch::randint(0, 256, {4, 256}, torch::kLong);
  for (auto& p : m->parameters()) p.mutable_grad() = torch::zeros_like(p);
  const int64_t plain = step_peak(m, x);
  std::vector<torch::Tensor> grads_plain;
  for (auto& p : m->parameters()) grads_plain.push_back(p.grad().clone()), p.grad().zero_();
  EXPECT_EQ(set_attention_kernel(*m, AttentionKernel{32, 32}), 2);
  const int64_t chunked = step_peak(m, x);
  size_t i = 0;
  for (auto& p : m->parameters()) {  // relative: the gradients of a sum of 4 x 256 x 256 logits are large
    const double scale = std::max(1.0, grads_plain[i].abs().max().item<double>());
    EXPECT_LT(attention_max_diff(p.grad(), grads_plain[i]) / scale, 1e-5) << i;
    ++i;
  }
  std::cout << "[chunked_attention] gpt step peak (B 4, T 256, 2 layers x 4 heads): plain "
            << format_bytes(plain) << ", tiles of 32 x 32 " << format_bytes(chunked) << "\n";
  // Each layer's plain probabilities alone are 4 x 4 x 256 x 256 floats (4 MiB).
  EXPECT_LT(chunked, plain / 2);
  EXPECT_GT(plain - chunked, 4 * (int64_t{1} << 20));
}

// ---- the plugin --------------------------------------------------------------------------------

TEST(ChunkedAttentionPlugin, AGptTrainsAsWithThePlainKernelAndGetsItBackAfterTheFit) {
  TinyGpt setup;
  setup.block_size = 32;
  PluginHost host;
  auto l = make_tiny_gpt_learner(setup);
  std::shared_ptr<chunked_attention::ChunkedAttention> plugin;
  for (auto& cb : host.load(plugins_of("[plugins.chunked_attention]\nquery_chunk = 8\nkey_chunk = 5\n"), "cfg.toml")) {
    plugin = std::dynamic_pointer_cast<chunked_attention::ChunkedAttention>(cb);
    l->add_callback(cb);
  }
  ASSERT_TRUE(plugin);
  l->fit(1);
  EXPECT_EQ(plugin->modules(), 2);
  auto plain = make_tiny_gpt_learner(setup);
  plain->fit(1);
  EXPECT_EQ(l->steps(), 4);
  const auto a = l->model()->parameters(), b = plain->model()->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(attention_max_diff(a[i], b[i]), 1e-4) << i;
  EXPECT_NEAR(l->stage_stats().at(0).last_epoch_loss, plain->stage_stats().at(0).last_epoch_loss, 1e-5);
  for (const auto& m : l->model()->modules()) {
    auto* att = dynamic_cast<AttentionModule*>(m.get());
    if (att) {
      EXPECT_FALSE(att->attention_kernel().chunked());
    }
  }
}

TEST(ChunkedAttentionPlugin, AModelWithoutAttentionIsToldNothingChangesAndTrainsAsWithout) {
  PluginHost host;
  std::vector<torch::Tensor> with_plugin;
  {
    LogCapture log;
    auto l = make_tiny_learner();
    for (auto& cb : host.load(plugins_of("[plugins.chunked_attention]\n"), "cfg.toml")) l->add_callback(cb);
    torch::manual_seed(2);
    l->fit(1);
    EXPECT_NE(log.text().find("chunked_attention: nothing to do"), std::string::npos) << log.text();
    with_plugin = clone_params(*l->model());
  }
  auto plain = make_tiny_learner();
  torch::manual_seed(2);
  plain->fit(1);
  EXPECT_TRUE(params_equal(*plain->model(), with_plugin));
  EXPECT_THROW(host.load(plugins_of("[plugins.chunked_attention]\nquery_chunk = 0\n"), "cfg.toml"), ConfigError);
}

}  // namespace
}  // namespace frugal::test
