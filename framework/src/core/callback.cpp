#include "frugal/core/callback.h"

#include "frugal/core/learner.h"

namespace frugal {

Callback::~Callback() = default;

torch::Tensor Callback::wrap_forward(Learner&, const torch::Tensor& x, const ForwardNext& next) {
  return next(x);
}

void Callback::dispatch(Event e, Learner& l) {
  switch (e) {
    case Event::BeforeFit: return before_fit(l);
    case Event::BeforeStage: return before_stage(l);
    case Event::BeforeEpoch: return before_epoch(l);
    case Event::BeforeTrain: return before_train(l);
    case Event::BeforeBatch: return before_batch(l);
    case Event::BeforeForward: return before_forward(l);
    case Event::AfterForward: return after_forward(l);
    case Event::AfterLoss: return after_loss(l);
    case Event::BeforeBackward: return before_backward(l);
    case Event::AfterBackward: return after_backward(l);
    case Event::BeforeStep: return before_step(l);
    case Event::AfterStep: return after_step(l);
    case Event::AfterBatch: return after_batch(l);
    case Event::AfterTrain: return after_train(l);
    case Event::BeforeValidate: return before_validate(l);
    case Event::AfterValidate: return after_validate(l);
    case Event::AfterEpoch: return after_epoch(l);
    case Event::AfterStage: return after_stage(l);
    case Event::AfterFit: return after_fit(l);
  }
}

torch::Tensor ForwardNext::operator()(const torch::Tensor& x) const {
  return learner_->forward_from(index_, x);
}

CallbackFacts facts_of(const Callback& cb) {
  return {cb.name(), cb.order(), cb.wraps_forward(), cb.relations()};
}

namespace {
const CallbackFacts* find(const std::vector<CallbackFacts>& cbs, const std::string& name) {
  for (const auto& c : cbs)
    if (c.name == name) return &c;
  return nullptr;
}

std::string order_violation(const std::vector<CallbackFacts>& cbs) {
  for (const auto& a : cbs)
    for (const auto& name : a.relations.runs_before) {
      const CallbackFacts* b = find(cbs, name);
      if (b && a.order >= b->order)
        return "callback '" + a.name + "' must run before '" + b->name + "', but its order is " +
               std::to_string(a.order) + " and '" + b->name + "' has order " +
               std::to_string(b->order) + ": give '" + a.name + "' a smaller order than '" +
               b->name + "'";
    }
  return "";
}

std::string innermost_violation(const std::vector<CallbackFacts>& cbs) {
  for (const auto& a : cbs) {
    if (!a.relations.innermost_forward) continue;
    for (const auto& b : cbs)
      if (&b != &a && b.wraps_forward && b.order >= a.order)
        return "callback '" + a.name + "' runs the model itself and must be the innermost "
               "forward wrapper (order " + std::to_string(a.order) + "), but '" + b.name +
               "' also wraps the forward with order " + std::to_string(b.order) + ": give '" +
               b.name + "' an order below " + std::to_string(a.order);
  }
  return "";
}
}  // namespace

std::string conflict_violation(const std::vector<CallbackFacts>& cbs) {
  for (const auto& a : cbs)
    for (const auto& name : a.relations.conflicts)
      if (name != a.name && find(cbs, name))
        return "callbacks '" + a.name + "' and '" + name + "' conflict: '" + a.name +
               "' declares that it cannot run together with '" + name +
               "'; turn one off (a plugin: enabled = false)";
  return "";
}

std::string relation_violation(const std::vector<CallbackFacts>& cbs) {
  std::string v = conflict_violation(cbs);
  if (v.empty()) v = order_violation(cbs);
  if (v.empty()) v = innermost_violation(cbs);
  return v;
}

}  // namespace frugal
