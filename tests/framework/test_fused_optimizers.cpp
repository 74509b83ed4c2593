// The fused CPU optimizers (optim/fused.h) against LibTorch's: the same weights and state after
// several steps (bitwise, or within 1e-6 relative where a CPU rounds one step differently), on
// parameters large enough to be split over threads; LibTorch's way where the pass does not
// apply; the non-finite scan; the `fused` key.
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "frugal/base/compat.h"
#include "frugal/base/error.h"
#include "frugal/config/config.h"
#include "frugal/optim/fused.h"
#include "frugal/optim/optimizers.h"

namespace frugal {
namespace {

// Parameters of several sizes: below a chunk, several chunks (split over threads), odd tails.
std::vector<torch::Tensor> make_params(torch::Dtype dtype = torch::kFloat) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> ps;
  for (int64_t n : {7, 1000, 70001, 150000})
    ps.push_back(torch::randn({n}, torch::dtype(dtype)).requires_grad_(true));
  return ps;
}

// Step `opt` over `ps` `steps` times with gradients drawn from a fixed seed (some large, some
// tiny, some zero: Adam's denominator near eps).
void train(torch::optim::Optimizer& opt, std::vector<torch::Tensor>& ps, int steps) {
  torch::manual_seed(11);
  for (int s = 0; s < steps; ++s) {
    for (auto& p : ps) {
      auto g = torch::randn_like(p) * (s % 2 ? 1e-4 : 3.0);
      g.index_put_({torch::indexing::Slice(0, 3)}, 0);
      p.mutable_grad() = g;
    }
    opt.step();
  }
}

// Largest |a - b| relative to the largest |b|; 0 when bitwise equal. Printed: how close this
// CPU came (0 = every bit).
double relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-30);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  std::cout << "[ fused vs LibTorch ] largest relative difference " << worst << "\n";
  return worst;
}

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

template <class State>
std::vector<torch::Tensor> moments(const torch::optim::Optimizer& opt,
                                   const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) {
    const auto& s = static_cast<const State&>(*opt.state().at(compat::optimizer_state_key(p)));
    out.push_back(s.exp_avg());
    out.push_back(s.exp_avg_sq());
  }
  return out;
}

struct Pair {
  std::unique_ptr<torch::optim::Optimizer> fused, plain;
  std::vector<torch::Tensor> fused_params, plain_params;
};

// The same optimizer fused and not, each over its own copy of the same parameters, trained alike.
Pair trained(OptimizerOptions o, int steps = 6) {
  Pair r;
  r.fused_params = make_params();
  r.plain_params = copies(r.fused_params);
  o.set("fused", true);
  r.fused = make_optimizer(o, r.fused_params);
  o.set("fused", false);
  r.plain = make_optimizer(o, r.plain_params);
  train(*r.fused, r.fused_params, steps);
  train(*r.plain, r.plain_params, steps);
  return r;
}

OptimizerOptions named(const std::string& name, double lr, double weight_decay) {
  OptimizerOptions o;
  o.name = name;
  o.lr = lr;
  o.weight_decay = weight_decay;
  return o;
}

constexpr double kTolerance = 1e-6;

TEST(FusedOptimizers, AdamMatchesLibTorchWithAndWithoutWeightDecay) {
  for (double wd : {0.0, 0.01}) {
    const Pair r = trained(named("adam", 1e-3, wd));
    ASSERT_NE(dynamic_cast<FusedAdam*>(r.fused.get()), nullptr);
    ASSERT_EQ(dynamic_cast<FusedAdam*>(r.plain.get()), nullptr);
    EXPECT_LE(relative_difference(r.fused_params, r.plain_params), kTolerance) << "wd " << wd;
    EXPECT_LE(relative_difference(moments<torch::optim::AdamParamState>(*r.fused, r.fused_params),
                                  moments<torch::optim::AdamParamState>(*r.plain, r.plain_params)),
              kTolerance);
    // It moved the weights (the comparison is not between two untouched copies).
    EXPECT_GT((r.fused_params[3] - make_params()[3]).abs().max().item<double>(), 1e-4);
  }
}

TEST(FusedOptimizers, AdamWMatchesLibTorch) {
  const Pair r = trained(named("adamw", 1e-2, 0.1));
  ASSERT_NE(dynamic_cast<FusedAdamW*>(r.fused.get()), nullptr);
  EXPECT_LE(relative_difference(r.fused_params, r.plain_params), kTolerance);
  EXPECT_LE(relative_difference(moments<torch::optim::AdamWParamState>(*r.fused, r.fused_params),
                                moments<torch::optim::AdamWParamState>(*r.plain, r.plain_params)),
            kTolerance);
}

TEST(FusedOptimizers, SgdMatchesLibTorchWithMomentumDecayAndWithout) {
  for (double momentum : {0.0, 0.9})
    for (double wd : {0.0, 1e-3}) {
      auto o = named("sgd", 0.05, wd);
      o.set("momentum", momentum);
      const Pair r = trained(o);
      ASSERT_NE(dynamic_cast<FusedSGD*>(r.fused.get()), nullptr);
      EXPECT_LE(relative_difference(r.fused_params, r.plain_params), kTolerance)
          << "momentum " << momentum << " wd " << wd;
      EXPECT_EQ(optimizer_state_bytes(*r.fused), optimizer_state_bytes(*r.plain));
    }
}

TEST(FusedOptimizers, NesterovAndDampeningAsLibTorch) {
  for (bool nesterov : {false, true}) {
    auto fused_params = make_params();
    auto plain_params = copies(fused_params);
    auto options = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3);
    options.nesterov(nesterov).dampening(nesterov ? 0.0 : 0.3);
    FusedSGD fused(fused_params, options);
    torch::optim::SGD plain(plain_params, options);
    train(fused, fused_params, 5);
    train(plain, plain_params, 5);
    EXPECT_LE(relative_difference(fused_params, plain_params), kTolerance) << nesterov;
  }
}

TEST(FusedOptimizers, ThreadsSplitTheWorkWithoutChangingABit) {
  const int before = at::get_num_threads();
  auto one = make_params(), two = copies(one);
  FusedAdam a(one, torch::optim::AdamOptions(1e-3).weight_decay(0.01));
  FusedAdam b(two, torch::optim::AdamOptions(1e-3).weight_decay(0.01));
  at::set_num_threads(1);
  train(a, one, 4);
  at::set_num_threads(2);
  train(b, two, 4);
  at::set_num_threads(before);
  EXPECT_EQ(relative_difference(one, two), 0.0);
}

TEST(FusedOptimizers, WhereThePassDoesNotApplyItStepsAsLibTorchBitwise) {
  // float64 parameters, and amsgrad: LibTorch's own step runs.
  auto fused_params = make_params(torch::kDouble), plain_params = copies(fused_params);
  FusedAdam fused(fused_params, torch::optim::AdamOptions(1e-3));
  torch::optim::Adam plain(plain_params, torch::optim::AdamOptions(1e-3));
  train(fused, fused_params, 3);
  train(plain, plain_params, 3);
  EXPECT_EQ(relative_difference(fused_params, plain_params), 0.0);

  auto a = make_params(), b = copies(a);
  FusedAdam fa(a, torch::optim::AdamOptions(1e-3).amsgrad(true));
  torch::optim::Adam pa(b, torch::optim::AdamOptions(1e-3).amsgrad(true));
  train(fa, a, 3);
  train(pa, b, 3);
  EXPECT_EQ(relative_difference(a, b), 0.0);
}

TEST(FusedOptimizers, StateLoadsIntoLibTorchsOptimizerAndContinuesTheSame) {
  // A checkpoint written with fused = true resumes with fused = false (and back): same class
  // of state, same archive.
  auto ps = make_params(), qs = copies(ps);
  FusedAdam fused(ps, torch::optim::AdamOptions(1e-3));
  torch::optim::Adam plain(qs, torch::optim::AdamOptions(1e-3));
  train(fused, ps, 3);
  train(plain, qs, 3);
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive out;
    fused.save(out);
    out.save_to(buffer);
  }
  auto rs = copies(ps);
  torch::optim::Adam reloaded(rs, torch::optim::AdamOptions(1e-3));
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  reloaded.load(in);
  EXPECT_LE(relative_difference(moments<torch::optim::AdamParamState>(reloaded, rs),
                                moments<torch::optim::AdamParamState>(plain, qs)),
            kTolerance);
  EXPECT_EQ(static_cast<const torch::optim::AdamParamState&>(
                *reloaded.state().at(compat::optimizer_state_key(rs[0])))
                .step(),
            3);
}

TEST(FusedOptimizers, AllFiniteFindsOneBadElementAnywhere) {
  auto big = torch::randn({200000});
  auto small = torch::randn({5});
  EXPECT_TRUE(all_finite({big, small, torch::Tensor()}));
  for (int64_t at : {0, 65535, 65536, 199999}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      auto t = big.clone();
      t[at] = bad;
      EXPECT_FALSE(all_finite({small, t})) << at << " " << bad;
    }
  }
  // The largest finite float is finite; other types and strides take LibTorch's reduction.
  auto edge = torch::full({10}, std::numeric_limits<float>::max());
  EXPECT_TRUE(all_finite({edge}));
  auto d = torch::randn({100}, torch::kDouble);
  EXPECT_TRUE(all_finite({d, big.view({400, 500}).t()}));
  d[50] = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(all_finite({d}));
  auto strided = big.clone().view({400, 500});
  strided[399][1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(all_finite({strided.t()}));
}

// The verdict riding on the step (GradientVerdict): asked, each fused optimizer names the first
// parameter whose gradient holds an inf or a NaN anywhere (in a chunk another thread stepped,
// in an odd tail), and none when all are finite; its finite steps are bitwise those of steps
// not asked; unasked it says nothing. Where LibTorch's step runs (amsgrad) the gradients are
// scanned first and that step does not run.
TEST(FusedOptimizers, TheStepSaysWhichGradientWasNotFinite) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  const auto make = [](const std::string& name, std::vector<torch::Tensor> ps) {
    OptimizerOptions o = named(name, 1e-3, 0.01);
    if (name == "sgd") o.set("momentum", 0.9);
    return make_optimizer(o, std::move(ps));
  };
  for (const std::string name : {"adam", "adamw", "sgd"}) {
    auto checked_params = make_params(), plain_params = copies(checked_params);
    auto checked = make(name, checked_params), plain = make(name, plain_params);
    auto* verdict = dynamic_cast<GradientVerdict*>(checked.get());
    ASSERT_NE(verdict, nullptr) << name;
    verdict->check_next_step();
    train(*checked, checked_params, 1);
    train(*plain, plain_params, 1);
    EXPECT_EQ(verdict->checked_steps(), 1) << name;
    EXPECT_FALSE(verdict->first_nonfinite().defined()) << name;
    EXPECT_EQ(relative_difference(checked_params, plain_params), 0.0) << name << ": the check changes no bit";
    train(*checked, checked_params, 1);  // not asked
    EXPECT_EQ(verdict->checked_steps(), 1) << name;
    for (const auto& [param, at] : std::vector<std::pair<size_t, int64_t>>{{3, 149999}, {2, 40000}, {0, 6}}) {
      for (auto& p : checked_params) p.mutable_grad() = torch::zeros_like(p);
      checked_params[3].mutable_grad()[100] = std::numeric_limits<float>::infinity();  // a later one too
      checked_params[param].mutable_grad()[at] = std::numeric_limits<float>::quiet_NaN();
      verdict->check_next_step();
      checked->step();
      ASSERT_TRUE(verdict->first_nonfinite().defined()) << name << " " << param;
      EXPECT_TRUE(verdict->first_nonfinite().is_same(checked_params[param])) << name << " " << param;
      EXPECT_TRUE(verdict->nonfinite_step_ran()) << name;
    }
  }
  // LibTorch's step (amsgrad): scanned before, not run.
  auto ps = make_params();
  FusedAdam amsgrad(ps, torch::optim::AdamOptions(1e-3).amsgrad(true));
  for (auto& p : ps) p.mutable_grad() = torch::ones_like(p);
  ps[1].mutable_grad()[999] = -std::numeric_limits<float>::infinity();
  const torch::Tensor kept = ps[2].detach().clone();
  amsgrad.check_next_step();
  amsgrad.step();
  EXPECT_TRUE(amsgrad.first_nonfinite().is_same(ps[1]));
  EXPECT_FALSE(amsgrad.nonfinite_step_ran());
  EXPECT_TRUE(torch::equal(ps[2], kept)) << "not stepped";
  at::set_num_threads(before);
}

TEST(FusedOptimizers, TheFusedKeyChoosesAndOtherOptimizersRefuseIt) {
  const std::string base = "[optimizer]\nname = \"adam\"\n[[stages]]\nepochs = 1\n";
  auto params = make_params();
  EXPECT_NE(dynamic_cast<FusedAdam*>(make_optimizer(parse_config(base, "c.toml").optimizer, params).get()),
            nullptr);
  auto off = parse_config(base, "c.toml", {"optimizer.fused=false"});
  EXPECT_EQ(dynamic_cast<FusedAdam*>(make_optimizer(off.optimizer, params).get()), nullptr);
  try {
    parse_config(base, "c.toml", {"optimizer.name=\"rmsprop\"", "optimizer.fused=true"});
    ADD_FAILURE() << "rmsprop took fused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fused"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace frugal
