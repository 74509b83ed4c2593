#include "frugal/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

#include "models/gpt.h"

namespace frugal {

namespace {

void check(const SampleOptions& o, size_t prompt) {
  if (o.tokens < 0) throw std::invalid_argument("tokens must be >= 0");
  if (!(o.temperature >= 0)) throw std::invalid_argument("temperature must be >= 0");
  if (o.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("top_p must be in (0, 1]");
  for (const auto& s : o.stop)
    if (s.empty()) throw std::invalid_argument("a stop string must not be empty");
  if (o.block_size < 1) throw std::invalid_argument("block_size must be >= 1");
  if (o.samples < 1) throw std::invalid_argument("samples must be >= 1");
  if (prompt == 0) throw std::invalid_argument("the prompt must hold at least one token");
}

/// The next token of each row from the last position's logits [B, V] (float, CPU).
torch::Tensor next_tokens(torch::Tensor logits, const SampleOptions& o, at::Generator& gen) {
  constexpr float kOut = -std::numeric_limits<float>::infinity();
  if (o.temperature == 0) return logits.argmax(1);
  logits = logits / o.temperature;
  if (o.top_k > 0 && o.top_k < logits.size(1)) {
    const torch::Tensor kth = std::get<0>(logits.topk(o.top_k, 1)).narrow(1, o.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, kOut);
  }
  if (o.top_p < 1) {  // per row, the smallest set of likeliest tokens holding top_p of the probability
    const auto sorted = torch::softmax(logits, 1).sort(1, /*descending=*/true);
    const torch::Tensor& p = std::get<0>(sorted);
    const torch::Tensor outside = (p.cumsum(1) - p) >= o.top_p;  // the mass before it is enough
    logits = logits.scatter(1, std::get<1>(sorted), logits.gather(1, std::get<1>(sorted)).masked_fill(outside, kOut));
  }
  return at::multinomial(torch::softmax(logits, 1), 1, false, gen).squeeze(1);
}

/// Cuts `s.text` before the earliest stop string that the last token (`added` bytes) completed;
/// true if it did. A subword token may complete several: the text ends at the first of them.
bool stopped(Sample& s, const std::vector<std::string>& stops, size_t added) {
  size_t cut = std::string::npos;
  for (const auto& stop : stops) {
    // A stop string ends somewhere inside the text the last token added.
    const size_t from = s.text.size() >= added + stop.size() ? s.text.size() - added - stop.size() + 1 : 0;
    cut = std::min(cut, s.text.find(stop, from));
  }
  if (cut == std::string::npos) return false;
  s.text.resize(cut);
  return true;
}

}  // namespace

std::vector<Sample> generate_tokens(torch::nn::Sequential& model, const std::vector<int64_t>& prompt,
                                    const SampleOptions& o,
                                    const std::function<std::string(int64_t)>& token_text) {
  check(o, prompt.size());
  torch::NoGradGuard no_grad;
  model->eval();
  const torch::Device device = model->parameters().empty() ? torch::Device(torch::kCPU)
                                                           : model->parameters().front().device();
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  const int64_t n = o.samples;
  // Every row holds the prompt and the tokens drawn so far; all rows have one length.
  torch::Tensor ids = torch::tensor(prompt, torch::kLong).view({1, -1}).repeat({n, 1});
  std::vector<Sample> out(static_cast<size_t>(n));
  std::vector<bool> done(static_cast<size_t>(n), false);
  int64_t open = n;
  // With the cache, each token after the prompt is one new position; once the context no longer
  // fits block_size its window slides, every position moves, and the whole window is computed
  // again for each token (as without the cache).
  GptCache cache;
  bool cached = o.kv_cache;
  for (int64_t i = 0; i < o.tokens && open > 0; ++i) {
    const int64_t len = ids.size(1), ctx = std::min(o.block_size, len);
    torch::Tensor logits;
    if (cached && len <= o.block_size) {
      if (auto l = gpt_forward_cached(model, ids.narrow(1, cache.length, len - cache.length).to(device), cache))
        logits = l->select(1, -1);
      else
        cached = false;  // not the zoo's gpt: the plain forward
    }
    if (!logits.defined()) logits = model->forward(ids.narrow(1, len - ctx, ctx).to(device)).select(1, -1);
    const torch::Tensor next = next_tokens(logits.to(torch::kCPU, torch::kFloat), o, gen);
    ids = torch::cat({ids, next.view({n, 1})}, 1);
    const auto* t = next.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      if (done[r]) continue;
      const std::string piece = token_text(t[r]);
      out[r].ids.push_back(t[r]);
      out[r].text += piece;
      if (stopped(out[r], o.stop, piece.size())) done[r] = true, --open;
    }
  }
  return out;
}

std::string generate_text(torch::nn::Sequential& model, const std::string& prompt, const SampleOptions& o) {
  std::vector<int64_t> ids;
  for (unsigned char c : prompt.empty() ? std::string("\n") : prompt) ids.push_back(c);
  SampleOptions one = o;
  one.samples = 1;
  return generate_tokens(model, ids, one, [](int64_t id) { return std::string(1, static_cast<char>(id)); })
      .front()
      .text;
}

}  // namespace frugal
