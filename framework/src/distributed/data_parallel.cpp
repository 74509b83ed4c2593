// DataParallel: the callback that keeps every rank's model equal (see data_parallel.h).
#include "frugal/distributed/data_parallel.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include <spdlog/spdlog.h>

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

/// DDP's first bucket: it closes once it holds this much, so the first all-reduce starts early.
constexpr int64_t kFirstBucketBytes = 1 << 20;
/// An allowance for the flags the last bucket carries (a few numbers; an allocation is 512).
constexpr int64_t kFlagBytes = 512;

}  // namespace

/// The trained parameters cut into buckets (reverse order; one dtype and device per bucket),
/// each launched once per step in bucket order, from the hooks (ready) or after backward
/// (finish). Every rank builds the same buckets from the same model.
class GradientBuckets {
 public:
  GradientBuckets(const std::vector<torch::Tensor>& params, int64_t first_bytes,
                  int64_t bucket_bytes) {
    int64_t bytes = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      const torch::Tensor& p = *it;
      // A tensor registered under two names is all-reduced once.
      if (!p.requires_grad() || where_.count(p.unsafeGetTensorImpl())) continue;
      const int64_t cap = buckets_.size() <= 1 ? first_bytes : bucket_bytes;
      if (buckets_.empty() || bytes >= cap || !same_kind(buckets_.back().params.front(), p)) {
        buckets_.emplace_back();
        bytes = 0;
      }
      Bucket& b = buckets_.back();
      where_[p.unsafeGetTensorImpl()] = {buckets_.size() - 1, b.params.size()};
      b.params.push_back(p);
      const int64_t n = p.numel() * static_cast<int64_t>(p.element_size());
      b.bytes += n;
      bytes += n;
    }
    for (auto& b : buckets_) b.got.assign(b.params.size(), 0);
  }

  size_t size() const { return buckets_.size(); }

  /// The largest flat copy a launch makes (a bucket of several gradients, or the last one, which
  /// carries the flags): live beside the gradients it copies until they are freed.
  int64_t largest_copy() const {
    int64_t most = 0;
    for (size_t i = 0; i < buckets_.size(); ++i)
      if (buckets_[i].params.size() > 1 || i + 1 == buckets_.size())
        most = std::max(most, buckets_[i].bytes + kFlagBytes);
    return most;
  }

  /// A new backward that completes a step: nothing complete, nothing launched.
  void arm() {
    for (auto& b : buckets_) {
      std::fill(b.got.begin(), b.got.end(), 0);
      b.ready = 0;
      b.launched = false;
    }
    next_ = 0;
    late_.clear();
    armed_ = true;
  }
  bool armed() const { return armed_; }

  /// From p's hook: p's gradient is complete. Launches every bucket, in order, whose
  /// gradients all are. Returns how many it launched.
  int64_t ready(const torch::Tensor& p) {
    if (!armed_) return 0;
    const auto it = where_.find(p.unsafeGetTensorImpl());
    if (it == where_.end()) return 0;
    Bucket& b = buckets_[it->second.first];
    char& got = b.got[it->second.second];
    if (b.launched) {  // a second backward through p (reentrant): its bucket already left
      late_.push_back(p);
      return 0;
    }
    if (got) return 0;
    got = 1;
    ++b.ready;
    int64_t launched = 0;
    while (next_ < buckets_.size() && buckets_[next_].ready == static_cast<int64_t>(buckets_[next_].params.size())) {
      launch(buckets_[next_++]);
      ++launched;
    }
    return launched;
  }

  /// Flags summed with the last bucket (read when it launches: at the end of backward or in
  /// finish), and after finish whether any rank set each.
  void set_flags(const std::vector<char>* flags) { flags_ = flags; }
  const std::vector<char>& flags_any() const { return flags_any_; }
  /// Whether the flags can ride (a bucket to carry them).
  bool carries_flags() const { return !buckets_.empty(); }

  /// Launches the buckets backward did not, then awaits each and divides it by the world
  /// size; the gradients become views of the reduced buckets.
  SyncVolume finish() {
    armed_ = false;
    if (!late_.empty())
      throw std::runtime_error(
          "data_parallel: a gradient of shape " + shape(late_.front()) + " was accumulated "
          "again after its bucket's all-reduce had been launched (a custom autograd function "
          "running a backward of its own through a parameter): set distributed.overlap = false");
    while (next_ < buckets_.size()) launch(buckets_[next_++]);
    SyncVolume v;
    const double inv = 1.0 / static_cast<double>(World::get().size());
    flags_any_.assign(flags_ ? flags_->size() : 0, 0);
    for (auto& b : buckets_) {
      b.pending.wait();
      if (b.flags > 0) {  // the flags' sums, then the gradients alone
        const int64_t n = b.flat.numel() - b.flags;
        const torch::Tensor sums = b.flat.narrow(0, n, b.flags).to(torch::kCPU, torch::kFloat).contiguous();
        for (int64_t i = 0; i < b.flags; ++i)
          flags_any_[static_cast<size_t>(i)] = sums.data_ptr<float>()[i] > 0.5f;
        b.flat = b.flat.narrow(0, 0, n);
      }
      b.flat.mul_(inv);
      if (b.params.size() == 1) {
        torch::Tensor(b.params.front()).mutable_grad() = b.flat.view(b.params.front().sizes());
      } else {
        const auto parts = at::unflatten_dense_tensors(b.flat, b.params);
        for (size_t i = 0; i < b.params.size(); ++i)
          torch::Tensor(b.params[i]).mutable_grad() = parts[i];
      }
      b.flat = torch::Tensor();
      v.bytes += b.bytes;
    }
    v.buckets = static_cast<int64_t>(buckets_.size());
    return v;
  }

  /// Drops what a failed step left on the wire (its results are never read).
  void disarm() {
    armed_ = false;
    late_.clear();
  }

 private:
  struct Bucket {
    std::vector<torch::Tensor> params;
    std::vector<char> got;  // this backward gave the parameter its complete gradient
    int64_t ready = 0, bytes = 0, flags = 0;
    bool launched = false;
    torch::Tensor flat;
    Pending pending;
  };

  static std::string shape(const torch::Tensor& t) {
    std::string s = "[";
    for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + "]";
  }

  /// One tensor: the gradient itself goes on the wire (no copy). Several: flattened, and the
  /// originals freed (the flat copy is all the bucket needs until finish).
  void launch(Bucket& b) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> grads;
    grads.reserve(b.params.size());
    for (auto& p : b.params) {
      if (!p.grad().defined()) torch::Tensor(p).mutable_grad() = torch::zeros_like(p);  // unused here
      grads.push_back(p.grad());
    }
    b.flags = flags_ && &b == &buckets_.back() ? static_cast<int64_t>(flags_->size()) : 0;
    if (b.flags > 0) {  // the flags after the gradients: one copy of both
      std::vector<torch::Tensor> pieces;
      for (const auto& g : grads) pieces.push_back(g.contiguous().view(-1));
      std::vector<float> f(flags_->begin(), flags_->end());
      pieces.push_back(torch::tensor(f, grads.front().options().dtype(torch::kFloat)).to(grads.front().scalar_type()));
      b.flat = torch::cat(pieces);
    } else if (grads.size() == 1) {
      b.flat = grads.front().contiguous().view(-1);
    } else {
      b.flat = at::flatten_dense_tensors(grads);
    }
    grads.clear();
    for (auto& p : b.params) torch::Tensor(p).mutable_grad().reset();
    b.launched = true;
    b.pending = World::get().all_reduce_async(b.flat);
  }

  std::vector<Bucket> buckets_;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> where_;
  std::vector<torch::Tensor> late_;
  const std::vector<char>* flags_ = nullptr;
  std::vector<char> flags_any_;
  size_t next_ = 0;
  bool armed_ = false;
};

SyncVolume average_gradients(const std::vector<torch::Tensor>& params, int64_t bucket_bytes) {
  if (!World::get().distributed()) return {};
  GradientBuckets buckets(params, bucket_bytes, bucket_bytes);
  buckets.arm();
  return buckets.finish();
}

DataParallel* find_data_parallel(const Learner& l) {
  for (const auto& c : l.callbacks())
    if (auto* dp = dynamic_cast<DataParallel*>(c.get())) return dp;
  return nullptr;
}

DataParallel::DataParallel(int64_t bucket_bytes, bool overlap)
    : bucket_bytes_(bucket_bytes), overlap_(overlap) {}

DataParallel::~DataParallel() = default;

size_t DataParallel::flag_slot() {
  flags_.push_back(0);
  flags_any_.push_back(0);
  return flags_.size() - 1;
}

void DataParallel::before_fit(Learner& l) {
  syncs_ = bytes_ = buckets_ = in_backward_ = 0;
  synced_batch_ = false;
  // Once per fit: small buckets keep the flat copy small (a model near the budget starts here,
  // whole on every rank), at the cost of a few more collectives.
  broadcast_tensors(model_tensors(*l.model(), true, true), std::min(kFirstBucketBytes, bucket_bytes_));
}

// The stage's trained parameters (its freeze applied) make the buckets.
void DataParallel::before_stage(Learner& l) {
  hooks_.remove();
  buckets_of_stage_ = std::make_unique<GradientBuckets>(
      l.model()->parameters(), std::min(kFirstBucketBytes, bucket_bytes_), bucket_bytes_);
  const std::string was = overlap_off_;
  if (!overlap_)
    overlap_off_ = "distributed.overlap = false";
  else if (l.oom_policy().retry)
    overlap_off_ = "run.on_oom = \"retry\": a backward retried on one rank would launch its "
                   "buckets twice";
  else if (!sync_taken_by_.empty())
    overlap_off_ = sync_taken_by_ + " synchronises the gradients";
  else
    overlap_off_.clear();
  if (overlap_off_.empty())
    hooks_.install(l.model()->parameters(), [this](const torch::Tensor& p) {
      in_backward_ += buckets_of_stage_->ready(p);
    });
  // What micro_batch = "auto" keeps free for the sync; a callback that took the sync over sets
  // its own (zero, a higher order, after this).
  if (l.collective().distributed() && sync_taken_by_.empty())
    l.set_sync_reserve(buckets_of_stage_->largest_copy());
  if (overlap_off_ != was || l.stage_index() == 0)
    spdlog::debug("data_parallel: {} gradient bucket(s); all-reduce {}", buckets_of_stage_->size(),
                  overlap_off_.empty() ? "overlapped with backward" : "after backward (" + overlap_off_ + ")");
}

void DataParallel::before_batch(Learner& l) {
  synced_batch_ = false;
  std::fill(flags_.begin(), flags_.end(), 0);  // each batch's flags are set anew
  const DataLoader& d = l.train_data();
  if (d.shard_world() <= 1 || !l.y().defined()) return;
  const int64_t total = d.batch_samples(l.batch_index()), mine = l.y().size(0);
  if (total <= 0 || mine * d.shard_world() == total) return;  // an even split: weight 1
  l.set_batch_weight(l.batch_weight() * static_cast<double>(mine * d.shard_world()) /
                     static_cast<double>(total));
}

// The hooks are armed for the step's last micro-batch. The flags are read when the last bucket
// launches, after every before_backward (a callback of any order may set its flag there).
void DataParallel::before_backward(Learner& l) {
  if (!buckets_of_stage_) return;  // a C++ user's learner that fired no before_stage
  if (overlap_off_.empty() && sync_taken_by_.empty() && l.completes_step() && !l.batch_skipped()) {
    buckets_of_stage_->set_flags(&flags_);
    buckets_of_stage_->arm();
  }
}

void DataParallel::after_backward(Learner& l) {
  if (!l.collective().distributed()) return;  // one process: nothing to average
  if (buckets_of_stage_ && buckets_of_stage_->armed() && !l.completes_step())
    throw std::logic_error(
        "data_parallel: a callback skipped the step after data_parallel armed this backward's "
        "gradient buckets (before_backward); buckets already on the wire took their gradients. "
        "Skip steps in before_batch or after_loss, or set distributed.overlap = false");
  if (!l.completes_step()) return;
  if (!sync_taken_by_.empty()) return;  // another callback reduces (hand_over_gradient_sync)
  if (!buckets_of_stage_)  // a C++ user's learner that fired no before_stage
    buckets_of_stage_ = std::make_unique<GradientBuckets>(l.model()->parameters(),
                                                          bucket_bytes_, bucket_bytes_);
  if (!buckets_of_stage_->armed()) {  // no overlap: every bucket launched here
    buckets_of_stage_->set_flags(&flags_);
    buckets_of_stage_->arm();
  }
  const SyncVolume v = buckets_of_stage_->finish();
  if (buckets_of_stage_->carries_flags()) {
    flags_any_ = buckets_of_stage_->flags_any();
    synced_batch_ = true;
  }
  buckets_ += v.buckets;
  bytes_ += v.bytes;
  ++syncs_;
}

void DataParallel::after_train(Learner& l) {
  broadcast_tensors(model_tensors(*l.model(), false, true), bucket_bytes_);
}

void DataParallel::release_caches(Learner&) {
  if (buckets_of_stage_) buckets_of_stage_->disarm();
}

void DataParallel::after_fit(Learner&) {
  hooks_.remove();
  buckets_of_stage_.reset();  // it holds the parameters: a swapped or merged model is freed
  flags_.clear();  // the next fit's callbacks take their slots again
  flags_any_.clear();
}

}  // namespace frugal
