#pragma once
/// Causal self-attention kernels: the plain one (the B x H x T x T probabilities in memory) and a
/// memory-efficient one (FlashAttention's algorithm in LibTorch operators: queries in chunks, keys
/// in chunks with an online softmax, backward by recomputing each chunk's probabilities), and the
/// interface through which a plugin switches a model's attention modules from one to the other.
#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace frugal {

/// How an attention module computes softmax(q kᵀ / sqrt(D) + causal mask) v.
struct AttentionKernel {
  /// 0: the plain kernel. Otherwise queries are taken `query_chunk` rows at a time and keys
  /// `key_chunk` columns at a time: the probabilities in memory at once are B x H x
  /// query_chunk x key_chunk, in the forward and the backward alike.
  int64_t query_chunk = 0;
  int64_t key_chunk = 0;
  bool chunked() const { return query_chunk > 0; }
};

/// q, k, v [B, H, T, D] -> [B, H, T, D]: position i attends to keys 0..i; dropout `p` on the
/// probabilities when `training`. The plain kernel keeps the B x H x T x T probabilities for
/// backward (and its masked scores while it computes them).
torch::Tensor plain_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     double p, bool training);

/// The same result from chunks (equal to the plain kernel to ~1e-6 in float; not bitwise: the
/// sums run in another order), differentiable in q, k and v. Saves only q, k, v, the output and
/// one log-sum-exp per row; backward recomputes each chunk's probabilities. Dropout draws a
/// mask per chunk from a seed drawn from LibTorch's default CPU generator at the forward and
/// replays it in the backward (so the masks differ from the plain kernel's draws; with p = 0
/// the two kernels agree). Chunk sizes past T are clamped.
torch::Tensor chunked_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       int64_t query_chunk, int64_t key_chunk, double p, bool training);

/// `kernel.chunked()` ? chunked_causal_attention : plain_causal_attention.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const AttentionKernel& kernel, double p, bool training);

/// The plain kernel fused for float on the CPU, from the qkv projection [B, T, 3C] (q, k, v side
/// by side, `heads` heads of C / heads each) to the heads' outputs [B, T, C] (before the output
/// projection): per (batch, head) pair, BLAS on the strided q, k, v in place (no copies), the
/// scale inside the product, the causal mask by not computing the future keys' scores (query
/// rows in blocks of 32, each against the keys before its end), softmax in one vectorized pass
/// per row, the output written in [B, T, C] order; backward likewise (softmax's backward in one
/// pass per row, the gradient of the projection written as one tensor). Keeps for backward the
/// projection and the B x H x T x T probabilities (the plain kernel keeps those plus contiguous
/// copies of q and k). Equal to plain_causal_attention to float rounding (~1e-6; not bitwise:
/// another summation order and exp). No dropout; differentiable once.
torch::Tensor fused_causal_attention(const torch::Tensor& qkv, int64_t heads);

/// Whether fused_causal_attention runs for this projection: float, on the CPU, no dropout in
/// effect, and a BLAS sgemm in the process (LibTorch's own, found at run time; a LibTorch that
/// hides its BLAS has none, and the plain kernel runs). FRUGAL_FUSED_ATTENTION=0 in the
/// environment turns it off (what benchmarks/speed_shares.py measures it by).
bool fused_attention_applies(const torch::Tensor& qkv, double p, bool training);

/// The attention of a q, k, v projection [B, T, 3C] (`heads` heads) as [B, T, C], the way the
/// gpt computes it: fused_causal_attention where `kernel` is the plain one and the fused kernel
/// applies (and `fused`), else `kernel` on q, k, v views of the projection.
torch::Tensor attention_from_projection(const torch::Tensor& proj, int64_t heads, const AttentionKernel& kernel,
                                        double p, bool training, bool fused = true);

/// A module that computes attention through an AttentionKernel it lets others set (the gpt's
/// attention does; so can a plugin's or a user's model: derive from it beside torch::nn::Module).
class AttentionModule {
 public:
  virtual ~AttentionModule() = default;
  AttentionKernel& attention_kernel() { return kernel_; }
  const AttentionKernel& attention_kernel() const { return kernel_; }

 protected:
  AttentionKernel kernel_;
};

/// Sets `kernel` on every AttentionModule in `model`'s tree (the model itself included);
/// returns how many there were.
int64_t set_attention_kernel(torch::nn::Module& model, const AttentionKernel& kernel);

}  // namespace frugal
