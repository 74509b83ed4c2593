// The inplace_act plugin: which modules it finds, the check that reverts unsafe ones (named),
// exactness and restored state, where it saves memory and where not, and the plugin in a fit.
#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "inplace_act.h"
#include "frugal/app/plugin_host.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace ia = frugal::inplace_act;
namespace nn = torch::nn;

torch::nn::Sequential zoo(const std::string& arch, int64_t depth, int64_t width, double dropout,
                          uint64_t seed = 0, int64_t image = 8) {
  return make_zoo_model(arch, depth, width, dropout, seed, image);
}

LossFn ce() { return make_loss(LossOptions{}); }

std::vector<std::string> names(const std::vector<ia::Site>& v) {
  std::vector<std::string> out;
  for (const auto& s : v) out.push_back(s.name);
  return out;
}
std::vector<std::string> names(const std::vector<std::pair<ia::Site, std::string>>& v) {
  std::vector<std::string> out;
  for (const auto& s : v) out.push_back(s.first.name);
  return out;
}

/// Gradients of one seeded training step (forward, cross entropy, backward).
std::vector<torch::Tensor> grads_of(torch::nn::Sequential& m, const torch::Tensor& x,
                                    const torch::Tensor& y, uint64_t seed = 5) {
  for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
  m->train();
  torch::manual_seed(seed);
  ce()(m->forward(x), y).backward();
  std::vector<torch::Tensor> g;
  for (auto& p : m->parameters()) g.push_back(p.grad().clone());
  return g;
}

std::pair<torch::Tensor, torch::Tensor> batch(int64_t n, int64_t image = 8, uint64_t seed = 3) {
  torch::manual_seed(seed);
  return {torch::randn({n, 1, image, image}), torch::randint(0, 4, {n})};
}

TEST(InplaceActSites, FindsTheZoosActivationsAndWhereTheySit) {
  auto mlp = zoo("mlp", 2, 8, 0.2);
  const auto s = ia::find_sites(mlp.ptr());
  EXPECT_EQ(names(s), (std::vector<std::string>{"stem.2", "block1.1", "block1.2", "block2.1",
                                                "block2.2"}));
  for (const auto& x : s) EXPECT_EQ(x.place, ia::Place::Chain) << x.name;
  EXPECT_EQ(s[2].type, "Dropout");

  auto resnet = zoo("resnet", 2, 4, 0.0);
  const auto r = ia::find_sites(resnet.ptr());
  EXPECT_EQ(names(r), (std::vector<std::string>{"stem.2", "layer1.act1", "layer1.act2",
                                                "layer2.act1", "layer2.act2"}));
  EXPECT_EQ(r[0].place, ia::Place::Chain);
  EXPECT_EQ(r[1].place, ia::Place::Opaque) << "a residual block's forward is its own";

  // An activation first in the model would overwrite the batch itself.
  nn::Sequential first(nn::ReLU(), nn::Flatten(), nn::Linear(64, 4));
  const auto f = ia::find_sites(first.ptr());
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].place, ia::Place::ModelInput);
}

TEST(InplaceActCheck, MlpReluGoesInPlaceDropoutAfterReluIsRevertedNamingIt) {
  auto m = zoo("mlp", 2, 16, 0.3);
  auto ref = zoo("mlp", 2, 16, 0.3);
  const auto [x, y] = batch(16);
  torch::manual_seed(42);
  ia::Settings with_dropout;
  with_dropout.dropout = true;
  const auto out = ia::apply(m, ce(), x, y, torch::kCPU, with_dropout);
  const float rng_after = torch::rand({1}).item<float>();
  torch::manual_seed(42);
  const float rng_plain = torch::rand({1}).item<float>();
  EXPECT_EQ(rng_after, rng_plain) << "the check leaves the RNG where it found it";

  EXPECT_EQ(names(out.changed), (std::vector<std::string>{"stem.2", "block1.1", "block2.1"}));
  // ReLU saves its output for backward; dropout in place would overwrite it.
  ASSERT_EQ(names(out.reverted), (std::vector<std::string>{"block1.2", "block2.2"}));
  for (const auto& [site, why] : out.reverted)
    EXPECT_NE(why.find("inplace operation"), std::string::npos) << site.name << ": " << why;
  EXPECT_EQ(out.passes, 2 + 5) << "reference, all at once, then one pass per module";
  for (auto& p : m->parameters()) EXPECT_FALSE(p.grad().defined()) << "no gradient left behind";

  // In-place ReLU trains bitwise as the out-of-place model does, dropout included.
  const auto g = grads_of(m, x, y), g_ref = grads_of(ref, x, y);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(torch::equal(g[i], g_ref[i])) << i;
  EXPECT_TRUE(m[0]->children()[2]->as<nn::ReLU>()->options.inplace());
  EXPECT_FALSE(m[1]->children()[2]->as<nn::Dropout>()->options.inplace());
}

TEST(InplaceActCheck, CnnAndResnetGoInPlaceExactlyWithBatchNormStatisticsUntouched) {
  for (const std::string arch : {"cnn", "resnet"}) {
    SCOPED_TRACE(arch);
    auto m = zoo(arch, 2, 4, 0.3);
    auto ref = zoo(arch, 2, 4, 0.3);
    const auto [x, y] = batch(8);
    std::vector<torch::Tensor> buffers;
    for (auto& b : m->buffers()) buffers.push_back(b.clone());
    ASSERT_FALSE(buffers.empty());
    ia::Settings with_dropout;
    with_dropout.dropout = true;
    const auto out = ia::apply(m, ce(), x, y, torch::kCPU, with_dropout);
    if (arch == "cnn") {
      // Three BN -> ReLU. The head's dropout reads a view (Flatten of the pooled 7x7 grid): in
      // place, autograd copies the base in backward and the check's peak rises.
      EXPECT_EQ(names(out.changed),
                (std::vector<std::string>{"features1.2", "features2.2", "features3.2"}));
      ASSERT_EQ(names(out.reverted), std::vector<std::string>{"head.0"});
      EXPECT_NE(out.reverted[0].second.find("raises the peak"), std::string::npos)
          << out.reverted[0].second;
    } else {
      // The stem's ReLU, both ReLUs of each residual block, the head's dropout (on a tensor of
      // 1x1 pooled features: the copy is small and the peak lies elsewhere).
      for (const auto& [site, why] : out.reverted) ADD_FAILURE() << site.label() << ": " << why;
      EXPECT_EQ(out.changed.size(), 6u) << ia::describe(out.changed);
    }
    EXPECT_LE(out.peak_after, out.peak_before);
    EXPECT_EQ(out.max_difference, 0.0) << "in place is bitwise on cpu";
    const auto now = m->buffers();
    for (size_t i = 0; i < buffers.size(); ++i)
      EXPECT_TRUE(torch::equal(now[i], buffers[i])) << "buffer " << i << " moved by the check";
    const auto g = grads_of(m, x, y), g_ref = grads_of(ref, x, y);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(torch::equal(g[i], g_ref[i])) << i;
  }
}

/// A Sequential that can sit inside another (as the zoo's Block).
struct ChainImpl : nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Chain);

/// h = fc(x); p = h^2 (saves h); act(h) in place would overwrite what pow saved.
struct SavesInputImpl : nn::Module {
  SavesInputImpl() : fc(register_module("fc", nn::Linear(8, 8))), act(register_module("act", nn::ReLU())) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc(x);
    auto p = h.pow(2);
    return act(h) + p;
  }
  nn::Linear fc;
  nn::ReLU act;
};
TORCH_MODULE(SavesInput);

/// h = fc(x); act(h) + h: in place, the sum reads the activated h twice.
struct ReusesInputImpl : nn::Module {
  ReusesInputImpl() : fc(register_module("fc", nn::Linear(8, 8))), act(register_module("act", nn::LeakyReLU())) {}
  torch::Tensor forward(torch::Tensor x) { auto h = fc(x); return act(h) + h; }
  nn::Linear fc;
  nn::LeakyReLU act;
};
TORCH_MODULE(ReusesInput);

/// fc(act(x)) at the model's front: in place would overwrite the batch.
struct ActOnInputImpl : nn::Module {
  ActOnInputImpl() : act(register_module("act", nn::ELU())), fc(register_module("fc", nn::Linear(8, 8))) {}
  torch::Tensor forward(torch::Tensor x) { return fc(act(x)); }
  nn::ELU act;
  nn::Linear fc;
};
TORCH_MODULE(ActOnInput);

TEST(InplaceActCheck, UnsafeModulesInCustomForwardsAreRevertedEachWithItsReason) {
  torch::manual_seed(0);
  nn::Sequential m;
  m->push_back("front", ActOnInput());
  m->push_back("saves", SavesInput());
  m->push_back("reuses", ReusesInput());
  m->push_back("tail", Chain(nn::Linear(8, 8), nn::ELU(), nn::Linear(8, 4)));
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({16, 8}), y = torch::randint(0, 4, {16});
  const torch::Tensor x_copy = x.clone();
  const auto out = ia::apply(m, ce(), x, y, torch::kCPU, {});
  EXPECT_TRUE(torch::equal(x, x_copy)) << "the check overwrote the batch";
  EXPECT_EQ(names(out.changed), std::vector<std::string>{"tail.1"});
  ASSERT_EQ(names(out.reverted), (std::vector<std::string>{"front.act", "saves.act", "reuses.act"}));
  EXPECT_NE(out.reverted[0].second.find("input was overwritten"), std::string::npos)
      << out.reverted[0].second;
  EXPECT_NE(out.reverted[1].second.find("modified by an inplace operation"), std::string::npos)
      << out.reverted[1].second;
  EXPECT_NE(out.reverted[2].second.find("differs from the out-of-place run"), std::string::npos)
      << out.reverted[2].second;
  EXPECT_LT(out.max_difference, 1e-5) << "ELU in place computes its gradient from the output";

  // Without the check only chain modules are touched, and the custom ones are not tried.
  for (const auto& s : out.changed) *s.flag = false;
  ia::Settings unchecked;
  unchecked.verify = false;
  const auto raw = ia::apply(m, ce(), x, y, torch::kCPU, unchecked);
  EXPECT_EQ(names(raw.changed), std::vector<std::string>{"tail.1"});
  EXPECT_EQ(raw.passes, 0);
  EXPECT_EQ(raw.skipped.size(), 3u);
}

// ---- memory: where in place saves and where it does not ------------------------------------

/// Bytes the forward adds at its peak over the live bytes before it.
int64_t forward_bytes(torch::nn::Sequential& m, const torch::Tensor& x) {
  MemoryMeter& mm = MemoryMeter::get();
  m->train();
  const int64_t before = mm.current();
  MemoryWindow window = mm.open_window();
  torch::Tensor out = m->forward(x);
  const int64_t peak = window.peak() - before;
  out.sum().backward();
  for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
  return peak;
}

struct Saving {
  int64_t plain, inplace;
  double ratio() const { return static_cast<double>(inplace) / static_cast<double>(plain); }
  /// Bytes saved, in activation tensors of `unit` bytes.
  double tensors(int64_t unit) const {
    return static_cast<double>(plain - inplace) / static_cast<double>(unit);
  }
};

Saving measure(torch::nn::Sequential m, const torch::Tensor& x, const torch::Tensor& y) {
  Saving s{};
  s.plain = forward_bytes(m, x);
  const auto out = ia::apply(m, ce(), x, y, torch::kCPU, {});
  for (const auto& [site, why] : out.reverted) ADD_FAILURE() << site.label() << ": " << why;
  EXPECT_FALSE(out.changed.empty());
  s.inplace = forward_bytes(m, x);
  return s;
}

template <class Act>
torch::nn::Sequential mlp_with(int64_t depth, int64_t width) {
  torch::manual_seed(0);
  nn::Sequential m(nn::Flatten(), nn::Linear(64, width), Act());
  for (int64_t i = 0; i < depth; ++i) {
    m->push_back(nn::Linear(width, width));
    m->push_back(Act());
  }
  m->push_back(nn::Linear(width, 4));
  return m;
}

template <class Act>
torch::nn::Sequential cnn_with(int64_t depth, int64_t ch) {
  torch::manual_seed(0);
  nn::Sequential m(nn::Conv2d(nn::Conv2dOptions(1, ch, 3).padding(1)), nn::BatchNorm2d(ch), Act());
  for (int64_t i = 0; i < depth; ++i) {
    m->push_back(nn::Conv2d(nn::Conv2dOptions(ch, ch, 3).padding(1)));
    m->push_back(nn::BatchNorm2d(ch));
    m->push_back(Act());
  }
  m->push_back(nn::Flatten());
  m->push_back(nn::Linear(ch * 64, 4));
  return m;
}

TEST(InplaceActMemory, SavesOneTensorPerActivationThatKeepsItsInputAndNothingForReLU) {
  if (!MemoryMeter::installed()) GTEST_SKIP() << "the tracking allocator is not installed";
  const auto [x, y] = batch(256);
  const auto relu_mlp = measure(mlp_with<nn::ReLU>(6, 256), x, y);
  const auto elu_mlp = measure(mlp_with<nn::ELU>(6, 256), x, y);
  const auto leaky_mlp = measure(mlp_with<nn::LeakyReLU>(6, 256), x, y);
  const auto [xc, yc] = batch(64);
  const auto relu_cnn = measure(cnn_with<nn::ReLU>(4, 16), xc, yc);
  const auto elu_cnn = measure(cnn_with<nn::ELU>(4, 16), xc, yc);
  const auto resnet = measure(zoo("resnet", 4, 16, 0.0), xc, yc);
  auto line = [](const char* what, const Saving& s) {
    std::cout << "[inplace_act] " << what << ": forward activations " << s.plain << " B -> "
              << s.inplace << " B, ratio " << s.ratio() << "\n";
  };
  line("Linear->ReLU x7 (batch 256, width 256)", relu_mlp);
  line("Linear->ELU x7", elu_mlp);
  line("Linear->LeakyReLU x7", leaky_mlp);
  line("Conv->BN->ReLU x5 (batch 64, 16 ch, 8x8)", relu_cnn);
  line("Conv->BN->ELU x5", elu_cnn);
  line("resnet depth 4 width 16 (BN->ReLU, add->ReLU)", resnet);
  // ReLU saves its output, which the next layer saves anyway, and the layer before saves its
  // own input, not its output: the pre-activation is a temporary either way. In place only the
  // last one, alive at the forward's peak, goes: about one tensor in all, not one per layer.
  const int64_t mlp_unit = 256 * 256 * 4, cnn_unit = 64 * 16 * 8 * 8 * 4;
  EXPECT_GT(relu_mlp.tensors(mlp_unit), 0.9);
  EXPECT_LT(relu_mlp.tensors(mlp_unit), 1.1);
  EXPECT_LT(relu_cnn.tensors(cnn_unit), 1.1);
  EXPECT_LT(resnet.tensors(cnn_unit), 1.1);
  // ELU and LeakyReLU out of place save their input, and the next layer saves their output:
  // two tensors per layer, one in place. Seven layers, seven tensors.
  EXPECT_GT(elu_mlp.tensors(mlp_unit), 6.9);
  EXPECT_GT(leaky_mlp.tensors(mlp_unit), 6.9);
  // After BatchNorm: Conv, BN and ELU out of place keep three tensors per layer, in place two.
  EXPECT_GT(elu_cnn.tensors(cnn_unit), 4.5);
}

// ---- the plugin --------------------------------------------------------------------------

std::shared_ptr<spdlog::logger> inplace_capture_logger(std::ostringstream& out) {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%l %n: %v");
  auto log = std::make_shared<spdlog::logger>("inplace_act", sink);
  log->set_level(spdlog::level::debug);
  return log;
}

std::unique_ptr<Learner> mlp_learner() {
  TinySetup s;
  s.depth = 2;
  s.dropout = 0.3;
  return make_tiny_learner(s);
}

TEST(InplaceActPlugin, TrainsBitwiseAsWithoutReportsWhatChangedAndRestoresTheFlags) {
  std::ostringstream log;
  std::vector<torch::Tensor> with_plugin;
  double loss_with = 0;
  {
    auto l = mlp_learner();
    ia::InplaceActOptions o;
    o.dropout = true;
    auto cb = std::make_shared<ia::InplaceAct>(o, PluginContext{"inplace_act", inplace_capture_logger(log)});
    l->add_callback(cb);
    torch::manual_seed(11);
    l->fit({make_stage("one", 2)});
    EXPECT_EQ(names(cb->outcome().changed),
              (std::vector<std::string>{"stem.2", "block1.1", "block2.1"}));
    EXPECT_EQ(names(cb->outcome().reverted), (std::vector<std::string>{"block1.2", "block2.2"}));
    for (const auto& s : ia::find_sites(l->model().ptr()))
      EXPECT_FALSE(*s.flag) << s.name << " is out of place again after the fit";
    with_plugin = clone_params(*l->model());
    loss_with = l->stage_stats().at(0).last_epoch_loss;
  }
  const std::string text = log.str();
  EXPECT_NE(text.find("info inplace_act: in place: stem.2 (ReLU), block1.1 (ReLU), block2.1 (ReLU)"),
            std::string::npos) << text;
  EXPECT_NE(text.find("warning inplace_act: block1.2 (Dropout) stays out of place"),
            std::string::npos) << text;

  auto plain = mlp_learner();
  torch::manual_seed(11);
  plain->fit({make_stage("one", 2)});
  EXPECT_TRUE(params_equal(*plain->model(), with_plugin)) << "same seed, same parameters";
  EXPECT_EQ(plain->stage_stats().at(0).last_epoch_loss, loss_with);
}

TEST(InplaceActPlugin, DropoutIsLeftOutByDefault) {
  auto m = zoo("cnn", 2, 4, 0.3);
  const auto [x, y] = batch(8);
  const auto out = ia::apply(m, ce(), x, y, torch::kCPU, ia::InplaceActOptions{}.settings());
  EXPECT_EQ(names(out.changed),
            (std::vector<std::string>{"features1.2", "features2.2", "features3.2"}));
  ASSERT_EQ(names(out.skipped), std::vector<std::string>{"head.0"});
  EXPECT_NE(out.skipped[0].second.find("dropout = false"), std::string::npos);
}

TEST(InplaceActPlugin, AModelThatCannotRunTheBatchIsLeftAloneWithAWarning) {
  auto m = zoo("mlp", 1, 8, 0.0);
  const auto [x, y] = batch(4, /*image=*/6);  // the mlp takes 8x8 images only
  const auto out = ia::apply(m, ce(), x, y, torch::kCPU, {});
  EXPECT_TRUE(out.changed.empty());
  EXPECT_FALSE(out.check_error.empty());
  EXPECT_EQ(out.skipped.size(), 2u);
  for (const auto& s : ia::find_sites(m.ptr())) EXPECT_FALSE(*s.flag) << s.name;
}

TEST(InplaceActPlugin, ChecksAtTheFirstStagesImageSize) {
  // 8x8 data, an mlp for 4x4 images, a stage that resizes to 4: the check must use 4x4 too.
  torch::manual_seed(0);
  Dataset train = make_synthetic(32, 1, 8, 8, 4, 1);
  auto l = std::make_unique<Learner>(zoo("mlp", 1, 8, 0.0, 0, /*image=*/4),
                                     DataLoader(std::move(train), 16, false, 0), std::nullopt,
                                     OptimizerOptions{}, ce());
  std::ostringstream log;
  auto cb = std::make_shared<ia::InplaceAct>(ia::InplaceActOptions{},
                                             PluginContext{"inplace_act", inplace_capture_logger(log)});
  l->add_callback(cb);
  Stage st = make_stage("small", 1);
  st.image_size = 4;
  l->fit({st});
  EXPECT_TRUE(cb->outcome().check_error.empty()) << cb->outcome().check_error;
  EXPECT_EQ(names(cb->outcome().changed), (std::vector<std::string>{"stem.2", "block1.1"}))
      << log.str();
  EXPECT_EQ(l->iteration(), 2);
}

TEST(InplaceActPlugin, LoadsFromTomlAndABadToleranceNamesTheKey) {
  PluginHost host;
  auto cbs = host.load(plugins_of("[plugins.inplace_act]\nexclude = [\"stem\"]\n"), "cfg.toml");
  ASSERT_EQ(cbs.size(), 1u);
  EXPECT_EQ(cbs[0]->order(), -100);
  try {
    host.load(plugins_of("[plugins.inplace_act]\ntolerance = -1.0\n"), "cfg.toml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("tolerance"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace frugal::test
