// optim_swap: replaces the optimizer once during a fit, freeing the old one's state.
#include "optim_swap.h"

#include <algorithm>

#include <frugal/base/compat.h>
#include <frugal/base/error.h>
#include <frugal/memory/memory.h>

namespace frugal::optim_swap {

namespace {

constexpr const char* kWhere = "plugins.optim_swap";

std::string key(const char* k) { return std::string("'") + kWhere + "." + k + "'"; }

}  // namespace

std::vector<std::pair<torch::Tensor, torch::Tensor>> first_moments(
    torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  auto& state = opt.state();
  for (const auto& p : params) {
    auto it = state.find(compat::optimizer_state_key(p));
    if (it == state.end()) continue;
    const auto* s = it->second.get();
    if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s))
      out.emplace_back(p, a->exp_avg());
    else if (const auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s))
      out.emplace_back(p, w->exp_avg());
  }
  return out;
}

int64_t seed_momentum(torch::optim::Optimizer& sgd,
                      const std::vector<std::pair<torch::Tensor, torch::Tensor>>& moments) {
  int64_t n = 0;
  for (const auto& [p, m] : moments) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(m.detach());
    sgd.state()[compat::optimizer_state_key(p)] = std::move(s);
    ++n;
  }
  return n;
}

// ---- the plugin ---------------------------------------------------------------------------

OptimSwapOptions::OptimSwapOptions() {
  to.name = "sgd";
  to.lr = 0.01;
}

void OptimSwapOptions::visit(frugal::FieldVisitor& v) {
  v.field("at_stage", at_stage,
          "swap when this stage starts (after its own freeze, image size and optimizer are "
          "set); one of at_stage, at_epoch, when_bytes_over must be set");
  v.field("at_epoch", at_epoch,
          "swap after this many epochs of the fit (counted across stages); 0 = off",
          frugal::at_least(0));
  v.field("when_bytes_over", when_bytes_over,
          "swap before the next batch once live memory has passed this size (\"512MiB\"); "
          "\"\" = off");
  v.table("to", to,
          "the new optimizer, keys as in [optimizer]; default name = \"sgd\", lr = 0.01, the "
          "other keys [optimizer]'s defaults");
  v.field("seed_momentum", seed_momentum,
          "Adam/AdamW -> SGD with momentum: start each momentum buffer from Adam's first "
          "moment (exp_avg) instead of the first gradient");
}

void OptimSwapOptions::check() const {
  std::vector<std::string> set;
  if (!at_stage.empty()) set.push_back(key("at_stage"));
  if (at_epoch > 0) set.push_back(key("at_epoch"));
  if (when_bytes_over.bytes > 0) set.push_back(key("when_bytes_over"));
  if (set.size() != 1) {
    std::string got;
    for (const auto& s : set) got += (got.empty() ? "" : " and ") + s;
    frugal::throw_config_error(
        "optim_swap needs exactly one trigger: " + key("at_stage") + " (a stage name), " +
        key("at_epoch") + " (epochs >= 1) or " + key("when_bytes_over") + " (a size); " +
        (set.empty() ? "none is set" : got + " are set"));
  }
  const double momentum = to.name == "sgd" ? to.get<double>("momentum") : 0.0;
  if (seed_momentum && (to.name != "sgd" || momentum <= 0))
    frugal::throw_config_error(
        key("seed_momentum") + " seeds SGD's momentum buffers, so it needs " + key("to.name") +
        " = \"sgd\" and " + key("to.momentum") + " > 0; got name = \"" + to.name +
        "\", momentum = " + std::to_string(momentum));
}

OptimSwap::OptimSwap(const OptimSwapOptions& o, const frugal::PluginContext& ctx)
    : o_(o), log_(ctx.logger), threshold_(o.when_bytes_over.bytes) {}

void OptimSwap::before_fit(frugal::Learner& l) {
  seen_peak_ = 0;
  if (o_.at_stage.empty()) return;
  std::vector<std::string> names;
  const frugal::Stage* target = nullptr;
  for (const auto& s : l.stages()) {
    names.push_back(s.name);
    if (s.name == o_.at_stage) target = &s;
  }
  if (!target) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "\"" : ", \"") + n + "\"";
    const std::string near = frugal::nearest(o_.at_stage, names);
    frugal::throw_config_error(key("at_stage") + " = \"" + o_.at_stage +
                               "\" names no stage of this fit" +
                               (near.empty() ? "" : "; did you mean \"" + near + "\"?") +
                               " The stages: " + list);
  }
  if (target->has_optimizer)
    log_->warn("stage '{}' has its own [stages.optimizer] ({}); optim_swap replaces it with "
               "'{}' when the stage starts",
               target->name, target->optimizer.name, o_.to.name);
}

void OptimSwap::before_stage(frugal::Learner& l) {
  if (!swapped_ && !o_.at_stage.empty() && l.stage().name == o_.at_stage)
    swap(l, "stage '" + o_.at_stage + "' starts", true);
}

void OptimSwap::before_epoch(frugal::Learner& l) {
  if (swapped_ || o_.at_epoch <= 0) return;
  if (fit_epoch(l.stages(), l.stage_index(), l.epoch()) >= o_.at_epoch)
    swap(l, std::to_string(o_.at_epoch) + " epochs done", true);
}

void OptimSwap::before_batch(frugal::Learner& l) {
  if (swapped_ || threshold_ <= 0) return;
  const int64_t peak = std::max(seen_peak_, l.stage_peak());
  if (peak > threshold_)
    swap(l, "live memory reached " + frugal::format_bytes(peak) + " (over " +
                frugal::format_bytes(threshold_) + ")",
         true);
}

void OptimSwap::after_batch(frugal::Learner& l) {
  if (!swapped_ && threshold_ > 0) seen_peak_ = std::max(seen_peak_, l.stage_peak());
}

void OptimSwap::save_state(torch::serialize::OutputArchive& out) const {
  out.write("swapped", c10::IValue(swapped_));
  out.write("to.name", c10::IValue(o_.to.name));
}

void OptimSwap::load_state(frugal::Learner& l, torch::serialize::InputArchive& in) {
  c10::IValue v;
  if (!in.try_read("swapped", v) || !v.isBool() || !v.toBool() || swapped_) return;
  swap(l, "resuming a run that had swapped", false);
}

void OptimSwap::swap(frugal::Learner& l, const std::string& why, bool seed) {
  auto& mm = l.memory();
  const int64_t live_before = mm.current();
  const std::string from = l.optimizer_options().name;
  const int64_t state_before = frugal::optimizer_state_bytes(l.optimizer());
  std::vector<std::pair<torch::Tensor, torch::Tensor>> moments;
  if (seed && o_.seed_momentum) {
    moments = first_moments(l.optimizer(), l.model()->parameters());
    if (moments.empty())
      log_->warn("seed_momentum: the '{}' optimizer being replaced has no first moments "
                 "(not Adam/AdamW, or it has not stepped); SGD's buffers start from the "
                 "first gradient", from);
  }
  l.set_optimizer(o_.to);  // frees the old optimizer, then builds the new one
  const int64_t seeded = seed_momentum(l.optimizer(), moments);
  moments.clear();
  swapped_ = true;
  log_->info("{}: optimizer {} -> {} (lr {}); optimizer state {} -> {}, live memory {} lower{}",
             why, from, o_.to.name, o_.to.lr, frugal::format_bytes(state_before),
             frugal::format_bytes(frugal::optimizer_state_bytes(l.optimizer())),
             frugal::format_bytes(live_before - mm.current()),
             seeded ? "; " + std::to_string(seeded) + " momentum buffers start from Adam's "
                                                      "first moment"
                    : std::string());
}

namespace {
frugal::CallbackRelations relations() { return {{"auto_purge"}, {}, false}; }
}  // namespace

frugal::CallbackRelations OptimSwap::relations() const { return optim_swap::relations(); }

}  // namespace frugal::optim_swap

FRUGAL_PLUGIN_EX(frugal::optim_swap::OptimSwap, frugal::optim_swap::OptimSwapOptions, "optim_swap",
                 "replaces the optimizer at a stage, an epoch or a memory threshold (e.g. "
                 "Adam -> SGD), freeing the old one's state",
                 "1.0.0", &frugal::optim_swap::relations, nullptr)
