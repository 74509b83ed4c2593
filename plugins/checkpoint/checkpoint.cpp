// checkpoint: activation checkpointing. The model's blocks run in segments; a checkpointed
// segment keeps only its input during the forward and runs again in backward (checkpoint.h).
#include <cmath>

#include <frugal/learner.h>
#include <frugal/plugin.h>

#include "checkpoint.h"

namespace {

namespace ck = frugal::checkpoint;

struct CheckpointOptions : frugal::Options {
  int64_t segments = 0;              ///< default 0: sqrt(number of blocks), rounded
  std::vector<std::string> modules;  ///< default empty: split by `segments` instead
  bool checkpoint_last = false;      ///< default false: the last of `segments` runs plainly
  void visit(frugal::FieldVisitor& v) override {
    v.field("segments", segments,
            "segments the model's blocks are split into; 0 = sqrt(blocks) rounded",
            frugal::at_least(0));
    v.field("modules", modules,
            "checkpoint exactly these named blocks, each as its own segment (instead of segments)");
    v.field("checkpoint_last", checkpoint_last,
            "with segments: checkpoint the last segment too (false: it runs plainly, as in "
            "torch's checkpoint_sequential: same step peak, higher forward peak, less recompute)");
  }
  void check() const override {
    if (segments > 0 && !modules.empty())
      frugal::throw_config_error(
          "plugins.checkpoint: set either segments (got " + std::to_string(segments) +
          ") or modules (got " + std::to_string(modules.size()) +
          " names), not both: remove one of the two keys");
  }
};

frugal::CallbackRelations checkpoint_relations() { return {{}, {}, true}; }

class Checkpoint : public frugal::Callback {
 public:
  Checkpoint(const CheckpointOptions& o, const frugal::PluginContext& ctx)
      : o_(o), log_(ctx.logger) {}
  std::string name() const override { return "checkpoint"; }
  /// The innermost forward wrapper: it runs the blocks itself instead of calling next(x), so
  /// wrappers that must see the forward (autocast) need a smaller order (the Learner checks).
  int order() const override { return frugal::order::kInnermostForward; }
  bool wraps_forward() const override { return true; }
  frugal::CallbackRelations relations() const override { return checkpoint_relations(); }

  /// Checks the options against the model's blocks.
  void before_fit(frugal::Learner& l) override {
    plan_ = make_plan(l.model());
    std::string desc;
    for (const auto& s : plan_)
      desc += (desc.empty() ? "" : " ") + std::string(s.checkpointed ? "[" : "(") +
              std::to_string(s.begin) + "-" + std::to_string(s.end - 1) +
              (s.checkpointed ? "]" : ")");
    log_->info("{} blocks in segments {} ([ ] checkpointed, ( ) plain)", l.model()->size(), desc);
  }

  /// Training with grad on: the blocks segment by segment; otherwise the plain chain.
  torch::Tensor wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                             const frugal::ForwardNext& next) override {
    if (!l.training() || !torch::GradMode::is_enabled()) return next(x);
    if (plan_.empty() || plan_.back().end != static_cast<int64_t>(l.model()->size()))
      plan_ = make_plan(l.model());
    return ck::checkpointed_forward(l.model(), plan_, x);
  }

 private:
  std::vector<ck::Segment> make_plan(const torch::nn::Sequential& model) const {
    if (!o_.modules.empty()) return ck::plan_by_names(ck::block_names(model), o_.modules);
    return ck::plan_by_count(static_cast<int64_t>(model->size()), o_.segments, o_.checkpoint_last);
  }

  CheckpointOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  std::vector<ck::Segment> plan_;
};

}  // namespace

FRUGAL_PLUGIN_EX(Checkpoint, CheckpointOptions, "checkpoint",
                 "activation checkpointing: recomputes segments of blocks in backward", "1.0.0",
                 &checkpoint_relations, nullptr)
