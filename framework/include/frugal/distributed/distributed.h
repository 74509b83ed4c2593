#pragma once
/// Data-parallel training across processes on PyTorch's c10d: a TCPStore for the rendezvous and
/// a process group (Gloo on CPU; NCCL for CUDA devices when the LibTorch has it). A process
/// learns its place from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so torchrun, Slurm and Kubernetes launchers
/// work; `frugal train --nproc N` sets them for N local workers.
///
/// World is process-wide, as torch.distributed's default group: one process (rank 0 of 1)
/// until init(). Collectives block; every rank must call them in the same order, and a rank
/// that does not arrives at the timeout as an error (never a silent hang).
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/config/config.h"
#include "frugal/core/collective.h"

namespace frugal {

/// This process's place among the run's processes, as torchrun describes it.
struct WorldEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  bool distributed() const { return world_size > 1; }
  /// From the environment: WORLD_SIZE unset (or 1) is one process. Throws ConfigError naming
  /// the variable for a missing or malformed one (RANK outside [0, WORLD_SIZE), a bad port).
  static WorldEnv from_environment();
};

/// A collective started with an *_async call; wait() blocks until it is done (and throws its
/// error). Destroying an unwaited Pending waits.
class Pending {
 public:
  struct Impl;
  Pending();
  explicit Pending(std::unique_ptr<Impl> impl);
  Pending(Pending&&) noexcept;
  Pending& operator=(Pending&&) noexcept;
  ~Pending();
  void wait();

 private:
  std::unique_ptr<Impl> impl_;
};

class World final : public Collective {
 public:
  static World& get();

  /// Joins the run's process group: the TCPStore rendezvous at master_addr:master_port (rank 0
  /// serves it), then the backend. A no-op for one process. Throws Error when the rendezvous
  /// times out, naming the address and the ranks expected.
  void init(const WorldEnv& env, const DistributedOptions& o, const torch::Device& device);
  /// Leaves the group (tests; a process ends by itself).
  void shutdown();

  int rank() const override { return env_.rank; }
  int size() const override { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  int local_size() const { return env_.local_world_size; }
  const std::string& backend() const { return backend_; }
  const DistributedOptions& options() const { return options_; }
  /// Where tensors handed to the collectives must be: CPU for gloo, the GPU for nccl.
  torch::Device device() const override { return device_; }

  /// In place, on every rank; a no-op in one process. Tensors are reduced one by one: flatten
  /// many small ones first (flatten_dense_tensors).
  void all_reduce(torch::Tensor& t, Reduce op = Reduce::Sum) override;
  Pending all_reduce_async(torch::Tensor& t, Reduce op = Reduce::Sum);
  /// Every tensor takes root's values.
  void broadcast(torch::Tensor& t, int root = 0);
  Pending broadcast_async(torch::Tensor& t, int root = 0);
  /// `t` reduced into root's `t` (the others' `t` are left undefined in value): what a
  /// sharded optimizer needs to bring a gradient to the one rank that steps it. Gloo has no
  /// reduce_scatter; this is its replacement, one owner at a time.
  Pending reduce_async(torch::Tensor& t, int root, Reduce op = Reduce::Sum);
  /// Every rank's `t` (same shape on every rank) on root only, in rank order; {} elsewhere.
  /// Unlike all_gather, only root holds them all.
  std::vector<torch::Tensor> gather(const torch::Tensor& t, int root = 0) override;
  /// Each rank's `t` (same shape on every rank), in rank order.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t) override;
  void barrier();
  /// True on every rank when `flag` is true on any.
  bool any(bool flag) override;
  /// The smallest (largest) of every rank's value.
  int64_t min(int64_t v) override;
  int64_t max(int64_t v) override;
  /// The rendezvous store: rank 0 publishes a decision, the others wait for it (the timeout).
  void store_set(const std::string& key, const std::string& value);
  std::string store_get(const std::string& key);

  ~World();

 private:
  World();
  void rendezvous(const WorldEnv& env, const std::string& where, int64_t timeout_s);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  WorldEnv env_;
  DistributedOptions options_;
  std::string backend_ = "none";
  torch::Device device_ = torch::kCPU;
};

/// Copies `params` (then `buffers`) of rank `root` to every rank, in buckets of `bucket_bytes`
/// (a bucket of one contiguous tensor goes on the wire as it is, without a flat copy).
void broadcast_tensors(const std::vector<torch::Tensor>& tensors, int64_t bucket_bytes, int root = 0);

}  // namespace frugal
