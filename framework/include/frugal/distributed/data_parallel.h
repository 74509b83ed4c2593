#pragma once
/// Data parallelism as a callback: every rank holds the whole model and trains on its shard of
/// each batch (DataLoader::set_shard); this callback keeps the ranks' models equal. make_learner
/// adds it when World is distributed; C++ users add it themselves after World::init.
///
///   before_fit      rank 0's parameters and buffers to every rank (bucketed broadcasts)
///   before_batch    the shard's loss weight: world x shard samples / batch samples (1 when
///                   the batch splits evenly), so an uneven last batch still averages per sample
///   before_stage  the gradient buckets (reverse parameter order, as DDP: the last layers'
///                   gradients are the first backward makes; the first bucket closes at 1 MiB
///                   so the wire starts early, the others at distributed.bucket_size) and, when the
///                   all-reduce overlaps backward, a hook on each trained parameter's
///                   AccumulateGrad node
///   before_backward arms the hooks on the step's last micro-batch (unless the step is skipped)
///   (backward)      overlap: as soon as every gradient of the next bucket in order is complete,
///                   the bucket is flattened and its all-reduce launched, while backward goes
///                   on (buckets go on the wire in the same order on every rank); the flattened
///                   gradients are freed, so a launched bucket costs no memory twice
///   after_backward  on the step's last micro-batch, unless the step is skipped: the buckets
///                   not yet launched (all of them without overlap) are launched, then each is
///                   awaited and divided by the world size; the gradients become views of the
///                   reduced buckets (no copy back). Runs before amp's unscale (kGradientSync >
///                   kPrecision in after_* order), so every rank sees the same non-finite
///                   gradients and skips the same steps.
///                   A callback that synchronises gradients itself (a sharded optimizer
///                   reducing each gradient to the one rank that steps it) takes this over
///                   with hand_over_gradient_sync: the all-reduce is then skipped.
///   after_train     rank 0's buffers (BatchNorm running statistics) to every rank, before
///                   validation and before an epoch's checkpoint
///
/// A parameter that trains but got no gradient on a rank (unused in its forward) contributes
/// zeros: after the sync every rank holds the same, defined gradient.
///
/// The overlap is off (named in the log and report.json distributed.overlap) when
/// distributed.overlap = false, or run.on_oom = "retry" (a backward retried on one rank would
/// put a launched bucket on the wire twice), or another callback took the sync over. With it,
/// a bucket's flattened copy is made while backward still holds activations: the step's peak
/// can rise by up to one bucket.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "frugal/core/callback.h"
#include "frugal/core/grad_hooks.h"

namespace frugal {

class GradientBuckets;

class DataParallel : public Callback {
 public:
  explicit DataParallel(int64_t bucket_bytes = 25 << 20, bool overlap = true);
  ~DataParallel() override;
  std::string name() const override { return "data_parallel"; }
  int order() const override { return order::kGradientSync; }

  void before_fit(Learner& l) override;
  void before_stage(Learner& l) override;
  void before_batch(Learner& l) override;
  void before_backward(Learner& l) override;
  void after_backward(Learner& l) override;
  void after_train(Learner& l) override;
  void release_caches(Learner& l) override;
  void after_fit(Learner& l) override;

  /// Gradient all-reduces (steps synchronised) and the bytes they carried, in this fit.
  int64_t syncs() const { return syncs_; }
  int64_t bytes_reduced() const { return bytes_; }
  int64_t buckets() const { return buckets_; }
  int64_t bucket_bytes() const { return bucket_bytes_; }
  /// Buckets launched from the hooks, while backward ran, in this fit.
  int64_t buckets_in_backward() const { return in_backward_; }
  /// Whether the all-reduce overlaps backward in this fit, and if not, why ("" when it does).
  bool overlaps() const { return overlap_off_.empty(); }
  const std::string& overlap_off_reason() const { return overlap_off_; }

  /// The lever for a callback that synchronises gradients its own way: from now on
  /// after_backward leaves the gradients as this rank's backward made them, and the callback
  /// named `by` (logs, report) must bring them where the optimizer needs them. "" gives the
  /// sync back. Broadcasts, batch weights and buffers stay this callback's.
  void hand_over_gradient_sync(const std::string& by) { sync_taken_by_ = by; }
  /// Who took the gradient sync over; "" when this callback all-reduces.
  const std::string& gradient_sync_taken_by() const { return sync_taken_by_; }

  /// Verdicts that ride on the step's gradient all-reduce (a few more numbers at the end of its
  /// last bucket) instead of a collective each per batch (on loopback Gloo, ~0.5 ms apiece): a
  /// callback takes a slot in before_fit (every rank the same slots in the same order), sets
  /// its flag by before_backward of the step's last micro-batch, and once synced_this_batch()
  /// reads whether any rank set it. Without a sync in a batch (an accumulation group's inner
  /// batch, zero stage 2, a batch skipped before backward) it asks Collective::any itself.
  size_t flag_slot();
  void set_flag(size_t slot, bool on) { flags_.at(slot) = on ? 1 : 0; }
  bool synced_this_batch() const { return synced_batch_; }
  bool any_flag(size_t slot) const { return flags_any_.at(slot) != 0; }

 private:
  int64_t bucket_bytes_;
  bool overlap_;
  std::string sync_taken_by_, overlap_off_;
  std::vector<char> flags_, flags_any_;
  bool synced_batch_ = false;
  std::unique_ptr<GradientBuckets> buckets_of_stage_;
  GradReadyHooks hooks_;
  int64_t syncs_ = 0, bytes_ = 0, buckets_ = 0, in_backward_ = 0;
};

/// What one average_gradients call sent: its buckets and their gradient bytes.
struct SyncVolume {
  int64_t buckets = 0, bytes = 0;
};

/// Every gradient of `params` (those that train) summed across ranks and divided by the world
/// size, in buckets of `bucket_bytes` all launched before the first is awaited; the gradients
/// become views of the reduced buckets.
SyncVolume average_gradients(const std::vector<torch::Tensor>& params, int64_t bucket_bytes);

/// The DataParallel callback `l` runs, or nullptr (one process; a C++ user who did not add it).
DataParallel* find_data_parallel(const Learner& l);

}  // namespace frugal
