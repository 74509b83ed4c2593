// adafactor and adam8bit (frugal/adafactor.h, frugal/adam8bit.h): each step against a reference
// written here element by element from the papers' (and bitsandbytes') arithmetic, their state
// bytes per parameter, a save and load that continues bitwise, and optim_swap swapping to them.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "frugal/app/plugin_host.h"
#include "frugal/base/compat.h"
#include "frugal/optim/adafactor.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/optimizers.h"
#include "learner_fixture.h"

// Its own namespace: unity builds put several test files in one translation unit.
namespace frugal::test::small_state_test {
namespace {

using Vec = std::vector<double>;

Vec values(const torch::Tensor& t) {
  const torch::Tensor d = t.detach().to(torch::kDouble).contiguous().reshape({-1});
  return Vec(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

torch::Tensor random_like(torch::IntArrayRef shape, double scale) {
  return torch::randn(shape) * scale;
}

// ---- the dynamic map and block-wise quantization, element by element ------------------------

/// bitsandbytes' create_dynamic_map(signed, 7, 8), in plain arithmetic: for decimal exponent
/// i = 0..6, the midpoints of n equal pieces of [0.1, 1] (n = 2^i signed, 2^(i+1) unsigned)
/// times 10^(i - 6), and their negatives when signed; then 0 and 1; sorted.
std::vector<float> reference_map(bool is_signed) {
  std::vector<double> codes = {0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? (1 << i) : (1 << (i + 1));
    for (int k = 0; k < n; ++k) {
      const double lo = 0.1 + 0.9 * k / n, hi = 0.1 + 0.9 * (k + 1) / n;
      const double code = std::pow(10.0, i - 6) * (lo + hi) / 2;
      codes.push_back(code);
      if (is_signed) codes.push_back(-code);
    }
  }
  std::sort(codes.begin(), codes.end());
  return std::vector<float>(codes.begin(), codes.end());
}

/// Index of the code nearest to v (the first such, i.e. the lower code on a tie).
int nearest(float v, const std::vector<float>& map) {
  int best = 0;
  for (int j = 1; j < static_cast<int>(map.size()); ++j)
    if (std::fabs(v - map[j]) < std::fabs(v - map[best])) best = j;
  return best;
}

/// x quantized block by block and back: each block of 2048 divided by its absolute maximum,
/// each element the nearest code times that maximum.
/// keep_positive: a positive element whose nearest code is 0 gets the smallest positive code
/// (adam8bit's second moment: no zero point).
std::vector<float> quantize_dequantize(const std::vector<float>& x, const std::vector<float>& map,
                                       bool keep_positive = false) {
  std::vector<float> out(x.size());
  for (size_t b = 0; b < x.size(); b += 2048) {
    const size_t e = std::min(x.size(), b + 2048);
    float absmax = 0;
    for (size_t i = b; i < e; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    for (size_t i = b; i < e; ++i) {
      const float normed = absmax > 0 ? x[i] / absmax : 0.0f;
      int code = nearest(normed, map);
      if (keep_positive && normed > 0 && map[code] == 0.0f) ++code;
      out[i] = map[code] * absmax;
    }
  }
  return out;
}

TEST(Adam8bitQuantization, MapsAreBitsandbytesDynamicMaps) {
  for (bool is_signed : {true, false}) {
    const torch::Tensor map = quant8::dynamic_map(is_signed);
    const std::vector<float> ref = reference_map(is_signed);
    ASSERT_EQ(map.numel(), 256);
    ASSERT_EQ(ref.size(), 256u);
    for (int j = 0; j < 256; ++j) EXPECT_NEAR(map[j].item<float>(), ref[j], 1e-7) << j;
  }
}

TEST(Adam8bitQuantization, EachElementIsItsBlocksNearestCode) {
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({5000}) * torch::linspace(0.01, 3, 5000);  // 3 blocks
  const torch::Tensor map = quant8::dynamic_map(true);
  const quant8::Quantized q = quant8::quantize(x, map);
  ASSERT_EQ(q.codes.numel(), 5000);
  ASSERT_EQ(q.absmax.numel(), 3);
  const std::vector<float> codes(map.data_ptr<float>(), map.data_ptr<float>() + 256);
  const auto xs = values(x);
  std::vector<float> absmax(3, 0.0f);
  for (int64_t i = 0; i < 5000; ++i)
    absmax[i / 2048] = std::max(absmax[i / 2048], std::fabs(static_cast<float>(xs[i])));
  for (int64_t b = 0; b < 3; ++b) ASSERT_EQ(q.absmax[b].item<float>(), absmax[b]);
  const auto got = values(q.codes);
  const auto back = values(quant8::dequantize(q, map));
  for (int64_t i = 0; i < 5000; ++i) {
    const float m = absmax[i / 2048];
    ASSERT_EQ(got[i], nearest(static_cast<float>(xs[i]) / m, codes)) << "element " << i;
    // within half the widest gap between neighbouring codes (0.9 / 64) of the block's maximum
    ASSERT_LE(std::fabs(back[i] - xs[i]), 0.9 / 64 / 2 * m * 1.0001) << "element " << i;
  }
}

// ---- Adam8bit against Adam in plain arithmetic ------------------------------------------------

/// Three Adam steps on p with gradients gs, element by element; moments stored float32, or
/// quantized after each step when p has 4096 elements or more (block-wise, bitsandbytes' maps).
Vec reference_adam8bit(Vec p, const std::vector<Vec>& gs, double lr, double b1, double b2,
                       double eps) {
  const bool quantized = p.size() >= 4096;
  const auto map1 = reference_map(true), map2 = reference_map(false);
  std::vector<float> m(p.size(), 0), v(p.size(), 0);
  for (size_t t = 1; t <= gs.size(); ++t) {
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = gs[t - 1][i];
      const double mi = b1 * m[i] + (1 - b1) * g, vi = b2 * v[i] + (1 - b2) * g * g;
      p[i] -= lr / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + eps);
      m[i] = static_cast<float>(mi);
      v[i] = static_cast<float>(vi);
    }
    if (quantized) {
      m = quantize_dequantize(m, map1);
      v = quantize_dequantize(v, map2, /*keep_positive=*/true);
    }
  }
  return p;
}

/// `opt` over p, stepped with each gradient of gs.
void run(torch::optim::Optimizer& opt, torch::Tensor& p, const std::vector<torch::Tensor>& gs) {
  for (const auto& g : gs) {
    p.mutable_grad() = g.clone();
    opt.step();
  }
}

TEST(Adam8bit, StepsMatchAdamWithQuantizedMomentsComputedElementByElement) {
  torch::manual_seed(1);
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{80, 64}, {3, 5}}) {
    torch::Tensor p = torch::randn(shape).requires_grad_();
    std::vector<torch::Tensor> gs;
    std::vector<Vec> gv;
    for (int t = 0; t < 3; ++t) {
      gs.push_back(random_like(shape, 0.1 * (t + 1)));
      gv.push_back(values(gs.back()));
    }
    const Vec expected = reference_adam8bit(values(p), gv, 1e-3, 0.9, 0.999, 1e-8);
    Adam8bit opt({p}, Adam8bitOptions(1e-3));
    run(opt, p, gs);
    const Vec got = values(p);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - expected[i]));
    EXPECT_LE(worst, 1e-6) << p.numel() << " elements";
  }
}

// The zero point: one large gradient in a block and small ones beside it, then a batch in
// which the small ones get no gradient at all (a ReLU unit silent for a batch). With v read
// back as 0 the second step would move them by lr * m / eps (~0.5 here, 500x Adam's step).
TEST(Adam8bit, ASecondMomentNeverReadsBackAsZeroSoASilentStepStaysSmall) {
  torch::Tensor p = torch::zeros({4096}).requires_grad_();
  torch::Tensor g1 = torch::full({4096}, 1e-4);
  g1[0] = 1.0;
  const double lr = 1e-3;
  Adam8bit opt({p}, Adam8bitOptions(lr));
  run(opt, p, {g1});
  const torch::Tensor before = p.detach().clone();
  run(opt, p, {torch::zeros({4096})});
  const double moved = (p.detach() - before).abs().max().item<double>();
  EXPECT_LE(moved, 5 * lr) << "a parameter moved " << moved << " on a step without gradient";
}

TEST(Adam8bit, UnderFourThousandElementsItIsTorchsAdamExactly) {
  torch::manual_seed(2);
  torch::Tensor a = torch::randn({40, 50}).requires_grad_();
  torch::Tensor b = a.detach().clone().requires_grad_();
  std::vector<torch::Tensor> gs = {torch::randn({40, 50}), torch::randn({40, 50})};
  Adam8bit mine({a}, Adam8bitOptions(1e-2).weight_decay(0.1));
  torch::optim::Adam adam({b}, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  run(mine, a, gs);
  run(adam, b, gs);
  EXPECT_TRUE(torch::equal(a.detach(), b.detach()));
}

// The fused pass (one pass per block, on the CPU) against the tensor operations: the same
// parameters and the same codes, block maxima and float32 moments after every step, for Adam's
// L2 term and AdamW's decay, a parameter of whole blocks, one with a partial last block and one
// under 4096 elements, gradients with exact zeros (a second moment's smallest positive code),
// and one of 20 blocks stepped on 2 threads (the blocks split over ATen's pool).
TEST(Adam8bit, TheFusedPassGivesBitwiseTheTensorOperationsResult) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  struct Restore {
    int n;
    ~Restore() { at::set_num_threads(n); }
  } restore{threads};
  for (const bool decoupled : {false, true}) {
    torch::manual_seed(11);
    std::vector<torch::Tensor> fused_params, plain_params;
    for (const int64_t n : {6144, 5000, 3000, 20 * 2048}) {
      fused_params.push_back(torch::randn({n}).requires_grad_());
      plain_params.push_back(fused_params.back().detach().clone().requires_grad_());
    }
    const auto options = Adam8bitOptions(1e-2).weight_decay(0.05).decoupled(decoupled);
    Adam8bit fused(fused_params, Adam8bitOptions(options).fused(true));
    Adam8bit plain(plain_params, Adam8bitOptions(options).fused(false));
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < fused_params.size(); ++i) {
        torch::Tensor g = torch::randn_like(fused_params[i]) * std::pow(10.0, step - 2);
        g.masked_fill_(torch::rand_like(g) < 0.2, 0.0);
        fused_params[i].mutable_grad() = g.clone();
        plain_params[i].mutable_grad() = g.clone();
      }
      fused.step();
      plain.step();
      for (size_t i = 0; i < fused_params.size(); ++i) {
        ASSERT_TRUE(torch::equal(fused_params[i].detach(), plain_params[i].detach()))
            << "parameter " << i << ", step " << step << ", decoupled " << decoupled;
        const auto& a = static_cast<const Adam8bitParamState&>(
            *fused.state().at(compat::optimizer_state_key(fused_params[i])));
        const auto& b = static_cast<const Adam8bitParamState&>(
            *plain.state().at(compat::optimizer_state_key(plain_params[i])));
        EXPECT_EQ(a.step(), b.step());
        for (const auto& [x, y] : {std::pair{a.exp_avg_codes(), b.exp_avg_codes()},
                                   {a.exp_avg_absmax(), b.exp_avg_absmax()},
                                   {a.exp_avg_sq_codes(), b.exp_avg_sq_codes()},
                                   {a.exp_avg_sq_absmax(), b.exp_avg_sq_absmax()},
                                   {a.exp_avg(), b.exp_avg()},
                                   {a.exp_avg_sq(), b.exp_avg_sq()}}) {
          ASSERT_EQ(x.defined(), y.defined());
          if (x.defined()) {
            EXPECT_TRUE(torch::equal(x, y)) << "parameter " << i << ", step " << step;
          }
        }
      }
    }
  }
}

// adamw8bit: AdamW's decoupled decay (the parameter shrinks by lr x weight_decay before the
// update), not Adam's L2 term in the gradient: under 4096 elements, torch's AdamW exactly.
TEST(Adam8bit, DecoupledIsTorchsAdamWExactlyAndNotAdam) {
  torch::manual_seed(3);
  torch::Tensor a = torch::randn({40, 50}).requires_grad_();
  torch::Tensor b = a.detach().clone().requires_grad_(), c = a.detach().clone().requires_grad_();
  std::vector<torch::Tensor> gs = {torch::randn({40, 50}), torch::randn({40, 50}), torch::randn({40, 50})};
  OptimizerOptions o;
  o.name = "adamw8bit";
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  auto mine = make_optimizer(o, {a});
  torch::optim::AdamW adamw({b}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::Adam adam({c}, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  run(*mine, a, gs);
  run(adamw, b, gs);
  run(adam, c, gs);
  EXPECT_TRUE(torch::equal(a.detach(), b.detach()));
  EXPECT_FALSE(torch::allclose(a.detach(), c.detach(), 1e-5, 1e-6));
}

// ---- Adafactor against the paper's arithmetic ---------------------------------------------------

struct AdafactorRef {
  double lr = 1e-2, beta1 = 0, weight_decay = 0, clip = 1, decay = -0.8, eps1 = 1e-30,
         eps2 = 1e-3;
  bool relative_step = false, scale_parameter = false;
};

/// Adafactor over p (rows x cols; cols = 0: a vector), element by element.
Vec reference_adafactor(Vec p, int64_t rows, int64_t cols, const std::vector<Vec>& gs,
                        const AdafactorRef& o) {
  const size_t n = p.size();
  const bool factored = cols > 0;
  Vec R(factored ? rows : 0, 0.0), C(factored ? cols : 0, 0.0), V(factored ? 0 : n, 0.0),
      M(n, 0.0);
  for (size_t t = 1; t <= gs.size(); ++t) {
    const Vec& g = gs[t - 1];
    double size = o.relative_step ? std::min(1e-2, 1 / std::sqrt(double(t))) : o.lr;
    if (o.scale_parameter) {
      double ss = 0;
      for (double x : p) ss += x * x;
      size *= std::max(o.eps2, std::sqrt(ss / n));
    }
    const double beta2 = 1 - std::pow(double(t), o.decay);
    Vec u(n);
    if (factored) {
      for (int64_t i = 0; i < rows; ++i) {
        double s = 0;
        for (int64_t j = 0; j < cols; ++j) s += g[i * cols + j] * g[i * cols + j] + o.eps1;
        R[i] = beta2 * R[i] + (1 - beta2) * s / cols;
      }
      for (int64_t j = 0; j < cols; ++j) {
        double s = 0;
        for (int64_t i = 0; i < rows; ++i) s += g[i * cols + j] * g[i * cols + j] + o.eps1;
        C[j] = beta2 * C[j] + (1 - beta2) * s / rows;
      }
      double mean_r = 0;
      for (double r : R) mean_r += r / rows;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          u[i * cols + j] = g[i * cols + j] / std::sqrt(R[i] / mean_r * C[j]);
    } else {
      for (size_t i = 0; i < n; ++i) {
        V[i] = beta2 * V[i] + (1 - beta2) * (g[i] * g[i] + o.eps1);
        u[i] = g[i] / std::sqrt(V[i]);
      }
    }
    double ss = 0;
    for (double x : u) ss += x * x;
    const double shrink = std::max(1.0, std::sqrt(ss / n) / o.clip);
    for (size_t i = 0; i < n; ++i) {
      double step = u[i] / shrink * size;
      if (o.beta1 > 0) step = M[i] = o.beta1 * M[i] + (1 - o.beta1) * step;
      p[i] -= o.weight_decay * size * p[i];
      p[i] -= step;
    }
  }
  return p;
}

TEST(Adafactor, StepsMatchThePapersArithmeticElementByElement) {
  struct Case {
    std::vector<int64_t> shape;
    int64_t rows, cols;  // the factored view; cols 0 = a vector
    AdafactorRef o;
  };
  AdafactorRef plain, momentum, relative;
  momentum.beta1 = 0.9;
  momentum.weight_decay = 0.1;
  momentum.clip = 0.5;
  relative.relative_step = relative.scale_parameter = true;
  const std::vector<Case> cases = {{{5, 7}, 5, 7, plain},      {{2, 3, 4}, 2, 12, momentum},
                                   {{7}, 7, 0, momentum},      {{6, 4}, 6, 4, relative},
                                   {{9}, 9, 0, relative}};
  torch::manual_seed(3);
  for (const Case& c : cases) {
    torch::Tensor p = torch::randn(c.shape).requires_grad_();
    std::vector<torch::Tensor> gs;
    std::vector<Vec> gv;
    for (int t = 0; t < 3; ++t) {
      gs.push_back(random_like(c.shape, 0.5 * (t + 1)));
      gv.push_back(values(gs.back()));
    }
    const Vec expected = reference_adafactor(values(p), c.rows, c.cols, gv, c.o);
    Adafactor opt({p}, AdafactorOptions(c.o.lr)
                           .beta1(c.o.beta1)
                           .weight_decay(c.o.weight_decay)
                           .clip_threshold(c.o.clip)
                           .relative_step(c.o.relative_step)
                           .scale_parameter(c.o.scale_parameter));
    run(opt, p, gs);
    const Vec got = values(p);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], expected[i], 1e-6) << "shape " << c.shape.size() << "-D, element " << i;
  }
}

// ---- state bytes, resume, registry ------------------------------------------------------------

/// Bytes of state per parameter of a 128 x 96 matrix after one step of optimizer `name`.
double state_bytes_per_parameter(const std::string& name) {
  torch::manual_seed(0);
  torch::Tensor w = torch::randn({128, 96}).requires_grad_();
  OptimizerOptions o;
  o.name = name;
  o.lr = 1e-3;
  auto opt = make_optimizer(o, {w});
  w.mutable_grad() = torch::randn({128, 96});
  opt->step();
  return double(optimizer_state_bytes(*opt)) / double(w.numel());
}

TEST(SmallStateOptimizers, StateBytesPerParameterOfAMatrix) {
  const double r = 128, c = 96;
  EXPECT_DOUBLE_EQ(state_bytes_per_parameter("adam"), 8.0);
  // 1 byte per moment and element, one float32 maximum per moment and block of 2048
  EXPECT_DOUBLE_EQ(state_bytes_per_parameter("adam8bit"), 2.0 + 2 * 4 * 6 / (r * c));
  EXPECT_DOUBLE_EQ(state_bytes_per_parameter("adafactor"), 4 * (r + c) / (r * c));
}

TEST(SmallStateOptimizers, StepNeedsGiveThePlannerTheStateTheStepMakes) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(64, 96), torch::nn::Linear(96, 10));  // 2 tensors of each size class
  for (const std::string name : {"adam8bit", "adafactor"}) {
    OptimizerOptions o;
    o.name = name;
    o.lr = 1e-3;
    auto opt = make_optimizer(o, m->parameters());
    const StepNeeds before = optimizer_step_needs(*m, *opt, o);
    m->forward(torch::randn({2, 64})).sum().backward();
    opt->step();
    EXPECT_EQ(before.state, optimizer_state_bytes(*opt)) << name;
    EXPECT_EQ(optimizer_step_needs(*m, *opt, o).state, 0) << name;
    for (auto& p : m->parameters()) p.mutable_grad().reset();
  }
}

/// 2 steps, save, a fresh optimizer over a copy loads it, 2 more steps: equal to 4 steps.
void expect_bitwise_continuation(const OptimizerOptions& o) {
  torch::manual_seed(4);
  std::vector<torch::Tensor> gs;
  for (int t = 0; t < 4; ++t) gs.push_back(torch::randn({80, 64}));
  torch::Tensor a = torch::randn({80, 64}).requires_grad_();
  torch::Tensor b = a.detach().clone().requires_grad_();
  auto whole = make_optimizer(o, {a});
  run(*whole, a, gs);

  auto first = make_optimizer(o, {b});
  run(*first, b, {gs[0], gs[1]});
  std::stringstream saved;
  torch::save(*first, saved);
  torch::Tensor c = b.detach().clone().requires_grad_();
  auto resumed = make_optimizer(o, {c});
  torch::load(*resumed, saved);
  run(*resumed, c, {gs[2], gs[3]});
  EXPECT_TRUE(torch::equal(a.detach(), c.detach())) << o.name;
  EXPECT_EQ(optimizer_state_bytes(*whole), optimizer_state_bytes(*resumed)) << o.name;
}

TEST(SmallStateOptimizers, SavedStateLoadsAndContinuesBitwise) {
  OptimizerOptions o;
  o.lr = 1e-2;
  o.name = "adam8bit";
  expect_bitwise_continuation(o);
  o.name = "adafactor";
  o.set("beta1", 0.9);
  expect_bitwise_continuation(o);
}

TEST(SmallStateOptimizers, OptimSwapSwapsToEach) {
  for (const std::string name : {"adam8bit", "adafactor"}) {
    auto l = make_tiny_learner();  // Adam
    PluginHost host;
    for (auto& cb : host.load(plugins_of("[plugins.optim_swap]\nat_stage = \"b\"\nto = { name = \"" +
                                         name + "\", lr = 1e-3 }\n"),
                              "cfg.toml"))
      l->add_callback(cb);
    l->fit({make_stage("a", 1), make_stage("b", 1)});
    EXPECT_EQ(l->optimizer_options().name, name);
    const bool right_class = name == "adam8bit" ? dynamic_cast<Adam8bit*>(&l->optimizer()) != nullptr
                                                : dynamic_cast<Adafactor*>(&l->optimizer()) != nullptr;
    EXPECT_TRUE(right_class) << name;
    EXPECT_GT(optimizer_state_bytes(l->optimizer()), 0) << name << " stepped";
    EXPECT_EQ(l->steps(), 8);
    l.reset();
  }
}

TEST(SmallStateOptimizers, KeysAreCheckedWithTheFileLineAndRange) {
  try {
    parse_config("[optimizer]\nname = \"adafactor\"\ndecay_rate = 0.5\n", "cfg.toml");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.toml:3:14: 'optimizer.decay_rate' must be"),
              std::string::npos)
        << e.what();
  }
  const Config c = parse_config(
      "[optimizer]\nname = \"adafactor\"\nbeta1 = 0.9\nrelative_step = true\n", "cfg.toml");
  EXPECT_DOUBLE_EQ(c.optimizer.get<double>("beta1"), 0.9);
  EXPECT_TRUE(c.optimizer.get<bool>("relative_step"));
}

}  // namespace
}  // namespace frugal::test::small_state_test
