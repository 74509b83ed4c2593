// zero stage 3: the parameters a rank does not own are freed between uses and gathered from
// their owners, unit by unit, for the forward and again for the backward.
#include "stage3.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <string>

#include <c10/core/StorageImpl.h>
#include <frugal/base/error.h>
#include <frugal/models/lm_head.h>

namespace frugal::zero {

namespace {

c10::StorageImpl& storage_of(const torch::Tensor& p) { return *p.storage().unsafeGetStorageImpl(); }

// The parameter keeps its TensorImpl (the optimizer's key, autograd's saved tensor, its shape);
// only the bytes go.
void free_storage(const torch::Tensor& p) {
  c10::StorageImpl& s = storage_of(p);
  s.set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
  s.set_nbytes(0);
}

// The parameter's bytes become `nbytes` of `flat` from element `offset`; flat owns them (the
// DataPtr has no deleter), so the caller keeps flat alive as long as the parameter points there.
void point_into(const torch::Tensor& p, const torch::Tensor& flat, int64_t offset, size_t nbytes) {
  c10::StorageImpl& s = storage_of(p);
  char* data = static_cast<char*>(flat.data_ptr()) + offset * static_cast<int64_t>(flat.element_size());
  s.set_data_ptr_noswap(c10::DataPtr(data, flat.device()));
  s.set_nbytes(nbytes);
}

// Elements a parameter takes in a flat: its own, padded so the next starts 64 bytes aligned.
int64_t padded(const torch::Tensor& p) {
  const int64_t a = std::max<int64_t>(1, 64 / static_cast<int64_t>(p.element_size()));
  return (p.numel() + a - 1) / a * a;
}

// A parameter this large goes on the wire alone: its owner sends it as it is (no flat copy).
constexpr int64_t kAloneBytes = 1 << 20;

// `params` grouped by owner (ascending) and dtype, each group in the given order, a parameter
// of kAloneBytes or more in a group of its own: every rank builds the same groups, so the
// collectives stay in step.
std::vector<std::vector<size_t>> groups(const std::vector<size_t>& params, const std::vector<int>& owners,
                                        const std::vector<torch::Tensor>& tensors) {
  std::vector<std::vector<size_t>> out;
  std::vector<int> sorted_owners;
  for (size_t i : params) sorted_owners.push_back(owners[i]);
  std::sort(sorted_owners.begin(), sorted_owners.end());
  sorted_owners.erase(std::unique(sorted_owners.begin(), sorted_owners.end()), sorted_owners.end());
  const auto alone = [&](size_t i) { return static_cast<int64_t>(tensors[i].nbytes()) >= kAloneBytes; };
  for (int r : sorted_owners) {
    const size_t first = out.size();
    for (size_t i : params) {
      if (owners[i] != r) continue;
      size_t g = first;
      while (g < out.size() && (alone(i) || alone(out[g].front()) ||
                                tensors[out[g].front()].scalar_type() != tensors[i].scalar_type()))
        ++g;
      if (g == out.size()) out.emplace_back();
      out[g].push_back(i);
    }
  }
  return out;
}

// The tensors a block reads: its parameters, and a tied head's weight (the embedding's, which
// the head uses without registering it).
std::vector<torch::Tensor> block_tensors(const std::shared_ptr<torch::nn::Module>& block) {
  std::vector<torch::Tensor> out = block->parameters();
  for (const auto& m : block->modules(/*include_self=*/true))
    if (const auto* head = dynamic_cast<const LmHeadImpl*>(m.get()); head && head->tied())
      out.push_back(head->weight);
  return out;
}

}  // namespace

ShardedParameters::ShardedParameters(torch::nn::Sequential model, std::vector<int> owners,
                                     int64_t unit_bytes, bool prefetch)
    : model_(std::move(model)), owners_(std::move(owners)), prefetch_(prefetch),
      rank_(World::get().rank()) {
  std::map<const c10::StorageImpl*, std::string> storages;
  std::map<const c10::TensorImpl*, size_t> index;
  for (const auto& np : model_->named_parameters()) {
    const torch::Tensor& p = np.value();
    const size_t bytes = static_cast<size_t>(p.numel()) * p.element_size();
    const auto [it, fresh] = storages.emplace(p.storage().unsafeGetStorageImpl(), np.key());
    if (!fresh || p.storage_offset() != 0 || p.storage().nbytes() != bytes || !p.is_contiguous())
      throw_config_error("plugins.zero.stage = 3 frees each parameter's storage on the ranks "
                         "that do not own it, but parameter '" + np.key() + "' " +
                         (fresh ? "is a view into a larger storage" : "shares its storage with '" + it->second + "'") +
                         ": use stage 2, or a model whose parameters own their storage");
    index.emplace(p.unsafeGetTensorImpl(), params_.size());
    params_.push_back(p);
    nbytes_.push_back(bytes);
  }
  std::vector<std::vector<size_t>> block_params;
  std::vector<int64_t> block_bytes;
  for (const auto& block : model_->children()) {
    std::vector<size_t> ps;
    int64_t bytes = 0;
    for (const auto& t : block_tensors(block)) {
      const auto it = index.find(t.unsafeGetTensorImpl());
      if (it == index.end() || std::find(ps.begin(), ps.end(), it->second) != ps.end()) continue;
      ps.push_back(it->second);
      bytes += static_cast<int64_t>(nbytes_[it->second]);
    }
    block_params.push_back(std::move(ps));
    block_bytes.push_back(bytes);
  }
  last_unit_.assign(params_.size(), 0);
  for (const auto& [begin, end] : plan_units(block_bytes, unit_bytes)) {
    Unit u{begin, end, {}, 0};
    for (int64_t b = begin; b < end; ++b)
      for (size_t i : block_params[static_cast<size_t>(b)])
        if (std::find(u.params.begin(), u.params.end(), i) == u.params.end()) {
          u.params.push_back(i);
          u.bytes += static_cast<int64_t>(nbytes_[i]);
        }
    units_.push_back(std::move(u));
  }
  // Backward runs the units last to first: a parameter's gradient is whole after the backward
  // of the first unit that uses it.
  for (size_t u = units_.size(); u-- > 0;)
    for (size_t i : units_[u].params) last_unit_[i] = u;
  uses_.assign(params_.size(), 0);
  holder_.resize(params_.size());
  state_.assign(units_.size(), State::Released);
  wire_.resize(units_.size());
  hooked_.assign(units_.size(), false);
  backward_open_.assign(units_.size(), false);
  sent_.assign(params_.size(), false);
}

ShardedParameters::~ShardedParameters() {
  try {
    for (size_t u = 0; u < units_.size(); ++u)
      for (auto& f : wire_[u]) f.pending.wait();
    await_reduces();
  } catch (...) {  // a broken group: the run ends with the error already raised
  }
  // A fit that failed before after_fit: nothing may point into the flats going away (a read
  // of such a parameter then finds no bytes instead of freed memory).
  for (size_t i = 0; i < params_.size(); ++i)
    if (holder_[i].defined()) free_storage(params_[i]);
}

int64_t ShardedParameters::largest_unit_bytes() const {
  int64_t m = 0;
  for (const auto& u : units_) m = std::max(m, u.bytes);
  return m;
}

// The unit's parameters on the wire from their owners: one flat broadcast per owner and dtype,
// the receivers' parameters pointing into it. A parameter another gathered unit holds (a tied
// weight) is current already: every rank skips it alike, so the collectives stay in step.
void ShardedParameters::launch(size_t u) {
  if (state_[u] != State::Released) return;
  World& w = World::get();
  torch::NoGradGuard no_grad;
  std::vector<size_t> bring;
  for (size_t i : units_[u].params)
    if (uses_[i]++ == 0) bring.push_back(i);
  // From here release(u) undoes the counts and frees what was brought, also when an allocation
  // below fails (an out-of-memory error under the budget).
  state_[u] = State::OnTheWire;
  for (const auto& group : groups(bring, owners_, params_)) {
    Flight f;
    f.owner = owners_[group.front()];
    if (group.size() == 1 && f.owner == rank_) {  // the owner's one parameter, sent as it is
      f.flat = params_[group.front()].detach().reshape(-1);
    } else {
      fill_flat(f, group);
    }
    f.pending = w.broadcast_async(f.flat, f.owner);
    wire_[u].push_back(std::move(f));
  }
}

// A group's flat: the owner copies its parameters in; a receiver's parameters point into it.
void ShardedParameters::fill_flat(Flight& f, const std::vector<size_t>& group) {
  int64_t numel = 0;
  for (size_t i : group) numel += padded(params_[i]);
  f.flat = torch::empty({numel}, params_[group.front()].options().requires_grad(false));
  int64_t at = 0;
  for (size_t i : group) {
    const torch::Tensor& p = params_[i];
    if (f.owner == rank_) {
      f.flat.narrow(0, at, p.numel()).copy_(p.detach().reshape(-1));
    } else {
      point_into(p, f.flat, at, nbytes_[i]);
      holder_[i] = f.flat;
      gathered_ += static_cast<int64_t>(nbytes_[i]);
    }
    at += padded(p);
  }
}

void ShardedParameters::await(size_t u) {
  launch(u);
  for (auto& f : wire_[u]) f.pending.wait();
  wire_[u].clear();  // a sender's copy goes; a receiver's flat stays with its parameters
  state_[u] = State::Gathered;
}

void ShardedParameters::free_parameter(size_t i) {
  free_storage(params_[i]);
  holder_[i] = torch::Tensor();
}

void ShardedParameters::release(size_t u) {
  if (state_[u] == State::Released) return;
  for (auto& f : wire_[u]) f.pending.wait();  // never free bytes a broadcast still writes
  wire_[u].clear();
  for (size_t i : units_[u].params)
    if (--uses_[i] == 0 && owners_[i] != rank_) free_parameter(i);
  state_[u] = State::Released;
}

void ShardedParameters::gather_all() {
  for (size_t u = 0; u < units_.size(); ++u) launch(u);
  for (size_t u = 0; u < units_.size(); ++u) await(u);
}

void ShardedParameters::unshard() {
  gather_all();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!holder_[i].defined()) continue;
    const torch::Tensor& p = params_[i];
    c10::StorageImpl& s = storage_of(p);
    c10::DataPtr own = s.allocator()->allocate(nbytes_[i]);
    std::memcpy(own.get(), s.data(), nbytes_[i]);
    s.set_data_ptr_noswap(std::move(own));
    holder_[i] = torch::Tensor();
  }
  for (size_t u = 0; u < units_.size(); ++u) state_[u] = State::Released;
  std::fill(uses_.begin(), uses_.end(), 0);
}

void ShardedParameters::skip_forward() {
  release_all();
  for (size_t u = 0; u < units_.size(); ++u) {
    launch(u);
    if (prefetch_ && u + 1 < units_.size()) launch(u + 1);
    await(u);
    release(u);
  }
}

void ShardedParameters::release_all() {
  for (size_t u = 0; u < units_.size(); ++u) release(u);
  for (size_t i = 0; i < params_.size(); ++i)  // the first call: the whole model is in memory
    if (uses_[i] == 0 && owners_[i] != rank_ && params_[i].storage().nbytes() > 0) free_parameter(i);
}

torch::Tensor ShardedParameters::forward(torch::Tensor x, bool reduce) {
  release_all();  // a unit a forward without backward left gathered
  const bool grad = torch::GradMode::is_enabled();
  reduce_ = grad && reduce;
  sent_bytes_ = 0;
  std::fill(hooked_.begin(), hooked_.end(), false);
  std::fill(backward_open_.begin(), backward_open_.end(), false);
  std::fill(sent_.begin(), sent_.end(), false);
  std::vector<torch::nn::AnyModule> blocks(model_->begin(), model_->end());
  for (size_t u = 0; u < units_.size(); ++u) {
    launch(u);  // first: a weight unit u shares with u + 1 comes with u's broadcasts
    if (prefetch_ && u + 1 < units_.size()) launch(u + 1);
    await(u);
    for (int64_t b = units_[u].begin; b < units_[u].end; ++b)
      x = blocks[static_cast<size_t>(b)].forward(std::move(x));
    if (grad && x.requires_grad()) {
      x.register_hook([this, u](const torch::Tensor& g) {
        before_unit_backward(u);
        return g;
      });
      hooked_[u] = true;
    }
    release(u);
  }
  // The last unit's backward comes first: its broadcasts overlap the loss.
  if (prefetch_ && !units_.empty() && hooked_.back()) launch(units_.size() - 1);
  return x;
}

// The gradient for unit u's output is whole: every later unit's backward has run.
void ShardedParameters::before_unit_backward(size_t u) {
  for (size_t j = units_.size(); j-- > u + 1;)
    if (backward_open_[j]) after_unit_backward(j);
  await(u);
  backward_open_[u] = true;
  if (prefetch_)
    for (size_t j = u; j-- > 0;)
      if (hooked_[j]) {
        launch(j);
        break;
      }
}

void ShardedParameters::after_unit_backward(size_t u) {
  backward_open_[u] = false;
  release(u);
  if (!reduce_) return;
  await_reduces();  // one unit's gradients on the wire at a time: the copies are freed as we go
  std::vector<size_t> done;
  for (size_t i : units_[u].params)
    if (last_unit_[i] == u) done.push_back(i);
  send_gradients(done);
}

// The parameters' gradients summed onto their owners, one flat reduce per owner and dtype; the
// other ranks let theirs go. A parameter this rank's forward did not use counts as zeros.
void ShardedParameters::send_gradients(const std::vector<size_t>& params) {
  std::vector<size_t> send;
  for (size_t i : params)
    if (!sent_[i] && params_[i].requires_grad()) {
      sent_[i] = true;
      send.push_back(i);
    }
  torch::NoGradGuard no_grad;
  World& w = World::get();
  for (const auto& group : groups(send, owners_, params_)) {
    Flight f;
    f.owner = owners_[group.front()];
    f.params = group;
    std::vector<torch::Tensor> grads;
    for (size_t i : group) {
      torch::Tensor p = params_[i];
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      grads.push_back(p.grad());
      sent_bytes_ += static_cast<int64_t>(nbytes_[i]);
    }
    // One gradient goes on the wire as it is (the owner's sum lands in it); several, flattened.
    f.flat = grads.size() == 1 && grads.front().is_contiguous() ? grads.front().view(-1)
                                                                : at::flatten_dense_tensors(grads);
    f.pending = w.reduce_async(f.flat, f.owner);
    if (f.owner != rank_)
      for (size_t i : group) torch::Tensor(params_[i]).mutable_grad().reset();
    reduces_.push_back(std::move(f));
  }
}

void ShardedParameters::await_reduces() {
  const double inv = 1.0 / static_cast<double>(World::get().size());
  torch::NoGradGuard no_grad;
  for (auto& f : reduces_) {
    f.pending.wait();
    if (f.owner != rank_) continue;
    f.flat.mul_(inv);  // as data_parallel: the sum, then the mean (Gloo has no AVG)
    if (f.params.size() == 1 && f.flat.is_alias_of(params_[f.params.front()].grad())) continue;
    std::vector<torch::Tensor> grads;
    for (size_t i : f.params) grads.push_back(params_[i].grad());
    const auto parts = at::unflatten_dense_tensors(f.flat, grads);
    for (size_t k = 0; k < grads.size(); ++k) grads[k].copy_(parts[k]);
  }
  reduces_.clear();
}

int64_t ShardedParameters::finish_backward() {
  for (size_t j = units_.size(); j-- > 0;)
    if (backward_open_[j]) after_unit_backward(j);
  release_all();
  if (reduce_) {  // what no unit's backward sent (a unit whose output needed no gradient)
    std::vector<size_t> all(params_.size());
    std::iota(all.begin(), all.end(), size_t{0});
    send_gradients(all);
  }
  await_reduces();
  reduce_ = false;
  return sent_bytes_;
}

}  // namespace frugal::zero
