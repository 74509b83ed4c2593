#pragma once
/// grad_accum's arithmetic, as free functions the tests call directly: where a batch falls in
/// its accumulation group, and the micro-batch size that splits a batch into `steps` passes.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace frugal::grad_accum {

/// Samples in batch `i` of an epoch over `dataset_size` samples in batches of `batch_size`
/// (every batch is full but possibly the last).
inline int64_t batch_samples(int64_t i, int64_t batch_size, int64_t dataset_size) {
  return std::max<int64_t>(0, std::min(batch_size, dataset_size - i * batch_size));
}

/// Where one batch falls in its accumulation group of `steps` consecutive batches.
struct Group {
  int64_t first = 0, last = 0;  ///< the group's batch indices, inclusive
  int64_t samples = 0;          ///< samples in the whole group
  int64_t batch_samples = 0;    ///< samples in this batch
  bool closes = false;          ///< this batch is the group's last: the optimizer steps here
  bool partial = false;         ///< the epoch ends before the group has `steps` batches
  /// The weight of this batch's mean loss so the group's gradient is the mean over its samples.
  double weight() const { return samples > 0 ? double(batch_samples) / double(samples) : 1.0; }
};

/// The group of batch `index` in an epoch of `num_batches` batches of `batch_size` over
/// `dataset_size` samples. Throws std::invalid_argument for an index or size out of range.
inline Group group_of(int64_t index, int64_t steps, int64_t num_batches, int64_t batch_size,
                      int64_t dataset_size) {
  if (steps < 1 || batch_size < 1 || index < 0 || index >= num_batches)
    throw std::invalid_argument("grad_accum::group_of: batch " + std::to_string(index) + " of " +
                                std::to_string(num_batches) + ", steps " + std::to_string(steps) +
                                ", batch size " + std::to_string(batch_size));
  Group g;
  g.first = index / steps * steps;
  g.last = std::min(g.first + steps, num_batches) - 1;
  for (int64_t i = g.first; i <= g.last; ++i) g.samples += batch_samples(i, batch_size, dataset_size);
  g.batch_samples = batch_samples(index, batch_size, dataset_size);
  g.closes = index == g.last;
  g.partial = g.last - g.first + 1 < steps;
  return g;
}

/// The micro-batch size that runs a batch of `batch_size` samples as `steps` passes.
inline int64_t split_size(int64_t batch_size, int64_t steps) {
  if (steps < 1) throw std::invalid_argument("grad_accum::split_size: steps must be >= 1");
  return (batch_size + steps - 1) / steps;
}

}  // namespace frugal::grad_accum
