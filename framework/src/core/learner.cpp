// The Learner: its callbacks (the event bus and the forward chain), the state callbacks read and
// change, model management, purge and destroy. The loop is in learner_loop.cpp, checkpoints
// and resume in learner_checkpoint.cpp; what they share with no Learner lives in archive,
// micro_batch and fit_stats.
#include "frugal/core/learner.h"

#include <algorithm>

#include "core/guard.h"
#include "core/pending_resume.h"
#include "frugal/base/error.h"

namespace frugal {

namespace {

int64_t dataset_bytes(const Dataset& d) {
  int64_t n = 0;
  if (d.images.defined()) n += static_cast<int64_t>(d.images.nbytes());
  if (d.labels.defined()) n += static_cast<int64_t>(d.labels.nbytes());
  if (d.tokens.defined()) n += static_cast<int64_t>(d.tokens.nbytes());
  if (d.features.defined()) n += static_cast<int64_t>(d.features.nbytes());
  return n;
}

}  // namespace

Learner::Learner(torch::nn::Sequential model, DataLoader train, std::optional<DataLoader> valid,
                 OptimizerOptions optimizer, LossFn loss, torch::Device device)
    : model_(std::move(model)),
      optimizer_options_(std::move(optimizer)),
      loss_fn_(std::move(loss)),
      train_(std::move(train)),
      valid_(std::move(valid)),
      device_(device),
      task_(task_for(train_.dataset())) {
  if (!loss_fn_) throw_usage_error("Learner needs a loss function");
  model_->to(device_);
  train_.set_device(device_);
  if (valid_) valid_->set_device(device_);
  optimizer_ = make_optimizer(optimizer_options_, model_->parameters());
}

Learner::~Learner() {
  // Callbacks (possibly from plugin libraries) go first, while everything they may touch lives.
  callbacks_.clear();
  forward_wrappers_.clear();
}

Learner& Learner::live() {
  if (destroyed_) throw_usage_error("this Learner was destroyed; create a new one");
  return *this;
}
const Learner& Learner::live() const {
  if (destroyed_) throw_usage_error("this Learner was destroyed; create a new one");
  return *this;
}

// ---------------------------------------------------------------- composition

void Learner::add_callback(std::shared_ptr<Callback> cb) {
  live();
  if (!cb) throw_usage_error("add_callback: null callback");
  std::vector<CallbackFacts> facts;
  for (const auto& c : callbacks_) facts.push_back(facts_of(*c));
  facts.push_back(call_guarded(*cb, "relations", [&] { return facts_of(*cb); }));
  const std::string violation = relation_violation(facts);
  if (!violation.empty()) throw_config_error(violation);
  auto pos = std::upper_bound(callbacks_.begin(), callbacks_.end(), cb,
                              [](const auto& a, const auto& b) { return a->order() < b->order(); });
  Callback& added = **callbacks_.insert(pos, cb);
  rebuild_forward_wrappers();
  try {
    call_guarded(added, "attach", [&] { added.attach(*this); });
  } catch (...) {
    callbacks_.erase(std::find(callbacks_.begin(), callbacks_.end(), cb));
    rebuild_forward_wrappers();
    throw;
  }
}

void Learner::rebuild_forward_wrappers() {
  forward_wrappers_.clear();
  for (auto& c : callbacks_)
    if (c->wraps_forward()) forward_wrappers_.push_back(c.get());
}

size_t Learner::remove_callback(const std::string& name) {
  size_t before = callbacks_.size();
  callbacks_.erase(std::remove_if(callbacks_.begin(), callbacks_.end(),
                                  [&](const auto& c) { return c->name() == name; }),
                   callbacks_.end());
  rebuild_forward_wrappers();
  return before - callbacks_.size();
}

void Learner::clear_callbacks() {
  shards_ = nullptr;  // registered by a callback going away
  callbacks_.clear();
  forward_wrappers_.clear();
}

void Learner::fire(Event e) {
  event_ = e;
  record_before(e);
  const bool reverse = is_after(e);
  const std::string_view where = to_string(e);
  const size_t n = callbacks_.size();
  for (size_t k = 0; k < n && k < callbacks_.size(); ++k) {
    announce_optimizer();  // a callback before this one may have replaced it
    Callback& cb = *callbacks_[reverse ? callbacks_.size() - 1 - k : k];
    call_guarded(cb, where, [&] { cb.dispatch(e, *this); });
  }
  record_after(e);
}

void Learner::announce_optimizer() {
  // A callback that replaces the optimizer in its optimizer_replaced (zero's shard) is told
  // too, and must recognise its own replacement (Learner::optimizer_changes()).
  while (announced_changes_ != optimizer_changes_) {
    announced_changes_ = optimizer_changes_;
    for (const auto& c : callbacks_)
      call_guarded(*c, "optimizer_replaced", [&] { c->optimizer_replaced(*this); });
  }
}

torch::Tensor Learner::forward(const torch::Tensor& x) { return live().forward_from(0, x); }

torch::Tensor Learner::forward_from(size_t index, const torch::Tensor& x) {
  if (index >= forward_wrappers_.size()) {
    try {
      return model_->forward(x);
    } catch (const c10::OutOfMemoryError&) {
      throw;  // keeps its type: the loop retries it
    } catch (const c10::Error& err) {
      throw ModelForwardError("model forward failed: " + first_line(err.what_without_backtrace()));
    }
  }
  Callback* cb = forward_wrappers_[index];
  return call_guarded(*cb, "wrap_forward",
                      [&] { return cb->wrap_forward(*this, x, ForwardNext(*this, index + 1)); });
}

// ---------------------------------------------------------------- optimizer and batch state

void Learner::set_optimizer(std::unique_ptr<torch::optim::Optimizer> opt, OptimizerOptions o) {
  live();
  if (!opt) throw_usage_error("set_optimizer: null optimizer");
  optimizer_.reset();  // free the old state before the new one lives
  optimizer_ = std::move(opt);
  optimizer_options_ = std::move(o);
  ++optimizer_changes_;
}

namespace {
/// The same optimizer but for its learning rate (and the keys read outside it: clipping): a
/// stage that lowers the rate keeps the moments it has (as PyTorch users change a group's lr).
bool same_but_lr(const OptimizerOptions& a, const OptimizerOptions& b) {
  return a.name == b.name && a.weight_decay == b.weight_decay && a.decay == b.decay &&
         a.own_keys() == b.own_keys();
}
}  // namespace

void Learner::adopt_stage_optimizer(const OptimizerOptions& o) {
  if (optimizer_ && same_but_lr(optimizer_options_, o)) {
    for (auto& g : optimizer_->param_groups()) g.options().set_lr(o.lr);
    optimizer_options_ = o;
    return;
  }
  set_optimizer(o);
}

void Learner::set_optimizer(const OptimizerOptions& o) {
  live();
  optimizer_.reset();
  optimizer_ = make_optimizer(o, model_->parameters());
  optimizer_options_ = o;
  ++optimizer_changes_;
}

void Learner::zero_grad() {
  // Set to none rather than zeroed: no gradient memory between steps.
  for (auto& p : model_->parameters()) p.mutable_grad().reset();
}

void Learner::backward() {
  if (!loss_.defined()) throw_usage_error("backward: no loss in this batch");
  const double factor = loss_scale_ * micro_weight_ * batch_weight_;
  if (factor == 1.0)
    loss_.backward();
  else
    (loss_ * factor).backward();
}

void Learner::set_oom_policy(const OomPolicy& p) {
  if (p.budget < 0) throw_usage_error("memory budget must be >= 0 (0 = none), got " + std::to_string(p.budget));
  if (p.max_retries < 1)
    throw_usage_error("oom retries must be >= 1, got " + std::to_string(p.max_retries));
  oom_ = p;
}

void Learner::reset_batch_state() {
  x_ = torch::Tensor();
  y_ = torch::Tensor();
  pred_ = torch::Tensor();
  loss_ = torch::Tensor();
  loss_scale_ = 1.0;
  micro_index_ = 0;
  micro_count_ = 1;
  micro_weight_ = 1.0;
  batch_weight_ = 1.0;
  skip_step_ = false;
  skip_batch_ = false;
}

// ---------------------------------------------------------------- measurements

int64_t Learner::data_bytes() const {
  return dataset_bytes(live().train_.dataset()) + (valid_ ? dataset_bytes(valid_->dataset()) : 0);
}

double Learner::epoch_loss() const {
  if (loss_count_ == 0) return 0;
  return static_cast<double>(loss_sum_) / static_cast<double>(loss_count_);
}

nlohmann::json Learner::report() const {
  nlohmann::json out = stats_.report(warmup_batches_, iteration_, steps_, valid_accuracy());
  out["task"] = task_.name();
  // What each stage fed the model: its sequence length (text) shows the warm-up's effect.
  const Dataset& d = train_.dataset();
  for (size_t i = 0; d.is_text() && i < out["stages"].size() && i < stages_.size(); ++i)
    out["stages"][i]["seq_len"] = stages_[i].seq_len > 0 ? stages_[i].seq_len : d.block_size;
  if (valid_sums_.count > 0) out.update(task_.to_json(valid_sums_));
  if (oom_.budget > 0 || oom_.retry || oom_.auto_micro_batch || micro_.oom_count() > 0)
    out["oom"] = micro_.report(oom_);
  return out;
}

// ---------------------------------------------------------------- inference

torch::Tensor Learner::predict(const torch::Tensor& x) {
  live();
  const bool was_training = model_->is_training();
  model_->eval();
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = forward(x.to(device_));
  }
  if (was_training) model_->train();
  return out;
}

torch::Tensor Learner::predict(const DataLoader& data) {
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i < data.num_batches(); ++i)
    if (data.rows(i) > 0) outs.push_back(predict(data.batch(i).x));  // a shard's empty last batch
  return outs.empty() ? torch::Tensor() : torch::cat(outs);
}

// ---------------------------------------------------------------- model management

void Learner::freeze(const std::vector<std::string>& prefixes) {
  for (auto& np : live().model_->named_parameters()) {
    for (const auto& prefix : prefixes) {
      if (np.key().rfind(prefix, 0) == 0) {
        if (np.value().requires_grad()) frozen_by_freeze_.insert(np.value().unsafeGetTensorImpl());
        np.value().set_requires_grad(false);
        np.value().mutable_grad().reset();
        break;
      }
    }
  }
}

void Learner::unfreeze() {
  // Only what freeze() froze: a parameter a callback keeps frozen (lora's base weights) stays.
  for (auto& p : live().model_->parameters())
    if (frozen_by_freeze_.count(p.unsafeGetTensorImpl())) p.set_requires_grad(true);
  frozen_by_freeze_.clear();
}

void check_freeze_prefixes(const torch::nn::Module& model, const std::vector<StageOptions>& stages) {
  std::vector<std::string> names;
  for (const auto& np : model.named_parameters()) names.push_back(np.key());
  for (const auto& s : stages) {
    for (const auto& prefix : s.freeze) {
      if (std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(prefix, 0) == 0; }))
        continue;
      std::vector<std::string> blocks;
      for (const auto& child : model.named_children()) blocks.push_back(child.key());
      std::string list;
      for (const auto& b : blocks) list += (list.empty() ? "" : ", ") + b;
      const std::string near = nearest(prefix, blocks);
      throw_config_error("stage '" + s.name + "': freeze prefix '" + prefix + "' matches no parameter" +
                         (near.empty() ? "" : "; did you mean '" + near + "'?") +
                         " The model's blocks: " + list);
    }
    // A stage that freezes everything has nothing to train: its first backward would fail in
    // LibTorch ("element 0 of tensors does not require grad").
    const bool all = !names.empty() && std::all_of(names.begin(), names.end(), [&](const std::string& n) {
      return std::any_of(s.freeze.begin(), s.freeze.end(),
                         [&](const std::string& p) { return n.rfind(p, 0) == 0; });
    });
    if (all && s.epochs > 0)
      throw_config_error("stage '" + s.name + "': freeze = [...] freezes every parameter of the "
                         "model, so the stage would train nothing; leave at least one block "
                         "unfrozen, or set the stage's epochs = 0");
  }
}

std::vector<std::string> Learner::frozen() const {
  std::vector<std::string> out;
  for (const auto& np : live().model_->named_parameters())
    if (!np.value().requires_grad()) out.push_back(np.key());
  return out;
}

// ---------------------------------------------------------------- releasing memory

void Learner::release_caches() {
  for (const auto& c : callbacks_) call_guarded(*c, "release_caches", [&] { c->release_caches(*this); });
  memory().empty_cache();
}

int64_t Learner::purge(bool clear_opt) {
  live();
  const int64_t before = memory().current();
  reset_batch_state();
  loss_sum_ = 0;
  loss_count_ = 0;
  zero_grad();
  if (clear_opt) optimizer_->state().clear();
  release_caches();
  return before - memory().current();
}

void Learner::destroy() {
  if (destroyed_) return;
  release_caches();  // while the callbacks that hold caches live
  callbacks_.clear();
  forward_wrappers_.clear();
  reset_batch_state();
  loss_sum_ = 0;
  optimizer_.reset();
  model_ = torch::nn::Sequential(nullptr);
  train_.clear();
  valid_.reset();
  stages_.clear();
  stage_window_.close();
  phase_window_.close();
  destroyed_ = true;
  memory().empty_cache();  // what the model and the optimizer held
}

}  // namespace frugal
