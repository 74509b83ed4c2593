#pragma once
/// The default random generators' state (CPU, and the device's CUDA generator), captured and
/// restored as one: a pass that must leave no trace (a recompute, a check, a probe) draws the
/// same dropout masks as the pass it repeats, and the run continues as if it had not run.
#include <mutex>

#include <torch/torch.h>

#ifdef FRUGAL_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace frugal {

struct RngState {
  torch::Tensor cpu;
#ifdef FRUGAL_WITH_CUDA
  torch::Tensor cuda;
  c10::DeviceIndex device = -1;
#endif

  /// The CPU generator's state, and the CUDA generator's of `d` when `d` is a CUDA device.
  static RngState capture(const torch::Device& d) {
    RngState s;
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cpu = gen.get_state();
    }
#ifdef FRUGAL_WITH_CUDA
    if (d.is_cuda()) {
      s.device = d.has_index() ? d.index() : c10::DeviceIndex(0);
      auto cg = at::cuda::detail::getDefaultCUDAGenerator(s.device);
      std::lock_guard<std::mutex> lock(cg.mutex());
      s.cuda = cg.get_state();
    }
#else
    (void)d;
#endif
    return s;
  }

  void restore() const {
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cpu);
    }
#ifdef FRUGAL_WITH_CUDA
    if (cuda.defined()) {
      auto cg = at::cuda::detail::getDefaultCUDAGenerator(device);
      std::lock_guard<std::mutex> lock(cg.mutex());
      cg.set_state(cuda);
    }
#endif
  }
};

}  // namespace frugal
