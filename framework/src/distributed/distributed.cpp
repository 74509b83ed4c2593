// World: the rendezvous (c10d TCPStore) and the process group (c10d ProcessGroupGloo, or
// ProcessGroupNCCL in a CUDA build) behind frugal's collectives.
//
// Debian's ProcessGroupGloo.hpp compiles to nothing without USE_C10D_GLOO (this file is built
// outside the unity batches, so the define stays here).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include "frugal/distributed/distributed.h"

#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
// NCCL: a CUDA build whose LibTorch ships it (its header compiles only with nccl.h and the
// define). Not exercised here: no GPU was available to this project.
#if defined(FRUGAL_WITH_CUDA) && __has_include(<nccl.h>)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define FRUGAL_WITH_NCCL 1
#endif

#include "core/guard.h"
#include "frugal/base/error.h"
#include "frugal/data/task.h"

namespace frugal {

namespace {
// LibTorch 2 split the process group into a front (ProcessGroup) and its backends; the
// collectives frugal calls are the backend's, with the same signatures as 1.13's group.
#if TORCH_VERSION_MAJOR >= 2
using Group = c10d::Backend;
#else
using Group = c10d::ProcessGroup;
#endif

// A collective's error, said as what it means to a user: a rank is gone or stuck. Also
// Pending::wait's.
template <class F>
auto guarded(const std::string& what, F&& f) -> decltype(f()) {
  auto lost = [&](const std::string& detail) {
    return Error(what + " failed: another rank left the run or stopped answering (a crash, a "
                 "kill, or distributed.timeout passed; the launcher's log names the rank): " +
                 first_line(detail));
  };
  try {
    return f();
  } catch (const c10::Error& e) {
    throw lost(e.what_without_backtrace());
  } catch (const Error&) {
    throw;
  } catch (const std::runtime_error& e) {  // Gloo's own errors (gloo::IoException)
    throw lost(e.what());
  }
}
}  // namespace


// ---------------------------------------------------------------- the environment

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  if (errno || *end || n < lo || n > hi)
    throw_config_error(std::string("environment variable ") + name + "='" + v +
                       "' must be an integer in [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + "] (torchrun sets it; frugal train --nproc N too)");
  return static_cast<int>(n);
}

}  // namespace

WorldEnv WorldEnv::from_environment() {
  WorldEnv e;
  e.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  if (e.world_size == 1) return e;
  if (!std::getenv("RANK"))
    throw_config_error("environment variable WORLD_SIZE=" + std::to_string(e.world_size) +
                       " is set but RANK is not: launch with torchrun or frugal train --nproc N");
  e.rank = env_int("RANK", 0, 0, e.world_size - 1);
  e.local_rank = env_int("LOCAL_RANK", e.rank, 0, e.world_size - 1);
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", e.world_size, 1, e.world_size);
  e.master_addr = env_or("MASTER_ADDR", "127.0.0.1");
  e.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  return e;
}

// ---------------------------------------------------------------- pending collectives

struct Pending::Impl {
  c10::intrusive_ptr<c10d::Work> work;
};

Pending::Pending() = default;
Pending::Pending(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Pending::Pending(Pending&&) noexcept = default;
Pending& Pending::operator=(Pending&& o) noexcept {
  if (this != &o) {
    if (impl_) {
      try {
        wait();
      } catch (...) {
      }
    }
    impl_ = std::move(o.impl_);
  }
  return *this;
}
Pending::~Pending() {
  if (!impl_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("a collective failed while it was abandoned: {}", e.what());
  }
}

void Pending::wait() {
  if (!impl_) return;
  auto impl = std::move(impl_);
  guarded("a collective", [&] { impl->work->wait(); });
}

// ---------------------------------------------------------------- the world

struct World::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<Group> group;
  std::chrono::milliseconds timeout{300000};
  /// The rendezvous ends by this time: distributed.timeout from init's start, once (the store's
  /// connection and the wait for the other ranks share it).
  std::chrono::steady_clock::time_point deadline;
};

World::World() : impl_(std::make_unique<Impl>()) {}
World::~World() = default;

World& World::get() {
  static World w;
  return w;
}

namespace {

bool loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  const std::string iface = env_or("GLOO_SOCKET_IFNAME", "");
  if (!iface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(iface);
  // Every rank on this machine: loopback, whatever the host name resolves to.
  if (loopback(master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10d::ReduceOp to_c10d(Reduce op) {
  switch (op) {
    case Reduce::Max:
      return c10d::ReduceOp::MAX;
    case Reduce::Min:
      return c10d::ReduceOp::MIN;
    case Reduce::Sum:
      break;
  }
  return c10d::ReduceOp::SUM;
}

int64_t reduce_scalar(World& w, int64_t v, Reduce op) {
  if (!w.distributed()) return v;
  torch::Tensor t = torch::full({1}, v, torch::TensorOptions().dtype(torch::kLong).device(w.device()));
  w.all_reduce(t, op);
  return t.item<int64_t>();
}

/// Ends the process when the rendezvous outlives its deadline by a grace period: a port that
/// accepts and never answers leaves the store's client in a read without a timeout, which no
/// exception can reach. Nothing of the run is written before the rendezvous, so the exit is clean.
class RendezvousWatchdog {
 public:
  RendezvousWatchdog(std::chrono::steady_clock::time_point deadline, std::string what)
      : thread_([this, deadline, what = std::move(what)] {
          std::unique_lock<std::mutex> g(m_);
          if (cv_.wait_until(g, deadline + std::chrono::seconds(3), [this] { return done_; })) return;
          spdlog::error("{}", what);
          spdlog::default_logger()->flush();
          std::_Exit(1);
        }) {}
  ~RendezvousWatchdog() {
    {
      std::lock_guard<std::mutex> g(m_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: started once the members it reads exist
};

}  // namespace

void World::init(const WorldEnv& env, const DistributedOptions& o, const torch::Device& device) {
  options_ = o;
  if (!env.distributed()) {
    env_ = env;
    return;
  }
  if (impl_->group) throw_usage_error("World::init: already initialised");
  std::string backend = o.backend;
  if (backend == "auto") backend = device.is_cuda() ? "nccl" : "gloo";
  if (backend == "nccl" && !device.is_cuda())
    throw_config_error("distributed.backend = \"nccl\" needs run.device = \"cuda\"; CPU ranks "
                       "use gloo");
  impl_->timeout = std::chrono::milliseconds(o.timeout * 1000);
  impl_->deadline = std::chrono::steady_clock::now() + impl_->timeout;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = static_cast<size_t>(env.world_size);
  so.waitWorkers = false;  // rendezvous() waits, naming the missing ranks, within the same deadline
  so.timeout = impl_->timeout;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const std::string rank = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size);
  {
    RendezvousWatchdog watchdog(impl_->deadline,
                                rank + ": no rendezvous at " + where + " within distributed.timeout = " +
                                    std::to_string(o.timeout) + " s: the port accepted the connection "
                                    "but never answered (is MASTER_ADDR:MASTER_PORT rank 0 of this run?)");
    try {
      impl_->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      throw Error(rank + ": no rendezvous at " + where + " (MASTER_ADDR:MASTER_PORT) within " +
                  std::to_string(o.timeout) + " s: " + e.what());
    }
    rendezvous(env, where, o.timeout);
  }
  if (backend == "gloo") {
    auto opts = c10d::ProcessGroupGloo::Options::create(impl_->timeout);
    opts->devices.push_back(gloo_device(env.master_addr));
    opts->threads = 1;
    impl_->group = guarded("the Gloo process group", [&] {
      return c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, env.rank, env.world_size, opts);
    });
  } else {
#ifdef FRUGAL_WITH_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = impl_->timeout;
    impl_->group = guarded("the NCCL process group", [&] {
      return c10::make_intrusive<c10d::ProcessGroupNCCL>(impl_->store, env.rank, env.world_size, opts);
    });
#else
    throw_config_error("distributed.backend = \"nccl\": this LibTorch has no NCCL; use gloo");
#endif
  }
  env_ = env;
  backend_ = backend;
  device_ = backend == "nccl" ? device : torch::Device(torch::kCPU);
  spdlog::debug("rank {} of {} joined at {} ({})", env.rank, env.world_size, where, backend);
}

// Every rank checks in at the store; each waits until all have, or names the missing ones.
void World::rendezvous(const WorldEnv& env, const std::string& where, int64_t timeout_s) {
  auto& store = *impl_->store;
  guarded("the rendezvous", [&] {
    store.set("frugal/arrived/" + std::to_string(env.rank), std::vector<uint8_t>{1});
    store.add("frugal/arrived", 1);
  });
  const auto deadline = impl_->deadline;
  while (guarded("the rendezvous", [&] { return store.add("frugal/arrived", 0); }) < env.world_size) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::string missing;
      int n = 0;
      for (int r = 0; r < env.world_size; ++r) {
        if (store.check({"frugal/arrived/" + std::to_string(r)})) continue;
        if (n++ < 8) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      throw Error("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                  ": no rendezvous at " + where + " within distributed.timeout = " +
                  std::to_string(timeout_s) + " s: rank(s) " + missing + (n > 8 ? ", ..." : "") +
                  " never arrived (not started, or started with another MASTER_ADDR:MASTER_PORT)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void World::shutdown() {
  impl_->group.reset();
  impl_->store.reset();
  env_ = WorldEnv{};
  backend_ = "none";
  device_ = torch::kCPU;
}

void World::all_reduce(torch::Tensor& t, Reduce op) { all_reduce_async(t, op).wait(); }

Pending World::all_reduce_async(torch::Tensor& t, Reduce op) {
  if (!distributed()) return Pending();
  std::vector<torch::Tensor> ts{t};
  c10d::AllreduceOptions ao;
  ao.reduceOp = to_c10d(op);
  ao.timeout = impl_->timeout;
  auto impl = std::make_unique<Pending::Impl>();
  impl->work = guarded("all_reduce", [&] { return impl_->group->allreduce(ts, ao); });
  return Pending(std::move(impl));
}

void World::broadcast(torch::Tensor& t, int root) {
  if (!distributed()) return;
  std::vector<torch::Tensor> ts{t};
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  bo.timeout = impl_->timeout;
  guarded("broadcast", [&] { impl_->group->broadcast(ts, bo)->wait(); });
}

Pending World::broadcast_async(torch::Tensor& t, int root) {
  if (!distributed()) return Pending();
  std::vector<torch::Tensor> ts{t};
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  bo.timeout = impl_->timeout;
  auto impl = std::make_unique<Pending::Impl>();
  impl->work = guarded("broadcast", [&] { return impl_->group->broadcast(ts, bo); });
  return Pending(std::move(impl));
}

Pending World::reduce_async(torch::Tensor& t, int root, Reduce op) {
  if (!distributed()) return Pending();
  std::vector<torch::Tensor> ts{t};
  c10d::ReduceOptions ro;
  ro.reduceOp = to_c10d(op);
  ro.rootRank = root;
  ro.timeout = impl_->timeout;
  auto impl = std::make_unique<Pending::Impl>();
  impl->work = guarded("reduce", [&] { return impl_->group->reduce(ts, ro); });
  return Pending(std::move(impl));
}

std::vector<torch::Tensor> World::gather(const torch::Tensor& t, int root) {
  if (!distributed()) return {t};
  std::vector<torch::Tensor> in{t.contiguous()};
  std::vector<std::vector<torch::Tensor>> out(rank() == root ? 1 : 0);
  if (rank() == root)
    for (int r = 0; r < size(); ++r) out[0].push_back(torch::empty_like(in[0]));
  c10d::GatherOptions go;
  go.rootRank = root;
  go.timeout = impl_->timeout;
  guarded("gather", [&] { impl_->group->gather(out, in, go)->wait(); });
  return rank() == root ? out[0] : std::vector<torch::Tensor>{};
}

std::vector<torch::Tensor> World::all_gather(const torch::Tensor& t) {
  if (!distributed()) return {t};
  std::vector<torch::Tensor> in{t.contiguous()};
  std::vector<std::vector<torch::Tensor>> out(1);
  for (int r = 0; r < size(); ++r) out[0].push_back(torch::empty_like(in[0]));
  c10d::AllgatherOptions go;
  go.timeout = impl_->timeout;
  guarded("all_gather", [&] { impl_->group->allgather(out, in, go)->wait(); });
  return out[0];
}

void World::barrier() {
  if (!distributed()) return;
  c10d::BarrierOptions bo;
  bo.timeout = impl_->timeout;
  guarded("barrier", [&] { impl_->group->barrier(bo)->wait(); });
}


bool World::any(bool flag) { return max(flag ? 1 : 0) != 0; }

int64_t World::min(int64_t v) { return reduce_scalar(*this, v, Reduce::Min); }

int64_t World::max(int64_t v) { return reduce_scalar(*this, v, Reduce::Max); }

void World::store_set(const std::string& key, const std::string& value) {
  if (!distributed()) return;
  guarded("store set", [&] { impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
}

std::string World::store_get(const std::string& key) {
  if (!distributed()) return "";
  const std::vector<uint8_t> v = guarded("store get", [&] { return impl_->store->get(key); });
  return std::string(v.begin(), v.end());
}

void broadcast_tensors(const std::vector<torch::Tensor>& tensors, int64_t bucket_bytes, int root) {
  World& w = World::get();
  if (!w.distributed() || tensors.empty()) return;
  torch::NoGradGuard g;
  std::vector<torch::Tensor> bucket;
  int64_t bytes = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    if (bucket.size() == 1 && bucket.front().is_contiguous()) {  // into the tensor itself: no copy
      w.broadcast(bucket.front(), root);
    } else {
      torch::Tensor flat = at::flatten_dense_tensors(bucket);
      w.broadcast(flat, root);
      const auto parts = at::unflatten_dense_tensors(flat, bucket);
      for (size_t i = 0; i < bucket.size(); ++i) bucket[i].copy_(parts[i]);
    }
    bucket.clear();
    bytes = 0;
  };
  for (const auto& t : tensors) {
    if (!bucket.empty() && (t.scalar_type() != bucket.front().scalar_type() ||
                            t.device() != bucket.front().device()))
      flush();
    bucket.push_back(t);
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
    if (bytes >= bucket_bytes) flush();
  }
  flush();
}

}  // namespace frugal
