// The optimizer registry: each built-in's state bytes and step needs (the numbers the Learner's
// own switch gave before the registry), an entry registered as a plugin would (usable from
// TOML, inherited by stages, round-tripped), per-optimizer keys and their errors.
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "frugal/base/error.h"
#include "frugal/config/config.h"
#include "frugal/optim/optimizers.h"

namespace frugal {
namespace {

std::string optimizer_config_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(text, "cfg.toml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for:\n" << text;
  return "";
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError";
  return "";
}

/// Linear(4, 3): a 48-byte weight and a 12-byte bias; 60 bytes train.
torch::nn::Linear tiny_linear() {
  torch::manual_seed(0);
  return torch::nn::Linear(4, 3);
}

OptimizerOptions options(const std::string& name, double weight_decay = 0,
                         double momentum = -1) {
  OptimizerOptions o;
  o.name = name;
  o.lr = 0.1;
  o.weight_decay = weight_decay;
  if (momentum >= 0) o.set("momentum", momentum);
  return o;
}

/// `o` with LibTorch's own step (optimizer.fused = false).
OptimizerOptions plain(OptimizerOptions o) {
  o.set("fused", false);
  return o;
}

void one_step(torch::nn::Linear& lin, torch::optim::Optimizer& opt) {
  lin->forward(torch::ones({2, 4})).sum().backward();
  opt.step();
}

// ---- the built-ins: the numbers the former code gave ----------------------------------------

TEST(OptimizerRegistry, BuiltinsAreRegisteredWithTheirKeys) {
  EXPECT_EQ(optimizers().names(),
            (std::vector<std::string>{"adafactor", "adagrad", "adam", "adam8bit", "adamw", "adamw8bit",
                                      "rmsprop", "sgd"}));
  auto keys = [](const std::string& name) {
    std::vector<std::string> out;
    for (const auto& f : describe_optimizer_keys(name)) out.push_back(f["key"]);
    return out;
  };
  EXPECT_EQ(keys("adam"), (std::vector<std::string>{"beta1", "beta2", "eps", "fused"}));
  EXPECT_EQ(keys("adamw"), (std::vector<std::string>{"beta1", "beta2", "eps", "fused"}));
  EXPECT_EQ(keys("sgd"), (std::vector<std::string>{"momentum", "fused"}));
  EXPECT_EQ(keys("rmsprop"), (std::vector<std::string>{"momentum", "eps"}));
  EXPECT_EQ(keys("adagrad"), (std::vector<std::string>{"eps"}));
}

TEST(OptimizerRegistry, StateBytesOfEachBuiltinAfterAStep) {
  struct Case {
    OptimizerOptions o;
    int64_t bytes;
  };
  const std::vector<Case> cases = {
      {options("adam"), 120},          {options("adamw"), 120},
      {options("sgd"), 0},             {options("sgd", 0, 0.9), 60},
      {options("rmsprop"), 60},        {options("rmsprop", 0, 0.9), 120},
      {options("adagrad"), 60}};
  for (const auto& c : cases) {
    auto lin = tiny_linear();
    auto opt = make_optimizer(c.o, lin->parameters());
    one_step(lin, *opt);
    EXPECT_EQ(optimizer_state_bytes(*opt), c.bytes) << c.o.name << " " << c.o.own;
  }
}

TEST(OptimizerRegistry, StepNeedsOfEachBuiltinMatchTheFormerNumbers) {
  // total 60 bytes train, the largest parameter is 48: the micro-batch probe's former switch
  // gave these (Adagrad's state exists from construction: none is left to create). The fused
  // step (the default on the CPU) makes no temporaries; LibTorch's makes the former numbers.
  struct Case {
    OptimizerOptions o;
    int64_t state, temporaries;
  };
  const std::vector<Case> cases = {
      {plain(options("adam")), 120, 96},   {plain(options("adam", 0.1)), 120, 144},
      {plain(options("adamw")), 120, 96},  {plain(options("adamw", 0.1)), 120, 96},
      {plain(options("sgd")), 0, 0},       {plain(options("sgd", 0, 0.9)), 60, 0},
      {plain(options("sgd", 0.1, 0.9)), 60, 48},
      {options("adam"), 120, 0},           {options("adam", 0.1), 120, 0},
      {options("adamw", 0.1), 120, 0},     {options("sgd", 0.1, 0.9), 60, 0},
      {options("rmsprop"), 60, 48},
      {options("rmsprop", 0.1, 0.9), 120, 96},
      {options("adagrad"), 0, 48},         {options("adagrad", 0.1), 0, 96}};
  for (const auto& c : cases) {
    auto lin = tiny_linear();
    auto opt = make_optimizer(c.o, lin->parameters());
    const StepNeeds n = optimizer_step_needs(*lin, *opt, c.o);
    EXPECT_EQ(n.state, c.state) << c.o.name << " " << c.o.own << " wd " << c.o.weight_decay;
    EXPECT_EQ(n.temporaries, c.temporaries) << c.o.name << " " << c.o.own;
  }
  // After a step Adam's state exists; a frozen bias neither trains nor needs state.
  auto lin = tiny_linear();
  auto adam = make_optimizer(options("adam"), lin->parameters());
  one_step(lin, *adam);
  EXPECT_EQ(optimizer_step_needs(*lin, *adam, options("adam")).state, 0);
  auto frozen = tiny_linear();
  frozen->bias.set_requires_grad(false);
  auto opt = make_optimizer(plain(options("adam")), frozen->parameters());
  EXPECT_EQ(optimizer_step_needs(*frozen, *opt, plain(options("adam"))).state, 96);
  EXPECT_EQ(optimizer_step_needs(*frozen, *opt, plain(options("adam"))).temporaries, 96);
}

// ---- weight decay on matrices only ---------------------------------------------------------

/// One step with zero gradients: Adam(W)'s update is 0, so only the decay moves a parameter.
std::pair<bool, bool> decayed_after_a_silent_step(const OptimizerOptions& o) {
  auto lin = tiny_linear();
  const auto w = lin->weight.detach().clone(), b = lin->bias.detach().clone();
  auto opt = make_optimizer(o, lin->parameters());
  for (auto& p : lin->parameters()) p.mutable_grad() = torch::zeros_like(p);
  opt->step();
  return {!torch::equal(lin->weight.detach(), w), !torch::equal(lin->bias.detach(), b)};
}

TEST(WeightDecay, DecoupledDecaySparesBiasesAndNormsUnlessAskedAndAdamsL2DecaysAll) {
  for (const std::string name : {"adamw", "adamw8bit"}) {
    OptimizerOptions o = options(name);
    o.weight_decay = 0.1;
    EXPECT_EQ(decayed_after_a_silent_step(o), std::make_pair(true, false)) << name << " auto";
    o.decay = "all";
    EXPECT_EQ(decayed_after_a_silent_step(o), std::make_pair(true, true)) << name << " all";
    o.decay = "matrices";
    auto lin = tiny_linear();
    auto opt = make_optimizer(o, lin->parameters());
    ASSERT_EQ(opt->param_groups().size(), 2u);  // matrices with decay, then the rest without
    EXPECT_EQ(opt->param_groups()[0].params().size(), 1u);
    EXPECT_TRUE(opt->param_groups()[0].params()[0].is_same(lin->weight));
    EXPECT_TRUE(opt->param_groups()[1].params()[0].is_same(lin->bias));
  }
  OptimizerOptions adam = options("adam");  // L2 in the gradient: "auto" is all
  adam.weight_decay = 0.1;
  EXPECT_EQ(decayed_after_a_silent_step(adam), std::make_pair(true, true));
  adam.decay = "matrices";
  EXPECT_EQ(decayed_after_a_silent_step(adam), std::make_pair(true, false));
  OptimizerOptions none = options("adamw");  // no decay: one group, as before
  EXPECT_EQ(make_optimizer(none, tiny_linear()->parameters())->param_groups().size(), 1u);
}

TEST(WeightDecay, TwoGroupsSaveAndLoadAndContinueBitwise) {
  OptimizerOptions o = options("adamw");
  o.weight_decay = 0.1;
  auto a = tiny_linear();
  auto opt = make_optimizer(o, a->parameters());
  one_step(a, *opt);
  torch::serialize::OutputArchive out;
  opt->save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  auto b = tiny_linear();
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  auto reloaded = make_optimizer(o, b->parameters());
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  reloaded->load(in);
  opt->zero_grad();
  one_step(a, *opt);
  one_step(b, *reloaded);
  EXPECT_TRUE(torch::equal(a->weight, b->weight));
  EXPECT_TRUE(torch::equal(a->bias, b->bias));
}

TEST(OptimizerRegistry, UnknownNameListsTheRegisteredNames) {
  const std::string built = error_of([] {
    make_optimizer(options("adma"), {torch::zeros({1}, torch::requires_grad())});
  });
  EXPECT_EQ(built,
            "unknown optimizer 'adma'; did you mean 'adam'? Available: adafactor, adagrad, adam, "
            "adam8bit, adamw, adamw8bit, rmsprop, sgd");
  EXPECT_EQ(optimizer_config_error("[optimizer]\nname = \"lamb\"\n"),
            "cfg.toml:2:8: 'optimizer.name' must be one of adafactor, adagrad, adam, adam8bit, "
            "adamw, adamw8bit, rmsprop, sgd; got \"lamb\"");
}

// ---- an entry registered as a plugin would ---------------------------------------------------

struct NesterovKeys : Options {
  double momentum = 0.5;
  int64_t warm_steps = 3;
  void visit(FieldVisitor& v) override {
    v.field("momentum", momentum, "momentum", between(0, 1));
    v.field("warm_steps", warm_steps, "steps before momentum", at_least(0));
  }
};

/// Registers "test_nesterov" (SGD with Nesterov momentum) with owner "test-plugin" for the
/// test's lifetime, as a plugin's on_load would.
class PluginOptimizer : public ::testing::Test {
 protected:
  void SetUp() override {
    OptimizerFactory f;
    f.make_options = [] { return std::make_unique<NesterovKeys>(); };
    f.build = [](const OptimizerOptions& o, std::vector<torch::Tensor> params) {
      const auto k = o.own_as<NesterovKeys>();
      return std::make_unique<torch::optim::SGD>(
          std::move(params), torch::optim::SGDOptions(o.lr).momentum(k.momentum).nesterov(true));
    };
    f.step_needs = [](const OptimizerOptions& o, const TrainableBytes& p) {
      return StepNeeds{p.total, o.own_as<NesterovKeys>().warm_steps * p.largest};
    };
    optimizers().add("test_nesterov", f, "SGD with Nesterov momentum (test)", "test-plugin");
  }
  void TearDown() override { optimizers().remove_owner("test-plugin"); }
};

TEST_F(PluginOptimizer, ItsNameAndKeysAreReadFromToml) {
  Config c = parse_config(
      "[optimizer]\nname = \"test_nesterov\"\nlr = 0.2\nmomentum = 0.8\nwarm_steps = 5\n"
      "[[stages]]\nname = \"a\"\n[[stages]]\nname = \"b\"\n[stages.optimizer]\nlr = 0.05\n",
      "cfg.toml");
  EXPECT_EQ(c.optimizer.name, "test_nesterov");
  EXPECT_DOUBLE_EQ(c.optimizer.get<double>("momentum"), 0.8);
  EXPECT_EQ(c.optimizer.get<int64_t>("warm_steps"), 5);
  // The stage inherits the name and the optimizer's own keys.
  const OptimizerOptions& b = c.stages[1].optimizer;
  EXPECT_EQ(b.name, "test_nesterov");
  EXPECT_DOUBLE_EQ(b.lr, 0.05);
  EXPECT_EQ(b.get<int64_t>("warm_steps"), 5);

  auto lin = tiny_linear();
  auto opt = make_optimizer(b, lin->parameters());
  auto& sgd = static_cast<torch::optim::SGDOptions&>(opt->param_groups()[0].options());
  EXPECT_DOUBLE_EQ(sgd.momentum(), 0.8);
  EXPECT_TRUE(sgd.nesterov());
  EXPECT_DOUBLE_EQ(sgd.lr(), 0.05);
  // Its step needs come from its entry; its state from the entry whose class it is (SGD).
  EXPECT_EQ(optimizer_step_needs(*lin, *opt, b).temporaries, 5 * 48);
  one_step(lin, *opt);
  EXPECT_EQ(optimizer_state_bytes(*opt), 60);

  // The resolved config reads back the same.
  const Config d = parse_config(c.to_toml(), "resolved.toml");
  EXPECT_EQ(d.optimizer.own, c.optimizer.own);
  EXPECT_EQ(d.stages[1].optimizer.own, b.own);
  EXPECT_EQ(d.to_toml(), c.to_toml());
}

TEST_F(PluginOptimizer, KeysOfOtherOptimizersAreRefusedNamingIt) {
  EXPECT_EQ(optimizer_config_error("[optimizer]\nname = \"test_nesterov\"\nbeta1 = 0.9\n"),
            "cfg.toml:3:1: unknown key 'optimizer.beta1'. 'beta1' is a key of adafactor, adam, "
            "adam8bit, adamw and adamw8bit, "
            "not of optimizer \"test_nesterov\". Allowed keys in [optimizer]: name, lr, "
            "weight_decay, decay, clip_grad_norm, clip_grad_value, momentum, warm_steps");
  EXPECT_EQ(optimizer_config_error("[optimizer]\nname = \"test_nesterov\"\nmomentum = 1.5\n"),
            "cfg.toml:3:12: 'optimizer.momentum' must be a number in [0, 1], got 1.5");
}

TEST_F(PluginOptimizer, UnregisteredItIsUnknownAgain) {
  optimizers().remove_owner("test-plugin");
  const std::string msg = optimizer_config_error("[optimizer]\nname = \"test_nesterov\"\n");
  EXPECT_NE(msg.find("must be one of adafactor, adagrad, adam, adam8bit, adamw, adamw8bit, rmsprop, sgd"),
            std::string::npos)
      << msg;
}

// ---- per-optimizer keys ----------------------------------------------------------------------

TEST(OptimizerKeys, AKeyOfAnotherOptimizerIsAnErrorNamingTheOptimizerAndItsKeys) {
  EXPECT_EQ(optimizer_config_error("[optimizer]\nname = \"adam\"\nmomentum = 0.9\n"),
            "cfg.toml:3:1: unknown key 'optimizer.momentum'. 'momentum' is a key of rmsprop and "
            "sgd, not of optimizer \"adam\". Allowed keys in [optimizer]: name, lr, weight_decay, decay, clip_grad_norm, clip_grad_value, "
            "beta1, beta2, eps, fused");
  EXPECT_EQ(optimizer_config_error("[optimizer]\nname = \"sgd\"\nbeta3 = 0.9\n"),
            "cfg.toml:3:1: unknown key 'optimizer.beta3'. Optimizer \"sgd\" has no such key. "
            "Allowed keys in [optimizer]: name, lr, weight_decay, decay, clip_grad_norm, clip_grad_value, momentum, fused");
}

TEST(OptimizerKeys, SetOverridesAnOwnKey) {
  const Config c = parse_config("[optimizer]\nname = \"sgd\"\n", "cfg.toml", {"optimizer.momentum=0.9"});
  EXPECT_DOUBLE_EQ(c.optimizer.get<double>("momentum"), 0.9);
  const Config d = parse_config("", "cfg.toml", {"optimizer.name=rmsprop", "optimizer.momentum=0.5"});
  EXPECT_DOUBLE_EQ(d.optimizer.get<double>("momentum"), 0.5);
  EXPECT_EQ(optimizer_config_error("", {"optimizer.momentum=0.9"}),
            "--set optimizer.momentum=0.9: unknown key 'optimizer.momentum'. 'momentum' is a key "
            "of rmsprop and sgd, not of optimizer \"adam\". Allowed keys in [optimizer]: name, "
            "lr, weight_decay, decay, clip_grad_norm, clip_grad_value, beta1, beta2, eps, fused");
}

TEST(OptimizerKeys, AStageWithAnotherNameInheritsTheKeysItShares) {
  const Config c = parse_config(
      "[optimizer]\nname = \"adam\"\neps = 1e-6\nbeta1 = 0.8\n"
      "[[stages]]\nname = \"a\"\n[stages.optimizer]\nname = \"rmsprop\"\nmomentum = 0.5\n",
      "cfg.toml");
  const OptimizerOptions& s = c.stages[0].optimizer;
  EXPECT_EQ(s.name, "rmsprop");
  EXPECT_DOUBLE_EQ(s.get<double>("eps"), 1e-6);  // inherited: rmsprop has eps too
  EXPECT_DOUBLE_EQ(s.get<double>("momentum"), 0.5);
  EXPECT_FALSE(s.own.contains("beta1"));  // adam's own, dropped
  EXPECT_DOUBLE_EQ(c.optimizer.get<double>("beta1"), 0.8);  // [optimizer] untouched
  // A key the stage's optimizer lacks, written in the stage's table, is refused.
  const std::string msg = optimizer_config_error(
      "[[stages]]\nname = \"a\"\n[stages.optimizer]\nname = \"sgd\"\neps = 1e-6\n");
  EXPECT_EQ(msg.rfind("cfg.toml:5:1: unknown key 'stages.0.optimizer.eps'. 'eps' is a key of "
                      "adagrad, adam, adam8bit, adamw, adamw8bit and rmsprop, not of optimizer \"sgd\".", 0), 0u)
      << msg;
}

TEST(OptimizerKeys, CppSetAndGetCheckTheKey) {
  OptimizerOptions o;  // adam
  EXPECT_DOUBLE_EQ(o.get<double>("beta2"), 0.999);  // the default when unset
  o.set("beta2", 0.99);
  EXPECT_DOUBLE_EQ(o.get<double>("beta2"), 0.99);
  EXPECT_EQ(error_of([&] { o.set("momentum", 0.9); }),
            "unknown key 'optimizer.momentum'. 'momentum' is a key of rmsprop and sgd, not of "
            "optimizer \"adam\". Keys of optimizer \"adam\": name, lr, weight_decay, beta1, "
            "beta2, eps, fused");
  EXPECT_EQ(error_of([&] { o.set("beta1", 1.5); }),
            "optimizer \"adam\": 'optimizer.beta1' must be a number in [0, 1), got 1.5");
  EXPECT_THROW(o.get<double>("momentum"), ConfigError);
  o.name = "sgd";  // changing the name keeps only the keys the new optimizer has
  EXPECT_DOUBLE_EQ(o.get<double>("momentum"), 0.0);
  EXPECT_EQ(o.own_keys().size(), 2u);  // momentum and fused
}

}  // namespace
}  // namespace frugal
