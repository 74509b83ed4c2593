#pragma once
/// The optimizer registry: everything about an optimizer is one entry (how to build it, its own
/// [optimizer] keys, the bytes of its state, what its first step needs), so adding one, also
/// from a plugin, touches one place. `[optimizer] name`, `[stages.optimizer]` and optim_swap's
/// `to` accept every registered name; `frugal keys` lists each one's keys.
///
/// A plugin registers in its on_load with owner = its name (the host removes the entry before
/// the library unloads), and [plugins] load before the rest of the config is read:
///
///   struct LionOptions : frugal::Options {
///     double beta1 = 0.9;  ///< default 0.9
///     void visit(frugal::FieldVisitor& v) override {
///       v.field("beta1", beta1, "interpolation of the update", frugal::half_open(0, 1));
///     }
///   };
///   void on_load(const frugal::PluginContext& ctx) {
///     frugal::OptimizerFactory f;
///     f.make_options = [] { return std::make_unique<LionOptions>(); };
///     f.build = [](const frugal::OptimizerOptions& o, std::vector<torch::Tensor> params) {
///       const auto own = o.own_as<LionOptions>();
///       return std::make_unique<Lion>(std::move(params), o.lr, own.beta1, o.weight_decay);
///     };
///     f.state_bytes = frugal::state_bytes_of<Lion, LionState>(
///         [](const LionState& s) { return frugal::tensor_bytes(s.exp_avg()); });
///     f.step_needs = [](const frugal::OptimizerOptions&, const frugal::TrainableBytes& p) {
///       return frugal::StepNeeds{p.total, p.largest};
///     };
///     frugal::optimizers().add("lion", f, "the sign of an interpolated momentum", ctx.name);
///   }
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/torch.h>

#include "frugal/config/sections.h"
#include "frugal/memory/memory.h"
#include "frugal/models/registry.h"

namespace frugal {

/// Bytes an optimizer's first step needs beyond what a forward and backward show (the
/// micro-batch probe adds them to what it measured).
struct StepNeeds {
  int64_t state = 0;        ///< optimizer state it will still create
  int64_t temporaries = 0;  ///< the step's temporaries
};

/// Bytes of the parameters that train (requires_grad): all together, and the largest one.
struct TrainableBytes {
  int64_t total = 0;
  int64_t largest = 0;
  /// Each one's shape, for an optimizer whose state depends on it (adafactor's factored
  /// moments, adam8bit's small tensors); empty when only the totals are known.
  std::vector<std::vector<int64_t>> shapes;
  /// Every one is on the CPU (where a fused optimizer's step makes no temporaries).
  bool cpu = true;
  /// Adds a parameter: its bytes to the totals, its shape to shapes.
  void add(const torch::Tensor& p);
};
TrainableBytes trainable_bytes(const torch::nn::Module& m);

/// One optimizer: what optimizers() holds under its name.
struct OptimizerFactory {
  /// Its own keys besides name, lr and weight_decay, with their defaults (read from the same
  /// [optimizer] table once the name is known). Null: it has none.
  std::function<std::unique_ptr<Options>()> make_options;
  /// Builds it over `params`; its own keys are o.own_as<TheOptionsMakeOptionsMakes>().
  std::function<std::unique_ptr<torch::optim::Optimizer>(const OptimizerOptions& o,
                                                         std::vector<torch::Tensor> params)>
      build;
  /// Bytes of the state tensors of `opt` when `opt` is this optimizer, else nullopt
  /// (state_bytes_of makes one). Null: its state counts as 0 (it shows as "other" memory).
  std::function<std::optional<int64_t>(const torch::optim::Optimizer& opt)> state_bytes;
  /// What it needs for its first step over parameters of these sizes: all the state it holds
  /// once it has stepped, and the step's temporaries. Null: state = p.total, temporaries =
  /// p.largest (twice that with weight decay).
  std::function<StepNeeds(const OptimizerOptions& o, const TrainableBytes& p)> step_needs;
  /// Its weight_decay is decoupled (AdamW's: the parameter shrinks, the gradient is untouched):
  /// then `decay = "auto"` decays only the matrices (nanoGPT's rule), not biases or norms.
  bool decoupled_decay = false;
};

/// The registry: adam, adamw, sgd, rmsprop, adagrad, adafactor, adam8bit and what plugins add.
Registry<OptimizerFactory>& optimizers();

/// Builds the optimizer `o.name` names over `params`. Throws ConfigError for an unknown name
/// (with the nearest and every registered name) or a value its keys refuse. With weight decay
/// on matrices only (decay_matrices_only), two parameter groups, always both, in this order:
/// the parameters of 2 or more dimensions with o.weight_decay, the others with none.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& o,
                                                        std::vector<torch::Tensor> params);
/// Bytes of the optimizer's state tensors in memory, measured on the live optimizer by the
/// entry whose optimizer it is (tensor_bytes: state offloaded to a file is not counted); 0 for
/// an optimizer no entry knows.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);
/// True when `o` decays only parameters of 2 or more dimensions (weights of linear,
/// convolution and embedding layers), not biases or normalization weights: decay = "matrices",
/// or "auto" for an optimizer with decoupled decay; false without weight decay.
bool decay_matrices_only(const OptimizerOptions& o);
/// What the next step of `opt` over the trainable parameters of `m` still needs: the state its
/// entry says it will hold, less the state it holds now (in memory or offloaded), and the
/// step's temporaries. From
/// LibTorch's optimizer implementations; an estimate for an optimizer without step_needs.
StepNeeds optimizer_step_needs(const torch::nn::Module& m, const torch::optim::Optimizer& opt,
                               const OptimizerOptions& o);

/// The own keys of optimizer `name` as describe_options gives them ([] when it has none).
/// Throws ConfigError for an unknown name.
nlohmann::json describe_optimizer_keys(const std::string& name);

/// Bytes of a tensor's storage in memory; 0 when it is undefined or offloaded (resident(),
/// memory.h).
inline int64_t tensor_bytes(const torch::Tensor& t) {
  return resident(t) ? static_cast<int64_t>(t.nbytes()) : 0;
}

/// A state_bytes for optimizer class O whose per-parameter state class is S: the sum of
/// `bytes(state)` over its parameters, or nullopt when the optimizer is not an O.
template <class O, class S>
std::function<std::optional<int64_t>(const torch::optim::Optimizer&)> state_bytes_of(
    std::function<int64_t(const S&)> bytes) {
  return [bytes = std::move(bytes)](
             const torch::optim::Optimizer& opt) -> std::optional<int64_t> {
    if (!dynamic_cast<const O*>(&opt)) return std::nullopt;
    int64_t total = 0;
    for (const auto& kv : opt.state())
      if (const auto* s = dynamic_cast<const S*>(kv.second.get())) total += bytes(*s);
    return total;
  };
}

}  // namespace frugal
