// grad_clip: clips the global L2 norm of the gradients before each optimizer step.
#include "grad_clip.h"

void GradClipOptions::visit(frugal::FieldVisitor& v) {
  v.field("max_norm", max_norm, "largest L2 norm of all gradients together", frugal::positive());
}

GradClip::GradClip(const GradClipOptions& o, const frugal::PluginContext& ctx)
    : o_(o), log_(ctx.logger) {}

void GradClip::before_step(frugal::Learner& l) {
  if (l.step_skipped()) return;
  const double norm = torch::nn::utils::clip_grad_norm_(l.model()->parameters(), o_.max_norm);
  const bool clipped = norm > o_.max_norm;
  clipped_ += clipped;
  ++steps_;
  log_->debug("step {}: gradient norm {:.4g}{}", l.steps(), norm, clipped ? " (clipped)" : "");
}

void GradClip::after_fit(frugal::Learner&) {
  log_->info("clipped {} of {} steps to a gradient norm of {}", clipped_, steps_, o_.max_norm);
}

FRUGAL_PLUGIN(GradClip, GradClipOptions, "grad_clip", "clips the gradient norm before each step",
              "1.0.0")
