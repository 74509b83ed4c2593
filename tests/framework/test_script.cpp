// model.pt is a TorchScript module: its forward, written from the model's tree (script.h),
// computes what the C++ model computes, for every model of the zoo; its prepare() prepares raw
// inputs as the data pipeline does; a module without a TorchScript form is named and the model
// is still saved; Python calls the module with torch.jit.load alone.
#include <torch/script.h>

#include <filesystem>
#include <sstream>

#include "cli_support.h"
#include "frugal/app/model_export.h"
#include "frugal/frugal.h"
#include "frugal/io/safetensors.h"
#include "gpt_fixture.h"
#include "learner_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

namespace nn = torch::nn;

/// The model's eval forward and model.pt's, on the same input.
std::pair<torch::Tensor, torch::Tensor> both_forwards(nn::Sequential model, const torch::Tensor& x,
                                                      const std::string& path,
                                                      const nlohmann::json& data = nullptr) {
  torch::NoGradGuard g;
  model->eval();
  export_model(*model, path, {}, data);
  torch::jit::Module scripted = torch::jit::load(path);
  EXPECT_TRUE(scripted.find_method("forward").has_value()) << path;
  return {model->forward(x), scripted.forward({x}).toTensor()};
}

/// Moves batch norm's running statistics away from 0 and 1, so eval mode is seen.
void train_batch_norms(nn::Sequential& model, const torch::Tensor& x) {
  torch::NoGradGuard g;
  model->train();
  for (int i = 0; i < 3; ++i) model->forward(x * (i + 1) + 0.5);
}

TEST(ModelScript, EveryZooModelsTorchScriptForwardEqualsItsOwn) {
  TempDir dir;
  torch::manual_seed(1);
  const auto images = torch::randn({5, 1, 8, 8});
  struct Case {
    std::string arch;
    int64_t depth;
  };
  // resnet depth 2: layer2 halves the size through a projection shortcut; mlp and cnn with
  // dropout (the identity in eval mode).
  for (const Case& c : {Case{"mlp", 2}, Case{"cnn", 0}, Case{"resnet", 2}, Case{"vit", 2}}) {
    SCOPED_TRACE(c.arch);
    torch::manual_seed(2);
    ModelOptions mo;
    mo.arch = c.arch;
    mo.depth = c.depth;
    mo.width = 8;
    mo.dropout = 0.25;
    mo.patch = 4;  // 2 x 2 patches of 4 x 4 pixels
    mo.heads = 2;
    ModelInput in;
    in.channels = 1;
    in.image_size = 8;
    in.num_classes = 4;
    in.image_sizes = {8};
    auto model = make_model(mo, in);
    train_batch_norms(model, images);
    const auto [own, scripted] = both_forwards(model, images, dir.file(c.arch + ".pt"));
    ASSERT_EQ(own.sizes(), scripted.sizes());
    EXPECT_TRUE(torch::allclose(own, scripted, 1e-6, 1e-6))
        << (own - scripted).abs().max().item<float>();
  }
}

TEST(ModelScript, TheGptsTorchScriptForwardEqualsItsOwnAtEveryLength) {
  TempDir dir;
  TinyGpt s;
  auto model = make_model(gpt_options(s), gpt_input(s));
  const std::string path = dir.file("gpt.pt");
  for (int64_t t : {s.block_size, int64_t{3}}) {  // shorter windows: the mask follows the length
    const auto tokens = torch::randint(0, 256, {2, t}, torch::kLong);
    const auto [own, scripted] = both_forwards(model, tokens, path);
    ASSERT_EQ(own.sizes(), scripted.sizes());
    // the model's fused attention against the script's composite form: rounding apart
    EXPECT_TRUE(torch::allclose(own, scripted, 1e-5, 1e-5)) << (own - scripted).abs().max().item<float>();
  }
}

TEST(ModelScript, PrepareTurnsRawPixelsAndFeaturesIntoWhatTheModelWasTrainedOn) {
  TempDir dir;
  auto model = make_zoo_model("mlp", 1, 8, 0.0);
  const nlohmann::json images = {{"images", {{"mean", 0.2860}, {"std", 0.3530}, {"size", 8}}}};
  export_model(*model, dir.file("m.pt"), {}, images);
  auto m = torch::jit::load(dir.file("m.pt"));
  const auto raw = torch::randint(0, 256, {3, 1, 8, 8}, torch::kUInt8);
  const auto prepared = m.run_method("prepare", raw).toTensor();
  EXPECT_TRUE(torch::equal(prepared, prepare_images(raw, 0.2860, 0.3530, 0)));

  const nlohmann::json csv = {{"features", {{"names", {"a", "b"}}, {"mean", {1.5, -2.0}}, {"std", {0.5, 4.0}}}}};
  export_model(*model, dir.file("c.pt"), {}, csv);
  auto c = torch::jit::load(dir.file("c.pt"));
  const auto rows = torch::tensor({{2.0, 2.0}, {1.0, -6.0}}, torch::kDouble);
  const auto standardized = c.run_method("prepare", rows).toTensor();
  EXPECT_TRUE(torch::equal(standardized, torch::tensor({{1.0f, 1.0f}, {-1.0f, -1.0f}})));
  // Tokens need no preparing: no method.
  export_model(*model, dir.file("t.pt"), {}, nlohmann::json{{"task", "language_model"}});
  EXPECT_FALSE(torch::jit::load(dir.file("t.pt")).find_method("prepare").has_value());
}

struct SquareImpl : nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x * x; }
};
TORCH_MODULE(Square);

TEST(ModelScript, AModuleWithoutAFormIsNamedAndAPluginCanGiveItOne) {
  TempDir dir;
  nn::Sequential model(nn::Linear(4, 3), Square());
  const ScriptSource none = script_forward(*model, "self.model");
  EXPECT_TRUE(none.code.empty());
  EXPECT_NE(none.missing.find("SquareImpl"), std::string::npos) << none.missing;
  EXPECT_NE(none.missing.find("getattr(self.model, \"1\")"), std::string::npos) << none.missing;
  // Saved all the same, without a forward: the weights are kept.
  export_model(*model, dir.file("none.pt"), {});
  auto saved = torch::jit::load(dir.file("none.pt"));
  EXPECT_FALSE(saved.find_method("forward").has_value());
  EXPECT_EQ(saved.named_parameters().size(), 2u);

  register_script<SquareImpl>(
      [](const nn::Module&, const std::string&, const std::string& x, ScriptWriter& w) {
        return w.let(x + " * " + x);
      },
      "square_plugin");
  const auto x = torch::randn({2, 4});
  const auto [own, scripted] = both_forwards(model, x, dir.file("square.pt"));
  EXPECT_TRUE(torch::equal(own, scripted));
  remove_scripts("square_plugin");  // as the plugin loader does before the library unloads
  EXPECT_FALSE(script_forward(*model, "self.model").missing.empty());
}

bool python_torch() { return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0; }

TEST(ModelFromPython, PythonCallsARunsModelPtWithTorchJitLoadAlone) {
  if (!python_torch()) GTEST_SKIP() << "Debian's python3-torch is not installed";
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("cnn.toml"),
             "[run]\nout_dir = \"" + out + "\"\nprogress = \"none\"\nthreads = 1\n"
             "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\n"
             "batch_size = 16\nvalid_samples = 16\n[model]\narch = \"cnn\"\nwidth = 4\n"
             "[[stages]]\nname = \"only\"\nepochs = 1\n");
  const CliResult r = run_cli("train " + dir.file("cnn.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Raw pixels in, frugal's logits of the prepared pixels out: what Python must print.
  torch::manual_seed(3);
  const auto raw = torch::randint(0, 256, {2, 1, 8, 8}, torch::kUInt8);
  safetensors::write(dir.file("raw.safetensors"), {{"raw", raw}}, {});
  RunModel run = load_run_model(out);
  torch::NoGradGuard g;
  const auto mean = run.data["images"]["mean"].get<double>(), sd = run.data["images"]["std"].get<double>();
  const auto logits = run.model->forward(prepare_images(raw, mean, sd, 0));
  write_text(dir.file("call.py"),
             "import json, struct, sys, torch\n"
             "b = open(sys.argv[2], 'rb').read()\n"
             "n = struct.unpack('<Q', b[:8])[0]\n"
             "h = json.loads(b[8:8 + n])['raw']\n"
             "raw = torch.frombuffer(bytearray(b[8 + n:]), dtype=torch.uint8).view(h['shape'])\n"
             "m = torch.jit.load(sys.argv[1])\n"
             "for v in m(m.prepare(raw)).flatten().tolist(): print('%.6f' % v)\n");
  const CliResult py = run_cli_command("/usr/bin/python3 " + dir.file("call.py") + " " + out + "/model.pt " +
                                       dir.file("raw.safetensors"));
  ASSERT_EQ(py.exit_code, 0) << py.output;
  std::string expected;
  for (float v : std::vector<float>(logits.data_ptr<float>(), logits.data_ptr<float>() + logits.numel())) {
    char line[32];
    std::snprintf(line, sizeof line, "%.6f\n", v);
    expected += line;
  }
  EXPECT_EQ(py.output, expected);
}

/// The lines of `output` that start with `prefix` (after spaces).
std::string lines_with(const std::string& output, const std::string& prefix) {
  std::istringstream in(output);
  std::string line, out;
  while (std::getline(in, line))
    if (line.find_first_not_of(' ') != std::string::npos && line.compare(line.find_first_not_of(' '), prefix.size(), prefix) == 0)
      out += line + "\n";
  return out;
}

// The documented path for one's own torch.nn code: examples/pytorch/load_run.py rebuilds the mlp
// and the cnn in torch.nn, loads model.safetensors, prepares the images as frugal does and
// scores what `frugal evaluate` scores, to the last printed digit.
TEST(ModelFromPython, LoadRunPyScoresTheSafetensorsAsFrugalEvaluateDoes) {
  const std::string data = "/usr/share/datasets/fashion-mnist";
  if (!python_torch()) GTEST_SKIP() << "Debian's python3-torch is not installed";
  if (!std::filesystem::exists(data + "/t10k-images-idx3-ubyte.gz")) GTEST_SKIP() << "no " << data;
  TempDir dir;
  for (const std::string arch : {"mlp", "cnn"}) {
    SCOPED_TRACE(arch);
    const std::string out = dir.file(arch);
    write_text(dir.file(arch + ".toml"),
               "[run]\nout_dir = \"" + out + "\"\nprogress = \"none\"\nthreads = 1\n"
               "[data]\ndataset = \"fashion-mnist\"\npath = \"" + data + "\"\nbatch_size = 64\n"
               "train_samples = 256\nvalid_samples = 300\nvalid_batch_size = 128\n"
               "[model]\narch = \"" + arch + "\"\nwidth = 8\ndropout = 0.1\n" +
               (arch == "mlp" ? "depth = 2\n" : "") + "[[stages]]\nname = \"only\"\nepochs = 1\n");
    ASSERT_EQ(run_cli("train " + dir.file(arch + ".toml")).exit_code, 0);
    const CliResult frugal = run_cli("evaluate " + out);
    ASSERT_EQ(frugal.exit_code, 0) << frugal.output;
    const CliResult py = run_cli_command("/usr/bin/python3 " + std::string(FRUGAL_TEST_SOURCE_DIR) +
                                         "/examples/pytorch/load_run.py " + out);
    ASSERT_EQ(py.exit_code, 0) << py.output;
    const std::string scores = lines_with(frugal.output, "accuracy:") + lines_with(frugal.output, "valid_loss:");
    ASSERT_FALSE(lines_with(frugal.output, "accuracy:").empty()) << frugal.output;
    EXPECT_EQ(lines_with(py.output, "accuracy:") + lines_with(py.output, "valid_loss:"), scores) << py.output;
  }
}

}  // namespace
}  // namespace frugal::test
