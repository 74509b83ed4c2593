// DataParallel: the callback that keeps every rank's model equal (see data_parallel.h).
#include "frugal/distributed/data_parallel.h"

#include "frugal/core/learner.h"
#include "frugal/distributed/distributed.h"

namespace frugal {

namespace {

std::vector<torch::Tensor> model_tensors(torch::nn::Module& m, bool params, bool buffers) {
  std::vector<torch::Tensor> out;
  if (params)
    for (const auto& p : m.parameters()) out.push_back(p);
  if (buffers)
    for (const auto& b : m.buffers()) out.push_back(b);
  return out;
}

bool same_kind(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.device() == b.device();
}

}  // namespace

SyncVolume average_gradients(const std::vector<torch::Tensor>& params, int64_t bucket_bytes) {
  World& w = World::get();
  SyncVolume volume;
  if (!w.distributed()) return volume;
  torch::NoGradGuard no_grad;
  struct Bucket {
    std::vector<torch::Tensor> grads;
    torch::Tensor flat;
    Pending pending;
  };
  std::vector<Bucket> buckets;
  int64_t bytes = 0;
  // Reverse parameter order, as DDP: the last layers' gradients are the first backward makes.
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    torch::Tensor p = *it;
    if (!p.requires_grad()) continue;
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);  // unused on this rank
    const torch::Tensor& g = p.grad();
    if (buckets.empty() || bytes >= bucket_bytes || !same_kind(buckets.back().grads.front(), g)) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().grads.push_back(g);
    const int64_t n = g.numel() * static_cast<int64_t>(g.element_size());
    bytes += n;
    volume.bytes += n;
  }
  // Every bucket on the wire before the first is awaited: Gloo works through them in order
  // while this thread flattens the next.
  for (auto& b : buckets) {
    b.flat = b.grads.size() == 1 ? b.grads.front().contiguous().view(-1).clone()
                                 : at::flatten_dense_tensors(b.grads);
    b.pending = w.all_reduce_async(b.flat);
  }
  const double inv = 1.0 / static_cast<double>(w.size());
  for (auto& b : buckets) {
    b.pending.wait();
    b.flat.mul_(inv);
    const auto parts = at::unflatten_dense_tensors(b.flat, b.grads);
    for (size_t i = 0; i < b.grads.size(); ++i) b.grads[i].copy_(parts[i]);
  }
  volume.buckets = static_cast<int64_t>(buckets.size());
  return volume;
}

DataParallel* find_data_parallel(const Learner& l) {
  for (const auto& c : l.callbacks())
    if (auto* dp = dynamic_cast<DataParallel*>(c.get())) return dp;
  return nullptr;
}

void DataParallel::before_fit(Learner& l) {
  syncs_ = bytes_ = buckets_ = 0;
  broadcast_tensors(model_tensors(*l.model(), true, true), bucket_bytes_);
}

void DataParallel::before_batch(Learner& l) {
  const DataLoader& d = l.train_data();
  if (d.shard_world() <= 1 || !l.y().defined()) return;
  const int64_t total = d.batch_samples(l.batch_index()), mine = l.y().size(0);
  if (total <= 0 || mine * d.shard_world() == total) return;  // an even split: weight 1
  l.set_batch_weight(l.batch_weight() * static_cast<double>(mine * d.shard_world()) /
                     static_cast<double>(total));
}

void DataParallel::after_backward(Learner& l) {
  if (!l.completes_step()) return;
  if (!sync_taken_by_.empty()) return;  // another callback reduces (hand_over_gradient_sync)
  const SyncVolume v = average_gradients(l.model()->parameters(), bucket_bytes_);
  buckets_ += v.buckets;
  bytes_ += v.bytes;
  ++syncs_;
}

void DataParallel::after_train(Learner& l) {
  broadcast_tensors(model_tensors(*l.model(), false, true), bucket_bytes_);
}

}  // namespace frugal
