#pragma once
/// checkpoint: activation checkpointing for a Sequential of blocks (Chen et al. 2016,
/// arXiv:1604.06174; torch.utils.checkpoint): a checkpointed segment keeps only its input during
/// the forward and runs its blocks again in backward.
#include <cstdint>
#include <string>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

namespace frugal::checkpoint {

/// Blocks [begin, end) of a Sequential, run with or without checkpointing.
struct Segment {
  int64_t begin = 0;
  int64_t end = 0;
  bool checkpointed = true;
  bool operator==(const Segment& o) const {
    return begin == o.begin && end == o.end && checkpointed == o.checkpointed;
  }
};

/// Splits n_blocks into min(k, n_blocks) contiguous segments whose lengths differ by at most one
/// (the first n_blocks % k are one block longer). Every segment is marked checkpointed.
std::vector<Segment> split_segments(int64_t n_blocks, int64_t k);

/// The default number of segments: sqrt(n_blocks) rounded, at least 1.
int64_t default_segments(int64_t n_blocks);

/// `segments` segments over n_blocks blocks (0 = default_segments), all checkpointed unless
/// `checkpoint_last` is false: then the last one runs plainly (torch's checkpoint_sequential), if
/// there are at least two.
std::vector<Segment> plan_by_count(int64_t n_blocks, int64_t segments, bool checkpoint_last);

/// Each block named in `wanted` is its own checkpointed segment; the blocks between run plainly.
/// An unknown name is a ConfigError naming it and listing the model's blocks.
std::vector<Segment> plan_by_names(const std::vector<std::string>& blocks,
                                   const std::vector<std::string>& wanted);

/// Runs `blocks` on x as one checkpointed segment (a plain run when grad mode is off).
torch::Tensor checkpoint_segment(std::vector<torch::nn::AnyModule> blocks, const torch::Tensor& x);

/// The model's forward, segment by segment as `plan` says.
torch::Tensor checkpointed_forward(torch::nn::Sequential& model, const std::vector<Segment>& plan,
                                   torch::Tensor x);

/// The names of a Sequential's blocks, in order.
std::vector<std::string> block_names(const torch::nn::Sequential& model);

/// [plugins.checkpoint]: TOML keys are the field names.
struct CheckpointOptions : frugal::Options {
  int64_t segments = 0;              ///< default 0: sqrt(number of blocks), rounded
  std::vector<std::string> modules;  ///< default empty: split by `segments` instead
  bool checkpoint_last = false;      ///< default false: the last of `segments` runs plainly
  void visit(frugal::FieldVisitor& v) override;
  void check() const override;
};

/// The callback: the model's blocks, segment by segment, in every training forward with grad on.
class Checkpoint : public frugal::Callback {
 public:
  Checkpoint(const CheckpointOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "checkpoint"; }
  /// The innermost forward wrapper: it runs the blocks itself instead of calling next(x), so
  /// wrappers that must see the forward (autocast) need a smaller order (the Learner checks).
  int order() const override { return frugal::order::kInnermostForward; }
  bool wraps_forward() const override { return true; }
  frugal::CallbackRelations relations() const override;

  /// Checks the options against the model's blocks.
  void before_fit(frugal::Learner& l) override;
  /// Training with grad on: the blocks segment by segment; otherwise the plain chain.
  torch::Tensor wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                             const frugal::ForwardNext& next) override;

 private:
  std::vector<Segment> make_plan(const torch::nn::Sequential& model) const;

  CheckpointOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  std::vector<Segment> plan_;
};

}  // namespace frugal::checkpoint
