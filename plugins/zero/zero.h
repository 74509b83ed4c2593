#pragma once
/// zero: ZeRO stages 1 and 2 (Rajbhandari et al., 2020) on frugal's data parallel. The
/// parameters are partitioned across the ranks (whole parameters, balanced by bytes); each rank
/// builds the configured optimizer over its own share only, steps it, and broadcasts what it
/// updated to the others. Stage 1 shards the optimizer state; stage 2 also the reduced
/// gradients: each gradient bucket is reduced to its owner, and the other ranks drop theirs as
/// soon as it is on the wire. Stage 3 also frees the parameters a rank does not own between
/// uses (stage3.h). The arithmetic (partition, buckets, the collectives) is free functions the
/// tests call directly.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

#include "stage3.h"

namespace frugal::zero {

/// The owner rank of each parameter, from its bytes: largest first, each to the rank holding
/// the fewest bytes so far (ties: the lower rank), as ZeroRedundancyOptimizer partitions.
/// Depends on the sizes and the world only, so every rank computes the same.
std::vector<int> partition_by_bytes(const std::vector<int64_t>& bytes, int world);

/// One collective's worth of parameters, all owned by `owner`, all of one dtype.
struct Bucket {
  int owner = 0;
  std::vector<size_t> params;  ///< indices into the parameter list
  int64_t bytes = 0;
};
/// The parameters with `take[i]` set, grouped by owner (rank 0's first), each owner's in
/// `reverse` (gradients: the order backward makes them) or forward order, cut at
/// `bucket_bytes` and at a change of dtype.
std::vector<Bucket> owner_buckets(const std::vector<torch::Tensor>& params,
                                  const std::vector<int>& owners, const std::vector<bool>& take,
                                  int64_t bucket_bytes, bool reverse);

/// Stage 2's sync: every trainable gradient summed onto its owner and divided by the world
/// size; a rank's gradients of parameters it does not own are set to none once their bucket is
/// on the wire. A parameter unused in a rank's forward counts as zeros. Returns the gradient
/// bytes this rank sent.
int64_t reduce_to_owners(const std::vector<torch::Tensor>& params, const std::vector<int>& owners,
                         int64_t bucket_bytes);
/// After the step: each trainable parameter takes its owner's values (bucketed broadcasts, all
/// launched before the first is awaited). Returns the parameter bytes broadcast.
int64_t broadcast_from_owners(const std::vector<torch::Tensor>& params,
                              const std::vector<int>& owners, int64_t bucket_bytes);

/// [plugins.zero]: TOML keys are the field names.
struct ZeroOptions : frugal::Options {
  int64_t stage = 1;  ///< default 1: the optimizer state sharded; 2: the gradients; 3: parameters
  int64_t unit_bytes = 0;  ///< stage 3: blocks gathered together up to these bytes (0: each block)
  bool prefetch = true;    ///< stage 3: the next unit's broadcasts launched before this one runs
  void visit(frugal::FieldVisitor& v) override;
  void check() const override;
};

/// What one rank holds, measured (the per-rank memory of the method card).
struct RankBytes {
  int64_t owned_parameters = 0;  ///< bytes of the parameters this rank steps
  int64_t optimizer_state = 0;   ///< its optimizer's state at the end of the fit
  int64_t step_gradients = 0;    ///< the largest gradient bytes held when a step began
};

/// The plugin's callback.
class Zero : public frugal::Callback {
 public:
  Zero(const ZeroOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "zero"; }
  /// Next to data_parallel (order::kGradientSync) and just above it: in after_backward the
  /// stage-2 reduce runs where data_parallel's all-reduce would, before amp (kPrecision)
  /// unscales and checks the gradients.
  int order() const override { return frugal::order::kGradientSync + 1; }
  /// Stage 3 runs the model's blocks itself, unit by unit (the innermost forward), and refuses
  /// what reads parameters outside it (checkpoint's recompute, chunked_loss's late head) or
  /// steps them inside backward (step_in_backward).
  bool wraps_forward() const override { return o_.stage == 3; }
  frugal::CallbackRelations relations() const override;
  torch::Tensor wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                             const frugal::ForwardNext& next) override;

  /// Partitions the parameters, replaces the optimizer by one over this rank's share, marks
  /// the optimizer state per rank (checkpoints) and, in stage 2, takes the gradient sync over
  /// from data_parallel. A no-op (with a warning) in one process.
  void before_fit(frugal::Learner& l) override;
  /// A new optimizer (a stage's own, optim_swap, a resume's) is sharded again, keeping the
  /// state it already holds for this rank's parameters.
  void optimizer_replaced(frugal::Learner& l) override;
  /// Stage 2: what micro_batch = "auto" keeps free for the reduce (Learner::set_sync_reserve):
  /// this rank's own gradient buckets, copied and in flight beside the gradients, and one
  /// bucket's copy of another rank's.
  void before_stage(frugal::Learner& l) override;
  /// Stage 2, on the step's last micro-batch: each bucket reduced to its owner.
  void after_backward(frugal::Learner& l) override;
  /// Stage 3: refuses micro-batches (each rank would run its own number of forwards, and every
  /// forward gathers with every rank).
  void before_batch(frugal::Learner& l) override;
  /// Notes the gradient bytes the step starts with.
  void before_step(frugal::Learner& l) override;
  /// Stage 3 in a distributed run: an out-of-memory retry would run one rank's forward again
  /// alone, its gathers waiting for ranks that went on.
  std::string retry_veto(const frugal::Learner& l) const override;
  /// Every owner broadcasts the parameters it stepped (stage 3: the next gathers bring them).
  void after_step(frugal::Learner& l) override;
  /// Each rank's bytes gathered to rank 0 and logged; gives data_parallel its sync back;
  /// stage 3 leaves every parameter in memory (the exported model, later validations).
  void after_fit(frugal::Learner& l) override;

  /// The sharding: stage, world size and each parameter's owner, marked optional (a run
  /// without zero may resume it). At the same world size load_state refuses owners that differ
  /// from this run's; at another, the Learner re-shards the optimizer state (learner.h).
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(frugal::Learner& l, torch::serialize::InputArchive& a) override;

  /// Every rank's bytes after the fit (rank 0; this rank's elsewhere).
  const std::vector<RankBytes>& rank_bytes() const { return ranks_; }
  const std::vector<int>& owners() const { return owners_; }

 private:
  bool active() const { return !owners_.empty(); }
  void shard_optimizer(frugal::Learner& l);

  ZeroOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  std::vector<int> owners_;  // per model parameter; empty: inactive (one process)
  int64_t bucket_bytes_ = 25 << 20;
  int64_t changes_ = -1;  // the optimizer_changes() this rank's optimizer was sharded at
  int64_t step_gradients_ = 0, reduced_ = 0, broadcast_ = 0, steps_ = 0;
  std::vector<RankBytes> ranks_;
  std::unique_ptr<ShardedParameters> shards_;  // stage 3, during a fit
};

}  // namespace frugal::zero
