// zero: ZeRO stages 1 and 2 — each rank steps, and in stage 2 holds the reduced gradients of,
// its own share of the parameters.
#include "zero.h"

#include <algorithm>
#include <numeric>
#include <typeinfo>

#include <frugal/base/compat.h>
#include <frugal/distributed/data_parallel.h>
#include <frugal/distributed/distributed.h>
#include <frugal/base/error.h>
#include <frugal/memory/memory.h>
#include <frugal/optim/optimizers.h>

namespace frugal::zero {

// ---- the arithmetic -----------------------------------------------------------------------

std::vector<int> partition_by_bytes(const std::vector<int64_t>& bytes, int world) {
  if (world < 1) throw std::invalid_argument("zero::partition_by_bytes: world must be >= 1");
  std::vector<size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // Stable: equal sizes keep the model's order, so every rank sorts alike.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::vector<int> owners(bytes.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owners[i] = static_cast<int>(least);
    load[static_cast<size_t>(least)] += bytes[i];
  }
  return owners;
}

std::vector<Bucket> owner_buckets(const std::vector<torch::Tensor>& params,
                                  const std::vector<int>& owners, const std::vector<bool>& take,
                                  int64_t bucket_bytes, bool reverse) {
  const int world = owners.empty() ? 0 : *std::max_element(owners.begin(), owners.end()) + 1;
  std::vector<Bucket> out;
  for (int r = 0; r < world; ++r) {
    bool open = false;
    for (size_t k = 0; k < params.size(); ++k) {
      const size_t i = reverse ? params.size() - 1 - k : k;
      if (owners[i] != r || !take[i]) continue;
      const torch::Tensor& p = params[i];
      if (!open || out.back().bytes >= bucket_bytes ||
          params[out.back().params.front()].scalar_type() != p.scalar_type()) {
        out.push_back(Bucket{r, {}, 0});
        open = true;
      }
      out.back().params.push_back(i);
      out.back().bytes += static_cast<int64_t>(p.numel()) * static_cast<int64_t>(p.element_size());
    }
  }
  return out;
}

namespace {

std::vector<bool> trainable(const std::vector<torch::Tensor>& params) {
  std::vector<bool> take;
  for (const auto& p : params) take.push_back(p.requires_grad());
  return take;
}

torch::Tensor flatten(const std::vector<torch::Tensor>& ts) {
  return ts.size() == 1 ? ts.front().contiguous().view(-1).clone() : at::flatten_dense_tensors(ts);
}

void unflatten_into(const torch::Tensor& flat, const std::vector<torch::Tensor>& into) {
  const auto parts = at::unflatten_dense_tensors(flat, into);
  for (size_t i = 0; i < into.size(); ++i) into[i].copy_(parts[i]);
}

}  // namespace

int64_t reduce_to_owners(const std::vector<torch::Tensor>& params, const std::vector<int>& owners,
                         int64_t bucket_bytes) {
  World& w = World::get();
  torch::NoGradGuard no_grad;
  struct Flight {
    std::vector<torch::Tensor> grads;  // the owner's, to receive the sum
    torch::Tensor flat;
    Pending pending;
  };
  std::vector<Flight> flights;
  int64_t sent = 0;
  // Every bucket on the wire before the first is awaited, in the same order on every rank.
  for (const Bucket& b : owner_buckets(params, owners, trainable(params), bucket_bytes, true)) {
    Flight f;
    for (size_t i : b.params) {
      torch::Tensor p = params[i];
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);  // unused on this rank
      f.grads.push_back(p.grad());
    }
    f.flat = flatten(f.grads);
    f.pending = w.reduce_async(f.flat, b.owner);
    sent += b.bytes;
    if (b.owner != w.rank()) {  // the copy on the wire is all that is left of them
      for (size_t i : b.params) params[i].mutable_grad().reset();
      f.grads.clear();
    }
    flights.push_back(std::move(f));
  }
  const double inv = 1.0 / static_cast<double>(w.size());
  for (auto& f : flights) {
    f.pending.wait();
    if (f.grads.empty()) continue;
    f.flat.mul_(inv);  // as data_parallel: the sum, then the mean (Gloo has no AVG)
    unflatten_into(f.flat, f.grads);
  }
  return sent;
}

int64_t broadcast_from_owners(const std::vector<torch::Tensor>& params,
                              const std::vector<int>& owners, int64_t bucket_bytes) {
  World& w = World::get();
  torch::NoGradGuard no_grad;
  struct Flight {
    std::vector<torch::Tensor> into;  // a receiver's parameters
    torch::Tensor flat;
    Pending pending;
  };
  std::vector<Flight> flights;
  int64_t bytes = 0;
  for (const Bucket& b : owner_buckets(params, owners, trainable(params), bucket_bytes, false)) {
    Flight f;
    std::vector<torch::Tensor> ps;
    int64_t numel = 0;
    for (size_t i : b.params) {
      ps.push_back(params[i]);
      numel += params[i].numel();
    }
    if (b.owner == w.rank()) {
      f.flat = flatten(ps);
    } else {
      f.flat = torch::empty({numel}, ps.front().options());
      f.into = std::move(ps);
    }
    f.pending = w.broadcast_async(f.flat, b.owner);
    bytes += b.bytes;
    flights.push_back(std::move(f));
  }
  for (auto& f : flights) {
    f.pending.wait();
    if (!f.into.empty()) unflatten_into(f.flat, f.into);
  }
  return bytes;
}

// ---- the plugin ---------------------------------------------------------------------------

void ZeroOptions::visit(frugal::FieldVisitor& v) {
  v.field("stage", stage,
          "1 = each rank keeps the optimizer state of its share of the parameters; 2 = the "
          "reduced gradients of its share too; 3 = only its share of the parameters, the others "
          "gathered for each unit's forward and backward (ZeRO's P_os, P_os+g, P_os+g+p)",
          frugal::Limits{1, 3});
  v.field("unit_bytes", unit_bytes,
          "stage 3: consecutive top-level blocks gathered together until their parameters reach "
          "these bytes (0 = each block on its own, FSDP's wrapping of each block)",
          frugal::at_least(0));
  v.field("prefetch", prefetch,
          "stage 3: launch the next unit's broadcasts before the current unit runs (one more "
          "unit in memory, the transfer overlapped with compute)");
}

void ZeroOptions::check() const {
  if (stage == 3) return;
  if (unit_bytes != 0)
    frugal::throw_config_error("plugins.zero.unit_bytes applies to stage = 3 only (this stage = " +
                               std::to_string(stage) + "): remove it or set stage = 3");
  if (!prefetch)
    frugal::throw_config_error("plugins.zero.prefetch applies to stage = 3 only (this stage = " +
                               std::to_string(stage) + "): remove it or set stage = 3");
}

frugal::CallbackRelations Zero::relations() const {
  if (o_.stage != 3) return {};
  return {{}, {"checkpoint", "step_in_backward", "chunked_loss"}, true};
}

Zero::Zero(const ZeroOptions& o, const frugal::PluginContext& ctx) : o_(o), log_(ctx.logger) {}

void Zero::before_fit(frugal::Learner& l) {
  World& w = World::get();
  owners_.clear();
  step_gradients_ = reduced_ = broadcast_ = steps_ = 0;
  ranks_.clear();
  if (!w.distributed()) {
    log_->warn("one process: nothing to shard (run with frugal train --nproc N or torchrun)");
    return;
  }
  DataParallel* dp = find_data_parallel(l);
  if (!dp)
    frugal::throw_config_error(
        "plugins.zero shards the optimizer across data-parallel ranks, but this learner has no "
        "data_parallel callback: add frugal::DataParallel after World::init (frugal train "
        "does)");
  bucket_bytes_ = dp->bucket_bytes();
  std::vector<int64_t> bytes;
  for (const auto& p : l.model()->parameters())
    bytes.push_back(static_cast<int64_t>(p.numel()) * static_cast<int64_t>(p.element_size()));
  owners_ = partition_by_bytes(bytes, w.size());
  if (o_.stage >= 2) dp->hand_over_gradient_sync(name());
  l.set_per_rank_optimizer_state(true);
  shard_optimizer(l);
  if (o_.stage == 3) {
    if (l.oom_policy().auto_micro_batch)
      frugal::throw_config_error(
          "plugins.zero.stage = 3 cannot run with run.micro_batch = \"auto\": each rank's probe "
          "gathers the parameters with the others, and ranks whose probes differ would wait for "
          "each other; set run.micro_batch to a size or leave it unset");
    shards_ = std::make_unique<ShardedParameters>(l.model(), owners_, o_.unit_bytes, o_.prefetch);
    shards_->release_all();
    l.set_parameter_shards(shards_.get());
    log_->info("stage 3: {} units of blocks gathered in turn (largest {})", shards_->units().size(),
               frugal::format_bytes(shards_->largest_unit_bytes()));
  }
  int64_t mine = 0;
  for (size_t i = 0; i < bytes.size(); ++i)
    if (owners_[i] == w.rank()) mine += bytes[i];
  log_->info("stage {}: rank {} steps {} of the {} parameter tensors ({} of {})", o_.stage,
             w.rank(), std::count(owners_.begin(), owners_.end(), w.rank()), owners_.size(),
             frugal::format_bytes(mine),
             frugal::format_bytes(std::accumulate(bytes.begin(), bytes.end(), int64_t{0})));
}

// The optimizer the learner holds (built over every parameter) replaced by the same optimizer
// over this rank's share. State it already holds for that share moves over (optim_swap's
// seeded momentum); a fresh optimizer has none, so the full one never held the whole state.
void Zero::shard_optimizer(frugal::Learner& l) {
  std::vector<torch::Tensor> mine;
  const auto params = l.model()->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (owners_[i] == World::get().rank()) mine.push_back(params[i]);
  const frugal::OptimizerOptions o = l.optimizer_options();
  auto sharded = frugal::make_optimizer(o, mine);
  // The lr and momentum the schedule set for this batch, not the configured ones.
  // Group by group: with decay on matrices only, both have the same two groups (make_optimizer).
  auto& groups = l.optimizer().param_groups();
  auto& to_groups = sharded->param_groups();
  for (size_t g = 0; g < std::min(groups.size(), to_groups.size()); ++g) {
    const torch::optim::OptimizerOptions& from = groups[g].options();
    if (typeid(from) == typeid(to_groups[g].options())) to_groups[g].set_options(from.clone());
  }
  auto& old = l.optimizer().state();
  for (const auto& p : mine) {
    auto it = old.find(frugal::compat::optimizer_state_key(p));
    if (it != old.end()) sharded->state()[it->first] = std::move(it->second);
  }
  l.set_optimizer(std::move(sharded), o);
  changes_ = l.optimizer_changes();
}

torch::Tensor Zero::wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                                 const frugal::ForwardNext& next) {
  if (!shards_) return next(x);
  return shards_->forward(x, l.training() && l.completes_step());
}

void Zero::optimizer_replaced(frugal::Learner& l) {
  if (active() && l.optimizer_changes() != changes_) shard_optimizer(l);  // not its own shard
}

void Zero::before_stage(frugal::Learner& l) {
  if (!active() || o_.stage != 2) return;
  const auto params = l.model()->parameters();
  int64_t owned = 0, largest = 0;
  for (const Bucket& b : owner_buckets(params, owners_, trainable(params), bucket_bytes_, true)) {
    if (b.owner == World::get().rank()) owned += b.bytes;
    largest = std::max(largest, b.bytes);
  }
  l.set_sync_reserve(owned + largest);
}

void Zero::after_backward(frugal::Learner& l) {
  if (shards_) {
    reduced_ += shards_->finish_backward();
    return;
  }
  if (!active() || o_.stage != 2) return;
  if (!l.completes_step()) return;
  reduced_ += reduce_to_owners(l.model()->parameters(), owners_, bucket_bytes_);
}

void Zero::before_batch(frugal::Learner& l) {
  if (shards_ && l.training() && l.micro_batch_size() > 0)
    frugal::throw_config_error(
        "plugins.zero.stage = 3 cannot split batches into micro-batches (run.micro_batch = " +
        std::to_string(l.micro_batch_size()) + ", or grad_accum's mode = \"split\"): a rank "
        "with one row fewer may run one forward fewer, and every forward gathers with every "
        "rank; use grad_accum's mode = \"accumulate\" or leave run.micro_batch unset");
}

std::string Zero::retry_veto(const frugal::Learner&) const {
  if (!shards_) return {};
  return "zero stage 3 gathers the parameters with every rank in each forward: a retry on this "
         "rank alone would wait for ranks that went on (use a smaller batch or more ranks)";
}

void Zero::before_step(frugal::Learner& l) {
  if (!active()) return;
  step_gradients_ = std::max(step_gradients_, frugal::gradient_bytes(*l.model()));
}

void Zero::after_step(frugal::Learner& l) {
  if (!active()) return;
  ++steps_;
  if (shards_) return;  // stage 3: the next unit gathers bring the stepped values
  broadcast_ += broadcast_from_owners(l.model()->parameters(), owners_, bucket_bytes_);
}

void Zero::after_fit(frugal::Learner& l) {
  if (!active()) return;
  World& w = World::get();
  if (shards_) {
    shards_->unshard();  // the model leaves the fit whole, on every rank
    broadcast_ = shards_->gathered_bytes();
    l.set_parameter_shards(nullptr);
    shards_.reset();
  }
  if (DataParallel* dp = find_data_parallel(l)) dp->hand_over_gradient_sync("");
  int64_t mine = 0;
  const auto params = l.model()->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (owners_[i] == w.rank()) mine += static_cast<int64_t>(params[i].nbytes());
  const int64_t state = frugal::optimizer_state_bytes(l.optimizer());
  const auto all = w.all_gather(torch::tensor({mine, state, step_gradients_}, torch::kLong).to(w.device()));
  for (size_t r = 0; r < all.size(); ++r) {
    const torch::Tensor v = all[r].cpu();
    ranks_.push_back({v[0].item<int64_t>(), v[1].item<int64_t>(), v[2].item<int64_t>()});
    if (w.is_main())
      log_->info("stage {}: rank {} owns {} of parameters, holds {} of optimizer state and at "
                 "most {} of gradients at a step ({} steps; per step {} reduced, {} broadcast)",
                 o_.stage, r, frugal::format_bytes(ranks_.back().owned_parameters),
                 frugal::format_bytes(ranks_.back().optimizer_state),
                 frugal::format_bytes(ranks_.back().step_gradients), steps_,
                 frugal::format_bytes(steps_ ? reduced_ / steps_ : 0),
                 frugal::format_bytes(steps_ ? broadcast_ / steps_ : 0));
  }
}

// Optional state: the Learner re-shards a checkpoint's optimizer by the layout it saved with it,
// so a run without zero (one process, or plain data parallel) may resume it.
void Zero::save_state(torch::serialize::OutputArchive& a) const {
  if (!active()) return;
  a.write(frugal::kOptionalState, c10::IValue(true));
  a.write("stage", torch::tensor(o_.stage));
  a.write("world_size", torch::tensor(static_cast<int64_t>(World::get().size())));
  a.write("owners", torch::tensor(std::vector<int64_t>(owners_.begin(), owners_.end())));
}

void Zero::load_state(frugal::Learner&, torch::serialize::InputArchive& a) {
  torch::Tensor saved, saved_world;
  if (!active() || !a.try_read("owners", saved) || !a.try_read("world_size", saved_world)) return;
  // Another world size (or a file of one process): the Learner re-shards the optimizer state.
  if (saved_world.item<int64_t>() != World::get().size()) return;
  // The same world size: each rank loads its own shard, which must be the one it steps now.
  const std::vector<int64_t> now(owners_.begin(), owners_.end());
  if (saved.numel() != static_cast<int64_t>(now.size()) ||
      !torch::equal(saved.to(torch::kLong), torch::tensor(now)))
    throw frugal::CheckpointError(
        "the checkpoint's optimizer shards were cut for another model (its parameters' owners "
        "differ from this run's): resume with the model it was written with");
  // optim_swap (a lower order) loads first and may put a full, unsharded optimizer back: the
  // Learner announces it (optimizer_replaced) before the checkpoint's shard loads into it.
}

}  // namespace frugal::zero

FRUGAL_PLUGIN(frugal::zero::Zero, frugal::zero::ZeroOptions, "zero",
              "ZeRO stages 1-3: each data-parallel rank keeps the optimizer state (and the reduced "
              "gradients, and the parameters) of its share of the parameters",
              "1.0.0")
