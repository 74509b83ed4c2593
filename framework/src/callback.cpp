#include "frugal/callback.h"

#include "frugal/learner.h"

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

}  // namespace frugal
