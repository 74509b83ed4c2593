#pragma once
// chunked_loss: a language model's cross-entropy computed in row chunks from the hidden states
// and the output layer's weight (frugal::LmHead): the N x V logits never exist whole in training.
#include <cstdint>
#include <string>

#include <frugal/core/learner.h>
#include <frugal/models/lm_head.h>
#include <frugal/plugin.h>

namespace frugal::chunked_loss {

struct ChunkedLossOptions : frugal::Options {
  int64_t chunk = 1024;  ///< rows (tokens) per chunk: chunk x vocabulary logits at once
  void visit(frugal::FieldVisitor& v) override;
};

class ChunkedLoss : public frugal::Callback {
 public:
  ChunkedLoss(const ChunkedLossOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "chunked_loss"; }

  /// Finds the model's output layer (its last module, an LmHead) and wraps the Learner's loss; a
  /// model without one gets a warning that nothing changes.
  void before_fit(frugal::Learner& l) override;
  bool wraps_forward() const override { return true; }
  /// Arms the head around the Learner's forward (the micro-batch probe's too): in training with
  /// gradients it keeps its input instead of the logits. Disarmed after it, so a checkpoint's
  /// recompute in backward gets logits; validation (eval, no gradients) gets them anyway.
  torch::Tensor wrap_forward(frugal::Learner& l, const torch::Tensor& x, const frugal::ForwardNext& next) override;
  /// Drops an input a skipped batch left.
  void after_batch(frugal::Learner& l) override;
  /// The Learner's loss and the head's plain forward back.
  void after_fit(frugal::Learner& l) override;

  /// Batches whose loss was computed in chunks (for tests and tools).
  int64_t fused_batches() const { return fused_; }

 private:
  torch::Tensor loss(const torch::Tensor& pred, const torch::Tensor& y);
  void check_against(const torch::Tensor& h_all, const torch::Tensor& y_all, const torch::Tensor& pred);

  ChunkedLossOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  frugal::LmHead head_{nullptr};
  frugal::LossFn previous_;
  bool checked_ = false;
  int64_t fused_ = 0;
};

}  // namespace frugal::chunked_loss
