// auto_purge: at every stage change (freeze/unfreeze, image size, a new optimizer) and when the
// fit ends, releases what the last stage left behind — batch, prediction and loss, gradients,
// optimizer state, autocast's cast cache, the CUDA caching allocator's free blocks — like
// fastai's Learner.purge, optionally saving and reloading the model to compact it (fastai v1).
// Then checks the stage-transition contract and names what still holds memory.
#include <unistd.h>

#include <filesystem>

#include <frugal/compat.h>
#include <frugal/error.h>
#include <frugal/learner.h>
#include <frugal/plugin.h>

#include "auto_purge.h"

namespace {

namespace ap = frugal::auto_purge;
namespace fs = std::filesystem;

struct AutoPurgeOptions : frugal::Options {
  bool clear_opt = true;         ///< default true (fastai)
  bool after_fit = true;         ///< default true
  bool defrag = false;           ///< default false
  std::string defrag_dir;        ///< default "": the system's temp folder
  bool check_contract = true;    ///< key "check"; default true
  frugal::ByteSize keep;         ///< default 0
  frugal::ByteSize tolerance{1 << 20};  ///< default "1MiB"

  void visit(frugal::FieldVisitor& v) override {
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
};

class AutoPurge : public frugal::Callback {
 public:
  AutoPurge(const AutoPurgeOptions& o, const frugal::PluginContext& ctx)
      : o_(o),
        keep_(o.keep.bytes),
        tolerance_(o.tolerance.bytes),
        log_(ctx.logger) {}
  std::string name() const override { return "auto_purge"; }
  /// -10: early in before_* (after optim_swap, -20, so a swapped optimizer is seen), late in
  /// after_* (the fit-end purge runs after the other callbacks' after_fit).
  int order() const override { return -10; }

  void before_fit(frugal::Learner& l) override {
    changes_ = l.optimizer_changes();
    released_ = 0;
  }
  /// Every stage after the first starts from a purge; so does a first stage whose optimizer
  /// was replaced (optim_swap at the first stage).
  void before_stage(frugal::Learner& l) override {
    if (l.stage_index() > 0 || l.optimizer_changes() != changes_)
      purge(l, "the start of stage '" + l.stage().name + "'");
  }
  /// An optimizer replaced at an epoch boundary (optim_swap at_epoch): a full purge is safe here.
  void before_epoch(frugal::Learner& l) override {
    if (l.optimizer_changes() != changes_)
      purge(l, "epoch " + std::to_string(l.epoch()) + " of stage '" + l.stage().name +
                   "' (new optimizer)");
  }
  /// An optimizer replaced between batches: the batch is loaded and gradients may be
  /// accumulating, so only the allocator's cache goes (the old state is already freed).
  void before_batch(frugal::Learner& l) override {
    if (l.optimizer_changes() == changes_) return;
    changes_ = l.optimizer_changes();
    l.memory().empty_cache();
    log_->info("new optimizer mid-epoch (batch {}): emptied the allocator's cache", l.batch_index());
  }
  void after_fit(frugal::Learner& l) override {
    if (o_.after_fit) purge(l, "the end of the fit");
  }

 private:
  void purge(frugal::Learner& l, const std::string& where) {
    const int64_t released = l.purge(o_.clear_opt);
    released_ += released;
    if (o_.defrag) defragment(l);
    changes_ = l.optimizer_changes();
    if (!o_.check_contract) {
      log_->info("purge at {}: released {}", where, frugal::format_bytes(released));
      return;
    }
    const ap::Residual r = measure(l);
    if (r.ok())
      log_->info("purge at {}: released {}; {}", where, frugal::format_bytes(released), ap::summary(r));
    else
      log_->warn("{} (the purge released {})", ap::explain(r, where), frugal::format_bytes(released));
  }

  ap::Residual measure(frugal::Learner& l) const {
    ap::Residual r;
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

  /// Save and reload: each parameter gets a fresh allocation (made right after the purge
  /// emptied the cache, so they pack). The temp file is removed whatever happens.
  void defragment(frugal::Learner& l) {
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

  AutoPurgeOptions o_;
  int64_t keep_, tolerance_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t changes_ = 0;
  int64_t released_ = 0;
  int64_t defrags_ = 0;
};

}  // namespace

FRUGAL_PLUGIN(AutoPurge, AutoPurgeOptions, "auto_purge",
              "releases gradients, optimizer state and caches at every stage change and checks "
              "that memory is back to parameters + data",
              "1.0.0")
