// chunked_loss: cross-entropy from the hidden states in row chunks (frugal::LmHead).
#include "chunked_loss.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <frugal/base/compat.h>
#include <frugal/base/error.h>

namespace frugal::chunked_loss {

void ChunkedLossOptions::visit(frugal::FieldVisitor& v) {
  v.field("chunk", chunk, "rows (tokens) per chunk: the logits alive at once are chunk x vocabulary",
          frugal::at_least(1));
}

ChunkedLoss::ChunkedLoss(const ChunkedLossOptions& o, const frugal::PluginContext& ctx) : o_(o), log_(ctx.logger) {}

void ChunkedLoss::before_fit(frugal::Learner& l) {
  auto& model = l.model();
  head_ = model->size() > 0 ? frugal::LmHead(std::dynamic_pointer_cast<frugal::LmHeadImpl>(model->ptr(model->size() - 1)))
                            : frugal::LmHead(nullptr);
  if (!head_) {
    log_->warn("nothing to do: the model's last module is not a frugal::LmHead (the gpt's head is); it trains "
               "as without the plugin");
    return;
  }
  previous_ = l.loss_fn();
  l.set_loss_fn([this](const torch::Tensor& pred, const torch::Tensor& y) { return loss(pred, y); });
  checked_ = false;
  fused_ = 0;
  log_->info("the loss is computed from the head's input in chunks of {} tokens x {} logits", o_.chunk,
             head_->weight.size(0));
}

torch::Tensor ChunkedLoss::wrap_forward(frugal::Learner&, const torch::Tensor& x, const frugal::ForwardNext& next) {
  if (!head_) return next(x);
  head_->set_fused(true);
  try {
    torch::Tensor out = next(x);
    head_->set_fused(false);
    return out;
  } catch (...) {
    head_->set_fused(false);
    throw;
  }
}

void ChunkedLoss::after_batch(frugal::Learner&) {
  if (head_) head_->take_input();
}

void ChunkedLoss::after_fit(frugal::Learner& l) {
  if (!head_) return;
  head_->set_fused(false);
  head_->take_input();
  l.set_loss_fn(previous_);
  log_->info("{} batches' losses computed in chunks", fused_);
  head_ = frugal::LmHead(nullptr);
}

torch::Tensor ChunkedLoss::loss(const torch::Tensor& pred, const torch::Tensor& y) {
  const torch::Tensor h = head_->take_input();
  if (!h.defined()) return previous_(pred, y);  // the head computed logits (no gradients, eval, a recompute)
  const auto flat = h.reshape({-1, h.size(-1)});
  const auto targets = y.reshape({-1});
  if (!checked_) check_against(flat, targets, pred);
  ++fused_;
  return frugal::chunked_linear_cross_entropy(flat, head_->weight, targets, o_.chunk);
}

/// On the first batch, the run's own loss on real logits of its first `chunk` tokens (no more
/// logits than a chunk: the check must not make the peak it saves): the plugin computes plain
/// cross-entropy (mean over tokens), so another loss or label smoothing is refused, naming both
/// values, rather than changed silently.
void ChunkedLoss::check_against(const torch::Tensor& h_all, const torch::Tensor& y_all, const torch::Tensor& pred) {
  torch::NoGradGuard g;
  frugal::compat::AutocastOff off(h_all.device().type());
  const int64_t rows = std::min(o_.chunk, h_all.size(0));
  const auto h = h_all.narrow(0, 0, rows), y = y_all.narrow(0, 0, rows);
  const auto logits = torch::matmul(h, head_->weight.to(h.scalar_type()).t());
  // In the prediction's rank ([1, rows, V] for [B, T, V]), as the run's loss receives it.
  std::vector<int64_t> shape(static_cast<size_t>(pred.dim()), 1), target(static_cast<size_t>(pred.dim() - 1), 1);
  shape[shape.size() - 2] = rows;
  shape.back() = logits.size(1);
  target.back() = rows;
  const double ref = previous_(logits.view(shape), y.view(target)).item<double>();
  const double mine = frugal::chunked_linear_cross_entropy(h, head_->weight, y, o_.chunk).item<double>();
  if (std::abs(ref - mine) > 1e-4 * std::max(1.0, std::abs(ref)))
    frugal::throw_config_error("plugins.chunked_loss computes plain cross-entropy (mean over tokens), but the run's "
                               "loss gives " + std::to_string(ref) + " on the first batch where it gives " +
                               std::to_string(mine) + " (label smoothing or another [loss]): disable one of them");
  checked_ = true;
}

}  // namespace frugal::chunked_loss

FRUGAL_PLUGIN(frugal::chunked_loss::ChunkedLoss, frugal::chunked_loss::ChunkedLossOptions, "chunked_loss",
              "a language model's cross-entropy in row chunks from the hidden states: no N x vocabulary logits",
              "1.0.0")
