#pragma once
/// grad_clip: clips the global L2 norm of the gradients before each optimizer step
/// (torch.nn.utils.clip_grad_norm_). A plugin built out of tree against an installed frugal.
#include <frugal/core/learner.h>
#include <frugal/plugin.h>

/// [plugins.grad_clip]: TOML keys are the field names.
struct GradClipOptions : frugal::Options {
  double max_norm = 1.0;  ///< default 1.0
  void visit(frugal::FieldVisitor& v) override;
};

class GradClip : public frugal::Callback {
 public:
  GradClip(const GradClipOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "grad_clip"; }

  /// Runs after backward, before the optimizer steps: gradients are complete (and unscaled
  /// by amp, which unscales in after_backward). Under gradient accumulation most batches do
  /// not step; those are left alone.
  void before_step(frugal::Learner& l) override;
  void after_fit(frugal::Learner&) override;

 private:
  GradClipOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t clipped_ = 0, steps_ = 0;
};
