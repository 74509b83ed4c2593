// auto_purge: fastai's purge at every stage change and at the end of the fit, then a check of
// the stage-transition contract naming what still holds memory.
#include "auto_purge.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <frugal/base/error.h>
#include <frugal/memory/memory.h>

namespace frugal::auto_purge {

namespace fs = std::filesystem;

int64_t Residual::other() const {
  int64_t known = gradients + (optimizer_state - kept_optimizer);
  for (const auto& c : callbacks) known += c.second;
  return std::max<int64_t>(0, over() - known);
}

std::string summary(const Residual& r) {
  std::string s = "live " + format_bytes(r.live) + " = parameters and buffers " +
                  format_bytes(r.parameters) + " + data " + format_bytes(r.data);
  if (r.kept_optimizer) s += " + kept optimizer state " + format_bytes(r.kept_optimizer);
  if (r.keep) s += " + keep " + format_bytes(r.keep);
  const int64_t over = r.over();
  s += over >= 0 ? " + " + format_bytes(over) : " - " + format_bytes(-over);
  return s;
}

std::string explain(const Residual& r, const std::string& where) {
  std::string s = "after the purge at " + where + ", live memory is " + format_bytes(r.over()) +
                  " over the stage baseline (" + summary(r) + "; tolerance " +
                  format_bytes(r.tolerance) + "). Still held:";
  std::string held;
  auto add = [&](const std::string& what, int64_t bytes) {
    if (bytes > 0) held += (held.empty() ? " " : ", ") + what + " " + format_bytes(bytes);
  };
  add("gradients", r.gradients);
  add("optimizer state", r.optimizer_state - r.kept_optimizer);
  for (const auto& [name, bytes] : r.callbacks) add("callback '" + name + "'", bytes);
  add("other (not attributed: tensors kept outside the Learner)", r.other());
  if (held.empty()) held = " nothing attributable";
  return s + held + ". Raise plugins.auto_purge.keep if this is meant to stay";
}

// ---- the plugin ---------------------------------------------------------------------------

void AutoPurgeOptions::visit(frugal::FieldVisitor& v) {
  v.field("clear_opt", clear_opt,
          "drop the optimizer's state at a stage change (fastai's default); false keeps it "
          "(Adam's moments carry over, and count as allowed in the check)");
  v.field("after_fit", after_fit, "also purge when the fit ends (before predict or export)");
  v.field("defrag", defrag,
          "after purging, save the model to a temp file and load it back: fresh, packed "
          "allocations for the parameters (fastai v1's purge)");
  v.field("defrag_dir", defrag_dir, "folder for defrag's temp file; \"\" = the system's temp folder");
  // The check only reports: its keys do not change what the run computes.
  v.field("check", check_contract,
          frugal::outside_training("check that live memory after the purge is at most "
                                   "parameters + data + keep + tolerance, and warn with what "
                                   "holds the rest"));
  v.field("keep", keep,
          frugal::outside_training("bytes the check allows on top of parameters and data "
                                   "(\"64MiB\")"));
  v.field("tolerance", tolerance,
          frugal::outside_training("bytes over the baseline the check ignores (\"1MiB\")"));
}

AutoPurge::AutoPurge(const AutoPurgeOptions& o, const frugal::PluginContext& ctx)
    : o_(o),
      keep_(o.keep.bytes),
      tolerance_(o.tolerance.bytes),
      log_(ctx.logger) {}

void AutoPurge::before_fit(frugal::Learner& l) {
  changes_ = l.optimizer_changes();
  released_ = 0;
}

void AutoPurge::before_stage(frugal::Learner& l) {
  if (l.stage_index() > 0 || l.optimizer_changes() != changes_)
    purge(l, "the start of stage '" + l.stage().name + "'");
}

void AutoPurge::before_epoch(frugal::Learner& l) {
  if (l.optimizer_changes() != changes_)
    purge(l, "epoch " + std::to_string(l.epoch()) + " of stage '" + l.stage().name +
                 "' (new optimizer)");
}

void AutoPurge::before_batch(frugal::Learner& l) {
  if (l.optimizer_changes() == changes_) return;
  changes_ = l.optimizer_changes();
  l.memory().empty_cache();
  log_->info("new optimizer mid-epoch (batch {}): emptied the allocator's cache", l.batch_index());
}

void AutoPurge::after_fit(frugal::Learner& l) {
  if (o_.after_fit) purge(l, "the end of the fit");
}

void AutoPurge::purge(frugal::Learner& l, const std::string& where) {
  const int64_t released = l.purge(o_.clear_opt);
  released_ += released;
  if (o_.defrag) defragment(l);
  changes_ = l.optimizer_changes();
  if (!o_.check_contract) {
    log_->info("purge at {}: released {}", where, frugal::format_bytes(released));
    return;
  }
  const Residual r = measure(l);
  if (r.ok())
    log_->info("purge at {}: released {}; {}", where, frugal::format_bytes(released), summary(r));
  else
    log_->warn("{} (the purge released {})", explain(r, where), frugal::format_bytes(released));
}

Residual AutoPurge::measure(frugal::Learner& l) const {
  Residual r;
  auto& mm = l.memory();
  r.live = mm.current();
  r.parameters = frugal::parameter_bytes(*l.model());
  // The datasets live in host memory; on CUDA the meter counts the device only.
  r.data = mm.device().is_cpu() ? l.data_bytes() : 0;
  r.optimizer_state = frugal::optimizer_state_bytes(l.optimizer());
  r.kept_optimizer = o_.clear_opt ? 0 : r.optimizer_state;
  r.keep = keep_;
  r.tolerance = tolerance_;
  r.gradients = frugal::gradient_bytes(*l.model());
  for (const auto& cb : l.callbacks())
    if (const int64_t b = cb->held_bytes(); b > 0) r.callbacks.emplace_back(cb->name(), b);
  return r;
}

void AutoPurge::defragment(frugal::Learner& l) {
  const fs::path dir = o_.defrag_dir.empty() ? fs::temp_directory_path() : fs::path(o_.defrag_dir);
  const fs::path file = dir / ("frugal-auto_purge-" + std::to_string(::getpid()) + "-" +
                               std::to_string(++defrags_) + ".pt");
  struct Remove {
    fs::path p;
    ~Remove() {
      std::error_code ec;
      fs::remove(p, ec);
    }
  } remove{file};
  l.save(file.string(), /*with_opt=*/false);
  l.load(file.string(), /*with_opt=*/false);
  l.memory().empty_cache();
}

}  // namespace frugal::auto_purge

FRUGAL_PLUGIN(frugal::auto_purge::AutoPurge, frugal::auto_purge::AutoPurgeOptions, "auto_purge",
              "releases gradients, optimizer state and caches at every stage change and checks "
              "that memory is back to parameters + data",
              "1.0.0")
