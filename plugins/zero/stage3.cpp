// zero stage 3: the parameters a rank does not own are freed between uses and gathered from
// their owners, unit by unit, for the forward and again for the backward.
#include "stage3.h"

#include <algorithm>
#include <map>
#include <string>

#include <c10/core/StorageImpl.h>
#include <frugal/base/error.h>
#include <frugal/models/lm_head.h>

namespace frugal::zero {

std::vector<std::pair<int64_t, int64_t>> plan_units(const std::vector<int64_t>& block_bytes,
                                                    int64_t unit_bytes) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t held = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(block_bytes.size()); ++b) {
    if (out.empty() || held >= std::max<int64_t>(unit_bytes, 1)) {
      out.emplace_back(b, b);
      held = 0;
    }
    out.back().second = b + 1;
    held += block_bytes[static_cast<size_t>(b)];
  }
  return out;
}

namespace {

c10::StorageImpl& storage_of(const torch::Tensor& p) { return *p.storage().unsafeGetStorageImpl(); }

bool freed(const torch::Tensor& p) { return p.storage().nbytes() == 0 && p.numel() > 0; }

// The parameter keeps its TensorImpl (the optimizer's key, autograd's saved tensor, its shape);
// only the bytes go.
void free_storage(const torch::Tensor& p) {
  c10::StorageImpl& s = storage_of(p);
  s.set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
  s.set_nbytes(0);
}

void allocate_storage(const torch::Tensor& p, size_t nbytes) {
  c10::StorageImpl& s = storage_of(p);
  s.set_data_ptr_noswap(s.allocator()->allocate(nbytes));
  s.set_nbytes(nbytes);
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
  state_.assign(units_.size(), State::Released);
  wire_.resize(units_.size());
  hooked_.assign(units_.size(), false);
  backward_open_.assign(units_.size(), false);
  sent_.assign(params_.size(), false);
}

ShardedParameters::~ShardedParameters() {
  try {
    for (size_t u = 0; u < units_.size(); ++u)
      for (auto& b : wire_[u]) b.pending.wait();
    await_reduces();
  } catch (...) {  // a broken group: the run ends with the error already raised
  }
}

int64_t ShardedParameters::largest_unit_bytes() const {
  int64_t m = 0;
  for (const auto& u : units_) m = std::max(m, u.bytes);
  return m;
}

// The unit's parameters on the wire from their owners, into storage allocated for them. A
// parameter another gathered unit holds (a tied weight) is current already: every rank skips
// it alike, so the collectives stay in step.
void ShardedParameters::launch(size_t u) {
  if (state_[u] != State::Released) return;
  World& w = World::get();
  for (size_t i : units_[u].params) {
    if (uses_[i]++ > 0) continue;
    const torch::Tensor& p = params_[i];
    if (owners_[i] != rank_) {
      if (freed(p)) allocate_storage(p, nbytes_[i]);
      gathered_ += static_cast<int64_t>(nbytes_[i]);
    }
    torch::Tensor into = p.detach();  // the same bytes; c10d writes them, autograd sees no op
    Pending pending = w.broadcast_async(into, owners_[i]);
    wire_[u].push_back({std::move(pending), std::move(into)});
  }
  state_[u] = State::OnTheWire;
}

void ShardedParameters::await(size_t u) {
  launch(u);
  for (auto& b : wire_[u]) b.pending.wait();
  wire_[u].clear();
  state_[u] = State::Gathered;
}

void ShardedParameters::release(size_t u) {
  if (state_[u] == State::Released) return;
  for (auto& b : wire_[u]) b.pending.wait();  // never free bytes a broadcast still writes
  wire_[u].clear();
  for (size_t i : units_[u].params)
    if (--uses_[i] == 0 && owners_[i] != rank_) free_storage(params_[i]);
  state_[u] = State::Released;
}

void ShardedParameters::gather_all() {
  for (size_t u = 0; u < units_.size(); ++u) launch(u);
  for (size_t u = 0; u < units_.size(); ++u) await(u);
}

void ShardedParameters::release_all() {
  for (size_t u = 0; u < units_.size(); ++u) release(u);
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
  for (size_t i : units_[u].params)
    if (last_unit_[i] == u) send_gradient(i);
}

// The parameter's gradient summed onto its owner; the other ranks let theirs go. A parameter
// this rank's forward did not use counts as zeros.
void ShardedParameters::send_gradient(size_t i) {
  torch::Tensor p = params_[i];
  if (sent_[i] || !p.requires_grad()) return;
  sent_[i] = true;
  torch::NoGradGuard no_grad;
  if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
  torch::Tensor g = p.grad();
  Pending pending = World::get().reduce_async(g, owners_[i]);
  sent_bytes_ += static_cast<int64_t>(nbytes_[i]);
  if (owners_[i] != rank_) p.mutable_grad().reset();
  reduces_.push_back({std::move(pending), std::move(g), i});
}

void ShardedParameters::await_reduces() {
  const double inv = 1.0 / static_cast<double>(World::get().size());
  for (auto& r : reduces_) {
    r.pending.wait();
    if (owners_[r.param] == rank_) r.grad.mul_(inv);  // as data_parallel: the sum, then the mean
  }
  reduces_.clear();
}

int64_t ShardedParameters::finish_backward() {
  for (size_t j = units_.size(); j-- > 0;)
    if (backward_open_[j]) after_unit_backward(j);
  release_all();
  if (reduce_)
    for (size_t i = 0; i < params_.size(); ++i) send_gradient(i);  // the order is every rank's
  await_reduces();
  reduce_ = false;
  return sent_bytes_;
}

}  // namespace frugal::zero
