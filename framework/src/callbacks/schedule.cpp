// Learning-rate schedules: the formulas (pure functions of a batch's place in its stage), the
// optimizer levers they use, and the callback that applies them before each batch.
#include "frugal/callbacks/schedule.h"

#include <cmath>

#include <spdlog/spdlog.h>

#include "frugal/base/error.h"
#include "frugal/config/own_keys.h"
#include "frugal/core/learner.h"

namespace frugal {

namespace {
constexpr double kPi = 3.14159265358979323846;

/// fastai's SchedCos: from a to b along half a cosine, q in [0, 1].
double cos_ramp(double a, double b, double q) { return a + (b - a) * (1.0 - std::cos(kPi * q)) / 2.0; }

/// fastai's combined_cos(pct, start, middle, end) at position p in [0, 1).
double combined_cos(double pct, double start, double middle, double end, double p) {
  if (p < pct) return cos_ramp(start, middle, p / pct);
  return cos_ramp(middle, end, (p - pct) / (1.0 - pct));
}

double warmup_factor(int64_t warmup, int64_t i) {
  return i < warmup ? static_cast<double>(i + 1) / static_cast<double>(warmup) : 1.0;
}
}  // namespace

void ScheduleOptions::visit(FieldVisitor& v) {
  v.field("name", name,
          "learning-rate schedule over the stage's batches; the peak is the optimizer's lr",
          {"constant", "linear_warmup", "cosine", "one_cycle", "step"});
  v.field("warmup_steps", warmup_steps,
          "linear_warmup, cosine: batches over which lr rises linearly to the optimizer's lr",
          at_least(0));
  v.field("min_lr", min_lr, "cosine: the learning rate the cosine ends at", at_least(0));
  v.field("pct_start", pct_start, "one_cycle: share of the stage's batches spent rising",
          Limits{0, 1, true, true});
  v.field("div", div, "one_cycle: the cycle starts at lr / div", at_least(1));
  v.field("div_final", div_final, "one_cycle: the cycle ends at lr / div_final", at_least(1));
  v.field("cycle_momentum", cycle_momentum,
          "one_cycle: move momentum (Adam's beta1, SGD's momentum) from mom_max to mom_min and "
          "back, against the learning rate");
  v.field("mom_max", mom_max, "one_cycle: momentum at the start and the end", half_open(0, 1));
  v.field("mom_min", mom_min, "one_cycle: momentum at the peak learning rate", half_open(0, 1));
  v.field("step_size", step_size, "step: batches between two decays (required for step)",
          at_least(0));
  v.field("gamma", gamma, "step: the factor each decay multiplies lr by", positive());
  v.field("span", span,
          "the batches the curve runs over: \"stage\" (restarts at each stage) or \"fit\" (every "
          "stage's batches as one curve: set it in [schedule], which stages inherit)",
          {"stage", "fit"});
}

void ScheduleOptions::check() const {
  if (name == "step" && step_size == 0)
    throw_config_error("'step_size' must be set (batches between decays, >= 1) when name = "
                       "\"step\"");
  if (mom_min > mom_max)
    throw_config_error("'mom_min' (" + std::to_string(mom_min) + ") must not exceed 'mom_max' (" +
                       std::to_string(mom_max) + ")");
}

double schedule_lr(const ScheduleOptions& s, double lr, int64_t i, int64_t n) {
  const double p = n > 0 ? static_cast<double>(i) / static_cast<double>(n) : 0.0;
  if (s.name == "linear_warmup") return lr * warmup_factor(s.warmup_steps, i);
  if (s.name == "cosine") {
    if (i < s.warmup_steps) return lr * warmup_factor(s.warmup_steps, i);
    const int64_t span = std::max<int64_t>(1, n - s.warmup_steps);
    const double t = static_cast<double>(i - s.warmup_steps) / static_cast<double>(span);
    return s.min_lr + (lr - s.min_lr) * (1.0 + std::cos(kPi * std::min(1.0, t))) / 2.0;
  }
  if (s.name == "one_cycle") return combined_cos(s.pct_start, lr / s.div, lr, lr / s.div_final, p);
  if (s.name == "step")
    return lr * std::pow(s.gamma, static_cast<double>(i / std::max<int64_t>(1, s.step_size)));
  return lr;
}

std::optional<double> schedule_momentum(const ScheduleOptions& s, int64_t i, int64_t n) {
  if (s.name != "one_cycle" || !s.cycle_momentum) return std::nullopt;
  const double p = n > 0 ? static_cast<double>(i) / static_cast<double>(n) : 0.0;
  return combined_cos(s.pct_start, s.mom_max, s.mom_min, s.mom_max, p);
}

void set_learning_rate(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

double learning_rate(const torch::optim::Optimizer& opt) {
  return opt.param_groups().empty() ? 0.0 : opt.param_groups().front().options().get_lr();
}

bool set_momentum(torch::optim::Optimizer& opt, double momentum) {
  bool set = false;
  for (auto& g : opt.param_groups()) {
    auto& o = g.options();
    if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
      a->betas(std::make_tuple(momentum, std::get<1>(a->betas())));
      set = true;
    } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
      w->betas(std::make_tuple(momentum, std::get<1>(w->betas())));
      set = true;
    } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&o); s && s->momentum() > 0) {
      s->momentum(momentum);
      set = true;
    }
  }
  return set;
}

namespace {
/// The momentum an optimizer's options give it (Adam's beta1, SGD's momentum), if any.
std::optional<double> base_momentum(const OptimizerOptions& o) {
  const OwnKeys own = o.own_keys();
  const toml::table& keys = toml_of(own);
  if (auto b = keys["beta1"].value<double>()) return b;
  return keys["momentum"].value<double>();
}
}  // namespace

// A constant stage after a scheduled one: the optimizer may still carry the last scheduled lr
// (the same optimizer continues when the stage has none of its own). Its options hold the base
// values. Decided from the stages alone, so a resumed fit does the same.
// A stage after a scheduled one starts from its optimizer's own values: a constant stage keeps
// its lr (the others set theirs each batch), and a stage that does not cycle momentum gets the
// optimizer's back (one_cycle's last momentum would otherwise stay).
void ScheduleCallback::before_stage(Learner& l) {
  bool after_scheduled = false;
  for (int64_t i = 0; i < l.stage_index(); ++i)
    after_scheduled = after_scheduled || l.stages()[static_cast<size_t>(i)].schedule.name != "constant";
  if (!after_scheduled) return;
  const ScheduleOptions& s = l.stage().schedule;
  if (s.name == "constant") set_learning_rate(l.optimizer(), l.optimizer_options().lr);
  if (!schedule_momentum(s, 0, 1))
    if (auto m = base_momentum(l.optimizer_options())) set_momentum(l.optimizer(), *m);
}

void ScheduleCallback::before_batch(Learner& l) {
  const ScheduleOptions& s = l.stage().schedule;
  if (s.name == "constant") return;
  // span = "fit": the epochs of every stage, this one's place among them (each epoch counted
  // with this stage's batches: stages that resize images or shorten windows keep the count).
  int64_t epochs = l.stage().epochs, before = 0;
  if (s.span == "fit") {
    epochs = 0;
    for (size_t k = 0; k < l.stages().size(); ++k) {
      epochs += l.stages()[k].epochs;
      if (static_cast<int64_t>(k) < l.stage_index()) before += l.stages()[k].epochs;
    }
  }
  const int64_t n = epochs * l.num_batches();
  const int64_t i = (before + l.epoch()) * l.num_batches() + l.batch_index();
  set_learning_rate(l.optimizer(), schedule_lr(s, l.optimizer_options().lr, i, n));
  if (auto m = schedule_momentum(s, i, n); m && !set_momentum(l.optimizer(), *m) && !warned_momentum_) {
    warned_momentum_ = true;
    spdlog::warn("stage '{}': one_cycle cycles the learning rate only: optimizer '{}' has no "
                 "momentum frugal can set (set cycle_momentum = false to silence this)",
                 l.stage().name, l.optimizer_options().name);
  }
}

}  // namespace frugal
