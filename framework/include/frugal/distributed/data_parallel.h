#pragma once
/// Data parallelism as a callback: every rank holds the whole model and trains on its shard of
/// each batch (DataLoader::set_shard); this callback keeps the ranks' models equal. make_learner
/// adds it when World is distributed; C++ users add it themselves after World::init.
///
///   before_fit      rank 0's parameters and buffers to every rank (bucketed broadcasts)
///   before_batch    the shard's loss weight: world x shard samples / batch samples (1 when
///                   the batch splits evenly), so an uneven last batch still averages per sample
///   after_backward  on the step's last micro-batch, unless the step is skipped: gradients
///                   all-reduced in buckets of distributed.bucket_size (reverse parameter order,
///                   as DDP), launched together, then divided by the world size. Runs before
///                   amp's unscale (kGradientSync > kPrecision in after_* order), so every rank
///                   sees the same non-finite gradients and skips the same steps.
///                   A callback that synchronises gradients itself (a sharded optimizer
///                   reducing each gradient to the one rank that steps it) takes this over
///                   with hand_over_gradient_sync: the all-reduce is then skipped.
///   after_train     rank 0's buffers (BatchNorm running statistics) to every rank, before
///                   validation and before an epoch's checkpoint
///
/// A parameter that trains but got no gradient on a rank (unused in its forward) contributes
/// zeros: after the sync every rank holds the same, defined gradient.
#include <cstdint>
#include <string>

#include "frugal/core/callback.h"

namespace frugal {

class DataParallel : public Callback {
 public:
  explicit DataParallel(int64_t bucket_bytes = 25 << 20) : bucket_bytes_(bucket_bytes) {}
  std::string name() const override { return "data_parallel"; }
  int order() const override { return order::kGradientSync; }

  void before_fit(Learner& l) override;
  void before_batch(Learner& l) override;
  void after_backward(Learner& l) override;
  void after_train(Learner& l) override;

  /// Gradient all-reduces (steps synchronised) and the bytes they carried, in this fit.
  int64_t syncs() const { return syncs_; }
  int64_t bytes_reduced() const { return bytes_; }
  int64_t buckets() const { return buckets_; }
  int64_t bucket_bytes() const { return bucket_bytes_; }

  /// The lever for a callback that synchronises gradients its own way: from now on
  /// after_backward leaves the gradients as this rank's backward made them, and the callback
  /// named `by` (logs, report) must bring them where the optimizer needs them. "" gives the
  /// sync back. Broadcasts, batch weights and buffers stay this callback's.
  void hand_over_gradient_sync(const std::string& by) { sync_taken_by_ = by; }
  /// Who took the gradient sync over; "" when this callback all-reduces.
  const std::string& gradient_sync_taken_by() const { return sync_taken_by_; }

 private:
  int64_t bucket_bytes_;
  std::string sync_taken_by_;
  int64_t syncs_ = 0, bytes_ = 0, buckets_ = 0;
};

/// What one average_gradients call sent: its buckets and their gradient bytes.
struct SyncVolume {
  int64_t buckets = 0, bytes = 0;
};

/// Every gradient of `params` (those that train) summed across ranks and divided by the world
/// size, in buckets of `bucket_bytes` all launched before the first is awaited.
SyncVolume average_gradients(const std::vector<torch::Tensor>& params, int64_t bucket_bytes);

/// The DataParallel callback `l` runs, or nullptr (one process; a C++ user who did not add it).
DataParallel* find_data_parallel(const Learner& l);

}  // namespace frugal
