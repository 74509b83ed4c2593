// The registries of models, losses and datasets, and the built-in model zoo.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>

#include "frugal/models/registry.h"

#include <nlohmann/json.hpp>
#include "models/gpt.h"
#include "models/script_builtins.h"

namespace frugal {
namespace {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

std::string str(int64_t v) { return std::to_string(v); }

/// The distinct image sizes the stages use (the largest alone when none are listed).
std::vector<int64_t> distinct_sizes(const ModelInput& in) {
  std::set<int64_t> s(in.image_sizes.begin(), in.image_sizes.end());
  if (s.empty()) s.insert(in.image_size);
  return {s.begin(), s.end()};
}

/// "14 and 28", "7, 14 and 28"
std::string join_sizes(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += i + 1 == v.size() ? " and " : ", ";
    out += str(v[i]);
  }
  return out;
}

/// The one image size of a model with a fixed input size.
int64_t single_size(const std::string& arch, const ModelInput& in) {
  auto sizes = distinct_sizes(in);
  if (sizes.size() > 1)
    throw_config_error("model '" + arch + "' takes one image size; the stages use " +
                       join_sizes(sizes) +
                       ". Give every stage the same image_size, or use model.arch = \"cnn\" or "
                       "\"resnet\", which take any size");
  return sizes.front();
}

void check_input(const std::string& arch, const ModelInput& in, int64_t min_size) {
  if (in.block_size > 0)
    throw_config_error("model '" + arch + "' takes images, but the data are text (tokens); use "
                       "model.arch = \"gpt\" for text");
  if (in.channels < 1 || in.num_classes < 1)
    throw_config_error("model '" + arch + "' needs channels >= 1 and classes >= 1; got " +
                       str(in.channels) + " channels and " + str(in.num_classes) + " classes");
  for (int64_t s : distinct_sizes(in))
    if (s < min_size)
      throw_config_error("model '" + arch + "' needs images of at least " + str(min_size) + "x" +
                         str(min_size) + " pixels; got image size " + str(s));
}

void check_width(const std::string& arch, const ModelOptions& o) {
  if (o.width < 1)
    throw_config_error("model '" + arch + "': model.width must be >= 1, got " + str(o.width));
  if (o.depth < 0)
    throw_config_error("model '" + arch + "': model.depth must be >= 0, got " + str(o.depth));
  if (o.dropout < 0 || o.dropout >= 1)
    throw_config_error("model '" + arch + "': model.dropout must be in [0, 1), got " +
                       std::to_string(o.dropout));
}

/// A Sequential that can sit inside another: nn::Sequential's templated forward cannot be
/// stored in an AnyModule, this one-tensor forward can.
struct BlockImpl : nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Block);

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

// ---- mlp -----------------------------------------------------------------------------------

nn::Sequential make_mlp(const ModelOptions& o, const ModelInput& in) {
  check_width("mlp", o);
  check_input("mlp", in, 1);
  const int64_t s = single_size("mlp", in);
  nn::Sequential m;
  m->push_back("stem", Block(nn::Flatten(), nn::Linear(in.channels * s * s, o.width), nn::ReLU()));
  for (int64_t i = 1; i <= o.depth; ++i) {
    Block block(nn::Linear(o.width, o.width), nn::ReLU());
    if (o.dropout > 0) block->push_back(nn::Dropout(o.dropout));
    m->push_back("block" + str(i), block);
  }
  m->push_back("head", Block(nn::Linear(o.width, in.num_classes)));
  return m;
}

// ---- cnn -----------------------------------------------------------------------------------

/// Three conv + batch-norm blocks and a linear head. The last block pools to a fixed 7 x 7 grid
/// (as VGG does), so any image size >= 4 works; a global average pool instead loses the layout
/// and stays near 82% on Fashion-MNIST after 3 epochs, 7 x 7 reaches 88-90% after 1-2.
nn::Sequential make_cnn(const ModelOptions& o, const ModelInput& in) {
  check_width("cnn", o);
  check_input("cnn", in, 4);
  const int64_t w = o.width, grid = 7;
  nn::Sequential m;
  m->push_back("features1", Block(conv(in.channels, w, 3), nn::BatchNorm2d(w), nn::ReLU(),
                                  nn::MaxPool2d(nn::MaxPool2dOptions(2))));
  m->push_back("features2", Block(conv(w, 2 * w, 3), nn::BatchNorm2d(2 * w), nn::ReLU(),
                                  nn::MaxPool2d(nn::MaxPool2dOptions(2))));
  m->push_back("features3",
               Block(conv(2 * w, 4 * w, 3), nn::BatchNorm2d(4 * w), nn::ReLU(),
                     nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(grid)), nn::Flatten()));
  Block head;
  if (o.dropout > 0) head->push_back(nn::Dropout(o.dropout));
  head->push_back(nn::Linear(4 * w * grid * grid, in.num_classes));
  m->push_back("head", head);
  return m;
}

// ---- resnet --------------------------------------------------------------------------------

/// Two 3x3 conv + BN with a skip: identity, or a 1x1 conv + BN projection when the shape changes.
/// The activations are registered modules (not torch::relu) so plugins can reach them
/// (inplace_act); they have no parameters, so initialization is as before.
struct BasicBlockImpl : nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module("conv1", conv(in, out, 3, stride))),
        bn1(register_module("bn1", nn::BatchNorm2d(out))),
        act1(register_module("act1", nn::ReLU())),
        conv2(register_module("conv2", conv(out, out, 3))),
        bn2(register_module("bn2", nn::BatchNorm2d(out))),
        act2(register_module("act2", nn::ReLU())) {
    if (stride != 1 || in != out)
      shortcut = register_module("shortcut", Block(conv(in, out, 1, stride), nn::BatchNorm2d(out)));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = act1(bn1(conv1(x)));
    y = bn2(conv2(y));
    return act2(y + (shortcut ? shortcut->forward(x) : x));
  }
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::ReLU act1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::ReLU act2;
  Block shortcut{nullptr};
};
TORCH_MODULE(BasicBlock);

nn::Sequential make_resnet(const ModelOptions& o, const ModelInput& in) {
  check_width("resnet", o);
  check_input("resnet", in, 1);
  int64_t ch = o.width;
  nn::Sequential m;
  m->push_back("stem", Block(conv(in.channels, ch, 3), nn::BatchNorm2d(ch), nn::ReLU()));
  for (int64_t i = 1; i <= o.depth; ++i) {
    const bool down = i % 2 == 0;  // layer2, layer4, ... halve the size, double the channels
    const int64_t out = down ? 2 * ch : ch;
    m->push_back("layer" + str(i), BasicBlock(ch, out, down ? 2 : 1));
    ch = out;
  }
  Block head(nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(1)), nn::Flatten());
  if (o.dropout > 0) head->push_back(nn::Dropout(o.dropout));
  head->push_back(nn::Linear(ch, in.num_classes));
  m->push_back("head", head);
  return m;
}

// ---- vit -----------------------------------------------------------------------------------

/// Patches to tokens [B, T, width] plus a learned position embedding.
struct PatchEmbedImpl : nn::Module {
  PatchEmbedImpl(int64_t channels, int64_t width, int64_t patch, int64_t tokens)
      : proj(register_module("proj",
                             nn::Conv2d(nn::Conv2dOptions(channels, width, patch).stride(patch)))),
        pos(register_parameter("pos", torch::randn({1, tokens, width}) * 0.02)) {}
  torch::Tensor forward(torch::Tensor x) { return proj(x).flatten(2).transpose(1, 2) + pos; }
  nn::Conv2d proj;
  torch::Tensor pos;
};
TORCH_MODULE(PatchEmbed);

/// Pre-norm transformer block; attention written with matmuls (nn::MultiheadAttention's C++
/// API differs across LibTorch versions).
struct TransformerBlockImpl : nn::Module {
  TransformerBlockImpl(int64_t width, int64_t num_heads, double dropout)
      : heads(num_heads),
        p(dropout),
        ln1(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({width})))),
        qkv(register_module("qkv", nn::Linear(width, 3 * width))),
        proj(register_module("proj", nn::Linear(width, width))),
        ln2(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", nn::Linear(4 * width, width))) {}

  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), W = x.size(2), D = W / heads;
    auto q_k_v = qkv(ln1(x)).reshape({B, T, 3, heads, D}).permute({2, 0, 3, 1, 4});
    auto q = q_k_v[0], k = q_k_v[1], v = q_k_v[2];  // [B, H, T, D]
    auto att = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(D)), -1);
    att = F::dropout(att, F::DropoutFuncOptions().p(p).training(is_training()));
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, W});
    x = x + F::dropout(proj(y), F::DropoutFuncOptions().p(p).training(is_training()));
    auto h = fc2(F::gelu(fc1(ln2(x))));
    return x + F::dropout(h, F::DropoutFuncOptions().p(p).training(is_training()));
  }
  int64_t heads;
  double p;
  nn::LayerNorm ln1;
  nn::Linear qkv, proj;
  nn::LayerNorm ln2;
  nn::Linear fc1, fc2;
};
TORCH_MODULE(TransformerBlock);

/// LayerNorm, mean over tokens, Linear.
struct TokenHeadImpl : nn::Module {
  TokenHeadImpl(int64_t width, int64_t classes)
      : ln(register_module("ln", nn::LayerNorm(nn::LayerNormOptions({width})))),
        fc(register_module("fc", nn::Linear(width, classes))) {}
  torch::Tensor forward(torch::Tensor x) { return fc(ln(x).mean(1)); }
  nn::LayerNorm ln;
  nn::Linear fc;
};
TORCH_MODULE(TokenHead);

nn::Sequential make_vit(const ModelOptions& o, const ModelInput& in) {
  check_width("vit", o);
  check_input("vit", in, 1);
  const int64_t s = single_size("vit", in);
  if (o.patch < 1 || o.patch > s || s % o.patch != 0) {
    std::string divisors;
    for (int64_t d = 2; d < s; ++d)
      if (s % d == 0) divisors += (divisors.empty() ? "" : ", ") + str(d);
    throw_config_error("model 'vit': model.patch = " + str(o.patch) +
                       " does not divide the image size " + str(s) + "; choose a patch that does" +
                       (divisors.empty() ? std::string() : " (" + divisors + ")"));
  }
  if (o.heads < 1 || o.width % o.heads != 0)
    throw_config_error("model 'vit': model.heads = " + str(o.heads) +
                       " must be >= 1 and divide model.width = " + str(o.width));
  const int64_t grid = s / o.patch;
  nn::Sequential m;
  m->push_back("embed", PatchEmbed(in.channels, o.width, o.patch, grid * grid));
  for (int64_t i = 1; i <= o.depth; ++i)
    m->push_back("layer" + str(i), TransformerBlock(o.width, o.heads, o.dropout));
  m->push_back("head", TokenHead(o.width, in.num_classes));
  return m;
}

// ---- their TorchScript forms (script.h): the same operators, in eval mode ----------------

std::string basic_block_script(const nn::Module& m, const std::string& at, const std::string& x,
                               ScriptWriter& w) {
  const auto& b = dynamic_cast<const BasicBlockImpl&>(m);
  auto y = w.call(*b.act1, at + ".act1", w.call(*b.bn1, at + ".bn1", w.call(*b.conv1, at + ".conv1", x)));
  y = w.call(*b.bn2, at + ".bn2", w.call(*b.conv2, at + ".conv2", y));
  const auto skip = b.shortcut ? w.call(*b.shortcut, at + ".shortcut", x) : x;
  return w.call(*b.act2, at + ".act2", w.let(y + " + " + skip));
}

std::string patch_embed_script(const nn::Module& m, const std::string& at, const std::string& x,
                               ScriptWriter& w) {
  const auto& p = dynamic_cast<const PatchEmbedImpl&>(m);
  return w.let(w.call(*p.proj, at + ".proj", x) + ".flatten(2).transpose(1, 2) + " + at + ".pos");
}

std::string transformer_block_script(const nn::Module& m, const std::string& at, const std::string& x,
                                     ScriptWriter& w) {
  const auto& b = dynamic_cast<const TransformerBlockImpl&>(m);
  const int64_t width = b.ln1->options.normalized_shape().at(0), d = width / b.heads;
  const auto B = w.let(x + ".size(0)", "b"), T = w.let(x + ".size(1)", "t");
  const auto qkv = w.let(w.call(*b.qkv, at + ".qkv", w.call(*b.ln1, at + ".ln1", x)) + ".reshape([" + B + ", " +
                         T + ", 3, " + str(b.heads) + ", " + str(d) + "]).permute([2, 0, 3, 1, 4])");
  const auto att = w.let("torch.softmax(torch.matmul(" + qkv + "[0], " + qkv + "[1].transpose(-2, -1)) / " +
                         ScriptWriter::number(std::sqrt(double(d))) + ", -1)");
  const auto y = w.let("torch.matmul(" + att + ", " + qkv + "[2]).transpose(1, 2).reshape([" + B + ", " + T +
                       ", " + str(width) + "])");
  const auto x1 = w.let(x + " + " + w.call(*b.proj, at + ".proj", y));
  const auto h = w.call(*b.fc1, at + ".fc1", w.call(*b.ln2, at + ".ln2", x1));
  return w.let(x1 + " + " + w.call(*b.fc2, at + ".fc2", w.let("torch.gelu(" + h + ")")));
}

std::string token_head_script(const nn::Module& m, const std::string& at, const std::string& x,
                              ScriptWriter& w) {
  const auto& h = dynamic_cast<const TokenHeadImpl&>(m);
  return w.call(*h.fc, at + ".fc", w.let(w.call(*h.ln, at + ".ln", x) + ".mean(1)"));
}

// ---- losses and datasets -------------------------------------------------------------------

LossFn cross_entropy(const LossOptions& o) {
  const double smoothing = o.label_smoothing;
  return [smoothing](const torch::Tensor& pred, const torch::Tensor& target) {
    if (target.is_floating_point())
      throw_config_error("loss 'cross_entropy' takes class labels, but the targets are floats (a "
                         "regression): set [loss] name = \"mse\"");
    // Logits [..., C] with targets [...]: one prediction per token of a sequence too.
    const auto opts = F::CrossEntropyFuncOptions().label_smoothing(smoothing);
    if (pred.dim() <= 2) return F::cross_entropy(pred, target, opts);
    return F::cross_entropy(pred.reshape({-1, pred.size(-1)}), target.reshape({-1}), opts);
  };
}

/// Mean squared error of a regression: one output per target ([B, 1] or [B] for [B]).
LossFn mse(const LossOptions&) {
  return [](const torch::Tensor& pred, const torch::Tensor& target) {
    if (!target.is_floating_point())
      throw_config_error("loss 'mse' takes float targets (data.task = \"regression\"), but the "
                         "targets are class labels: set [loss] name = \"cross_entropy\"");
    if (pred.numel() != target.numel())
      throw_config_error("loss 'mse': the model predicts " + str(pred.numel()) + " values for " +
                         str(target.numel()) + " targets; a regression model has one output");
    // In the target's dtype: under autocast the prediction may be bfloat16.
    return F::mse_loss(pred.reshape(target.sizes()).to(target.scalar_type()), target);
  };
}

Dataset fashion_mnist(const DataOptions& o, bool train) {
  return load_fashion_mnist(o.path, train);
}

Dataset synthetic(const DataOptions& o, bool train) {
  const int64_t n = train ? o.samples : std::max<int64_t>(o.samples / 4, 1);
  return make_synthetic(n, o.channels, o.image_size, o.image_size, o.classes, train ? 1 : 2);
}

Dataset text(const DataOptions& o, bool train) {
  const auto tok = text_tokenizer(o);
  if (!o.valid_path.empty())
    return load_text(o.paths, {o.valid_path}, o.block_size, o.windows_per_epoch, train, tok);
  return load_text(o.paths, o.block_size, o.windows_per_epoch, train, tok);
}

/// The validation split's path; the run may have trained without one (`frugal evaluate`).
const std::string& valid_path(const DataOptions& o) {
  if (o.valid_path.empty())
    throw_data_error("data.valid_path is empty: the " + o.dataset + " dataset's validation " +
                     (o.dataset == "csv" ? "file" : "folder") + " is not named");
  return o.valid_path;
}

Dataset image_folder(const DataOptions& o, bool train) {
  if (train) return load_image_folder(o.path, o.channels, o.image_size);
  // The training folder's classes, so label i means the same class in both splits.
  return load_image_folder(valid_path(o), o.channels, o.image_size, list_image_folder(o.path).classes);
}

Dataset csv(const DataOptions& o, bool train) {
  const CsvSpec spec{o.label_column, o.task == "regression"};
  return load_csv(train ? o.path : valid_path(o), spec, o.path);
}

}  // namespace

void add_model_scripts(const ScriptAdder& add) {
  add(typeid(BasicBlockImpl), basic_block_script);
  add(typeid(PatchEmbedImpl), patch_embed_script);
  add(typeid(TransformerBlockImpl), transformer_block_script);
  add(typeid(TokenHeadImpl), token_head_script);
}

Registry<ModelFactory>& models() {
  static Registry<ModelFactory> r("model");
  static const bool builtins = [] {
    using Keys = std::vector<std::string>;
    r.add("mlp", make_mlp, "fully connected: stem, block1..block<depth>, head", "frugal",
          Keys{"width", "depth", "dropout"});
    r.add("cnn", make_cnn, "three conv + batch-norm blocks (features1..3) and a linear head",
          "frugal", Keys{"width", "dropout"});
    r.add("resnet", make_resnet,
          "residual basic blocks layer1..layer<depth>; even layers halve the size", "frugal",
          Keys{"width", "depth", "dropout"});
    r.add("vit", make_vit, "vision transformer: embed, layer1..layer<depth>, head", "frugal",
          Keys{"width", "depth", "dropout", "patch", "heads"});
    r.add("gpt", make_gpt,
          "decoder-only transformer over bytes: embed, block0..block<n_layer-1>, ln_f, head",
          "frugal", Keys{"n_layer", "n_head", "n_embd", "block_size", "dropout"});
    r.add("gpt2", make_gpt2,
          "Hugging Face's GPT-2 (Conv1D weights, tanh GELU, tied head; config.json and "
          "safetensors of a model.init_from folder load as they are): embed, block0.., ln_f, head",
          "frugal", Keys{"n_layer", "n_head", "n_embd", "block_size", "dropout"});
    return true;
  }();
  (void)builtins;
  return r;
}

Registry<LossFactory>& losses() {
  static Registry<LossFactory> r("loss");
  static const bool builtins = [] {
    r.add("cross_entropy", cross_entropy, "cross entropy with optional label smoothing");
    r.add("mse", mse, "mean squared error of a regression (data.task = \"regression\")");
    return true;
  }();
  (void)builtins;
  return r;
}

Registry<DatasetFactory>& datasets() {
  static Registry<DatasetFactory> r("dataset");
  static const bool builtins = [] {
    using Keys = std::vector<std::string>;
    const Keys images = {"flip", "crop_padding", "stages.image_size"};
    const auto with = [](Keys a, const Keys& b) {
      a.insert(a.end(), b.begin(), b.end());
      return a;
    };
    r.add("fashion-mnist", fashion_mnist, "Fashion-MNIST from data.path (dataset-fashion-mnist)",
          "frugal", with({"path"}, images));
    r.add("synthetic", synthetic, "random images with learnable labels of any shape", "frugal",
          with({"channels", "image_size", "classes", "samples"}, images));
    r.add("text", text,
          "tokens (bytes, sentencepiece or gpt2's BPE) of text files (data.paths) in windows of "
          "block_size; validation is data.valid_path or the corpus' last tenth",
          "frugal", Keys{"paths", "valid_path", "block_size", "windows_per_epoch", "stages.seq_len", "tokenizer",
                         "vocab_size", "tokenizer_model", "tokenizer_path"});
    r.add("image_folder", image_folder,
          "PNG/JPEG images, one sub-folder per class (data.path, data.valid_path), resized to "
          "data.image_size and cached in memory as uint8",
          "frugal", with({"path", "valid_path", "channels", "image_size"}, images));
    r.add("csv", csv,
          "numeric features and a label column (data.path, data.valid_path); classification or "
          "regression (data.task)",
          "frugal", Keys{"path", "valid_path", "label_column", "task"});
    return true;
  }();
  (void)builtins;
  return r;
}

namespace {
std::mutex names_mutex;
std::map<std::string, WeightNames>& names_by_arch() {
  static std::map<std::string, WeightNames> m{{"gpt2", gpt2_weight_names()}};
  return m;
}
}  // namespace

void set_weight_names(const std::string& arch, WeightNames names) {
  std::lock_guard<std::mutex> g(names_mutex);
  if (names.to_file) names_by_arch()[arch] = std::move(names);
  else names_by_arch().erase(arch);
}

std::optional<WeightNames> weight_names(const std::string& arch) {
  std::lock_guard<std::mutex> g(names_mutex);
  auto it = names_by_arch().find(arch);
  if (it == names_by_arch().end()) return std::nullopt;
  return it->second;
}

torch::nn::Sequential make_model(const ModelOptions& o, const ModelInput& in) {
  return models().get(o.arch).make(o, in);
}

LossFn make_loss(const LossOptions& o) { return losses().get(o.name).make(o); }

namespace {
/// data.train_samples: at most what the split holds (a larger count trained on the whole split
/// without a word). data.valid_samples is a cap: the validation split may hold fewer.
Dataset head(const Dataset& d, const DataOptions& o, bool train) {
  const int64_t n = train ? o.train_samples : o.valid_samples;
  if (n <= 0) return d;
  if (train && n > d.size())
    throw_config_error("data.train_samples = " + str(n) + ", but the " + o.dataset +
                       " dataset's training split holds " + str(d.size()) +
                       (d.is_text() ? " windows" : " samples") + "; use at most " + str(d.size()) +
                       " (0 = all)");
  return d.head(n);
}
}  // namespace

Dataset make_dataset(const DataOptions& o, bool train) {
  Dataset d = datasets().get(o.dataset).make(o, train);
  if (train) {
    d.augment.flip = o.flip;
    d.augment.crop_padding = o.crop_padding;
  }
  return head(d, o, train);
}

namespace {

using Names = std::vector<std::string>;

/// The names of the entries of `r` that declare reading `key`.
template <class F>
std::string readers(const Registry<F>& r, const std::string& key) {
  std::string out;
  for (const auto& name : r.names()) {
    const auto e = r.get(name);
    if (e.reads && std::find(e.reads->begin(), e.reads->end(), key) != e.reads->end())
      out += (out.empty() ? "" : ", ") + name;
  }
  return out.empty() ? "none of the built-in ones" : out;
}

/// Every key of `o` changed from `defaults` that `entry` does not read: ConfigError.
template <class F>
void check_section(const Registry<F>& r, const std::string& chosen, const std::string& section,
                   Options& o, Options& defaults, const Names& shared) {
  const auto e = r.get(chosen);
  if (!e.reads) return;
  const nlohmann::json now = options_to_json(o), base = options_to_json(defaults);
  for (const auto& [key, value] : now.items()) {
    if (std::find(shared.begin(), shared.end(), key) != shared.end()) continue;
    if (std::find(e.reads->begin(), e.reads->end(), key) != e.reads->end()) continue;
    if (base.contains(key) && base[key] == value) continue;
    throw_config_error(section + "." + key + " = " + value.dump() + ": the " + r.what() + " '" +
                       chosen + "' does not read it (" + section + "." + key + " is read by " +
                       readers(r, key) + "); remove it or choose a " + r.what() + " that uses it");
  }
}

}  // namespace

void check_keys_are_read(const DataOptions& d, const ModelOptions& m,
                         const std::vector<StageOptions>& stages) {
  // What the loader reads for every dataset, and what chooses the entry.
  const Names data_shared = {"dataset", "batch_size", "valid_batch_size", "train_samples",
                             "valid_samples", "shuffle"};
  DataOptions data = d, data_defaults;
  check_section(datasets(), d.dataset, "data", data, data_defaults, data_shared);
  ModelOptions model = m, model_defaults;
  check_section(models(), m.arch, "model", model, model_defaults,
                {"arch", "init_from", "init_strict", "init_prefixes"});
  const auto e = datasets().get(d.dataset);
  if (!e.reads) return;
  const auto reads = [&](const char* key) {
    return std::find(e.reads->begin(), e.reads->end(), key) != e.reads->end();
  };
  for (size_t i = 0; i < stages.size(); ++i) {
    const std::string at = "stages." + str(static_cast<int64_t>(i));
    if (stages[i].image_size != 0 && !reads("stages.image_size"))
      throw_config_error(at + ".image_size = " + str(stages[i].image_size) + ": the dataset '" +
                         d.dataset + "' holds no images to resize (read by " +
                         readers(datasets(), "stages.image_size") + "); remove it");
    if (stages[i].seq_len != 0 && !reads("stages.seq_len"))
      throw_config_error(at + ".seq_len = " + str(stages[i].seq_len) + ": the dataset '" + d.dataset +
                         "' holds no token windows to shorten (read by " +
                         readers(datasets(), "stages.seq_len") + "); remove it");
  }
}

}  // namespace frugal
