#pragma once
/// offload `to = "cpu"`: ZeRO-Offload's step (Ren et al., 2021) for a run on CUDA. The optimizer
/// steps a host copy (the *master*) of each parameter it steps, with the gradient copied to host
/// memory, on the CPU (frugal's fused step); its state is made and kept in host memory. The new
/// values go back to the device afterwards. The device keeps the parameters and, until the step,
/// the gradients; never the optimizer state. On CUDA every host buffer is pinned (page-locked:
/// the copies are DMA, the one back to the device does not block).
///
/// The parameters keep their tensor (the optimizer's key, the model's registration, autograd's
/// leaf): around the step each one *points at* its master (Tensor::set_data, the same move
/// PyTorch's FSDP makes for its CPU offload) and at its device storage again after; the
/// parameter's gradient accumulator (which set_data drops when the device changes) is put back,
/// so hooks on it (data parallel's overlapped all-reduce) keep firing.
///
/// Host buffers come in chunks of 256 MiB per kind and dtype (masters, gradients, state), each
/// tensor a view of one: CUDA's caching host allocator rounds every request up to a power of
/// two, which a chunk already is.
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

namespace frugal::offload {

class HostStep {
 public:
  /// `device`: the run's. Host buffers are pinned when it is CUDA, in chunks of `chunk_bytes`
  /// (a power of two; tests make it small).
  explicit HostStep(torch::Device device, int64_t chunk_bytes = int64_t{256} << 20);

  /// Before the optimizer steps: every parameter of `opt` on the run's device type with a gradient
  /// gets a master in host memory (made once; copied from the device again only when something
  /// else wrote the parameter since: its version counter or its storage moved), its gradient is
  /// copied into a host buffer (the device gradient is let go), and the parameter points at the
  /// master with that buffer as its gradient. State tensors not in host memory yet (a resume
  /// loads them on the device) move there first, at the first call for `opt`: a state loaded
  /// between two steps needs reset() (the plugin makes a new HostStep for each fit).
  void to_host(torch::optim::Optimizer& opt);
  /// After the step (`stepped`): the masters' new values are copied to the device and every
  /// parameter points at its device storage again; the state the step made moves into host
  /// buffers (pinned on CUDA). Without a step (it failed): the parameters point at their
  /// unchanged device storage, host gradients are dropped, and each master is copied afresh
  /// at the next step (it may hold half a step).
  void to_device(bool stepped);
  /// Whether the parameters point at their masters now (between to_host and to_device).
  bool on_host() const { return !moved_.empty(); }
  /// Frees the masters and gradient buffers (the fit ended); the state is the optimizer's.
  void release_buffers();
  /// Forgets everything of the optimizer it served: a new one, whose parameters may differ.
  /// State tensors stay where they are (in host memory, the old optimizer's).
  void reset();

  /// Host bytes held (the tensors', without the chunks' alignment): masters, gradient buffers,
  /// and the optimizer state in host memory.
  struct Bytes {
    int64_t masters = 0;
    int64_t gradients = 0;
    int64_t state = 0;
  };
  Bytes bytes() const;
  /// Whether `t`'s bytes are one of the host state buffers this made.
  bool holds_state(const torch::Tensor& t) const;
  /// How many parameters' states were of a type it does not know (left where the step made them).
  int64_t unknown_states() const { return unknown_; }

 private:
  struct Slot {
    torch::Tensor master, grad;  // host copies (views of chunks)
    torch::Tensor device;        // the device storage while the parameter points at its master
    std::weak_ptr<torch::autograd::Node> accumulator;  // its AccumulateGrad, kept across set_data
    int64_t version = -1;        // the parameter's version after the last copy back
    const void* device_ptr = nullptr;
  };
  torch::Device device_;
  bool pinned_;
  int64_t chunk_bytes_;
  std::unordered_map<const c10::TensorImpl*, Slot> slots_;
  std::vector<torch::Tensor> moved_;  // the parameters that point at their masters now
  torch::optim::Optimizer* opt_ = nullptr;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> state_;  // host state chunks
  int64_t state_bytes_ = 0;  // the state tensors' bytes at the last move_state
  int64_t unknown_ = 0;

  /// Host tensors shaped like each of `ts`, views of chunks per dtype (pinned on CUDA).
  std::vector<torch::Tensor> host_like(const std::vector<torch::Tensor>& ts) const;
  void move_state();
  void point_at_masters(torch::optim::Optimizer& opt);
};

}  // namespace frugal::offload
