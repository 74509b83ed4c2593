#include "frugal/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <stdexcept>
#include <vector>

#include "models/gpt.h"

namespace frugal {

namespace {

void check(const SampleOptions& o) {
  if (o.tokens < 0) throw std::invalid_argument("tokens must be >= 0");
  if (!(o.temperature >= 0)) throw std::invalid_argument("temperature must be >= 0");
  if (o.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("top_p must be in (0, 1]");
  for (const auto& s : o.stop)
    if (s.empty()) throw std::invalid_argument("a stop string must not be empty");
  if (o.block_size < 1) throw std::invalid_argument("block_size must be >= 1");
}

/// The next byte from the last position's logits.
int64_t next_byte(torch::Tensor logits, const SampleOptions& o, at::Generator& gen) {
  if (o.temperature == 0) return logits.argmax().item<int64_t>();
  logits = logits / o.temperature;
  if (o.top_k > 0 && o.top_k < logits.size(0)) {
    const torch::Tensor kth = std::get<0>(logits.topk(o.top_k)).index({-1});
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  if (o.top_p < 1) {  // the smallest set of likeliest bytes holding top_p of the probability
    const auto sorted = torch::softmax(logits, 0).sort(0, /*descending=*/true);
    const torch::Tensor& p = std::get<0>(sorted);
    const torch::Tensor outside = (p.cumsum(0) - p) >= o.top_p;  // the mass before it is enough
    logits = logits.index_fill(0, std::get<1>(sorted).masked_select(outside),
                               -std::numeric_limits<float>::infinity());
  }
  return at::multinomial(torch::softmax(logits, 0), 1, false, gen).item<int64_t>();
}

}  // namespace

std::string generate_text(torch::nn::Sequential& model, const std::string& prompt,
                          const SampleOptions& o) {
  check(o);
  torch::NoGradGuard no_grad;
  model->eval();
  const torch::Device device = model->parameters().empty() ? torch::Device(torch::kCPU)
                                                           : model->parameters().front().device();
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  std::vector<int64_t> tokens;
  for (unsigned char c : prompt.empty() ? std::string("\n") : prompt) tokens.push_back(c);
  std::string out;
  // With the cache, each byte after the prompt is one new position; once the context no longer
  // fits block_size its window slides, every position moves, and the whole window is computed
  // again for each byte (as without the cache).
  GptCache cache;
  bool cached = o.kv_cache;
  const auto ids = [&](size_t from) {
    return torch::tensor(std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(from), tokens.end()),
                         torch::kLong)
        .view({1, -1})
        .to(device);
  };
  for (int64_t i = 0; i < o.tokens; ++i) {
    const int64_t n = std::min<int64_t>(o.block_size, static_cast<int64_t>(tokens.size()));
    torch::Tensor logits;
    if (cached && static_cast<int64_t>(tokens.size()) <= o.block_size) {
      if (auto l = gpt_forward_cached(model, ids(static_cast<size_t>(cache.length)), cache))
        logits = l->index({0, -1});
      else
        cached = false;  // not the zoo's gpt: the plain forward
    }
    if (!logits.defined()) logits = model->forward(ids(tokens.size() - static_cast<size_t>(n))).index({0, -1});
    logits = logits.to(torch::kCPU, torch::kFloat);
    const int64_t b = next_byte(logits, o, gen);
    tokens.push_back(b);
    out.push_back(static_cast<char>(static_cast<unsigned char>(b)));
    for (const auto& stop : o.stop)
      if (out.size() >= stop.size() && out.compare(out.size() - stop.size(), stop.size(), stop) == 0)
        return out.substr(0, out.size() - stop.size());
  }
  return out;
}

}  // namespace frugal
