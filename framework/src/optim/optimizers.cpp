// The optimizer registry: the built-in optimizers (build, own keys, state bytes, step needs),
// and OptimizerOptions, whose keys beyond name, lr and weight_decay come from the entry.
#include "frugal/optim/optimizers.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/options_toml.h"
#include "frugal/base/error.h"
#include "frugal/config/own_keys.h"
#include "frugal/optim/adafactor.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/fused.h"
#include "memory/counting_offloaded.h"

namespace frugal {
namespace {

namespace optim = torch::optim;

// ---- the built-in optimizers' own keys -----------------------------------------------------

struct NoKeys : Options {
  void visit(FieldVisitor&) override {}
};

struct AdamKeys : Options {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  void visit(FieldVisitor& v) override {
    v.field("beta1", beta1, "first-moment decay", half_open(0, 1));
    v.field("beta2", beta2, "second-moment decay", half_open(0, 1));
    v.field("eps", eps, "term added to the denominator for stability", positive());
  }
};

constexpr const char* kFusedHelp =
    "one vectorized pass over each parameter on the CPU (fused.h; the same arithmetic as "
    "LibTorch's); false = LibTorch's tensor operations. No effect off the CPU";

/// adam's and adamw's keys: Adam's and the fused pass.
struct FusedAdamKeys : AdamKeys {
  bool fused = true;
  void visit(FieldVisitor& v) override {
    AdamKeys::visit(v);
    v.field("fused", fused, kFusedHelp);
  }
};

struct SgdKeys : Options {
  double momentum = 0.0;
  bool fused = true;
  void visit(FieldVisitor& v) override {
    v.field("momentum", momentum, "momentum; 0 = none (no state)", at_least(0));
    v.field("fused", fused, kFusedHelp);
  }
};

struct RmspropKeys : Options {
  double momentum = 0.0;
  double eps = 1e-8;
  void visit(FieldVisitor& v) override {
    v.field("momentum", momentum, "momentum; 0 = none", at_least(0));
    v.field("eps", eps, "term added to the denominator for stability", positive());
  }
};

struct AdagradKeys : Options {
  double eps = 1e-8;
  void visit(FieldVisitor& v) override {
    v.field("eps", eps, "term added to the denominator for stability", positive());
  }
};

struct AdafactorKeys : Options {
  double beta1 = 0.0;
  double eps1 = 1e-30;
  double eps2 = 1e-3;
  double clip_threshold = 1.0;
  double decay_rate = -0.8;
  bool relative_step = false;
  bool scale_parameter = false;
  bool warmup_init = false;
  void visit(FieldVisitor& v) override {
    v.field("beta1", beta1, "first-moment decay; 0 = no first moment (no state for it)",
            half_open(0, 1));
    v.field("eps1", eps1, "added to the squared gradient", positive());
    v.field("eps2", eps2, "least parameter scale (scale_parameter)", positive());
    v.field("clip_threshold", clip_threshold, "an update's RMS is capped here", positive());
    v.field("decay_rate", decay_rate, "second-moment decay at step t is 1 - t^decay_rate",
            Limits{-std::numeric_limits<double>::infinity(), 0.0, false, true});
    v.field("relative_step", relative_step,
            "the paper's step size min(1e-2, 1/sqrt(t)) instead of lr");
    v.field("scale_parameter", scale_parameter, "multiply the step size by RMS(parameter)");
    v.field("warmup_init", warmup_init, "relative_step: grow the step size as 1e-6 t");
  }
};

template <class T>
std::function<std::unique_ptr<Options>()> keys_of() {
  return [] { return std::make_unique<T>(); };
}

int64_t decay_copies(const OptimizerOptions& o) { return o.weight_decay > 0 ? 1 : 0; }

// ---- the built-in optimizers ---------------------------------------------------------------
// Step needs from LibTorch's implementations: the state after the first step, and the
// temporaries of the step for the largest parameter (Adam's sqrt and division, a
// weight-decayed copy of the gradient).

// The fused class or LibTorch's, over the same options.
template <class Fused, class Plain, class O>
std::unique_ptr<optim::Optimizer> fused_or_plain(bool fused, std::vector<torch::Tensor> params,
                                                 const O& options) {
  if (fused) return std::make_unique<Fused>(std::move(params), options);
  return std::make_unique<Plain>(std::move(params), options);
}

// The fused pass on the CPU makes no temporaries (fused.h).
int64_t step_temporaries(bool fused, const TrainableBytes& p, int64_t libtorch) {
  return fused && p.cpu ? 0 : libtorch;
}

OptimizerFactory adam() {
  OptimizerFactory f;
  f.make_options = keys_of<FusedAdamKeys>();
  f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<FusedAdamKeys>();
    return fused_or_plain<FusedAdam, optim::Adam>(k.fused, std::move(params),
                                                  optim::AdamOptions(o.lr)
                                                      .betas(std::make_tuple(k.beta1, k.beta2))
                                                      .eps(k.eps)
                                                      .weight_decay(o.weight_decay));
  };
  f.state_bytes = state_bytes_of<optim::Adam, optim::AdamParamState>(
      [](const optim::AdamParamState& s) {
        return tensor_bytes(s.exp_avg()) + tensor_bytes(s.exp_avg_sq()) +
               tensor_bytes(s.max_exp_avg_sq());
      });
  f.step_needs = [](const OptimizerOptions& o, const TrainableBytes& p) {
    const bool fused = o.own_as<FusedAdamKeys>().fused;
    return StepNeeds{2 * p.total, step_temporaries(fused, p, (2 + decay_copies(o)) * p.largest)};
  };
  return f;
}

OptimizerFactory adamw() {
  OptimizerFactory f;
  f.make_options = keys_of<FusedAdamKeys>();
  f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<FusedAdamKeys>();
    return fused_or_plain<FusedAdamW, optim::AdamW>(k.fused, std::move(params),
                                                    optim::AdamWOptions(o.lr)
                                                        .betas(std::make_tuple(k.beta1, k.beta2))
                                                        .eps(k.eps)
                                                        .weight_decay(o.weight_decay));
  };
  f.state_bytes = state_bytes_of<optim::AdamW, optim::AdamWParamState>(
      [](const optim::AdamWParamState& s) {
        return tensor_bytes(s.exp_avg()) + tensor_bytes(s.exp_avg_sq()) +
               tensor_bytes(s.max_exp_avg_sq());
      });
  f.step_needs = [](const OptimizerOptions& o, const TrainableBytes& p) {
    const bool fused = o.own_as<FusedAdamKeys>().fused;  // decoupled decay: no gradient copy
    return StepNeeds{2 * p.total, step_temporaries(fused, p, 2 * p.largest)};
  };
  f.decoupled_decay = true;
  return f;
}

OptimizerFactory sgd() {
  OptimizerFactory f;
  f.make_options = keys_of<SgdKeys>();
  f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<SgdKeys>();
    return fused_or_plain<FusedSGD, optim::SGD>(
        k.fused, std::move(params),
        optim::SGDOptions(o.lr).momentum(k.momentum).weight_decay(o.weight_decay));
  };
  f.state_bytes = state_bytes_of<optim::SGD, optim::SGDParamState>(
      [](const optim::SGDParamState& s) { return tensor_bytes(s.momentum_buffer()); });
  f.step_needs = [](const OptimizerOptions& o, const TrainableBytes& p) {
    const auto k = o.own_as<SgdKeys>();
    return StepNeeds{k.momentum > 0 ? p.total : 0,
                     step_temporaries(k.fused, p, decay_copies(o) * p.largest)};
  };
  return f;
}

OptimizerFactory rmsprop() {
  OptimizerFactory f;
  f.make_options = keys_of<RmspropKeys>();
  f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<RmspropKeys>();
    return std::make_unique<optim::RMSprop>(
        std::move(params),
        optim::RMSpropOptions(o.lr).momentum(k.momentum).eps(k.eps).weight_decay(o.weight_decay));
  };
  f.state_bytes = state_bytes_of<optim::RMSprop, optim::RMSpropParamState>(
      [](const optim::RMSpropParamState& s) {
        return tensor_bytes(s.square_avg()) + tensor_bytes(s.momentum_buffer()) +
               tensor_bytes(s.grad_avg());
      });
  f.step_needs = [](const OptimizerOptions& o, const TrainableBytes& p) {
    const bool momentum = o.own_as<RmspropKeys>().momentum > 0;
    return StepNeeds{p.total * (momentum ? 2 : 1), (1 + decay_copies(o)) * p.largest};
  };
  return f;
}

/// The estimate for an optimizer without step_needs; also Adagrad's (whose state exists from
/// construction, so none is left to create).
StepNeeds default_step_needs(const OptimizerOptions& o, const TrainableBytes& p) {
  return {p.total, (1 + decay_copies(o)) * p.largest};
}

OptimizerFactory adagrad() {
  OptimizerFactory f;
  f.make_options = keys_of<AdagradKeys>();
  f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<AdagradKeys>();
    return std::make_unique<optim::Adagrad>(
        std::move(params), optim::AdagradOptions(o.lr).eps(k.eps).weight_decay(o.weight_decay));
  };
  f.state_bytes = state_bytes_of<optim::Adagrad, optim::AdagradParamState>(
      [](const optim::AdagradParamState& s) { return tensor_bytes(s.sum()); });
  f.step_needs = default_step_needs;
  return f;
}

// ---- the optimizers with little state: adafactor and adam8bit (adafactor.h, adam8bit.h) ---
// Their state follows the parameters' shapes, so step needs sum it over TrainableBytes::shapes
// (the totals alone when shapes are unknown: adafactor then counts a factored matrix as none).

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

OptimizerFactory adafactor() {
  OptimizerFactory f;
  f.make_options = keys_of<AdafactorKeys>();
  f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<AdafactorKeys>();
    return std::make_unique<Adafactor>(std::move(params), AdafactorOptions(o.lr)
                                                              .beta1(k.beta1)
                                                              .eps1(k.eps1)
                                                              .eps2(k.eps2)
                                                              .clip_threshold(k.clip_threshold)
                                                              .decay_rate(k.decay_rate)
                                                              .relative_step(k.relative_step)
                                                              .scale_parameter(k.scale_parameter)
                                                              .warmup_init(k.warmup_init)
                                                              .weight_decay(o.weight_decay));
  };
  f.state_bytes = state_bytes_of<Adafactor, AdafactorParamState>(
      [](const AdafactorParamState& s) {
        return tensor_bytes(s.exp_avg_sq_row()) + tensor_bytes(s.exp_avg_sq_col()) +
               tensor_bytes(s.exp_avg_sq()) + tensor_bytes(s.exp_avg());
      });
  f.step_needs = [](const OptimizerOptions& o, const TrainableBytes& p) {
    const bool momentum = o.own_as<AdafactorKeys>().beta1 > 0;
    int64_t state = momentum ? p.total : 0;
    if (!p.shapes.empty()) {
      state = 0;
      for (const auto& shape : p.shapes) state += Adafactor::state_bytes(shape, momentum);
    }
    // the squared gradient and the update, each the largest parameter's size
    return StepNeeds{state, 2 * p.largest};
  };
  return f;
}

/// 8-bit Adam; `decoupled`: AdamW's decay (adamw8bit).
OptimizerFactory adam8bit(bool decoupled) {
  OptimizerFactory f;
  f.make_options = keys_of<FusedAdamKeys>();
  f.build = [decoupled](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
    const auto k = o.own_as<FusedAdamKeys>();
    return std::make_unique<Adam8bit>(std::move(params),
                                      Adam8bitOptions(o.lr)
                                          .betas(std::make_tuple(k.beta1, k.beta2))
                                          .eps(k.eps)
                                          .weight_decay(o.weight_decay)
                                          .decoupled(decoupled)
                                          .fused(k.fused));
  };
  f.state_bytes = state_bytes_of<Adam8bit, Adam8bitParamState>(
      [](const Adam8bitParamState& s) { return s.bytes(); });
  f.step_needs = [decoupled](const OptimizerOptions& o, const TrainableBytes& p) {
    int64_t state = p.total / 2;  // 2 bytes per float32 parameter
    if (!p.shapes.empty()) {
      state = 0;
      for (const auto& shape : p.shapes) state += Adam8bit::state_bytes(numel_of(shape));
    }
    // the largest parameter's two moments dequantized, Adam's sqrt and division; quantizing
    // works in chunks of 65536 elements (about 40 bytes each: 2.5 MiB). The fused pass on the
    // CPU: none (a block's moments live on the stack).
    const int64_t temporaries =
        (4 + (decoupled ? 0 : decay_copies(o))) * p.largest + (int64_t{5} << 19);
    return StepNeeds{state, step_temporaries(o.own_as<FusedAdamKeys>().fused, p, temporaries)};
  };
  f.decoupled_decay = decoupled;
  return f;
}

// ---- OptimizerOptions' own keys ------------------------------------------------------------

/// The own keys of optimizer `name` with their defaults; null when no optimizer has the name.
std::unique_ptr<Options> own_options(const std::string& name) {
  if (!optimizers().contains(name)) return nullptr;
  const auto make = optimizers().get(name).make.make_options;
  std::unique_ptr<Options> o = make ? make() : nullptr;
  if (!o) return std::make_unique<NoKeys>();
  return o;
}

/// Reads the keys of `own` that `into` declares, each alone: a value `into` refuses (one
/// inherited from another optimizer) leaves its default.
void carry_over(const toml::table& own, Options& into) {
  for (const auto& key : detail::field_keys(into)) {
    const toml::node* n = own.get(key);
    if (!n) continue;
    toml::table one;
    one.insert_or_assign(key, *n);
    try {
      detail::read_fields(one, into, "optimizer", "");
    } catch (const ConfigError&) {
    }
  }
}

/// "a", "a and b", "a, b and c"
std::string join_words(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += i + 1 == items.size() ? " and " : ", ";
    out += items[i];
  }
  return out;
}

}  // namespace

void OptimizerOptions::visit(FieldVisitor& v) {
  v.field("name", name, "optimizer; `frugal keys` lists the keys of each", optimizers().names());
  v.field("lr", lr, "learning rate", positive());
  v.field("weight_decay", weight_decay, "weight decay (decoupled for adamw)", at_least(0));
  v.field("decay", decay,
          "which parameters weight_decay applies to: \"matrices\" (2+ dimensions: not biases or "
          "norms, nanoGPT's rule), \"all\", or \"auto\" (matrices for decoupled decay: adamw, "
          "adamw8bit; all otherwise)", std::vector<std::string>{"auto", "matrices", "all"});
  v.field("clip_grad_norm", clip_grad_norm,
          "0 = off; else before each step the gradients are scaled so their global L2 norm is at "
          "most this (torch.nn.utils.clip_grad_norm_), after grad_accum's last micro-batch, "
          "amp's unscaling and data parallel's all-reduce", at_least(0));
  v.field("clip_grad_value", clip_grad_value,
          "0 = off; else each gradient element is clamped to [-v, v] before each step (before "
          "clip_grad_norm)", at_least(0));
  // The optimizer's own keys, read from and written to the same table. An unknown name (one
  // whose plugin has gone) keeps `own` as it is.
  std::unique_ptr<Options> mine = own_options(name);
  if (!mine) return;
  carry_over(toml_of(own), *mine);
  mine->visit(v);
  toml_of(own) = detail::write_fields(*mine);
}

std::string OptimizerOptions::unknown_key_note(const std::string& key) const {
  std::vector<std::string> having;
  for (const auto& other : optimizers().names()) {
    if (other == name) continue;
    std::unique_ptr<Options> o = own_options(other);
    if (o && detail::contains(detail::field_keys(*o), key)) having.push_back(other);
  }
  if (having.empty()) return "Optimizer \"" + name + "\" has no such key.";
  return "'" + key + "' is a key of " + join_words(having) + ", not of optimizer \"" + name +
         "\".";
}

OptimizerOptions& OptimizerOptions::set_own(const OwnKeys& own_keys) {
  const toml::table& keys = toml_of(own_keys);
  std::unique_ptr<Options> mine = own_options(name);
  if (!mine) optimizers().get(name);  // throws: unknown, with every registered name
  carry_over(toml_of(own), *mine);
  const std::vector<std::string> allowed = detail::field_keys(*mine);
  for (auto&& [k, v] : keys)
    if (!detail::contains(allowed, k.str())) no_such_key(std::string(k.str()));
  const std::string who = "optimizer \"" + name + "\"";
  detail::read_fields(keys, *mine, "optimizer", who);
  try {
    mine->check();
  } catch (const ConfigError& e) {
    throw_config_error(who + ": " + e.what());
  }
  toml_of(own) = detail::write_fields(*mine);
  return *this;
}

namespace {
template <class T>
OptimizerOptions& set_one(OptimizerOptions& o, const std::string& key, T value) {
  OwnKeys k;
  toml_of(k).insert_or_assign(key, std::move(value));
  return o.set_own(k);
}
}  // namespace

OptimizerOptions& OptimizerOptions::set(const std::string& key, double value) { return set_one(*this, key, value); }
OptimizerOptions& OptimizerOptions::set(const std::string& key, int64_t value) { return set_one(*this, key, value); }
OptimizerOptions& OptimizerOptions::set(const std::string& key, bool value) { return set_one(*this, key, value); }
OptimizerOptions& OptimizerOptions::set(const std::string& key, const std::string& value) {
  return set_one(*this, key, value);
}

template <class T>
T OptimizerOptions::get(const std::string& key) const {
  const OwnKeys all = own_keys();
  if (auto v = toml_of(all)[key].value<T>()) return *v;
  no_such_key(key);
}
template double OptimizerOptions::get<double>(const std::string&) const;
template int64_t OptimizerOptions::get<int64_t>(const std::string&) const;
template bool OptimizerOptions::get<bool>(const std::string&) const;
template std::string OptimizerOptions::get<std::string>(const std::string&) const;

OwnKeys OptimizerOptions::own_keys() const {
  std::unique_ptr<Options> mine = own_options(name);
  if (!mine) return own;
  carry_over(toml_of(own), *mine);
  OwnKeys out;
  toml_of(out) = detail::write_fields(*mine);
  return out;
}

void OptimizerOptions::read_own(Options& into) const {
  detail::read_fields(toml_of(own), into, "optimizer", "optimizer \"" + name + "\"");
}

void OptimizerOptions::no_such_key(const std::string& key) const {
  std::unique_ptr<Options> mine = own_options(name);
  std::vector<std::string> keys = {"name", "lr", "weight_decay"};
  if (mine)
    for (auto& k : detail::field_keys(*mine)) keys.push_back(std::move(k));
  throw_config_error("unknown key 'optimizer." + key + "'. " + unknown_key_note(key) +
                     " Keys of optimizer \"" + name + "\": " + detail::join(keys, ", "));
}

// ---- the registry and its uses -------------------------------------------------------------

Registry<OptimizerFactory>& optimizers() {
  static Registry<OptimizerFactory> r("optimizer");
  static const bool builtins = [] {
    r.add("adam", adam(), "Adam: per-parameter first and second moments (2x the parameters)");
    r.add("adamw", adamw(), "AdamW: Adam with decoupled weight decay (2x the parameters)");
    r.add("sgd", sgd(), "SGD, with optional momentum (1x the parameters with momentum, else 0)");
    r.add("rmsprop", rmsprop(),
          "RMSprop: a running mean of squared gradients (1x the parameters; 2x with momentum)");
    r.add("adagrad", adagrad(), "Adagrad: the sum of squared gradients (1x the parameters)");
    r.add("adafactor", adafactor(),
          "Adafactor: a factored second moment (rows + columns of each matrix), no first "
          "moment unless beta1 > 0, update clipping");
    r.add("adam8bit", adam8bit(false),
          "8-bit Adam: both moments block-wise quantized to 1 byte (about 0.5x the "
          "parameters; float32 for tensors under 4096 elements); weight_decay as Adam's (L2)");
    r.add("adamw8bit", adam8bit(true),
          "8-bit AdamW: adam8bit with AdamW's decoupled weight decay (bitsandbytes' AdamW8bit)");
    return true;
  }();
  (void)builtins;
  return r;
}

void TrainableBytes::add(const torch::Tensor& p) {
  const auto bytes = static_cast<int64_t>(p.nbytes());
  total += bytes;
  largest = std::max(largest, bytes);
  shapes.push_back(p.sizes().vec());
  cpu = cpu && p.device().is_cpu();
}

TrainableBytes trainable_bytes(const torch::nn::Module& m) {
  TrainableBytes p;
  for (const auto& t : m.parameters())
    if (t.requires_grad()) p.add(t);
  return p;
}

bool decay_matrices_only(const OptimizerOptions& o) {
  if (o.weight_decay <= 0 || o.decay == "all") return false;
  if (o.decay == "matrices") return true;
  return optimizers().contains(o.name) && optimizers().get(o.name).make.decoupled_decay;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& o,
                                                        std::vector<torch::Tensor> params) {
  const OptimizerFactory f = optimizers().get(o.name).make;
  if (!f.build) throw_config_error("optimizer '" + o.name + "' has no build function");
  const auto build = [&](const OptimizerOptions& with, std::vector<torch::Tensor> ps) {
    std::unique_ptr<torch::optim::Optimizer> opt = f.build(with, std::move(ps));
    if (!opt) throw_config_error("optimizer '" + o.name + "': its build function returned null");
    return opt;
  };
  if (!decay_matrices_only(o)) return build(o, std::move(params));
  // Two groups, always both (a zero shard may hold none of one kind): same options, the second
  // without decay. The optimizer's own group type comes from building it once more.
  std::vector<torch::Tensor> matrices, others;
  for (auto& p : params) (p.dim() >= 2 ? matrices : others).push_back(std::move(p));
  std::unique_ptr<torch::optim::Optimizer> opt = build(o, std::move(matrices));
  OptimizerOptions no_decay = o;
  no_decay.weight_decay = 0;
  std::unique_ptr<torch::optim::Optimizer> spared = build(no_decay, std::move(others));
  opt->add_param_group(spared->param_groups().front());
  for (auto& kv : spared->state()) opt->state()[kv.first] = std::move(kv.second);  // Adagrad's
  return opt;
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  for (const auto& name : optimizers().names()) {
    if (!optimizers().contains(name)) continue;  // removed meanwhile
    const OptimizerFactory f = optimizers().get(name).make;
    if (!f.state_bytes) continue;
    if (const std::optional<int64_t> bytes = f.state_bytes(opt)) return *bytes;
  }
  return 0;
}

StepNeeds optimizer_step_needs(const torch::nn::Module& m, const torch::optim::Optimizer& opt,
                               const OptimizerOptions& o) {
  const TrainableBytes p = trainable_bytes(m);
  StepNeeds full = default_step_needs(o, p);
  if (optimizers().contains(o.name))
    if (const auto needs = optimizers().get(o.name).make.step_needs) full = needs(o, p);
  int64_t made = 0;  // the state that exists, offloaded or not: no new bytes for it
  {
    const detail::CountingOffloaded anywhere;
    made = optimizer_state_bytes(opt);
  }
  return {std::max<int64_t>(0, full.state - made), full.temporaries};
}

nlohmann::json describe_optimizer_keys(const std::string& name) {
  std::unique_ptr<Options> mine = own_options(name);
  if (!mine) optimizers().get(name);  // throws: unknown, with every registered name
  return describe_options(*mine);
}

}  // namespace frugal
