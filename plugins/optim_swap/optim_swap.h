#pragma once
/// optim_swap: replaces the optimizer once during a fit — at the start of a named stage, after a
/// number of epochs, or when live memory has passed a threshold — for example Adam -> SGD, which
/// frees Adam's two moments (8 bytes per float32 parameter). SGD's momentum can start from
/// Adam's first moment instead of from zero.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

namespace frugal::optim_swap {

/// The epoch of the whole fit (counted from 0 across stages) that `stage_epoch` of stage
/// `stage_index` is: epochs of the earlier stages plus the epoch within the stage.
template <class Stages>
int64_t fit_epoch(const Stages& stages, int64_t stage_index, int64_t stage_epoch) {
  int64_t n = stage_epoch;
  for (int64_t i = 0; i < stage_index && i < static_cast<int64_t>(stages.size()); ++i)
    n += stages[static_cast<size_t>(i)].epochs;
  return n;
}

/// Adam's (or AdamW's) first moment of each parameter that has one, as (parameter, exp_avg)
/// pairs. The tensors are shared, not copied: they outlive the optimizer that made them and
/// become SGD's momentum buffers without a second copy in memory.
std::vector<std::pair<torch::Tensor, torch::Tensor>> first_moments(
    torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params);

/// Installs each moment as the parameter's SGD momentum buffer in `sgd` (which must be a
/// torch::optim::SGD with momentum > 0: SGD only reads a buffer when momentum is on). The
/// first SGD step then is buf = momentum * exp_avg + grad; p -= lr * buf. Returns how many
/// buffers it seeded.
int64_t seed_momentum(torch::optim::Optimizer& sgd,
                      const std::vector<std::pair<torch::Tensor, torch::Tensor>>& moments);

/// [plugins.optim_swap]: TOML keys are the field names.
struct OptimSwapOptions : frugal::Options {
  std::string at_stage;         ///< default "": off
  int64_t at_epoch = 0;         ///< default 0: off
  frugal::ByteSize when_bytes_over;  ///< default 0: off
  frugal::OptimizerOptions to;  ///< default sgd, lr 0.01
  bool seed_momentum = false;   ///< default false

  OptimSwapOptions();
  void visit(frugal::FieldVisitor& v) override;
  void check() const override;
};

/// The callback: one swap, when its trigger fires (and again on resume if the run had swapped).
class OptimSwap : public frugal::Callback {
 public:
  OptimSwap(const OptimSwapOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "optim_swap"; }
  /// Swaps first in before_* events, so auto_purge (order::kPurge) and everything else already
  /// see the new optimizer.
  int order() const override { return frugal::order::kOptimizerSwap; }
  frugal::CallbackRelations relations() const override;

  /// Checks at_stage against the fit's stages before any work.
  void before_fit(frugal::Learner& l) override;
  void before_stage(frugal::Learner& l) override;
  void before_epoch(frugal::Learner& l) override;
  /// The stage's peak so far (Learner::stage_peak) also covers the batch that just
  /// ran: a threshold passed in a forward swaps before the next batch.
  void before_batch(frugal::Learner& l) override;
  /// A stage's last batch may pass the threshold; the next stage reopens the window.
  void after_batch(frugal::Learner& l) override;

  void save_state(torch::serialize::OutputArchive& out) const override;
  /// Runs before the optimizer's state is loaded: a run that had swapped swaps again, so the
  /// state loads into the optimizer it belongs to. No momentum seeding: the saved state has it.
  void load_state(frugal::Learner& l, torch::serialize::InputArchive& in) override;

 private:
  void swap(frugal::Learner& l, const std::string& why, bool seed);

  OptimSwapOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t threshold_ = 0;
  int64_t seen_peak_ = 0;
  bool swapped_ = false;
};

}  // namespace frugal::optim_swap
