// grad_accum: a batch as several micro-batches, or several batches per optimizer step.
#include "grad_accum.h"

#include <algorithm>
#include <stdexcept>

namespace frugal::grad_accum {

int64_t batch_samples(int64_t i, int64_t batch_size, int64_t dataset_size) {
  return std::max<int64_t>(0, std::min(batch_size, dataset_size - i * batch_size));
}

Group group_of(int64_t index, int64_t steps, int64_t num_batches, int64_t batch_size,
               int64_t dataset_size) {
  if (steps < 1 || batch_size < 1 || index < 0 || index >= num_batches)
    throw std::invalid_argument("grad_accum::group_of: batch " + std::to_string(index) + " of " +
                                std::to_string(num_batches) + ", steps " + std::to_string(steps) +
                                ", batch size " + std::to_string(batch_size));
  Group g;
  g.first = index / steps * steps;
  g.last = std::min(g.first + steps, num_batches) - 1;
  for (int64_t i = g.first; i <= g.last; ++i) g.samples += batch_samples(i, batch_size, dataset_size);
  g.batch_samples = batch_samples(index, batch_size, dataset_size);
  g.closes = index == g.last;
  g.partial = g.last - g.first + 1 < steps;
  return g;
}

int64_t split_size(int64_t batch_size, int64_t steps) {
  if (steps < 1) throw std::invalid_argument("grad_accum::split_size: steps must be >= 1");
  return (batch_size + steps - 1) / steps;
}

// ---- the plugin ---------------------------------------------------------------------------

void GradAccumOptions::visit(frugal::FieldVisitor& v) {
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

GradAccum::GradAccum(const GradAccumOptions& o, const frugal::PluginContext& ctx)
    : o_(o), split_(o.mode == "split"), log_(ctx.logger) {}

void GradAccum::before_fit(frugal::Learner& l) {
  saved_micro_ = l.micro_batch_size();
  steps_before_ = l.steps();
  dropped_ = 0;
  if (split_) apply_split(l);
}

void GradAccum::before_stage(frugal::Learner& l) {
  if (split_) apply_split(l);
}

void GradAccum::before_train(frugal::Learner& l) {
  if (!split_ && o_.steps > 1) l.zero_grad();
}

void GradAccum::before_batch(frugal::Learner& l) {
  if (split_ || o_.steps == 1) return;
  const auto& data = l.train_data();
  group_ = group_of(l.batch_index(), o_.steps, l.num_batches(), data.batch_size(),
                    data.dataset().size());
  l.set_batch_weight(group_.weight());
  if (!group_.closes || (group_.partial && !o_.step_last_partial)) l.skip_step();
}

void GradAccum::before_step(frugal::Learner& l) {
  if (split_ || o_.steps == 1) return;
  if (group_.closes && group_.partial && !o_.step_last_partial) {
    l.zero_grad();
    ++dropped_;
  }
}

void GradAccum::save_state(torch::serialize::OutputArchive& a) const {
  a.write("steps_before", c10::IValue(steps_before_));
  a.write("dropped", c10::IValue(dropped_));
}

void GradAccum::load_state(frugal::Learner&, torch::serialize::InputArchive& a) {
  c10::IValue v;
  if (a.try_read("steps_before", v) && v.isInt()) steps_before_ = v.toInt();
  if (a.try_read("dropped", v) && v.isInt()) dropped_ = v.toInt();
}

void GradAccum::after_fit(frugal::Learner& l) {
  if (split_) {
    l.set_micro_batch_size(saved_micro_);
    log_->info("ran each batch as {} micro-batches of at most {} samples", o_.steps, micro_);
  } else {
    log_->info("{} optimizer steps over groups of {} batches ({} partial groups dropped)",
               l.steps() - steps_before_, o_.steps, dropped_);
  }
}

void GradAccum::apply_split(frugal::Learner& l) {
  micro_ = split_size(l.train_data().batch_size(), o_.steps);
  l.set_micro_batch_size(micro_);
}

namespace {
frugal::CallbackRelations relations() { return {{"amp"}, {}, false}; }
}  // namespace

frugal::CallbackRelations GradAccum::relations() const { return grad_accum::relations(); }

}  // namespace frugal::grad_accum

FRUGAL_PLUGIN_EX(frugal::grad_accum::GradAccum, frugal::grad_accum::GradAccumOptions, "grad_accum",
                 "gradient accumulation: a batch as several micro-batches, or several batches "
                 "per optimizer step",
                 "1.0.0", &frugal::grad_accum::relations, nullptr)
