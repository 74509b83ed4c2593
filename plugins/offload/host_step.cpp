// offload to = "cpu": the optimizer steps host masters of the parameters (ZeRO-Offload).
#include "host_step.h"

#include <map>
#include <stdexcept>
#include <unordered_set>
#include <utility>

#include <torch/csrc/autograd/variable.h>

#include "offload.h"

namespace frugal::offload {

namespace {

constexpr int64_t kAlignBytes = 64;

// set_data drops a parameter's AccumulateGrad when the device changes: the hooks on it (data
// parallel's, firing as each gradient is complete) would be lost with it.
std::weak_ptr<torch::autograd::Node> accumulator_of(const torch::Tensor& p) {
  auto* meta = torch::autograd::impl::get_autograd_meta(p);
  if (!meta) return {};
  std::lock_guard<std::mutex> lock(meta->mutex_);
  return meta->grad_accumulator_;
}

void restore_accumulator(const torch::Tensor& p, const std::weak_ptr<torch::autograd::Node>& a) {
  auto* meta = torch::autograd::impl::get_autograd_meta(p);
  if (!meta || a.expired()) return;
  std::lock_guard<std::mutex> lock(meta->mutex_);
  if (meta->grad_accumulator_.expired()) meta->grad_accumulator_ = a;
}

}  // namespace

HostStep::HostStep(torch::Device device, int64_t chunk_bytes)
    : device_(device), pinned_(device.is_cuda()), chunk_bytes_(chunk_bytes) {
  if (chunk_bytes < kAlignBytes || (chunk_bytes & (chunk_bytes - 1)) != 0)
    throw std::invalid_argument("HostStep: chunk_bytes must be a power of two of at least 64");
}

// Tensors are packed first-fit into chunks of chunk_bytes_ per dtype, each chunk one request of a
// power-of-two size (CUDA's caching host allocator rounds every request up to one: a chunk of
// exactly that size wastes nothing, the last one at most half of itself); a tensor larger than
// a chunk is a request of its own.
std::vector<torch::Tensor> HostStep::host_like(const std::vector<torch::Tensor>& ts) const {
  struct Place {
    size_t chunk;
    int64_t at;  // elements
  };
  struct Chunk {
    torch::ScalarType dtype;
    int64_t used = 0, capacity = 0;  // elements
  };
  std::vector<Chunk> chunks;
  std::vector<Place> places;
  std::map<torch::ScalarType, size_t> open;  // the chunk each dtype is filling
  for (const auto& t : ts) {
    const int64_t size = static_cast<int64_t>(t.element_size());
    const int64_t align = std::max<int64_t>(1, kAlignBytes / size), per_chunk = chunk_bytes_ / size;
    const int64_t n = (t.numel() + align - 1) / align * align;
    auto it = open.find(t.scalar_type());
    if (n > per_chunk) {  // alone
      chunks.push_back({t.scalar_type(), n, n});
      places.push_back({chunks.size() - 1, 0});
      continue;
    }
    if (it == open.end() || chunks[it->second].used + n > per_chunk) {
      chunks.push_back({t.scalar_type(), 0, per_chunk});
      it = open.insert_or_assign(t.scalar_type(), chunks.size() - 1).first;
    }
    Chunk& c = chunks[it->second];
    places.push_back({it->second, c.used});
    c.used += n;
  }
  std::vector<torch::Tensor> flats;
  for (const Chunk& c : chunks) {
    // A chunk no one filled to its capacity: the used bytes' power of two, at least one page.
    int64_t elements = c.used;
    if (c.used < c.capacity) {
      const int64_t size = static_cast<int64_t>(c10::elementSize(c.dtype));
      int64_t bytes = 4096;
      while (bytes < c.used * size) bytes *= 2;
      elements = bytes / size;
    }
    flats.push_back(torch::empty({elements}, torch::TensorOptions().dtype(c.dtype).pinned_memory(pinned_)));
  }
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < ts.size(); ++i)
    out.push_back(flats[places[i].chunk].narrow(0, places[i].at, ts[i].numel()).view(ts[i].sizes()));
  return out;
}

void HostStep::to_host(torch::optim::Optimizer& opt) {
  if (on_host()) to_device(false);
  // The step reads its state where its parameters are, on the host: what a load put elsewhere
  // comes home at the first step for this optimizer (after construction or reset); the step's
  // own new state moves after each step (to_device).
  const bool first = opt_ != &opt;
  opt_ = &opt;
  try {
    if (first) move_state();
    point_at_masters(opt);
  } catch (...) {
    to_device(false);  // the parameters moved so far point at their device storage again
    throw;
  }
}

void HostStep::point_at_masters(torch::optim::Optimizer& opt) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> params, fresh;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tensor in two groups moves once
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) {
      if (!p.grad().defined() || p.device().type() != device_.type() || p.numel() == 0 ||
          !seen.insert(p.unsafeGetTensorImpl()).second)
        continue;
      params.push_back(p);
      if (!slots_[p.unsafeGetTensorImpl()].master.defined()) fresh.push_back(p);
    }
  if (!fresh.empty()) {  // their masters and gradient buffers
    const auto masters = host_like(fresh), grads = host_like(fresh);
    for (size_t i = 0; i < fresh.size(); ++i) {
      Slot& s = slots_[fresh[i].unsafeGetTensorImpl()];
      s.master = masters[i];
      s.grad = grads[i];
      s.version = -1;
    }
  }
  for (auto& p : params) {
    Slot& s = slots_[p.unsafeGetTensorImpl()];
    s.grad.copy_(p.grad());  // device to host, synchronous: the step reads it next
    if (p._version() != s.version || p.data_ptr() != s.device_ptr) s.master.copy_(p);
    s.device = p.detach();  // holds the device storage (and shares the version counter)
    s.accumulator = accumulator_of(p);
    p.mutable_grad() = s.grad;  // the device gradient goes with its last reference
    p.set_data(s.master);
    moved_.push_back(p);
  }
}

void HostStep::to_device(bool stepped) {
  torch::NoGradGuard no_grad;
  for (auto& p : moved_) {
    Slot& s = slots_.at(p.unsafeGetTensorImpl());
    // From pinned memory the copy is queued on the current stream: the master is not written
    // again before the next to_host, whose synchronous copies on that stream wait for it.
    if (stepped) s.device.copy_(s.master, /*non_blocking=*/pinned_);
    p.set_data(s.device);
    restore_accumulator(p, s.accumulator);
    s.device = torch::Tensor();
    if (p.grad().defined() && p.grad().is_alias_of(s.grad)) p.mutable_grad().reset();  // not the device's
    s.version = stepped ? p._version() : -1;
    s.device_ptr = p.data_ptr();
  }
  moved_.clear();
  if (stepped) move_state();
}

// Each state tensor of a known type whose bytes are not in a host chunk of ours (the first step
// made it in plain memory; a resume loaded it on the device) is copied into new chunks and
// points at its view. The map is rebuilt from what the optimizer holds: a replaced state's
// chunk is let go with its last tensor.
void HostStep::move_state() {
  if (!opt_) return;
  torch::NoGradGuard no_grad;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> kept;
  std::vector<torch::Tensor> fresh;
  int64_t unknown = 0, bytes = 0;
  for (auto& kv : opt_->state()) {
    auto ts = state_tensors(*kv.second);
    if (!ts) {
      ++unknown;
      continue;
    }
    for (auto& t : *ts) {
      if (!t.defined() || t.numel() == 0) continue;
      bytes += static_cast<int64_t>(t.nbytes());
      const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
      if (auto it = state_.find(key); it != state_.end())
        kept.insert(*it);
      else
        fresh.push_back(t);
    }
  }
  if (!fresh.empty()) {
    const auto homes = host_like(fresh);
    for (size_t i = 0; i < fresh.size(); ++i) {
      homes[i].copy_(fresh[i]);
      fresh[i].set_data(homes[i]);
      kept.emplace(homes[i].storage().unsafeGetStorageImpl(), homes[i].storage());
    }
  }
  state_ = std::move(kept);
  state_bytes_ = bytes;
  unknown_ = unknown;
}

void HostStep::release_buffers() {
  if (on_host()) to_device(false);
  slots_.clear();
}

void HostStep::reset() {
  release_buffers();
  state_.clear();  // the old optimizer's state goes with it
  state_bytes_ = 0;
  unknown_ = 0;
  opt_ = nullptr;
}

HostStep::Bytes HostStep::bytes() const {
  Bytes b;
  for (const auto& [impl, s] : slots_) {
    if (s.master.defined()) b.masters += static_cast<int64_t>(s.master.nbytes());
    if (s.grad.defined()) b.gradients += static_cast<int64_t>(s.grad.nbytes());
  }
  b.state = state_bytes_;
  return b;
}

bool HostStep::holds_state(const torch::Tensor& t) const {
  return t.defined() && t.has_storage() && state_.count(t.storage().unsafeGetStorageImpl()) > 0;
}

}  // namespace frugal::offload
