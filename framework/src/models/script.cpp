// The TorchScript form of a model's forward: the emitters of LibTorch's own modules, and the
// walk over a model's tree (script.h).
#include "frugal/models/script.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include "models/script_builtins.h"

namespace frugal {

namespace nn = torch::nn;

// ---------------------------------------------------------------- the writer

std::string ScriptWriter::fresh(const std::string& hint) { return hint + "_" + std::to_string(next_++); }

std::string ScriptWriter::let(const std::string& expr, const std::string& hint) {
  std::string name = fresh(hint);
  line(name + " = " + expr);
  return name;
}

void ScriptWriter::line(const std::string& code) { body_ += "    " + code + "\n"; }

std::string ScriptWriter::child(const std::string& at, const std::string& key) {
  bool name = !key.empty() && !std::isdigit(static_cast<unsigned char>(key[0]));
  for (char c : key) name = name && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
  return name ? at + "." + key : "getattr(" + at + ", \"" + key + "\")";
}

std::string ScriptWriter::number(double v) {
  if (std::isinf(v)) return v > 0 ? "float(\"inf\")" : "float(\"-inf\")";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";  // a float, not an int
  return s;
}

std::string ScriptWriter::ints(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// ---------------------------------------------------------------- the emitters

namespace {

struct Emitter {
  ScriptEmitter emit;
  std::string owner;
};

std::mutex& emitters_mutex() {
  static std::mutex m;
  return m;
}

std::unordered_map<std::type_index, Emitter>& emitters();

template <size_t D>
std::vector<int64_t> vec(const torch::ExpandingArray<D>& a) {
  return std::vector<int64_t>(a->begin(), a->end());
}

/// A parameter or buffer as TorchScript reads it: `at.name`, or None when undefined.
std::string tensor_or_none(const torch::Tensor& t, const std::string& at, const std::string& name) {
  return t.defined() ? ScriptWriter::child(at, name) : "None";
}

std::string unsupported(const nn::Module& m, const std::string& why) {
  throw std::invalid_argument(m.name() + " " + why);
}

std::string linear(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& l = dynamic_cast<const nn::LinearImpl&>(m);
  return w.let("torch.linear(" + x + ", " + at + ".weight, " + tensor_or_none(l.bias, at, "bias") + ")");
}

std::string conv2d(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& c = dynamic_cast<const nn::Conv2dImpl&>(m);
  const auto& o = c.options;
  // Padding given as numbers, of zeros: `visit` and index() found on c10::variant (LibTorch 1.13)
  // and std::variant (2.x) alike.
  std::vector<int64_t> pad;
  visit([&pad](const auto& p) {
    if constexpr (std::is_same_v<std::decay_t<decltype(p)>, torch::ExpandingArray<2>>) pad = vec(p);
  }, o.padding());
  if (pad.empty() || o.padding_mode().index() != 0)
    return unsupported(m, "with padding other than numbers of zeros");
  return w.let("torch.conv2d(" + x + ", " + at + ".weight, " + tensor_or_none(c.bias, at, "bias") + ", " +
               ScriptWriter::ints(vec(o.stride())) + ", " + ScriptWriter::ints(pad) + ", " +
               ScriptWriter::ints(vec(o.dilation())) + ", " + std::to_string(o.groups()) + ")");
}

std::string batch_norm(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& b = dynamic_cast<const nn::BatchNorm2dImpl&>(m);
  if (!b.options.track_running_stats())
    return unsupported(m, "without running statistics (its eval forward uses the batch's)");
  return w.let("torch.batch_norm(" + x + ", " + tensor_or_none(b.weight, at, "weight") + ", " +
               tensor_or_none(b.bias, at, "bias") + ", " + at + ".running_mean, " + at +
               ".running_var, False, 0.0, " + ScriptWriter::number(b.options.eps()) + ", False)");
}

std::string layer_norm(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& n = dynamic_cast<const nn::LayerNormImpl&>(m);
  return w.let("torch.layer_norm(" + x + ", " + ScriptWriter::ints(n.options.normalized_shape()) + ", " +
               tensor_or_none(n.weight, at, "weight") + ", " + tensor_or_none(n.bias, at, "bias") + ", " +
               ScriptWriter::number(n.options.eps()) + ")");
}

std::string embedding(const nn::Module& m, const std::string& at, const std::string& x, ScriptWriter& w) {
  const auto& e = dynamic_cast<const nn::EmbeddingImpl&>(m);
  if (e.options.max_norm()) return unsupported(m, "with max_norm (its forward renormalizes the weights)");
  return w.let("torch.embedding(" + at + ".weight, " + x + ")");
}

std::string max_pool(const nn::Module& m, const std::string&, const std::string& x, ScriptWriter& w) {
  const auto& o = dynamic_cast<const nn::MaxPool2dImpl&>(m).options;
  return w.let("torch.max_pool2d(" + x + ", " + ScriptWriter::ints(vec(o.kernel_size())) + ", " +
               ScriptWriter::ints(vec(o.stride())) + ", " + ScriptWriter::ints(vec(o.padding())) + ", " +
               ScriptWriter::ints(vec(o.dilation())) + ", " + (o.ceil_mode() ? "True" : "False") + ")");
}

std::string adaptive_avg_pool(const nn::Module& m, const std::string&, const std::string& x, ScriptWriter& w) {
  const auto& o = dynamic_cast<const nn::AdaptiveAvgPool2dImpl&>(m).options;
  std::vector<int64_t> size;
  for (const auto& s : *o.output_size()) {
    if (!s) return unsupported(m, "with an output size that keeps the input's");
    size.push_back(*s);
  }
  return w.let("torch.adaptive_avg_pool2d(" + x + ", " + ScriptWriter::ints(size) + ")");
}

std::string flatten(const nn::Module& m, const std::string&, const std::string& x, ScriptWriter& w) {
  const auto& o = dynamic_cast<const nn::FlattenImpl&>(m).options;
  return w.let("torch.flatten(" + x + ", " + std::to_string(o.start_dim()) + ", " + std::to_string(o.end_dim()) + ")");
}

std::string gelu(const nn::Module& m, const std::string&, const std::string& x, ScriptWriter& w) {
  const auto& o = dynamic_cast<const nn::GELUImpl&>(m).options;
  return w.let("torch.gelu(" + x + ", approximate=\"" + o.approximate() + "\")");
}

std::string pointwise(const std::string& fn, const std::string& x, ScriptWriter& w) {
  return w.let(fn + "(" + x + ")");
}

std::string identity(const nn::Module&, const std::string&, const std::string& x, ScriptWriter&) { return x; }

std::unordered_map<std::type_index, Emitter>& emitters() {
  static std::unordered_map<std::type_index, Emitter> e = [] {
    std::unordered_map<std::type_index, Emitter> m;
    const ScriptAdder add = [&m](std::type_index t, ScriptEmitter f) { m[t] = Emitter{std::move(f), "frugal"}; };
    add(typeid(nn::LinearImpl), linear);
    add(typeid(nn::Conv2dImpl), conv2d);
    add(typeid(nn::BatchNorm2dImpl), batch_norm);
    add(typeid(nn::LayerNormImpl), layer_norm);
    add(typeid(nn::EmbeddingImpl), embedding);
    add(typeid(nn::MaxPool2dImpl), max_pool);
    add(typeid(nn::AdaptiveAvgPool2dImpl), adaptive_avg_pool);
    add(typeid(nn::FlattenImpl), flatten);
    add(typeid(nn::GELUImpl), gelu);
    add(typeid(nn::ReLUImpl), [](const nn::Module&, const std::string&, const std::string& x, ScriptWriter& w) {
      return pointwise("torch.relu", x, w);
    });
    add(typeid(nn::TanhImpl), [](const nn::Module&, const std::string&, const std::string& x, ScriptWriter& w) {
      return pointwise("torch.tanh", x, w);
    });
    add(typeid(nn::SigmoidImpl), [](const nn::Module&, const std::string&, const std::string& x, ScriptWriter& w) {
      return pointwise("torch.sigmoid", x, w);
    });
    // Dropout is the identity in eval mode, which is what model.pt's forward is.
    add(typeid(nn::DropoutImpl), identity);
    add(typeid(nn::Dropout2dImpl), identity);
    add(typeid(nn::IdentityImpl), identity);
    add_model_scripts(add);  // the zoo's own blocks (models.cpp, gpt.cpp)
    add_gpt_scripts(add);
    return m;
  }();
  return e;
}

}  // namespace

void register_script(std::type_index type, ScriptEmitter emit, const std::string& owner) {
  std::lock_guard<std::mutex> g(emitters_mutex());
  emitters()[type] = Emitter{std::move(emit), owner};
}

void remove_scripts(const std::string& owner) {
  std::lock_guard<std::mutex> g(emitters_mutex());
  auto& e = emitters();
  for (auto it = e.begin(); it != e.end();) it = it->second.owner == owner ? e.erase(it) : std::next(it);
}

std::string ScriptWriter::call(const nn::Module& m, const std::string& at, const std::string& x) {
  ScriptEmitter emit;
  {
    std::lock_guard<std::mutex> g(emitters_mutex());
    const auto it = emitters().find(std::type_index(typeid(m)));
    if (it != emitters().end()) emit = it->second.emit;
  }
  if (emit) return emit(m, at, x, *this);
  if (dynamic_cast<const nn::SequentialImpl*>(&m)) {  // a Sequential, or derived from one: a chain
    std::string y = x;
    for (const auto& c : m.named_children()) y = call(*c.value(), child(at, c.key()), y);
    return y;
  }
  throw std::invalid_argument(m.name() + " (at " + at + ") has no TorchScript form (register_script)");
}

ScriptSource script_forward(const nn::Module& model, const std::string& at) {
  ScriptWriter w;
  ScriptSource s;
  try {
    const std::string y = w.call(model, at, "x");
    s.code = "def forward(self, x: Tensor) -> Tensor:\n" + w.body() + "    return " + y + "\n";
  } catch (const std::invalid_argument& e) {
    s.missing = e.what();
  }
  return s;
}

}  // namespace frugal
