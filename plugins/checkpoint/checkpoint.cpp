// checkpoint: activation checkpointing. The model's blocks run in segments; a checkpointed
// segment keeps only its input during the forward and runs again in backward.
#include "checkpoint.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include <ATen/core/ivalue.h>
#include <frugal/base/compat.h>
#include <frugal/base/error.h>
#include <frugal/base/rng.h>

namespace frugal::checkpoint {

std::vector<Segment> split_segments(int64_t n_blocks, int64_t k) {
  if (n_blocks < 0 || k < 1)
    throw std::invalid_argument("split_segments: need n_blocks >= 0 and k >= 1, got n_blocks = " +
                                std::to_string(n_blocks) + ", k = " + std::to_string(k));
  k = std::min(k, n_blocks);
  std::vector<Segment> out;
  int64_t begin = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t len = n_blocks / k + (i < n_blocks % k ? 1 : 0);
    out.push_back({begin, begin + len, true});
    begin += len;
  }
  return out;
}

int64_t default_segments(int64_t n_blocks) {
  return std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(n_blocks))));
}

std::vector<Segment> plan_by_count(int64_t n_blocks, int64_t segments, bool checkpoint_last) {
  auto plan = split_segments(n_blocks, segments > 0 ? segments : default_segments(n_blocks));
  if (!checkpoint_last && plan.size() > 1) plan.back().checkpointed = false;
  return plan;
}

std::vector<Segment> plan_by_names(const std::vector<std::string>& blocks,
                                   const std::vector<std::string>& wanted) {
  for (const auto& w : wanted) {
    if (std::find(blocks.begin(), blocks.end(), w) != blocks.end()) continue;
    std::string list;
    for (const auto& b : blocks) list += (list.empty() ? "" : ", ") + b;
    throw_config_error("plugins.checkpoint.modules: the model has no block named '" + w +
                       "'; its blocks are: " + list);
  }
  std::vector<Segment> out;
  const auto n = static_cast<int64_t>(blocks.size());
  for (int64_t i = 0; i < n; ++i) {
    const bool ck = std::find(wanted.begin(), wanted.end(), blocks[i]) != wanted.end();
    if (ck || out.empty() || out.back().checkpointed)
      out.push_back({i, i + 1, ck});
    else
      out.back().end = i + 1;  // extend the plain run
  }
  return out;
}

namespace {

/// Autocast's state for CPU and CUDA, so the recompute runs in the precision the forward ran in.
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  bool cache = true;
  static AutocastState capture() {
    AutocastState s;
    s.cpu = compat::autocast_enabled(c10::DeviceType::CPU);
    s.cpu_dtype = compat::autocast_dtype(c10::DeviceType::CPU);
    s.cuda = compat::autocast_enabled(c10::DeviceType::CUDA);
    s.cuda_dtype = compat::autocast_dtype(c10::DeviceType::CUDA);
    s.cache = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
    compat::set_autocast(c10::DeviceType::CPU, cpu, cpu_dtype);
    compat::set_autocast(c10::DeviceType::CUDA, cuda, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

/// Runs blocks one after the other.
torch::Tensor run_blocks(std::vector<torch::nn::AnyModule>& blocks, torch::Tensor x) {
  for (auto& b : blocks) x = b.forward(std::move(x));
  return x;
}

/// What a checkpointed segment keeps between forward and backward, besides its input.
struct SegmentState : torch::CustomClassHolder {
  std::vector<torch::nn::AnyModule> blocks;  ///< shallow copies: the model's own modules
  std::vector<torch::Tensor> params;         ///< the blocks' parameters, in Function input order
  std::vector<torch::Tensor> buffers;        ///< running statistics the recompute must not move
  RngState rng;
  AutocastState autocast;
};

/// Forward: the segment under no-grad, saving its input, RNG and autocast state. Backward: the
/// segment again with grad from a detached input, then autograd::grad for the input and every
/// parameter. The parameters are inputs too: with an input that needs no gradient, the output
/// would otherwise have no grad_fn.
class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const torch::Tensor& input, at::TensorList params,
                                                c10::intrusive_ptr<SegmentState> state) {
    (void)params;  // the same tensors as state->params; listed so autograd records them
    state->rng = RngState::capture(input.device());
    state->autocast = AutocastState::capture();
    torch::Tensor out;
    {
      // Casts made under no-grad must not land in autocast's weight cache: the recompute (or a
      // later plain block) would reuse a cast without a path to its weight.
      torch::NoGradGuard no_grad;
      at::autocast::set_autocast_cache_enabled(false);
      try {
        out = run_blocks(state->blocks, input);
      } catch (...) {
        at::autocast::set_autocast_cache_enabled(state->autocast.cache);
        throw;
      }
      at::autocast::set_autocast_cache_enabled(state->autocast.cache);
    }
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(
        ctx->saved_data["state"].toCapsule());
    const torch::Tensor input = ctx->get_saved_variables().at(0);
    torch::Tensor x = input.detach();
    x.requires_grad_(ctx->needs_input_grad(0));

    // Running statistics (BatchNorm) go back to what the forward left once gradients are taken
    // (backward reads them, so not earlier): without this the recompute moves them twice a step.
    struct RestoreBuffers {
      std::vector<torch::Tensor>& buffers;
      std::vector<torch::Tensor> saved;
      ~RestoreBuffers() {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < saved.size(); ++i) buffers[i].copy_(saved[i]);
      }
    } restore_buffers{state->buffers, {}};
    {
      torch::NoGradGuard no_grad;
      for (const auto& b : state->buffers) restore_buffers.saved.push_back(b.clone());
    }

    torch::Tensor out;
    {
      // The recompute sees the forward's RNG and autocast state; the outer state comes back after.
      struct RestoreState {
        RngState rng;
        AutocastState autocast;
        ~RestoreState() {
          const bool was_on = on(AutocastState::capture());
          autocast.apply();
          if (was_on && !on(autocast)) compat::clear_autocast_cache();
          rng.restore();
        }
        static bool on(const AutocastState& s) { return s.cpu || s.cuda; }
      } restore{RngState::capture(input.device()), AutocastState::capture()};
      state->rng.restore();
      state->autocast.apply();
      torch::AutoGradMode grad_on(true);
      out = run_blocks(state->blocks, x);
    }

    return gradients(ctx, out, x, *state, grad_out.at(0));
  }

 private:
  /// The gradients of the recomputed `out` for the input `x` and the parameters autograd asks
  /// for, in the Function's input order: input, params..., state.
  static torch::autograd::variable_list gradients(torch::autograd::AutogradContext* ctx,
                                                  const torch::Tensor& out, const torch::Tensor& x,
                                                  const SegmentState& state,
                                                  const torch::Tensor& grad_out) {
    const size_t n = state.params.size();
    std::vector<torch::Tensor> wrt;
    std::vector<size_t> slot;  // where each gradient goes in the result
    if (ctx->needs_input_grad(0)) {
      wrt.push_back(x);
      slot.push_back(0);
    }
    for (size_t i = 0; i < n; ++i)
      if (ctx->needs_input_grad(i + 1)) {
        wrt.push_back(state.params[i]);
        slot.push_back(i + 1);
      }
    torch::autograd::variable_list grads(n + 2);  // input, params..., state
    if (!wrt.empty() && out.requires_grad()) {
      auto g = torch::autograd::grad({out}, wrt, {grad_out}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t k = 0; k < g.size(); ++k) grads[slot[k]] = g[k];
    }
    return grads;
  }
};

}  // namespace

torch::Tensor checkpoint_segment(std::vector<torch::nn::AnyModule> blocks, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return run_blocks(blocks, x);
  auto state = c10::make_intrusive<SegmentState>();
  for (auto& b : blocks) {
    for (auto& p : b.ptr()->parameters()) state->params.push_back(p);
    if (b.ptr()->is_training())
      for (auto& buf : b.ptr()->buffers()) state->buffers.push_back(buf);
  }
  state->blocks = std::move(blocks);
  std::vector<torch::Tensor> params = state->params;
  return CheckpointFunction::apply(x, at::TensorList(params), std::move(state))[0];
}

torch::Tensor checkpointed_forward(torch::nn::Sequential& model, const std::vector<Segment>& plan,
                                   torch::Tensor x) {
  std::vector<torch::nn::AnyModule> all(model->begin(), model->end());
  for (const auto& s : plan) {
    std::vector<torch::nn::AnyModule> blocks(all.begin() + s.begin, all.begin() + s.end);
    x = s.checkpointed ? checkpoint_segment(std::move(blocks), x) : run_blocks(blocks, x);
  }
  return x;
}

std::vector<std::string> block_names(const torch::nn::Sequential& model) {
  return model->named_children().keys();
}

// ---- the callback -------------------------------------------------------------------------

void CheckpointOptions::visit(frugal::FieldVisitor& v) {
  v.field("segments", segments,
          "segments the model's blocks are split into; 0 = sqrt(blocks) rounded",
          frugal::at_least(0));
  v.field("modules", modules,
          "checkpoint exactly these named blocks, each as its own segment (instead of segments)");
  v.field("checkpoint_last", checkpoint_last,
          "with segments: checkpoint the last segment too (false: it runs plainly, as in "
          "torch's checkpoint_sequential: same step peak, higher forward peak, less recompute)");
}

void CheckpointOptions::check() const {
  if (segments > 0 && !modules.empty())
    frugal::throw_config_error(
        "plugins.checkpoint: set either segments (got " + std::to_string(segments) +
        ") or modules (got " + std::to_string(modules.size()) +
        " names), not both: remove one of the two keys");
}

namespace {
frugal::CallbackRelations relations() { return {{}, {}, true}; }
}  // namespace

Checkpoint::Checkpoint(const CheckpointOptions& o, const frugal::PluginContext& ctx)
    : o_(o), log_(ctx.logger) {}

frugal::CallbackRelations Checkpoint::relations() const { return checkpoint::relations(); }

void Checkpoint::before_fit(frugal::Learner& l) {
  plan_ = make_plan(l.model());
  std::string desc;
  for (const auto& s : plan_)
    desc += (desc.empty() ? "" : " ") + std::string(s.checkpointed ? "[" : "(") +
            std::to_string(s.begin) + "-" + std::to_string(s.end - 1) +
            (s.checkpointed ? "]" : ")");
  log_->info("{} blocks in segments {} ([ ] checkpointed, ( ) plain)", l.model()->size(), desc);
}

torch::Tensor Checkpoint::wrap_forward(frugal::Learner& l, const torch::Tensor& x,
                                       const frugal::ForwardNext& next) {
  if (!l.training() || !torch::GradMode::is_enabled()) return next(x);
  if (plan_.empty() || plan_.back().end != static_cast<int64_t>(l.model()->size()))
    plan_ = make_plan(l.model());
  return checkpointed_forward(l.model(), plan_, x);
}

std::vector<Segment> Checkpoint::make_plan(const torch::nn::Sequential& model) const {
  if (!o_.modules.empty()) return plan_by_names(block_names(model), o_.modules);
  return plan_by_count(static_cast<int64_t>(model->size()), o_.segments, o_.checkpoint_last);
}

}  // namespace frugal::checkpoint

FRUGAL_PLUGIN_EX(frugal::checkpoint::Checkpoint, frugal::checkpoint::CheckpointOptions,
                 "checkpoint",
                 "activation checkpointing: recomputes segments of blocks in backward", "1.0.0",
                 &frugal::checkpoint::relations, nullptr)
