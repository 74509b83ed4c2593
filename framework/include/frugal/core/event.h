#pragma once
/// The events of the training loop, in before/after pairs. Where each one fires:
///
///   before_fit
///     for stage in stages:          # epochs with one setup: frozen groups, image size, optimizer
///       before_stage
///       for epoch in stage.epochs:
///         before_epoch
///         before_train
///         for batch in train_data:
///           before_batch
///           before_forward  -> pred = forward(x)     (callbacks may wrap forward)
///           after_forward
///           loss = loss_fn(pred, y)
///           after_loss
///           before_backward -> (loss * loss_scale).backward()
///           after_backward
///           before_step     -> optimizer.step(); optimizer.zero_grad()   (unless skip_step)
///           after_step                                                   (only if stepped)
///           after_batch                    (always, also when the batch was skipped)
///         after_train
///         before_validate -> accuracy over valid_data -> after_validate
///         after_epoch
///       after_stage
///   after_fit
///
/// before_* events run callbacks in ascending order(), after_* in descending order, so a
/// callback can undo in after_X what it did in before_X (Composer's FILO pass). Every
/// before_X that fired gets its after_X, also when a flag stops the loop early.
#include <array>
#include <string_view>

namespace frugal {

enum class Event {
  BeforeFit,
  BeforeStage,
  BeforeEpoch,
  BeforeTrain,
  BeforeBatch,
  BeforeForward,
  AfterForward,
  AfterLoss,
  BeforeBackward,
  AfterBackward,
  BeforeStep,
  AfterStep,
  AfterBatch,
  AfterTrain,
  BeforeValidate,
  AfterValidate,
  AfterEpoch,
  AfterStage,
  AfterFit,
};

inline constexpr std::array<Event, 19> kAllEvents = {
    Event::BeforeFit,     Event::BeforeStage,    Event::BeforeEpoch,   Event::BeforeTrain,
    Event::BeforeBatch,   Event::BeforeForward,  Event::AfterForward,  Event::AfterLoss,
    Event::BeforeBackward, Event::AfterBackward, Event::BeforeStep,    Event::AfterStep,
    Event::AfterBatch,    Event::AfterTrain,     Event::BeforeValidate, Event::AfterValidate,
    Event::AfterEpoch,    Event::AfterStage,     Event::AfterFit};

constexpr std::string_view to_string(Event e) {
  switch (e) {
    case Event::BeforeFit: return "before_fit";
    case Event::BeforeStage: return "before_stage";
    case Event::BeforeEpoch: return "before_epoch";
    case Event::BeforeTrain: return "before_train";
    case Event::BeforeBatch: return "before_batch";
    case Event::BeforeForward: return "before_forward";
    case Event::AfterForward: return "after_forward";
    case Event::AfterLoss: return "after_loss";
    case Event::BeforeBackward: return "before_backward";
    case Event::AfterBackward: return "after_backward";
    case Event::BeforeStep: return "before_step";
    case Event::AfterStep: return "after_step";
    case Event::AfterBatch: return "after_batch";
    case Event::AfterTrain: return "after_train";
    case Event::BeforeValidate: return "before_validate";
    case Event::AfterValidate: return "after_validate";
    case Event::AfterEpoch: return "after_epoch";
    case Event::AfterStage: return "after_stage";
    case Event::AfterFit: return "after_fit";
  }
  return "unknown";
}

/// after_* events run callbacks in reverse order.
constexpr bool is_after(Event e) { return to_string(e).substr(0, 6) == "after_"; }

}  // namespace frugal
