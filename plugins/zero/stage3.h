#pragma once
/// zero stage 3 (ZeRO's P_os+g+p, FSDP's FULL_SHARD): each rank keeps only the parameters it
/// owns (whole parameters, as stages 1 and 2 partition them); the others' storage is freed to
/// 0 bytes between uses and gathered back by broadcasts from their owners, one unit of blocks
/// at a time, for the unit's forward and again for its backward. Autograd keeps the same
/// parameter tensors, so nothing is recomputed: the unit's storage is refilled before its
/// backward runs (a hook on the unit's output) and freed once the next unit's backward starts,
/// when its gradients go to their owners (reduce; Gloo has no reduce_scatter).
#include <cstdint>
#include <utility>
#include <vector>

#include <frugal/core/parameter_shards.h>
#include <frugal/distributed/distributed.h>
#include <torch/torch.h>

namespace frugal::zero {

/// Blocks [begin, end) of the model gathered together.
struct Unit {
  int64_t begin = 0, end = 0;
  std::vector<size_t> params;  ///< indices into the model's parameters()
  int64_t bytes = 0;           ///< the parameters' bytes
};

class ShardedParameters final : public frugal::ParameterShards {
 public:
  /// Throws ConfigError when a parameter shares its storage with another tensor (it could not
  /// be freed alone).
  ShardedParameters(torch::nn::Sequential model, std::vector<int> owners, int64_t unit_bytes,
                    bool prefetch);
  ~ShardedParameters() override;

  void gather_all() override;
  /// Every unit gathered and freed in turn, as a forward without grad would.
  void skip_forward() override;
  /// Frees every parameter this rank does not own (awaiting what is still on the wire).
  void release_all() override;
  /// Every parameter gathered into storage of its own: the model whole again, independent of
  /// this object (the end of the fit).
  void unshard();

  /// The model's forward, unit by unit, each gathered before its blocks run (the next one's
  /// broadcasts launched first when prefetching) and freed after. With grad on, each unit is
  /// gathered again before its backward; `reduce`: its gradients then go to their owners.
  torch::Tensor forward(torch::Tensor x, bool reduce);
  /// In after_backward: the units still gathered freed, every gradient not yet sent reduced
  /// (when the forward said `reduce`), each owner's sum averaged. Returns the gradient bytes
  /// this backward sent.
  int64_t finish_backward();

  const std::vector<Unit>& units() const { return units_; }
  int64_t largest_unit_bytes() const;
  /// Parameter bytes received by broadcasts since construction.
  int64_t gathered_bytes() const { return gathered_; }

 private:
  enum class State { Released, OnTheWire, Gathered };
  /// One owner's parameters of one dtype in a unit, on the wire as one flat tensor. Received:
  /// each parameter's storage points into `flat` (no copy), which lives as long as one of them
  /// does (holder_). Sent: a copy of the owner's parameters.
  struct Flight {
    Pending pending;
    torch::Tensor flat;
    std::vector<size_t> params;  ///< reduce: the parameters whose gradients it carries
    int owner = 0;
  };
  void launch(size_t u);
  void fill_flat(Flight& f, const std::vector<size_t>& group);
  void await(size_t u);
  void release(size_t u);
  void before_unit_backward(size_t u);
  void after_unit_backward(size_t u);
  void send_gradients(const std::vector<size_t>& params);
  void await_reduces();
  void free_parameter(size_t i);

  torch::nn::Sequential model_;
  std::vector<torch::Tensor> params_;
  std::vector<int> owners_;
  std::vector<size_t> nbytes_;
  std::vector<Unit> units_;
  std::vector<size_t> last_unit_;  // per parameter: the last unit whose backward uses it
  std::vector<int> uses_;          // per parameter: gathered units holding it
  std::vector<State> state_;
  std::vector<std::vector<Flight>> wire_;
  std::vector<torch::Tensor> holder_;  // per parameter: the received flat its storage points into
  std::vector<bool> hooked_, backward_open_, sent_;
  std::vector<Flight> reduces_;
  bool prefetch_ = true, reduce_ = false;
  int rank_ = 0;
  int64_t gathered_ = 0, sent_bytes_ = 0;
};

}  // namespace frugal::zero
