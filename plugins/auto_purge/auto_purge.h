#pragma once
/// auto_purge: at every stage change (freeze/unfreeze, image size, a new optimizer) and when the
/// fit ends, releases what the last stage left behind — batch, prediction and loss, gradients,
/// optimizer state, autocast's cast cache, the CUDA caching allocator's free blocks — like
/// fastai's Learner.purge, optionally saving and reloading the model to compact it (fastai v1).
/// Then checks the stage-transition contract: live memory should be what the next stage starts
/// from — parameters and buffers, the datasets held in memory, what the user asked to keep —
/// within a tolerance; whatever is over it is attributed.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>

namespace frugal::auto_purge {

/// What was live right after a purge, and what was allowed to be.
struct Residual {
  int64_t live = 0;
  int64_t parameters = 0;      ///< parameters and buffers
  int64_t data = 0;            ///< the datasets held in (the meter's) memory
  int64_t kept_optimizer = 0;  ///< optimizer state kept on purpose (clear_opt = false)
  int64_t keep = 0;            ///< the `keep` option
  int64_t tolerance = 0;
  // what still holds memory, for the warning
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  std::vector<std::pair<std::string, int64_t>> callbacks;  ///< held_bytes() > 0

  /// The baseline the contract promises.
  int64_t allowed() const { return parameters + data + kept_optimizer + keep; }
  /// Live bytes over the baseline (negative when under it).
  int64_t over() const { return live - allowed(); }
  bool ok() const { return over() <= tolerance; }
  /// Bytes over the baseline that no category explains.
  int64_t other() const;
};

/// "live 1.2 MiB = parameters 1.0 MiB + data 200 KiB + 12 B": one line for the log.
std::string summary(const Residual& r);

/// The warning when the contract does not hold: how much is over, and what holds it.
std::string explain(const Residual& r, const std::string& where);

/// [plugins.auto_purge]: TOML keys are the field names (check_contract's is "check").
struct AutoPurgeOptions : frugal::Options {
  bool clear_opt = true;         ///< default true (fastai)
  bool after_fit = true;         ///< default true
  bool defrag = false;           ///< default false
  std::string defrag_dir;        ///< default "": the system's temp folder
  bool check_contract = true;    ///< key "check"; default true
  frugal::ByteSize keep;         ///< default 0
  frugal::ByteSize tolerance{1 << 20};  ///< default "1MiB"

  void visit(frugal::FieldVisitor& v) override;
};

/// The callback: a purge at every stage change and at the end of the fit, then the check.
class AutoPurge : public frugal::Callback {
 public:
  AutoPurge(const AutoPurgeOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "auto_purge"; }
  /// Early in before_* (after optim_swap, order::kOptimizerSwap, so a swapped optimizer is
  /// seen), late in after_* (the fit-end purge runs after the other callbacks' after_fit).
  int order() const override { return frugal::order::kPurge; }

  void before_fit(frugal::Learner& l) override;
  /// Every stage after the first starts from a purge; so does a first stage whose optimizer
  /// was replaced (optim_swap at the first stage).
  void before_stage(frugal::Learner& l) override;
  /// An optimizer replaced at an epoch boundary (optim_swap at_epoch): a full purge is safe here.
  void before_epoch(frugal::Learner& l) override;
  /// An optimizer replaced between batches: the batch is loaded and gradients may be
  /// accumulating, so only the allocator's cache goes (the old state is already freed).
  void before_batch(frugal::Learner& l) override;
  void after_fit(frugal::Learner& l) override;

 private:
  void purge(frugal::Learner& l, const std::string& where);
  Residual measure(frugal::Learner& l) const;
  /// Save and reload: each parameter gets a fresh allocation (made right after the purge
  /// emptied the cache, so they pack). The temp file is removed whatever happens.
  void defragment(frugal::Learner& l);

  AutoPurgeOptions o_;
  int64_t keep_, tolerance_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t changes_ = 0;
  int64_t released_ = 0;
  int64_t defrags_ = 0;
};

}  // namespace frugal::auto_purge
