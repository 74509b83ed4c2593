#pragma once
/// A language model's output layer (hidden [.., C] -> logits [.., V], no bias) that can hand its
/// input to a fused loss instead: cross-entropy computed in row chunks straight from the hidden
/// states and the weight, so the N x V logits (and their softmax and gradient) never exist whole.
/// What a 32k vocabulary at T = 1024 needs: its logits alone are 128 MiB per sequence in float.
#include <cstdint>

#include <torch/torch.h>

namespace frugal {

/// mean over rows of cross_entropy(h w^T, y): h [N, C], w [V, C], y [N] int64 -> a scalar,
/// differentiable in h and w. Rows are taken `chunk` at a time, in the forward and again in the
/// backward (which recomputes each chunk's logits from h, w and the kept log-sum-exp per row):
/// at most chunk x V logits exist at once. The matrix products run in h's dtype, the softmax in
/// float, autocast off inside. Equal to the plain loss to ~1e-6 (another summation order).
torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& h, const torch::Tensor& w, const torch::Tensor& y,
                                           int64_t chunk);

/// The output layer: `weight` [V, C], forward h [.., C] -> h weight^T [.., V]. With a fused loss
/// set (set_fused(true), in training mode with gradients on), forward keeps h and returns a
/// zero-strided placeholder of the logits' shape instead (no memory); the loss then calls
/// take_input() and computes chunked_linear_cross_entropy itself. In eval mode, or without
/// gradients (validation, generate, export), it computes the logits as always.
class LmHeadImpl : public torch::nn::Module {
 public:
  LmHeadImpl(int64_t in_features, int64_t vocabulary);
  /// A head tied to `embedding` [V, C] (GPT-2's: the token embedding's weight): it registers no
  /// parameter of its own, so the optimizer steps the shared tensor once, with the gradient of
  /// both uses, and state dicts hold it once (as the embedding's).
  explicit LmHeadImpl(torch::Tensor embedding);
  bool tied() const { return tied_; }
  torch::Tensor forward(const torch::Tensor& h);

  void set_fused(bool fused) { fused_ = fused; }
  bool fused() const { return fused_; }
  /// The input the last fused forward kept (undefined if none), released.
  torch::Tensor take_input();

  torch::Tensor weight;

 private:
  bool fused_ = false;
  bool tied_ = false;
  torch::Tensor pending_;
};
TORCH_MODULE(LmHead);

}  // namespace frugal
