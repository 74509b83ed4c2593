// grad_clip: clips the global L2 norm of the gradients before each optimizer step
// (torch.nn.utils.clip_grad_norm_). A plugin built out of tree against an installed frugal.
#include <frugal/learner.h>
#include <frugal/plugin.h>

struct GradClipOptions : frugal::Options {
  double max_norm = 1.0;  ///< default 1.0
  void visit(frugal::FieldVisitor& v) override {
    v.field("max_norm", max_norm, "largest L2 norm of all gradients together", frugal::positive());
  }
};

class GradClip : public frugal::Callback {
 public:
  GradClip(const GradClipOptions& o, const frugal::PluginContext& ctx) : o_(o), log_(ctx.logger) {}
  std::string name() const override { return "grad_clip"; }

  /// Runs after backward, before the optimizer steps: gradients are complete (and unscaled
  /// by amp, whose order is lower). Under gradient accumulation most batches do not step.
  void before_step(frugal::Learner& l) override {
    if (l.step_skipped()) return;
    const double norm = torch::nn::utils::clip_grad_norm_(l.model()->parameters(), o_.max_norm);
    const bool clipped = norm > o_.max_norm;
    clipped_ += clipped;
    ++steps_;
    log_->debug("step {}: gradient norm {:.4g}{}", l.steps(), norm, clipped ? " (clipped)" : "");
  }

  void after_fit(frugal::Learner&) override {
    log_->info("clipped {} of {} steps to a gradient norm of {}", clipped_, steps_, o_.max_norm);
  }

 private:
  GradClipOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t clipped_ = 0, steps_ = 0;
};

FRUGAL_PLUGIN(GradClip, GradClipOptions, "grad_clip", "clips the gradient norm before each step",
              "1.0.0")
