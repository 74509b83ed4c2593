// The trained model kept: every finished run writes model.pt (weights only) and
// model.safetensors; both load back exactly, from C++ and from Python; damaged or foreign
// files are refused with the file's name.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "cli_support.h"
#include "frugal/app/model_export.h"
#include "frugal/app/run.h"
#include "frugal/frugal.h"
#include "frugal/io/safetensors.h"
#include "support.h"

namespace frugal::test {
namespace {

std::string run_config(const std::string& out_dir, const std::string& arch = "mlp") {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"none\"\nthreads = 1\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\n"
         "batch_size = 16\nvalid_samples = 32\n"
         "[model]\narch = \"" + arch + "\"\nwidth = 8\n" + (arch == "cnn" ? "" : "depth = 1\n") +
         "[[stages]]\nname = \"only\"\nepochs = 1\n";
}

/// Trains the config of `out_dir` through the CLI; returns its output.
std::string train(const TempDir& dir, const std::string& out, const std::string& arch = "mlp") {
  write_text(dir.file(arch + ".toml"), run_config(out, arch));
  const CliResult r = run_cli("train " + dir.file(arch + ".toml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}

TEST(Safetensors, RoundTripKeepsNamesDtypesShapesAndBytes) {
  TempDir dir;
  const std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"w", torch::randn({3, 5})},
      {"half", torch::randn({7}).to(torch::kHalf)},
      {"bf", torch::randn({2, 2}).to(torch::kBFloat16)},
      {"ids", torch::arange(10, torch::kLong).view({2, 5})},
      {"mask", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(3.5, torch::kDouble)},
      {"empty", torch::zeros({0, 4})},
      {"strided", torch::randn({4, 6}).t()}};  // not contiguous: written row-major
  safetensors::write(dir.file("t.safetensors"), tensors, {{"format", "pt"}});
  std::map<std::string, std::string> meta;
  const auto back = safetensors::read(dir.file("t.safetensors"), &meta);
  EXPECT_EQ(meta.at("format"), "pt");
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_EQ(back.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back.at(name).sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(back.at(name), t)) << name;
  }
  // The data starts at a multiple of 8, as the format recommends.
  uint64_t n = 0;
  std::ifstream(dir.file("t.safetensors"), std::ios::binary).read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
}

/// The file's bytes after `edit`, written back.
void edit_file(const std::string& path, const std::function<void(std::string&)>& edit) {
  std::string bytes = read_text(path);
  edit(bytes);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(Safetensors, DamagedFilesAreRefusedNamingTheFileAndWhat) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  const auto expect_refused = [&](const std::function<void(std::string&)>& edit, const char* what) {
    safetensors::write(path, {{"a", torch::ones({4})}, {"b", torch::zeros({2, 2})}});
    edit_file(path, edit);
    try {
      safetensors::read(path);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_refused([](std::string& b) { b.resize(5); }, "shorter than");
  expect_refused([](std::string& b) { b[7] = '\x7f'; }, "beyond the end");
  expect_refused([](std::string& b) { b[8] = '#'; }, "not JSON");
  expect_refused([](std::string& b) { b.resize(b.size() - 4); }, "outside the file");
  expect_refused([](std::string& b) { b.replace(b.find("[2,2]"), 5, "[2,3]"); }, "disagree");
  expect_refused([](std::string& b) { b.replace(b.find("F32"), 3, "F99"); }, "unknown dtype");
  expect_refused([](std::string& b) { b.replace(b.find("[16,32]"), 7, "[12,28]"); }, "overlap");
  // A flipped bit in a weight keeps the layout valid: the per-tensor checksum catches it.
  expect_refused([](std::string& b) { b.back() ^= 0x01; }, "tensor 'b' do not match their checksum");
  expect_refused([](std::string& b) { b.replace(b.find("frugal.crc32.a"), 14, "frugal.crc32.z"); },
                 "tensor 'a' has no checksum");
}

TEST(Safetensors, EveryFlippedBitOfTheTensorsIsRefused) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  const std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"w", torch::randn({16, 8})}, {"b", torch::randn({8})}, {"ids", torch::arange(6)}};
  safetensors::write(path, tensors);
  const std::string good = read_text(path);
  uint64_t n = 0;
  std::memcpy(&n, good.data(), sizeof n);
  const size_t data = 8 + n;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100; ++i) {
    const size_t at = data + rng() % (good.size() - data);
    const int bit = static_cast<int>(rng() % 8);
    std::string bytes = good;
    bytes[at] = static_cast<char>(bytes[at] ^ (1 << bit));
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    EXPECT_THROW(safetensors::read(path), CheckpointError) << "byte " << at << " bit " << bit;
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << good;
  EXPECT_EQ(safetensors::read(path).size(), tensors.size());
}

std::string init_config(const std::string& out_dir, int64_t classes, const std::string& init) {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"none\"\nthreads = 1\nseed = 7\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = " + std::to_string(classes) +
         "\nbatch_size = 16\nvalid_samples = -1\n[model]\narch = \"cnn\"\nwidth = 4\n" + init;
}

TEST(InitFrom, ARunStartsFromAnotherRunsWeightsExactly) {
  TempDir dir;
  auto a = make_learner(parse_config(init_config(dir.file("a"), 4, ""), "a.toml"));
  a->fit(1);
  safetensors::write(dir.file("a.safetensors"), safetensors::state_dict(*a->model()));
  auto b = make_learner(parse_config(
      init_config(dir.file("b"), 4, "init_from = \"" + dir.file("a.safetensors") + "\"\n"), "b.toml"));
  const auto sa = safetensors::state_dict(*a->model()), sb = safetensors::state_dict(*b->model());
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first << " (buffers too)";
}

TEST(InitFrom, AMismatchIsNamedAndNonStrictLoadsWhatMatches) {
  TempDir dir;
  auto a = make_learner(parse_config(init_config(dir.file("a"), 4, ""), "a.toml"));
  safetensors::write(dir.file("a.safetensors"), safetensors::state_dict(*a->model()));
  const std::string from = "init_from = \"" + dir.file("a.safetensors") + "\"\n";
  try {  // 10 classes: the head is of another shape
    make_learner(parse_config(init_config(dir.file("b"), 10, from), "b.toml"));
    ADD_FAILURE() << "a head of another shape loaded";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("b.toml: model.init_from: '" + dir.file("a.safetensors") + "' does not match the model"),
              std::string::npos) << m;
    EXPECT_NE(m.find("of another shape: head."), std::string::npos) << m;
    EXPECT_NE(m.find("file [4"), std::string::npos) << m;
    EXPECT_NE(m.find("model.init_strict = false"), std::string::npos) << m;
  }
  auto b = make_learner(parse_config(init_config(dir.file("b"), 10, from + "init_strict = false\n"), "b.toml"));
  const auto other = safetensors::state_dict(*a->model());
  for (const auto& entry : safetensors::state_dict(*b->model())) {
    const std::string& name = entry.first;
    const torch::Tensor& t = entry.second;
    const auto it = std::find_if(other.begin(), other.end(), [&](const auto& p) { return p.first == name; });
    ASSERT_NE(it, other.end()) << name;
    if (name.rfind("head.", 0) == 0)
      EXPECT_NE(t.sizes(), it->second.sizes()) << name;
    else
      EXPECT_TRUE(torch::equal(t, it->second)) << name << " was not loaded";
  }
  try {  // a folder without a model, named
    make_learner(parse_config(init_config(dir.file("c"), 4, "init_from = \"" + dir.path().string() + "\"\n"), "c.toml"));
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("is a folder without a model.safetensors"), std::string::npos) << e.what();
  }
}

TEST(ModelExport, AFinishedRunKeepsItsWeightsAndTheyLoadBackExactly) {
  TempDir dir;
  const std::string out = dir.file("run");
  train(dir, out);
  ASSERT_TRUE(std::filesystem::exists(out + "/model.pt"));
  ASSERT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  const RunModel run = load_run_model(out);
  const auto weights = safetensors::read(out + "/model.safetensors");
  const auto named = run.model->named_parameters();
  ASSERT_EQ(weights.size(), named.size() + run.model->named_buffers().size());
  for (const auto& p : named) {
    ASSERT_TRUE(weights.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(weights.at(p.key()), p.value())) << p.key();
  }
  // A freshly initialised model differs: the weights did load.
  torch::manual_seed(123);
  auto fresh = make_config_model(run.loaded.config);
  EXPECT_FALSE(torch::equal(fresh->parameters().front(), run.model->parameters().front()));
}

TEST(ModelExport, PythonReadsTheSafetensorsFileByTheFormatAlone) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed";
  TempDir dir;
  const std::string out = dir.file("run");
  train(dir, out);
  // What safetensors.torch.load_file does, in plain Python: length, JSON header, raw bytes.
  write_text(dir.file("read.py"),
             "import json, struct, sys, torch\n"
             "b = open(sys.argv[1], 'rb').read()\n"
             "n = struct.unpack('<Q', b[:8])[0]\n"
             "h = json.loads(b[8:8 + n])\n"
             "data = b[8 + n:]\n"
             "for k in sorted(h):\n"
             "    if k == '__metadata__': continue\n"
             "    s, e = h[k]['data_offsets']\n"
             "    t = torch.frombuffer(bytearray(data[s:e]), dtype=torch.float32).view(h[k]['shape'])\n"
             "    print(k, '%.6f' % t.double().sum().item())\n");
  const CliResult py = run_cli_command("/usr/bin/python3 " + dir.file("read.py") + " " + out + "/model.safetensors");
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const RunModel run = load_run_model(out);
  for (const auto& p : run.model->named_parameters()) {
    char line[256];
    std::snprintf(line, sizeof line, "%s %.6f\n", p.key().c_str(), p.value().to(torch::kDouble).sum().item<double>());
    EXPECT_NE(py.output.find(line), std::string::npos) << line << " not in:\n" << py.output;
  }
}

TEST(ModelExport, ARunFolderWithoutAModelOrWithAnotherModelIsRefusedNamingTheFile) {
  TempDir dir;
  EXPECT_THROW(load_run_model(dir.file("nowhere")), ConfigError);
  const std::string mlp = dir.file("mlp-run"), cnn = dir.file("cnn-run");
  train(dir, mlp, "mlp");
  train(dir, cnn, "cnn");
  // The cnn run's config with the mlp's weights (read from model.safetensors, not model.pt's
  // TorchScript): every name and shape is checked before loading.
  std::filesystem::copy_file(mlp + "/model.safetensors", cnn + "/model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  try {
    load_run_model(cnn);
    ADD_FAILURE() << "loaded another model's weights";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(cnn + "/model.safetensors does not fit the run's model"),
              std::string::npos) << e.what();
  }
  std::filesystem::remove(cnn + "/model.pt");
  try {
    load_run_model(cnn);
    ADD_FAILURE() << "loaded a run without model.pt";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("no trained model"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace frugal::test
