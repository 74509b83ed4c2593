#include "frugal/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <stdexcept>
#include <vector>

namespace frugal {

namespace {

void check(const SampleOptions& o) {
  if (o.tokens < 0) throw std::invalid_argument("tokens must be >= 0");
  if (!(o.temperature >= 0)) throw std::invalid_argument("temperature must be >= 0");
  if (o.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
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
  for (int64_t i = 0; i < o.tokens; ++i) {
    const int64_t n = std::min<int64_t>(o.block_size, static_cast<int64_t>(tokens.size()));
    const torch::Tensor ctx =
        torch::tensor(std::vector<int64_t>(tokens.end() - n, tokens.end()), torch::kLong)
            .view({1, n}).to(device);
    const torch::Tensor logits = model->forward(ctx).index({0, -1}).to(torch::kCPU, torch::kFloat);
    const int64_t b = next_byte(logits, o, gen);
    tokens.push_back(b);
    out.push_back(static_cast<char>(static_cast<unsigned char>(b)));
  }
  return out;
}

}  // namespace frugal
