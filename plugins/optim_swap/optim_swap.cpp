// optim_swap: replaces the optimizer once during a fit — at the start of a named stage, after a
// number of epochs, or when live memory has passed a threshold — for example Adam -> SGD, which
// frees Adam's two moments (8 bytes per float32 parameter). SGD's momentum can start from
// Adam's first moment instead of from zero.
#include <frugal/error.h>
#include <frugal/learner.h>
#include <frugal/plugin.h>

#include "optim_swap.h"

namespace {

namespace os = frugal::optim_swap;

constexpr const char* kWhere = "plugins.optim_swap";

std::string key(const char* k) { return std::string("'") + kWhere + "." + k + "'"; }

struct OptimSwapOptions : frugal::Options {
  std::string at_stage;         ///< default "": off
  int64_t at_epoch = 0;         ///< default 0: off
  frugal::ByteSize when_bytes_over;  ///< default 0: off
  frugal::OptimizerOptions to;  ///< default sgd, lr 0.01
  bool seed_momentum = false;   ///< default false

  OptimSwapOptions() {
    to.name = "sgd";
    to.lr = 0.01;
  }
  void visit(frugal::FieldVisitor& v) override {
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
  void check() const override {
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
};

class OptimSwap : public frugal::Callback {
 public:
  OptimSwap(const OptimSwapOptions& o, const frugal::PluginContext& ctx)
      : o_(o), log_(ctx.logger), threshold_(o.when_bytes_over.bytes) {}
  std::string name() const override { return "optim_swap"; }
  /// -20: swaps first in before_* events, so auto_purge (-10) and everything else already see
  /// the new optimizer.
  int order() const override { return -20; }

  /// Checks at_stage against the fit's stages before any work.
  void before_fit(frugal::Learner& l) override {
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
  void before_stage(frugal::Learner& l) override {
    if (!swapped_ && !o_.at_stage.empty() && l.stage().name == o_.at_stage)
      swap(l, "stage '" + o_.at_stage + "' starts", true);
  }
  void before_epoch(frugal::Learner& l) override {
    if (swapped_ || o_.at_epoch <= 0) return;
    if (os::fit_epoch(l.stages(), l.stage_index(), l.epoch()) >= o_.at_epoch)
      swap(l, std::to_string(o_.at_epoch) + " epochs done", true);
  }
  /// The stage's peak so far (the Learner's stage window) also covers the batch that just
  /// ran: a threshold passed in a forward swaps before the next batch.
  void before_batch(frugal::Learner& l) override {
    if (swapped_ || threshold_ <= 0) return;
    const int64_t peak = std::max(seen_peak_, l.memory().window_peak(0));
    if (peak > threshold_)
      swap(l, "live memory reached " + frugal::format_bytes(peak) + " (over " +
                  frugal::format_bytes(threshold_) + ")",
           true);
  }
  /// A stage's last batch may pass the threshold; the next stage reopens the window.
  void after_batch(frugal::Learner& l) override {
    if (!swapped_ && threshold_ > 0) seen_peak_ = std::max(seen_peak_, l.memory().window_peak(0));
  }

  void save_state(torch::serialize::OutputArchive& out) const override {
    out.write("swapped", c10::IValue(swapped_));
    out.write("to.name", c10::IValue(o_.to.name));
  }
  /// Runs before the optimizer's state is loaded: a run that had swapped swaps again, so the
  /// state loads into the optimizer it belongs to. No momentum seeding: the saved state has it.
  void load_state(frugal::Learner& l, torch::serialize::InputArchive& in) override {
    c10::IValue v;
    if (!in.try_read("swapped", v) || !v.isBool() || !v.toBool() || swapped_) return;
    swap(l, "resuming a run that had swapped", false);
  }

 private:
  void swap(frugal::Learner& l, const std::string& why, bool seed) {
    auto& mm = l.memory();
    const int64_t live_before = mm.current();
    const std::string from = l.optimizer_options().name;
    const int64_t state_before = frugal::optimizer_state_bytes(l.optimizer());
    std::vector<std::pair<torch::Tensor, torch::Tensor>> moments;
    if (seed && o_.seed_momentum) {
      moments = os::first_moments(l.optimizer(), l.model()->parameters());
      if (moments.empty())
        log_->warn("seed_momentum: the '{}' optimizer being replaced has no first moments "
                   "(not Adam/AdamW, or it has not stepped); SGD's buffers start from the "
                   "first gradient", from);
    }
    l.set_optimizer(o_.to);  // frees the old optimizer, then builds the new one
    const int64_t seeded = os::seed_momentum(l.optimizer(), moments);
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

  OptimSwapOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t threshold_ = 0;
  int64_t seen_peak_ = 0;
  bool swapped_ = false;
};

frugal::PluginRelations relations() { return {{"auto_purge"}, {}}; }

}  // namespace

FRUGAL_PLUGIN_EX(OptimSwap, OptimSwapOptions, "optim_swap",
                 "replaces the optimizer at a stage, an epoch or a memory threshold (e.g. "
                 "Adam -> SGD), freeing the old one's state",
                 "1.0.0", &relations, nullptr)
