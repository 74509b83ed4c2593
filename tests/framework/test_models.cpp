// The model zoo, the registries, losses, datasets by name and optimizers by name.
#include <gtest/gtest.h>

#include <set>

#include "frugal/models/registry.h"
#include "frugal/optim/optimizers.h"
#include "support.h"

namespace frugal {
namespace {

class Model : public test::Seeded {};
class Optimizer : public test::Seeded {};

template <class Fn>
std::string model_config_error(Fn&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

ModelOptions arch(const std::string& name) {
  ModelOptions o;
  o.arch = name;
  return o;
}

ModelInput input(int64_t channels, int64_t classes, std::vector<int64_t> sizes) {
  ModelInput in;
  in.channels = channels;
  in.num_classes = classes;
  in.image_sizes = sizes;
  in.image_size = *std::max_element(sizes.begin(), sizes.end());
  return in;
}

std::vector<std::string> block_names(const torch::nn::Sequential& m) {
  std::vector<std::string> out;
  for (const auto& kv : m->named_children()) out.push_back(kv.key());
  return out;
}

bool has_parameter(const torch::nn::Module& m, const std::string& name) {
  return m.named_parameters().contains(name);
}

int64_t parameter_count(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// ---- shapes and names ----------------------------------------------------------------------

TEST_F(Model, EveryArchMapsImagesToLogits) {
  for (const std::string name : {"mlp", "cnn", "resnet", "vit"}) {
    auto m = make_model(arch(name), input(3, 7, {28}));
    m->eval();
    auto y = m->forward(torch::randn({2, 3, 28, 28}));
    EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 7})) << name;
    EXPECT_TRUE(torch::isfinite(y).all().item<bool>()) << name;
  }
}

TEST_F(Model, CnnAndResnetTakeSeveralSizes) {
  for (const std::string name : {"cnn", "resnet"}) {
    auto m = make_model(arch(name), input(1, 10, {14, 28}));
    for (int64_t s : {14, 28}) {
      auto y = m->forward(torch::randn({4, 1, s, s}));
      EXPECT_EQ(y.sizes(), torch::IntArrayRef({4, 10})) << name << " at " << s;
    }
  }
}

TEST_F(Model, BlocksRunOneByOne) {
  // Each block maps one tensor to one tensor, so the Sequential can be split anywhere.
  for (const std::string name : {"mlp", "cnn", "resnet", "vit"}) {
    auto m = make_model(arch(name), input(1, 10, {28}));
    m->eval();
    auto x = torch::randn({2, 1, 28, 28});
    auto whole = m->forward(x);
    auto y = x;
    for (auto& block : *m) y = block.forward(y);
    EXPECT_TRUE(torch::allclose(y, whole)) << name;
  }
}

TEST_F(Model, MlpBlockNames) {
  auto o = arch("mlp");
  o.depth = 3;
  o.dropout = 0.1;
  auto m = make_model(o, input(1, 10, {28}));
  EXPECT_EQ(block_names(m),
            (std::vector<std::string>{"stem", "block1", "block2", "block3", "head"}));
  EXPECT_TRUE(has_parameter(*m, "stem.1.weight"));
  EXPECT_TRUE(has_parameter(*m, "block3.0.weight"));
  EXPECT_EQ(m[1]->as<torch::nn::Sequential>()->size(), 3u);  // Linear, ReLU, Dropout
}

TEST_F(Model, CnnBlockNamesMatchFreezePrefixes) {
  auto m = make_model(arch("cnn"), input(1, 10, {28}));
  EXPECT_EQ(block_names(m),
            (std::vector<std::string>{"features1", "features2", "features3", "head"}));
  EXPECT_TRUE(has_parameter(*m, "features1.0.weight"));
  EXPECT_TRUE(has_parameter(*m, "features3.1.weight"));
  int64_t features = 0;
  for (const auto& kv : m->named_parameters())
    if (kv.key().rfind("features", 0) == 0) ++features;
  EXPECT_EQ(features, 9);  // three convs (no bias) and three batch norms (weight, bias)
  // Default width 32: the head sees 4 * 32 channels on a 7 x 7 grid.
  EXPECT_EQ(m->named_parameters()["head.0.weight"].sizes(), torch::IntArrayRef({10, 128 * 49}));
}

TEST_F(Model, ResnetBlockNames) {
  auto o = arch("resnet");
  o.depth = 4;
  o.width = 8;
  auto m = make_model(o, input(3, 5, {16}));
  EXPECT_EQ(block_names(m),
            (std::vector<std::string>{"stem", "layer1", "layer2", "layer3", "layer4", "head"}));
  // Even layers double the channels and project the skip; odd layers keep the identity.
  EXPECT_FALSE(has_parameter(*m, "layer1.shortcut.0.weight"));
  EXPECT_EQ(m->named_parameters()["layer2.shortcut.0.weight"].sizes(),
            torch::IntArrayRef({16, 8, 1, 1}));
  EXPECT_EQ(m->named_parameters()["layer4.conv1.weight"].sizes(),
            torch::IntArrayRef({32, 16, 3, 3}));
  EXPECT_EQ(m->forward(torch::randn({2, 3, 16, 16})).sizes(), torch::IntArrayRef({2, 5}));
}

TEST_F(Model, VitBlockNamesAndTokens) {
  auto o = arch("vit");
  o.width = 32;
  o.heads = 4;
  o.patch = 7;
  o.depth = 2;
  auto m = make_model(o, input(1, 10, {28}));
  EXPECT_EQ(block_names(m), (std::vector<std::string>{"embed", "layer1", "layer2", "head"}));
  // 28 / 7 = 4: a 4 x 4 grid of tokens.
  EXPECT_EQ(m->named_parameters()["embed.pos"].sizes(), torch::IntArrayRef({1, 16, 32}));
  auto x = torch::randn({3, 1, 28, 28});
  auto y = m->forward(x);
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({3, 10}));
  y.sum().backward();
  EXPECT_TRUE(m->named_parameters()["layer1.qkv.weight"].grad().defined());
  EXPECT_GT(m->named_parameters()["embed.pos"].grad().abs().sum().item<double>(), 0.0);
}

// ---- configuration errors ------------------------------------------------------------------

TEST_F(Model, MlpRejectsTwoImageSizes) {
  auto msg = model_config_error([] { make_model(arch("mlp"), input(1, 10, {28, 14, 28})); });
  EXPECT_NE(msg.find("model 'mlp' takes one image size; the stages use 14 and 28"),
            std::string::npos)
      << msg;
}

TEST_F(Model, VitRejectsTwoImageSizes) {
  auto msg = model_config_error([] { make_model(arch("vit"), input(1, 10, {14, 28})); });
  EXPECT_NE(msg.find("model 'vit' takes one image size"), std::string::npos) << msg;
}

TEST_F(Model, VitRejectsPatchNotDividingSize) {
  auto o = arch("vit");
  o.patch = 5;
  auto msg = model_config_error([&] { make_model(o, input(1, 10, {28})); });
  EXPECT_NE(msg.find("model.patch = 5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("28"), std::string::npos) << msg;
}

TEST_F(Model, CnnRejectsTinyImages) {
  auto msg = model_config_error([] { make_model(arch("cnn"), input(1, 10, {2})); });
  EXPECT_NE(msg.find("at least 4x4"), std::string::npos) << msg;
  // 4 x 4 is enough.
  auto m = make_model(arch("cnn"), input(1, 10, {4}));
  EXPECT_EQ(m->forward(torch::randn({2, 1, 4, 4})).sizes(), torch::IntArrayRef({2, 10}));
}

TEST_F(Model, UnknownArchNamesNearest) {
  auto msg = model_config_error([] { make_model(arch("resnte"), input(1, 10, {28})); });
  EXPECT_NE(msg.find("unknown model 'resnte'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'resnet'?"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cnn, gpt, gpt2, mlp, resnet, vit"), std::string::npos) << msg;
}

TEST_F(Model, ResnetWidthAndDepthChangeParameterCount) {
  auto base = arch("resnet");
  auto wider = base;
  wider.width = 2 * base.width;
  auto deeper = base;
  deeper.depth = base.depth + 2;
  const auto in = input(1, 10, {28});
  const int64_t n = parameter_count(*make_model(base, in));
  EXPECT_GT(parameter_count(*make_model(wider, in)), 3 * n);
  EXPECT_GT(parameter_count(*make_model(deeper, in)), n);
}

// ---- registries ----------------------------------------------------------------------------

TEST_F(Model, RegistriesHoldTheBuiltins) {
  EXPECT_EQ(models().names(), (std::vector<std::string>{"cnn", "gpt", "gpt2", "mlp", "resnet", "vit"}));
  EXPECT_EQ(models().get("cnn").owner, "frugal");
  EXPECT_TRUE(losses().contains("cross_entropy"));
  EXPECT_TRUE(datasets().contains("fashion-mnist"));
  EXPECT_TRUE(datasets().contains("synthetic"));
  EXPECT_TRUE(datasets().contains("text"));
}

TEST_F(Model, PluginModelRegistersAndUnregisters) {
  models().add(
      "tiny",
      [](const ModelOptions&, const ModelInput& in) {
        torch::nn::Sequential m;
        m->push_back("flatten", torch::nn::Flatten());
        m->push_back(
            "head", torch::nn::Linear(in.channels * in.image_size * in.image_size, in.num_classes));
        return m;
      },
      "a test model", "test-plugin");
  auto m = make_model(arch("tiny"), input(1, 3, {8}));
  EXPECT_EQ(m->forward(torch::randn({2, 1, 8, 8})).sizes(), torch::IntArrayRef({2, 3}));
  models().remove_owner("test-plugin");
  EXPECT_FALSE(models().contains("tiny"));
  EXPECT_TRUE(models().contains("cnn"));
}

TEST_F(Model, AKeyTheChosenEntryDoesNotReadIsAnErrorUnlessTheEntryDeclaresNothing) {
  const auto error_of = [](const DataOptions& d, const ModelOptions& m, std::vector<StageOptions> st = {}) {
    try {
      check_keys_are_read(d, m, st);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  DataOptions d;  // fashion-mnist
  ModelOptions m = arch("mlp");
  EXPECT_EQ(error_of(d, m), "(no error)") << "defaults everywhere";
  d.samples = 2000;
  EXPECT_EQ(error_of(d, m), "data.samples = 2000: the dataset 'fashion-mnist' does not read it "
                            "(data.samples is read by synthetic); remove it or choose a dataset "
                            "that uses it");
  d.dataset = "synthetic";
  EXPECT_EQ(error_of(d, m), "(no error)") << "synthetic reads samples";
  m.n_embd = 64;
  EXPECT_NE(error_of(d, m).find("model.n_embd = 64: the model 'mlp' does not read it (model.n_embd is read by gpt, gpt2)"),
            std::string::npos);
  m = arch("mlp");
  StageOptions text_stage;
  text_stage.seq_len = 8;
  EXPECT_NE(error_of(d, m, {StageOptions{}, text_stage}).find("stages.1.seq_len = 8"), std::string::npos);
  // A plugin's entry that declares nothing is not checked: it may read any key.
  models().add("undeclared", [](const ModelOptions&, const ModelInput&) { return torch::nn::Sequential(); },
               "a test model", "test-plugin");
  ModelOptions u = arch("undeclared");
  u.heads = 2;
  EXPECT_EQ(error_of(d, u), "(no error)");
  models().remove_owner("test-plugin");
}

TEST_F(Model, TrainSamplesPastTheDataAreAnErrorValidSamplesACap) {
  DataOptions d;
  d.dataset = "synthetic";
  d.samples = 64;
  d.image_size = 4;
  d.train_samples = 65;
  try {
    make_dataset(d, true);
    ADD_FAILURE() << "65 of 64 samples accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.train_samples = 65, but the synthetic dataset's "
                                         "training split holds 64 samples"), std::string::npos) << e.what();
  }
  d.train_samples = 64;
  d.valid_samples = 1000;
  EXPECT_EQ(make_dataset(d, true).size(), 64);
  EXPECT_EQ(make_dataset(d, false).size(), 16) << "validation: the whole split";
}

TEST_F(Model, ErrorMessagesKeepANulAndShortenAHugeValue) {
  const Error nul(std::string("unknown key 'data.a\0b'", 22));
  EXPECT_EQ(std::string(nul.what()), "unknown key 'data.a\\x00b'");
  const Error huge("out_dir '" + std::string(1 << 20, 'x') + "': set a shorter one");
  const std::string what = huge.what();
  EXPECT_LE(what.size(), kMaxMessageBytes + 64);
  EXPECT_EQ(what.rfind("out_dir 'xxx", 0), 0u);
  EXPECT_NE(what.find("bytes left out"), std::string::npos);
  EXPECT_EQ(what.substr(what.size() - 20), "': set a shorter one") << "the fix is kept";
}

TEST_F(Model, CrossEntropyWithLabelSmoothing) {
  auto logits = torch::tensor({{10.0f, 0.0f, 0.0f}, {0.0f, 10.0f, 0.0f}});
  auto target = torch::tensor({0, 1}, torch::kLong);
  LossOptions plain;
  LossOptions smooth;
  smooth.label_smoothing = 0.2;
  const double l0 = make_loss(plain)(logits, target).item<double>();
  const double l1 = make_loss(smooth)(logits, target).item<double>();
  EXPECT_NEAR(l0, torch::log(1 + 2 * torch::exp(torch::tensor(-10.0))).item<double>(), 1e-6);
  EXPECT_GT(l1, l0 + 0.5);  // confident predictions pay for the smoothed targets
  LossOptions unknown;
  unknown.name = "cross_entropyy";
  EXPECT_NE(model_config_error([&] { make_loss(unknown); }).find("did you mean 'cross_entropy'"),
            std::string::npos);
}

TEST_F(Model, MakeDatasetSyntheticSplits) {
  DataOptions o;
  o.dataset = "synthetic";
  o.samples = 400;
  o.channels = 3;
  o.image_size = 12;
  o.classes = 4;
  auto train = make_dataset(o, true);
  auto valid = make_dataset(o, false);
  EXPECT_EQ(train.size(), 400);
  EXPECT_EQ(valid.size(), 100);
  EXPECT_EQ(train.images.sizes(), torch::IntArrayRef({400, 3, 12, 12}));
  EXPECT_EQ(train.num_classes, 4);
  EXPECT_FALSE(torch::equal(train.images.narrow(0, 0, 100), valid.images));
  o.train_samples = 50;
  o.valid_samples = 20;
  EXPECT_EQ(make_dataset(o, true).size(), 50);
  EXPECT_EQ(make_dataset(o, false).size(), 20);
  o.dataset = "synthtic";
  EXPECT_NE(model_config_error([&] { make_dataset(o, true); }).find("did you mean 'synthetic'"),
            std::string::npos);
}

TEST_F(Model, CnnSgdStepsLowerTheLoss) {
  auto data = make_synthetic(256, 1, 28, 28, 10, 1);
  DataLoader loader(data, 64, true, 0);
  ModelOptions mo;
  mo.width = 8;
  auto model = make_model(mo, input(1, 10, {28}));
  OptimizerOptions oo;
  oo.name = "sgd";
  oo.lr = 0.05;
  oo.set("momentum", 0.9);
  auto opt = make_optimizer(oo, model->parameters());
  auto loss_fn = make_loss(LossOptions{});
  // Batch norm in training mode: the loss the steps see, without the running statistics'
  // lag.
  auto mean_loss = [&] {
    torch::NoGradGuard g;
    double total = 0;
    for (int64_t i = 0; i < loader.num_batches(); ++i) {
      auto b = loader.batch(i);
      total += loss_fn(model->forward(b.x), b.y).item<double>();
    }
    return total / loader.num_batches();
  };
  const double before = mean_loss();
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    loader.set_epoch(epoch);
    for (int64_t i = 0; i < loader.num_batches(); ++i) {
      auto b = loader.batch(i);
      opt->zero_grad();
      loss_fn(model->forward(b.x), b.y).backward();
      opt->step();
    }
  }
  const double after = mean_loss();
  EXPECT_LT(after, before - 0.2) << "before " << before << ", after " << after;
}

// ---- optimizers ----------------------------------------------------------------------------

TEST_F(Optimizer, BuildsEachNameAndSteps) {
  for (const std::string name :
       {"adam", "adamw", "sgd", "rmsprop", "adagrad", "adafactor", "adam8bit"}) {
    auto w = torch::ones({3}, torch::requires_grad());
    OptimizerOptions o;
    o.name = name;
    o.lr = 0.1;
    auto opt = make_optimizer(o, {w});
    ASSERT_NE(opt, nullptr) << name;
    (w * w).sum().backward();
    opt->step();
    EXPECT_LT(w.detach().max().item<double>(), 1.0) << name;
    EXPECT_DOUBLE_EQ(opt->param_groups()[0].options().get_lr(), 0.1) << name;
  }
}

TEST_F(Optimizer, CarriesTheOptions) {
  OptimizerOptions o;
  o.name = "adamw";
  o.lr = 0.01;
  o.set("beta1", 0.8).set("beta2", 0.95);
  o.weight_decay = 0.05;
  auto opt = make_optimizer(o, {torch::zeros({2}, torch::requires_grad())});
  auto& adamw = static_cast<torch::optim::AdamWOptions&>(opt->param_groups()[0].options());
  EXPECT_DOUBLE_EQ(std::get<0>(adamw.betas()), 0.8);
  EXPECT_DOUBLE_EQ(std::get<1>(adamw.betas()), 0.95);
  EXPECT_DOUBLE_EQ(adamw.weight_decay(), 0.05);
  o.name = "sgd";
  o.set("momentum", 0.9);
  auto sgd_opt = make_optimizer(o, {torch::zeros({2}, torch::requires_grad())});
  auto& sgd = static_cast<torch::optim::SGDOptions&>(sgd_opt->param_groups()[0].options());
  EXPECT_DOUBLE_EQ(sgd.momentum(), 0.9);
}

TEST_F(Optimizer, RejectsUnknownNamingAllowed) {
  OptimizerOptions o;
  o.name = "adma";
  auto msg = model_config_error([&] { make_optimizer(o, {torch::zeros({1}, torch::requires_grad())}); });
  EXPECT_NE(msg.find("unknown optimizer 'adma'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'adam'?"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Available: adafactor, adagrad, adam, adam8bit, adamw, adamw8bit, rmsprop, sgd"), std::string::npos) << msg;
}

}  // namespace
}  // namespace frugal
