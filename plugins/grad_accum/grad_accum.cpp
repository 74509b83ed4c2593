// grad_accum: one optimizer step over more samples than one forward pass holds. "split" runs
// each batch as `steps` micro-batches (the core's exact micro-batching: same step, a quarter of
// the activations for steps = 4); "accumulate" sums the gradients of `steps` whole batches into
// one step, each batch's loss weighted by its share of the group's samples.
#include <frugal/learner.h>
#include <frugal/plugin.h>

#include "grad_accum.h"

namespace {

namespace ga = frugal::grad_accum;

struct GradAccumOptions : frugal::Options {
  int64_t steps = 4;               ///< default 4
  std::string mode = "split";      ///< default "split"
  bool step_last_partial = true;   ///< default true
  void visit(frugal::FieldVisitor& v) override {
    v.field("steps", steps,
            "split: micro-batches per batch; accumulate: batches per optimizer step",
            frugal::at_least(1));
    v.field("mode", mode,
            "split = each batch as `steps` micro-batches (same step, less activation memory); "
            "accumulate = `steps` batches per optimizer step (a larger effective batch)",
            {"split", "accumulate"});
    v.field("step_last_partial", step_last_partial,
            "accumulate: step on the epoch's last group even when it has fewer than `steps` "
            "batches (false drops its gradients)");
  }
};

frugal::CallbackRelations grad_accum_relations() { return {{"amp"}, {}, false}; }

class GradAccum : public frugal::Callback {
 public:
  GradAccum(const GradAccumOptions& o, const frugal::PluginContext& ctx)
      : o_(o), split_(o.mode == "split"), log_(ctx.logger) {}
  std::string name() const override { return "grad_accum"; }
  /// Before amp (order::kPrecision), whose loss scaler must see which batches step.
  int order() const override { return frugal::order::kBatchGrouping; }
  frugal::CallbackRelations relations() const override { return grad_accum_relations(); }

  /// split: the micro-batch size for the loader's batch size; remembers the one to restore.
  void before_fit(frugal::Learner& l) override {
    saved_micro_ = l.micro_batch_size();
    steps_before_ = l.steps();
    dropped_ = 0;
    if (split_) apply_split(l);
  }
  /// split: again, in case a stage changed the data.
  void before_stage(frugal::Learner& l) override {
    if (split_) apply_split(l);
  }
  /// accumulate: an epoch always starts a fresh group (drops one a stopped epoch left open).
  void before_train(frugal::Learner& l) override {
    if (!split_ && o_.steps > 1) l.zero_grad();
  }
  /// accumulate: weights the batch by its share of the group's samples; steps only when the
  /// batch closes its group (and the group is whole, or step_last_partial).
  void before_batch(frugal::Learner& l) override {
    if (split_ || o_.steps == 1) return;
    const auto& data = l.train_data();
    group_ = ga::group_of(l.batch_index(), o_.steps, l.num_batches(), data.batch_size(),
                          data.dataset().size());
    l.set_batch_weight(group_.weight());
    if (!group_.closes || (group_.partial && !o_.step_last_partial)) l.skip_step();
  }
  /// accumulate: a dropped last group loses its gradients instead of stepping.
  void before_step(frugal::Learner& l) override {
    if (split_ || o_.steps == 1) return;
    if (group_.closes && group_.partial && !o_.step_last_partial) {
      l.zero_grad();
      ++dropped_;
    }
  }
  /// Checkpoints are taken only between accumulation groups (CheckpointWriter waits until no
  /// gradient is pending) and the group of a batch follows from its index, so the position
  /// suffices; saved here: the counters of the final log line.
  void save_state(torch::serialize::OutputArchive& a) const override {
    a.write("steps_before", c10::IValue(steps_before_));
    a.write("dropped", c10::IValue(dropped_));
  }
  void load_state(frugal::Learner&, torch::serialize::InputArchive& a) override {
    c10::IValue v;
    if (a.try_read("steps_before", v) && v.isInt()) steps_before_ = v.toInt();
    if (a.try_read("dropped", v) && v.isInt()) dropped_ = v.toInt();
  }
  void after_fit(frugal::Learner& l) override {
    if (split_) {
      l.set_micro_batch_size(saved_micro_);
      log_->info("ran each batch as {} micro-batches of at most {} samples", o_.steps, micro_);
    } else {
      log_->info("{} optimizer steps over groups of {} batches ({} partial groups dropped)",
                 l.steps() - steps_before_, o_.steps, dropped_);
    }
  }

 private:
  void apply_split(frugal::Learner& l) {
    micro_ = ga::split_size(l.train_data().batch_size(), o_.steps);
    l.set_micro_batch_size(micro_);
  }

  GradAccumOptions o_;
  bool split_;
  std::shared_ptr<spdlog::logger> log_;
  ga::Group group_;
  int64_t saved_micro_ = 0, micro_ = 0, steps_before_ = 0, dropped_ = 0;
};

}  // namespace

FRUGAL_PLUGIN_EX(GradAccum, GradAccumOptions, "grad_accum",
                 "gradient accumulation: a batch as several micro-batches, or several batches "
                 "per optimizer step",
                 "1.0.0", &grad_accum_relations, nullptr)
