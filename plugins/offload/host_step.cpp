// offload to = "cpu": the optimizer steps host masters of the parameters (ZeRO-Offload).
#include "host_step.h"

#include "offload.h"

namespace frugal::offload {

HostStep::HostStep(torch::Device device) : device_(device), pinned_(device.is_cuda()) {}

torch::Tensor HostStep::host_like(const torch::Tensor& t) const {
  return torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(pinned_));
}

void HostStep::to_host(torch::optim::Optimizer& opt) {
  if (on_host()) to_device(false);
  torch::NoGradGuard no_grad;
  opt_ = &opt;
  move_state();  // the step reads its state where its parameters are: on the host
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined() || p.device() != device_ || p.numel() == 0) continue;
      Slot& s = slots_[p.unsafeGetTensorImpl()];
      if (!s.master.defined()) {
        s.master = host_like(p);
        s.grad = host_like(p);
        s.version = -1;
      }
      s.grad.copy_(p.grad());  // device to host, synchronous: the step reads it next
      if (p._version() != s.version || p.data_ptr() != s.device_ptr) s.master.copy_(p);
      s.device = p.detach();  // holds the device storage (and shares the version counter)
      p.mutable_grad() = s.grad;  // the device gradient goes with its last reference
      p.set_data(s.master);
      moved_.push_back(p);
    }
  }
}

void HostStep::to_device(bool stepped) {
  torch::NoGradGuard no_grad;
  for (auto& p : moved_) {
    Slot& s = slots_.at(p.unsafeGetTensorImpl());
    // From pinned memory the copy is queued on the current stream: the master is not written
    // again before the next to_host, whose synchronous copies wait for it.
    if (stepped) s.device.copy_(s.master, /*non_blocking=*/pinned_);
    p.set_data(s.device);
    s.device = torch::Tensor();
    if (p.grad().defined() && p.grad().is_alias_of(s.grad)) p.mutable_grad().reset();  // not the device's
    s.version = stepped ? p._version() : -1;
    s.device_ptr = p.data_ptr();
  }
  moved_.clear();
  if (stepped) move_state();
}

// Each state tensor of a known type whose bytes are not a host buffer of ours (the first step
// made it in plain memory; a resume loaded it on the device) is copied into one and points at
// it. The map is rebuilt from what the optimizer holds: a replaced state's buffer is let go.
void HostStep::move_state() {
  if (!opt_) return;
  torch::NoGradGuard no_grad;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> kept;
  int64_t unknown = 0;
  for (auto& kv : opt_->state()) {
    auto ts = state_tensors(*kv.second);
    if (!ts) {
      ++unknown;
      continue;
    }
    for (auto& t : *ts) {
      if (!t.defined() || t.numel() == 0) continue;
      const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
      if (auto it = state_.find(key); it != state_.end()) {
        kept.insert(*it);
        continue;
      }
      torch::Tensor h = host_like(t);
      h.copy_(t);
      t.set_data(h);
      kept.emplace(h.storage().unsafeGetStorageImpl(), h.storage());
    }
  }
  state_ = std::move(kept);
  unknown_ = unknown;
}

void HostStep::reset() {
  if (on_host()) to_device(false);
  slots_.clear();
  opt_ = nullptr;
}

HostStep::Bytes HostStep::bytes() const {
  Bytes b;
  for (const auto& [impl, s] : slots_) {
    if (s.master.defined()) b.masters += static_cast<int64_t>(s.master.nbytes());
    if (s.grad.defined()) b.gradients += static_cast<int64_t>(s.grad.nbytes());
  }
  for (const auto& [impl, storage] : state_) b.state += static_cast<int64_t>(storage.nbytes());
  return b;
}

bool HostStep::holds_state(const torch::Tensor& t) const {
  return t.defined() && t.has_storage() && state_.count(t.storage().unsafeGetStorageImpl()) > 0;
}

}  // namespace frugal::offload
