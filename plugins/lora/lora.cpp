// lora: low-rank adapters on frozen (optionally quantized) linear layers.
#include "lora.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include <frugal/io/safetensors.h>
#include <frugal/models/registry.h>

namespace frugal::lora {

namespace nn = torch::nn;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void LoraOptions::visit(frugal::FieldVisitor& v) {
  v.field("rank", rank, "rank r of each update B A (lora_A [r, in], lora_B [out, r])", frugal::at_least(1));
  v.field("alpha", alpha, "the update is scaled by alpha / rank", frugal::positive());
  v.field("dropout", dropout, "dropout on the adapters' input", frugal::between(0.0, 0.99));
  v.field("targets", targets,
          "layers adapted: a linear layer whose name is one of these or ends with \".\" + one "
          "(gpt, gpt2: c_attn, c_proj, c_fc)");
  v.field("quantize", quantize, "how the frozen weights are kept: none (float), int8, nf4 (QLoRA)",
          {"none", "int8", "nf4"});
  v.field("block", block, "weights per absmax scale when quantized", frugal::at_least(1));
  v.field("double_quant", double_quant, "the absmax scales themselves in 8 bits (QLoRA's double quantization)");
  v.field("export_adapter", export_adapter,
          "when the fit ends, write <run.out_dir>/adapter in PEFT's layout (adapter_model.safetensors, "
          "adapter_config.json)");
}

void LoraOptions::check() const {
  if (targets.empty()) frugal::throw_config_error("plugins.lora.targets: name at least one layer");
}

// ---------------------------------------------------------------- quantized weights

QuantStoreImpl::QuantStoreImpl(QuantizedWeight q) : meta_(std::move(q)) {
  meta_.codes = register_buffer("codes", meta_.codes);
  meta_.absmax = register_buffer("absmax", meta_.absmax);
  meta_.absmax_codes = register_buffer("absmax_codes", meta_.absmax_codes);
  meta_.absmax_scale = register_buffer("absmax_scale", meta_.absmax_scale);
  meta_.absmax_offset = register_buffer("absmax_offset", meta_.absmax_offset);
}

QuantizedWeight QuantStoreImpl::weight() const {
  QuantizedWeight q = meta_;  // the buffers as they are now (a checkpoint may have loaded them)
  const auto b = named_buffers(/*recurse=*/false);
  q.codes = b["codes"];
  q.absmax = b["absmax"];
  q.absmax_codes = b["absmax_codes"];
  q.absmax_scale = b["absmax_scale"];
  q.absmax_offset = b["absmax_offset"];
  return q;
}

namespace {

/// x W with W dequantized from the layer's codes in the forward and again in the backward:
/// autograd keeps the codes (references to the buffers, no copy), not a float copy of every
/// layer's weight until backward (which would cost what quantizing saved). W is frozen: only x
/// gets a gradient.
struct DequantizedMatmul : torch::autograd::Function<DequantizedMatmul> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const QuantizedWeight& q, bool in_out) {
    ctx->saved_data["codes"] = q.codes;
    ctx->saved_data["absmax"] = q.absmax;
    ctx->saved_data["absmax_codes"] = q.absmax_codes;
    ctx->saved_data["absmax_scale"] = q.absmax_scale;
    ctx->saved_data["absmax_offset"] = q.absmax_offset;
    ctx->saved_data["kind"] = static_cast<int64_t>(q.kind);
    ctx->saved_data["shape"] = q.shape;
    ctx->saved_data["sizes"] = std::vector<int64_t>{q.numel, q.block, q.block2, q.double_quant ? 1 : 0};
    ctx->saved_data["in_out"] = in_out;
    const auto w = dequantize(q, x.scalar_type());
    return torch::matmul(x, in_out ? w : w.t());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& d = ctx->saved_data;
    QuantizedWeight q;
    q.codes = d["codes"].toTensor();
    q.absmax = d["absmax"].toTensor();
    q.absmax_codes = d["absmax_codes"].toTensor();
    q.absmax_scale = d["absmax_scale"].toTensor();
    q.absmax_offset = d["absmax_offset"].toTensor();
    q.kind = static_cast<QuantKind>(d["kind"].toInt());
    q.shape = d["shape"].toIntVector();
    const auto sizes = d["sizes"].toIntVector();
    q.numel = sizes[0], q.block = sizes[1], q.block2 = sizes[2], q.double_quant = sizes[3] != 0;
    const auto w = dequantize(q, grads[0].scalar_type());
    const bool in_out = d["in_out"].toBool();
    return {torch::matmul(grads[0], in_out ? w.t() : w), torch::Tensor(), torch::Tensor()};
  }
};

std::shared_ptr<QuantStoreImpl> store_of(const frugal::AdaptableLinearImpl& layer) {
  for (const auto& c : layer.named_children())
    if (c.key() == "quant") return std::dynamic_pointer_cast<QuantStoreImpl>(c.value());
  return nullptr;
}
std::shared_ptr<nn::LinearImpl> child_linear(const frugal::AdaptableLinearImpl& layer, const char* name) {
  for (const auto& c : layer.named_children())
    if (c.key() == name) return std::dynamic_pointer_cast<nn::LinearImpl>(c.value());
  return nullptr;
}

}  // namespace

// ---------------------------------------------------------------- the adapter

torch::Tensor LoraAdapter::forward(frugal::AdaptableLinearImpl& layer, const torch::Tensor& x) {
  const auto store = store_of(layer);
  torch::Tensor base;
  if (store) {
    base = DequantizedMatmul::apply(x, store->weight(), layer.layout == frugal::WeightLayout::InOut);
    if (layer.bias.defined()) base = base + layer.bias;
  } else {
    base = layer.project(x, layer.weight);
  }
  const auto a = child_linear(layer, "lora_A"), b = child_linear(layer, "lora_B");
  const auto h = dropout_ > 0 ? nn::functional::dropout(x, nn::functional::DropoutFuncOptions().p(dropout_).training(layer.is_training())) : x;
  return base + b->forward(a->forward(h)) * scale_;
}

torch::Tensor LoraAdapter::merged_weight(const frugal::AdaptableLinearImpl& layer) const {
  torch::NoGradGuard g;
  const auto store = store_of(layer);
  auto w = store ? dequantize(store->weight(), torch::kFloat) : layer.weight.to(torch::kFloat);
  const auto a = child_linear(layer, "lora_A"), b = child_linear(layer, "lora_B");
  const auto delta = torch::matmul(b->weight.to(torch::kFloat), a->weight.to(torch::kFloat)) * scale_;  // [out, in]
  return (w + (layer.layout == frugal::WeightLayout::InOut ? delta.t() : delta)).to(layer.weight.scalar_type());
}

// ---------------------------------------------------------------- adapting a model

namespace {

bool targeted(const std::string& name, const std::vector<std::string>& targets) {
  for (const auto& t : targets)
    if (name == t || (name.size() > t.size() && name.compare(name.size() - t.size() - 1, t.size() + 1, "." + t) == 0))
      return true;
  return false;
}

/// Each named AdaptableLinear of `model`.
std::vector<std::pair<std::string, std::shared_ptr<frugal::AdaptableLinearImpl>>> linear_layers(nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<frugal::AdaptableLinearImpl>>> out;
  for (const auto& m : model.named_modules("", /*include_self=*/false))
    if (auto l = std::dynamic_pointer_cast<frugal::AdaptableLinearImpl>(m.value())) out.emplace_back(m.key(), l);
  return out;
}

void add_adapter(frugal::AdaptableLinearImpl& layer, const LoraOptions& o, Adapted& r) {
  const auto opts = layer.weight.options();
  auto a = layer.register_module("lora_A", nn::Linear(nn::LinearOptions(layer.in_features, o.rank).bias(false)));
  auto b = layer.register_module("lora_B", nn::Linear(nn::LinearOptions(o.rank, layer.out_features).bias(false)));
  a->to(opts.device(), opts.dtype().toScalarType());  // A keeps nn::Linear's Kaiming uniform draw
  b->to(opts.device(), opts.dtype().toScalarType());
  torch::NoGradGuard g;
  b->weight.zero_();  // B = 0: the adapted model starts as the base model
  r.base_bytes += layer.weight.numel() * 4;
  if (o.quantize != "none") {
    const QuantKind kind = o.quantize == "nf4" ? QuantKind::Nf4 : QuantKind::Int8;
    auto store = layer.register_module("quant", QuantStore(quantize(layer.weight.detach(), kind, o.block, o.double_quant)));
    r.stored_bytes += store->bytes();
    layer.weight.set_data(torch::empty({0}, opts));  // the float weight is freed
  } else {
    r.stored_bytes += layer.weight.numel() * layer.weight.element_size();
  }
  layer.set_adapter(std::make_shared<LoraAdapter>(o.alpha / static_cast<double>(o.rank), o.dropout));
}

}  // namespace

Adapted adapt(nn::Module& model, const LoraOptions& o) {
  Adapted r;
  for (const auto& p : model.parameters()) r.total += p.numel();  // before any weight is quantized
  const auto layers = linear_layers(model);
  for (const auto& [name, layer] : layers) {  // every check before the first change
    if (!targeted(name, o.targets)) continue;
    if (layer->adapter())
      frugal::throw_config_error("plugins.lora: layer '" + name + "' already has an adapter");
    r.layers.push_back(name);
  }
  if (layers.empty()) return r;  // Lora::attach says the model has nothing to adapt
  for (const auto& [name, layer] : layers)
    if (targeted(name, o.targets)) add_adapter(*layer, o, r);
  if (r.layers.empty()) {
    std::string names;
    for (size_t i = 0; i < layers.size() && i < 8; ++i) names += (i ? ", " : "") + layers[i].first;
    frugal::throw_config_error("plugins.lora.targets: no linear layer of the model matches (" +
                               std::to_string(layers.size()) + " adaptable: " + (names.empty() ? "none" : names) +
                               (layers.size() > 8 ? ", ..." : "") + ")");
  }
  for (auto& p : model.named_parameters()) {
    const bool adapter = p.key().find(".lora_A.") != std::string::npos || p.key().find(".lora_B.") != std::string::npos;
    p.value().set_requires_grad(adapter);
    if (adapter) r.trainable += p.value().numel(), r.total += p.value().numel();
  }
  return r;
}

void merge_for_good(nn::Module& model) {
  torch::NoGradGuard g;
  for (const auto& [name, layer] : linear_layers(model)) {
    if (!layer->adapter()) continue;
    const auto merged = layer->adapter()->merged_weight(*layer);
    for (const char* child : {"lora_A", "lora_B", "quant"})
      if (layer->named_children().contains(child)) layer->unregister_module(child);
    layer->weight.set_data(merged.to(layer->weight.device()));
    layer->set_adapter(nullptr);
  }
}

void export_peft(const nn::Module& model, const LoraOptions& o, const std::string& arch, const std::string& folder,
                 const std::string& base) {
  const auto names = frugal::weight_names(arch);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  bool in_out = false;
  for (const auto& p : model.named_parameters()) {
    if (p.key().find(".lora_A.") == std::string::npos && p.key().find(".lora_B.") == std::string::npos) continue;
    tensors.emplace_back("base_model.model." + (names ? names->to_file(p.key()) : p.key()), p.value());
  }
  for (const auto& m : model.modules(/*include_self=*/false))
    if (const auto* l = dynamic_cast<const frugal::AdaptableLinearImpl*>(m.get()); l && l->adapter())
      in_out = l->layout == frugal::WeightLayout::InOut;
  std::filesystem::create_directories(folder);
  frugal::safetensors::write(folder + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  const nlohmann::json config = {
      {"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"}, {"r", o.rank}, {"lora_alpha", o.alpha},
      {"lora_dropout", o.dropout}, {"target_modules", o.targets}, {"fan_in_fan_out", in_out},
      {"bias", "none"}, {"inference_mode", true}, {"base_model_name_or_path", base.empty() ? arch : base},
      {"modules_to_save", nullptr}, {"init_lora_weights", true}};
  std::ofstream out(folder + "/adapter_config.json");
  out << config.dump(2) << "\n";
  out.close();
  if (!out) frugal::throw_usage_error("cannot write " + folder + "/adapter_config.json");
}

// ---------------------------------------------------------------- the callback

Lora::Lora(const LoraOptions& o, const frugal::PluginContext& ctx) : o_(o), log_(ctx.logger) {}

Lora::~Lora() {
  // The adapters' code lives in this library: a model still used elsewhere keeps their effect,
  // folded in; one nobody else holds only loses them (no allocation in a destructor then).
  if (!model_) return;
  try {
    if (model_.use_count() > 1) {
      merge_for_good(*model_);
      return;
    }
  } catch (...) {  // out of memory folding: the adapters are dropped instead
  }
  for (const auto& m : model_->modules(/*include_self=*/false))
    if (auto* layer = dynamic_cast<frugal::AdaptableLinearImpl*>(m.get())) layer->set_adapter(nullptr);
}

void Lora::attach(frugal::Learner& l) {
  model_ = l.model().ptr();
  adapted_ = adapt(*model_, o_);
  if (adapted_.layers.empty()) {
    log_->warn("nothing to adapt: the model has no adaptable linear layer (frugal::AdaptableLinear, as in "
               "gpt and gpt2); it trains as without the plugin");
    return;
  }
  l.set_optimizer(l.optimizer_options());  // over the new parameters; the frozen ones keep no state
  const auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  log_->info("{} layers adapted (rank {}, alpha {}): {} of {} parameters train ({:.2f}%); their frozen weights "
             "take {:.2f} MiB ({}) instead of {:.2f} MiB in float", adapted_.layers.size(), o_.rank, o_.alpha,
             adapted_.trainable, adapted_.total,
             100.0 * static_cast<double>(adapted_.trainable) / static_cast<double>(adapted_.total),
             mib(adapted_.stored_bytes), o_.quantize == "none" ? "float" : o_.quantize, mib(adapted_.base_bytes));
}

void Lora::after_fit(frugal::Learner& l) {
  if (!o_.export_adapter || l.run_info().out_dir.empty() || l.collective().rank() != 0) return;
  const std::string folder = l.run_info().out_dir + "/adapter";
  export_peft(*l.model(), o_, l.run_info().arch, folder, l.run_info().init_from);
  log_->info("adapter written to {} (PEFT's layout)", folder);
}

}  // namespace frugal::lora

FRUGAL_PLUGIN(frugal::lora::Lora, frugal::lora::LoraOptions, "lora",
              "low-rank adapters on frozen linear layers (LoRA); quantize = \"nf4\" keeps the frozen "
              "weights in 4 bits (QLoRA)",
              "1.0.0")
