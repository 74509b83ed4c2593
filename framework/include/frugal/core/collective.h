#pragma once
/// What the Learner needs from the other processes of a data-parallel run, and nothing more:
/// the checkpoint's gather, validation's sums, the micro-batch probe's minimum and the verdicts
/// every rank must share (a stop, a non-finite step). One process is `SingleProcess` (every
/// call returns its input); `World` (distributed/) implements it on c10d. The core is built and
/// tested without knowing which.
///
/// Collectives block, and every rank must call them in the same order.
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace frugal {

struct MetricSums;

enum class Reduce { Sum, Max, Min };

class Collective {
 public:
  virtual ~Collective();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  bool distributed() const { return size() > 1; }
  bool is_main() const { return rank() == 0; }
  /// Where tensors handed to the collectives must be: CPU for gloo, the GPU for nccl.
  virtual torch::Device device() const = 0;
  /// In place, on every rank.
  virtual void all_reduce(torch::Tensor& t, Reduce op = Reduce::Sum) = 0;
  /// Every rank's `t` (same shape on every rank) on root only, in rank order; {} elsewhere.
  virtual std::vector<torch::Tensor> gather(const torch::Tensor& t, int root = 0) = 0;
  /// Each rank's `t` (same shape on every rank), in rank order, on every rank.
  virtual std::vector<torch::Tensor> all_gather(const torch::Tensor& t) = 0;
  /// True on every rank when `flag` is true on any.
  virtual bool any(bool flag) = 0;
  /// The smallest (largest) of every rank's value.
  virtual int64_t min(int64_t v) = 0;
  virtual int64_t max(int64_t v) = 0;
};

/// One process: rank 0 of 1, every collective its own input.
class SingleProcess final : public Collective {
 public:
  /// The process-wide instance every Learner starts with.
  static SingleProcess& get();
  int rank() const override { return 0; }
  int size() const override { return 1; }
  torch::Device device() const override { return torch::kCPU; }
  void all_reduce(torch::Tensor&, Reduce) override {}
  std::vector<torch::Tensor> gather(const torch::Tensor& t, int) override { return {t}; }
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t) override { return {t}; }
  bool any(bool flag) override { return flag; }
  int64_t min(int64_t v) override { return v; }
  int64_t max(int64_t v) override { return v; }
};

/// Validation sums of every rank's shard added up (a no-op in one process).
void sum_across_ranks(Collective& c, MetricSums& s);

}  // namespace frugal
