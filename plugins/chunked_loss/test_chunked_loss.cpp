// The chunked cross-entropy against LibTorch's (loss and gradients), the bytes it saves, and the
// plugin in a gpt's fit: the same training, a refused label smoothing, nothing done on an MLP.
#include <gtest/gtest.h>

#include "chunked_loss.h"
#include "frugal/app/plugin_host.h"
#include "frugal/memory/memory.h"
#include "frugal/models/lm_head.h"
#include "gpt_fixture.h"
#include "learner_fixture.h"
#include "log_capture.h"

namespace frugal::test {
namespace {

namespace F = torch::nn::functional;

double ce_max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct CeGrads {
  torch::Tensor loss, dh, dw;
};

CeGrads run_ce(const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& y, int64_t chunk) {
  auto h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
  auto loss = chunk > 0 ? chunked_linear_cross_entropy(h, w, y, chunk) : F::cross_entropy(torch::matmul(h, w.t()), y);
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

TEST(ChunkedLossKernel, LossAndGradientsEqualLibTorchsCrossEntropyForEveryChunk) {
  torch::manual_seed(1);
  const auto h = torch::randn({37, 16}), w = torch::randn({50, 16}) * 0.3;
  const auto y = torch::randint(0, 50, {37}, torch::kLong);
  const CeGrads plain = run_ce(h, w, y, 0);
  for (int64_t chunk : {1, 5, 16, 37, 100}) {
    const CeGrads c = run_ce(h, w, y, chunk);
    EXPECT_LT(ce_max_diff(c.loss, plain.loss), 1e-5) << "chunk " << chunk;
    EXPECT_LT(ce_max_diff(c.dh, plain.dh), 1e-6) << "chunk " << chunk;
    EXPECT_LT(ce_max_diff(c.dw, plain.dw), 1e-6) << "chunk " << chunk;
  }
}

/// Bytes the forward + backward of the loss adds at its peak over what was alive before.
int64_t loss_peak(const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& y, int64_t chunk) {
  auto h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t before = mm.current();
  MemoryWindow window = mm.open_window();
  {
    auto loss = chunk > 0 ? chunked_linear_cross_entropy(h, w, y, chunk) : F::cross_entropy(torch::matmul(h, w.t()), y);
    loss.backward();
  }
  return window.peak() - before;
}

TEST(ChunkedLossKernel, ThePeakHoldsAChunkOfLogitsNotAllOfThem) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  torch::manual_seed(2);
  const int64_t n = 2048, v = 4096, c = 32;  // logits: 2048 x 4096 floats = 32 MiB
  const auto h = torch::randn({n, c}), w = torch::randn({v, c}) * 0.1;
  const auto y = torch::randint(0, v, {n}, torch::kLong);
  const int64_t plain = loss_peak(h, w, y, 0), chunked = loss_peak(h, w, y, 128);
  std::cout << "[chunked_loss] loss forward + backward peak, 2048 tokens x 4096 classes: plain "
            << format_bytes(plain) << ", chunks of 128 tokens " << format_bytes(chunked) << "\n";
  const int64_t logits = n * v * 4;
  EXPECT_GT(plain, 2 * logits) << "LibTorch holds the logits and their log-softmax at least";
  EXPECT_LT(chunked, logits / 4) << "a chunk's logits and its gradient, h's and w's gradients";
}

// A frozen head (lora's: tied to a frozen embedding) gets no gradient, and no V x C buffer for one.
TEST(ChunkedLossKernel, AFrozenHeadGetsNoGradientAndNoBufferForIt) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  torch::manual_seed(3);
  const int64_t n = 64, v = 8192, c = 256;  // w: 8192 x 256 floats = 8 MiB
  const auto h = torch::randn({n, c}).requires_grad_(), w = torch::randn({v, c}) * 0.1;
  const auto y = torch::randint(0, v, {n}, torch::kLong);
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t before = mm.current();
  int64_t peak = 0;
  {
    MemoryWindow window = mm.open_window();
    chunked_linear_cross_entropy(h, w, y, 16).backward();
    peak = window.peak() - before;
  }
  EXPECT_FALSE(w.grad().defined());
  ASSERT_TRUE(h.grad().defined());
  const auto plain_h = h.detach().clone().requires_grad_();
  F::cross_entropy(torch::matmul(plain_h, w.t()), y).backward();
  EXPECT_LT(ce_max_diff(h.grad(), plain_h.grad()), 1e-6);
  EXPECT_LT(peak, v * c * 4 / 2) << "a dW buffer was made for a frozen head";
}

// ---- the plugin --------------------------------------------------------------------------------

std::shared_ptr<chunked_loss::ChunkedLoss> load_chunked_loss(PluginHost& host, Learner& l, const std::string& table) {
  std::shared_ptr<chunked_loss::ChunkedLoss> plugin;
  for (auto& cb : host.load(plugins_of(table), "cfg.toml")) {
    plugin = std::dynamic_pointer_cast<chunked_loss::ChunkedLoss>(cb);
    l.add_callback(cb);
  }
  return plugin;
}

TEST(ChunkedLossPlugin, AGptTrainsAsWithThePlainLossAndGetsItBack) {
  PluginHost host;
  auto l = make_tiny_gpt_learner();
  const auto plugin = load_chunked_loss(host, *l, "[plugins.chunked_loss]\nchunk = 20\n");
  ASSERT_TRUE(plugin);
  l->fit(1);
  auto plain = make_tiny_gpt_learner();
  plain->fit(1);
  EXPECT_EQ(plugin->fused_batches(), l->steps());
  EXPECT_GT(l->steps(), 0);
  const auto a = l->model()->parameters(), b = plain->model()->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(ce_max_diff(a[i], b[i]), 1e-4) << i;
  EXPECT_NEAR(l->stage_stats().at(0).last_epoch_loss, plain->stage_stats().at(0).last_epoch_loss, 1e-5);
  EXPECT_NEAR(l->valid_sums().mean_loss(), plain->valid_sums().mean_loss(), 1e-4) << "validation saw real logits";
  // After the fit the head computes logits again, in training mode too.
  l->model()->train();
  const auto x = torch::randint(0, 256, {2, 8}, torch::kLong);
  EXPECT_EQ(l->model()->forward(x).stride(-1), 1) << "real logits, not the placeholder";
}

TEST(ChunkedLossPlugin, LabelSmoothingIsRefusedNamingBothLosses) {
  PluginHost host;
  TinyGpt s;
  auto l = make_tiny_gpt_learner(s);
  LossOptions smoothing;
  smoothing.label_smoothing = 0.1;
  l->set_loss_fn(make_loss(smoothing));
  load_chunked_loss(host, *l, "[plugins.chunked_loss]\n");
  try {
    l->fit(1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label smoothing"), std::string::npos) << e.what();
  }
  EXPECT_EQ(l->steps(), 0);
}

TEST(ChunkedLossPlugin, AModelWithoutAnLmHeadIsToldNothingChanges) {
  PluginHost host;
  LogCapture log;
  auto l = make_tiny_learner();
  const auto plugin = load_chunked_loss(host, *l, "[plugins.chunked_loss]\n");
  l->fit(1);
  EXPECT_EQ(plugin->fused_batches(), 0);
  EXPECT_NE(log.text().find("chunked_loss: nothing to do"), std::string::npos) << log.text();
}

}  // namespace
}  // namespace frugal::test
