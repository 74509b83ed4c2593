#pragma once
/// The TorchScript form of a model's forward, so that model.pt is a module a PyTorch user
/// calls: `torch.jit.load("runs/x/model.pt")(x)` with no frugal installed. A model is walked
/// module by module; each module type has an emitter that writes its forward, in eval mode
/// (dropout off, batch norm on its running statistics), as TorchScript lines over the same
/// parameters, so the scripted forward computes what the C++ forward computes with the same
/// ATen operators. Any Sequential (or a class derived from it) chains its children. A plugin
/// that adds a model with its own module types registers their emitters here, as it registers
/// the model (and removes them before it unloads: the plugin loader does it for it).
#include <functional>
#include <string>
#include <typeindex>
#include <vector>

#include <torch/torch.h>

namespace frugal {

/// The lines of one TorchScript function under construction.
class ScriptWriter {
 public:
  /// A fresh local name, "<hint>_<n>", unique in this function.
  std::string fresh(const std::string& hint = "x");
  /// Appends `name = expr` for a fresh name and returns the name.
  std::string let(const std::string& expr, const std::string& hint = "x");
  /// Appends one line of the function's body (indented for it).
  void line(const std::string& code);
  /// The forward of `m`, reached from `self` as the expression `at`, applied to the tensor
  /// variable `x`: its lines appended, the name of its output returned. Throws
  /// std::invalid_argument naming the module type when no emitter knows it.
  std::string call(const torch::nn::Module& m, const std::string& at, const std::string& x);
  /// `at.key`, or getattr(at, "key") when key is not a Python name ("0", "1", ...).
  static std::string child(const std::string& at, const std::string& key);
  /// A double as TorchScript reads it back exactly ("1e-05", "float(\"-inf\")").
  static std::string number(double v);
  /// A list of ints: "[2, 2]".
  static std::string ints(const std::vector<int64_t>& v);

  /// The body written so far, each line indented by four spaces.
  const std::string& body() const { return body_; }

 private:
  std::string body_;
  int64_t next_ = 0;
};

/// Writes the forward of one module: `m` (whose dynamic type the emitter was registered for),
/// reached as `at`, on the variable `x`; returns the variable holding the output.
using ScriptEmitter =
    std::function<std::string(const torch::nn::Module& m, const std::string& at,
                              const std::string& x, ScriptWriter& w)>;

/// Registers the emitter of module type `type` (typeid of the Impl class).
void register_script(std::type_index type, ScriptEmitter emit, const std::string& owner = "frugal");
template <class ModuleImpl>
void register_script(ScriptEmitter emit, const std::string& owner = "frugal") {
  register_script(std::type_index(typeid(ModuleImpl)), std::move(emit), owner);
}
/// Removes every emitter `owner` registered (a plugin's, before its library unloads).
void remove_scripts(const std::string& owner);

/// TorchScript source of `def forward(self, x: Tensor) -> Tensor:` for `model`, reached from
/// self as `at` ("self.model"). `missing` is empty on success; otherwise the source is empty
/// and `missing` names the module (its path in the model and its C++ type) no emitter knows.
struct ScriptSource {
  std::string code;
  std::string missing;
};
ScriptSource script_forward(const torch::nn::Module& model, const std::string& at);

}  // namespace frugal
