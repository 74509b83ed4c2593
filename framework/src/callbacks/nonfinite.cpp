// The non-finite check: a diverged step fails (or is skipped) before it reaches the parameters.
#include "frugal/callbacks/nonfinite.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "frugal/base/error.h"
#include "frugal/core/learner.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/optim/fused.h"

namespace frugal {

std::optional<std::string> first_nonfinite_gradient(const torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  // One pass over the gradients' bits (fused.h: no operation dispatched, the intra-op threads
  // sharing it): the optimizer's step reads them next, from the cache. Names only when needed.
  std::vector<torch::Tensor> grads;
  for (const auto& p : m.parameters()) grads.push_back(p.grad());
  if (all_finite(grads)) return std::nullopt;
  for (const auto& p : m.named_parameters()) {  // rare: find which one
    const torch::Tensor& g = p.value().grad();
    if (g.defined() && !torch::isfinite(g).all().item<bool>()) return p.key();
  }
  return std::nullopt;
}

namespace {

// Whether `b` can take copies of `a` (same count, each the same shape, type and device).
bool same_layout(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && (a[i].sizes() != b[i].sizes() || a[i].dtype() != b[i].dtype() ||
                           a[i].device() != b[i].device()))
      return false;
  }
  return true;
}

// Learner::zero_grad sets gradients to none: none defined = no step under way.
bool has_pending_gradient(const torch::nn::Module& m) {
  for (const auto& p : m.parameters())
    if (p.grad().defined()) return true;
  return false;
}

}  // namespace

nlohmann::json NonFiniteEvent::to_json() const {
  // JSON has no NaN or infinity: a non-finite loss is written as its text ("nan", "inf").
  const nlohmann::json l = std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json(std::to_string(loss));
  return {{"what", what},   {"parameter", parameter},   {"loss", l},         {"stage", stage},
          {"stage_name", stage_name}, {"epoch", epoch}, {"batch", batch}, {"iteration", iteration},
          {"steps", steps}, {"step_ran", step_ran}};
}

std::string NonFiniteEvent::describe() const {
  std::ostringstream os;
  os << "non-finite " << what;
  if (what == "loss") os << " (" << loss << ")";
  os << " in stage '" << stage_name << "' (" << stage + 1 << "), epoch " << epoch + 1 << ", batch "
     << batch + 1 << " (iteration " << iteration + 1 << ", after " << steps << " optimizer steps)";
  if (!parameter.empty())
    os << "; first non-finite gradient: " << parameter;
  else if (what == "loss or gradient")
    os << " on another rank";
  if (step_ran) os << " (found by the optimizer's step, whose update stays in memory: nothing was written after it)";
  return os.str();
}

NonFiniteCheck::Mode NonFiniteCheck::parse_mode(const std::string& s) {
  if (s == "fail") return Mode::Fail;
  if (s == "skip") return Mode::Skip;
  throw ConfigError("run.on_nonfinite = \"" + s + "\": allowed are \"fail\" (stop the run with an "
                    "error) and \"skip\" (skip the step and count it)");
}

void NonFiniteCheck::before_fit(Learner& l) {
  skipped_ = 0;
  last_.reset();
  dp_ = find_data_parallel(l);
  if (dp_) loss_slot_ = dp_->flag_slot();
  snapshot_due_ = true;  // a fit (and a resumed one: checkpoints hold no gradients) starts a step
}

void NonFiniteCheck::before_backward(Learner& l) {
  if (!dp_) return;
  if (l.micro_index() == 0) loss_bad_ = false;
  loss_bad_ = loss_bad_ || (l.loss().defined() && !std::isfinite(l.loss().item<double>()));
  dp_->set_flag(loss_slot_, loss_bad_);
}

// The step's first forward: later ones (micro-batches, the batches of an accumulation group, a
// retry after running out of memory) belong to the same step and keep the first one's copy.
void NonFiniteCheck::before_forward(Learner& l) {
  if (mode_ != Mode::Skip || !snapshot_due_) return;
  snapshot_buffers(l);
  snapshot_due_ = false;
}

// The next forward starts a step when no gradient is pending: this batch stepped, or its step
// was skipped and the gradients dropped. An accumulation group's inner batch keeps them.
void NonFiniteCheck::after_batch(Learner& l) {
  withdraw_request(l);
  if (mode_ == Mode::Skip) snapshot_due_ = !has_pending_gradient(*l.model());
}

// Scan::InStep in Mode::Fail: the optimizer, when it can check the gradients its step reads and
// it steps them all (zero's shard optimizers step a part on each rank: a verdict there would
// need every rank's).
// Clipping (GradClip, after this check) would change what the step sees: by value it clamps an
// inf into range, by norm a NaN norm spreads to every gradient (the first parameter would be
// named, not the culprit): the scan before the step then. Data parallel: each rank's step finds
// the same gradient only when the gradients were reduced in this batch; otherwise the ranks'
// verdicts must be agreed before the step (Collective::any below).
GradientVerdict* NonFiniteCheck::riding_verdict(Learner& l) const {
  if (mode_ != Mode::Fail || scan_ != Scan::InStep || l.per_rank_optimizer_state() ||
      l.optimizer_options().clip_grad_value > 0 || l.optimizer_options().clip_grad_norm > 0)
    return nullptr;
  if (l.collective().distributed() && !(dp_ && dp_->synced_this_batch())) return nullptr;
  return dynamic_cast<GradientVerdict*>(&l.optimizer());
}

NonFiniteEvent NonFiniteCheck::event_at(const Learner& l) const {
  NonFiniteEvent e;
  e.stage = l.stage_index();
  e.stage_name = l.stage().name;
  e.epoch = l.epoch();
  e.batch = l.batch_index();
  e.iteration = l.iteration();
  e.steps = l.steps();
  return e;
}

void NonFiniteCheck::before_step(Learner& l) {
  verdict_due_ = -1;
  if (l.batch_skipped()) return;
  // A step another callback skipped (amp's scaler after an overflow, grad_accum inside a group)
  // keeps its gradients to itself: amp finds its scale through inf gradients. Its loss is
  // checked all the same: the loss is taken before any scaling, so an inf or NaN there (a
  // forward that overflowed) is never the scaler's to fix.
  const bool skipped_by_another = l.step_skipped();
  GradientVerdict* rides = skipped_by_another ? nullptr : riding_verdict(l);
  NonFiniteEvent e = event_at(l);
  e.loss = l.loss().defined() ? l.loss().item<double>() : 0.0;
  if (!skipped_by_another && !rides)
    if (auto p = first_nonfinite_gradient(*l.model())) e.parameter = *p;
  const bool bad_here = !std::isfinite(e.loss) || !e.parameter.empty();
  // Data parallel: the gradients are the same on every rank (all-reduced), the losses are not:
  // whether any rank's was non-finite came with the gradients, or is asked here.
  const bool bad_anywhere = dp_ && dp_->synced_this_batch()
                                ? !e.parameter.empty() || dp_->any_flag(loss_slot_)
                                : l.collective().any(bad_here);
  if (!bad_anywhere) {
    if (rides) {  // the gradients' verdict comes with the step
      rides->check_next_step();
      verdict_due_ = rides->checked_steps() + 1;
      step_loss_ = e.loss;
    }
    return;
  }
  e.what = !bad_here ? "loss or gradient" : std::isfinite(e.loss) ? "gradient" : "loss";
  last_ = e;
  if (mode_ == Mode::Fail) throw Error(e.describe());
  // A non-finite loss is left out of the epoch's loss, the progress line and the history.
  if (!std::isfinite(e.loss)) l.loss() = torch::Tensor();
  // The step's forwards updated the buffers from a non-finite batch: back to before them (also
  // when another callback skipped the step: amp's scaler drops a NaN batch's gradients, not
  // what its forward did to BatchNorm's statistics).
  restore_buffers(l);
  if (skipped_by_another) return;
  ++skipped_;
  l.skip_step();
  l.zero_grad();
}

// The gradient found after the scan's place (in the step, or when the optimizer changed):
// the fit fails as the scan before the step would have made it.
void NonFiniteCheck::fail_at_gradient(const Learner& l, std::string parameter, int64_t steps, bool ran) {
  NonFiniteEvent e = event_at(l);
  e.what = "gradient";
  e.loss = step_loss_;
  e.parameter = std::move(parameter);
  e.steps = steps;
  e.step_ran = ran;
  last_ = e;
  throw Error(e.describe());
}

// Every rank of a data-parallel run reads the same reduced gradients: each finds the same one.
void NonFiniteCheck::after_step(Learner& l) {
  if (verdict_due_ < 0) return;
  const int64_t due = std::exchange(verdict_due_, -1);
  const auto* v = dynamic_cast<const GradientVerdict*>(&l.optimizer());
  if (!v || v->checked_steps() != due)
    throw Error("the non-finite check asked the optimizer's step for its gradients' verdict and "
                "got none (the optimizer changed after the check): this step's gradients were "
                "not checked");
  if (!v->first_nonfinite().defined()) return;
  std::string name;
  const c10::TensorImpl* bad = v->first_nonfinite().unsafeGetTensorImpl();
  for (const auto& p : l.model()->named_parameters())
    if (p.value().unsafeGetTensorImpl() == bad) name = p.key();
  // steps: those before this one, as the scan before the step says
  fail_at_gradient(l, name, l.steps() - 1, v->nonfinite_step_ran());
}

// A callback's before_step after this one replaced the optimizer: the verdict asked of the old
// one will not come. The gradients are still there: scanned now, as before any step.
void NonFiniteCheck::optimizer_replaced(Learner& l) {
  if (verdict_due_ < 0) return;
  verdict_due_ = -1;
  if (auto p = first_nonfinite_gradient(*l.model())) fail_at_gradient(l, *p, l.steps(), false);
}

// A request the step did not use (a later before_step hook threw, or skipped it) is withdrawn:
// the next step is asked afresh. Nothing to do, and no lookup, in the common batch.
void NonFiniteCheck::withdraw_request(Learner& l) {
  if (verdict_due_ < 0) return;
  verdict_due_ = -1;
  if (auto* v = dynamic_cast<GradientVerdict*>(&l.optimizer())) v->cancel_check();
}

void NonFiniteCheck::release_caches(Learner& l) { withdraw_request(l); }

void NonFiniteCheck::snapshot_buffers(Learner& l) {
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> now = l.model()->buffers();
  if (!same_layout(now, buffers_)) {  // the first step, or a stage rewrote the model
    buffers_.clear();
    for (const auto& b : now) buffers_.push_back(b.defined() ? b.detach().clone() : torch::Tensor());
    return;
  }
  for (size_t i = 0; i < now.size(); ++i)
    if (now[i].defined()) buffers_[i].copy_(now[i]);
}

void NonFiniteCheck::restore_buffers(Learner& l) const {
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> now = l.model()->buffers();
  if (!same_layout(now, buffers_)) return;  // no copy of this model's buffers
  for (size_t i = 0; i < now.size(); ++i)
    if (now[i].defined()) now[i].copy_(buffers_[i]);
}

int64_t NonFiniteCheck::held_bytes() const {
  int64_t n = 0;
  for (const auto& b : buffers_)
    if (b.defined()) n += static_cast<int64_t>(b.nbytes());
  return n;
}

nlohmann::json NonFiniteCheck::record() const {
  nlohmann::json j = {{"mode", mode_ == Mode::Fail ? "fail" : "skip"}, {"skipped_steps", skipped_}};
  if (last_) j["event"] = last_->to_json();
  return j;
}

// Nothing while nothing was skipped: a checkpoint then loads into a Learner without this check.
void NonFiniteCheck::save_state(torch::serialize::OutputArchive& a) const {
  if (skipped_ > 0) a.write("skipped", c10::IValue(skipped_));
}

void NonFiniteCheck::load_state(Learner&, torch::serialize::InputArchive& a) {
  c10::IValue v;
  if (a.try_read("skipped", v) && v.isInt()) skipped_ = v.toInt();
}

}  // namespace frugal
