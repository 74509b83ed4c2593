#pragma once
/// inplace_act: runs the model's activation modules (ReLU, LeakyReLU, ReLU6, Hardtanh, ELU,
/// SELU, CELU, RReLU, the Dropout family) in their in-place forms where that is safe,
/// and proves it on a real batch before training: one forward and backward with the model as it
/// was, one with the modules flipped; gradients and outputs must match and autograd must not
/// report a saved tensor modified in place. A module that breaks the check goes back to its
/// out-of-place form, with a warning naming it.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/plugin.h>
#include <torch/torch.h>

namespace frugal::inplace_act {

/// Where an activation module sits, which decides whether its input may be overwritten.
enum class Place {
  Chain,     ///< in a Sequential after another module: its input is that module's output alone
  Opaque,    ///< registered in a module with its own forward: only the check can tell
  ModelInput ///< the first module of the model: in place would overwrite the batch
};

/// An activation module with an in-place form.
struct Site {
  std::string name;  ///< qualified name in the model: "stem.2", "layer1.act2"
  std::string type;  ///< "ReLU", "Dropout", ...
  Place place = Place::Chain;
  std::shared_ptr<torch::nn::Module> module;
  bool* flag = nullptr;  ///< the module's options.inplace()
  bool was_inplace = false;
  std::string label() const { return name + " (" + type + ")"; }
};

/// Every activation module of `model` with an in-place form, in forward order for Sequentials.
std::vector<Site> find_sites(const std::shared_ptr<torch::nn::Module>& model);

/// What apply() did.
struct Outcome {
  std::vector<Site> changed;                            ///< now in place
  std::vector<std::pair<Site, std::string>> reverted;   ///< tried, failed the check, and why
  std::vector<std::pair<Site, std::string>> skipped;    ///< not tried, and why
  int passes = 0;                                       ///< forward + backward passes run
  double max_difference = 0;                            ///< of the accepted set, relative
  int64_t peak_before = 0, peak_after = 0;  ///< a check pass's added peak bytes, out of / in place
  std::string check_error;  ///< the unchanged model's own pass failed: nothing was changed
};

/// What apply() may try (the plugin's options, as plain data).
struct Settings {
  bool verify = true;          ///< check on a batch; false: flip Chain sites unchecked
  bool custom_modules = true;  ///< also try modules inside custom forwards (needs verify)
  bool dropout = false;        ///< also try the Dropout family (CPU only: see the README)
  double tolerance = 1e-5;     ///< relative difference allowed in outputs and gradients
  std::vector<std::string> exclude;  ///< names (or name prefixes) never touched
};

/// Flips the eligible sites of `model` to in place, verified on (x, y) when s.verify: the flipped
/// set is accepted when it passes the check; otherwise sites are added one at a time in forward
/// order and each one that breaks the check goes back. The model's parameters, gradients,
/// buffers, train modes and the RNG are as before. When the unchanged model's own pass fails,
/// nothing changes and check_error says why.
Outcome apply(torch::nn::Sequential& model, const LossFn& loss_fn, const torch::Tensor& x,
              const torch::Tensor& y, const torch::Device& device, const Settings& s);

/// "stem.2 (ReLU), block1.1 (ReLU)"
std::string describe(const std::vector<Site>& sites);

/// [plugins.inplace_act]: TOML keys are the field names.
struct InplaceActOptions : frugal::Options {
  bool verify = true;
  bool custom_modules = true;
  bool dropout = false;
  double tolerance = 1e-5;
  std::vector<std::string> exclude;
  void visit(frugal::FieldVisitor& v) override;
  Settings settings() const { return {verify, custom_modules, dropout, tolerance, exclude}; }
};

/// The callback. before_fit flips and checks; after_fit puts every flag back as it was.
class InplaceAct : public frugal::Callback {
 public:
  InplaceAct(const InplaceActOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "inplace_act"; }
  /// Its before_fit runs before the other plugins' (the model is final when they look).
  int order() const override { return frugal::order::kModelRewrite; }

  void before_fit(frugal::Learner& l) override;
  void after_fit(frugal::Learner&) override;

  /// What the last before_fit did (changed, reverted, skipped), for tests and tools.
  const Outcome& outcome() const { return outcome_; }

 private:
  InplaceActOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  Outcome outcome_;
};

}  // namespace frugal::inplace_act
