// What `frugal check` knows without training: the bytes a run will hold (compared with what a
// real run holds), the output folder, freeze prefixes, the budget, disabled plugins' options.
#include <filesystem>

#include "cli_support.h"
#include "frugal/app/preflight.h"
#include "frugal/app/run.h"
#include "frugal/base/error.h"
#include "frugal/config/config.h"
#include "frugal/data/data.h"
#include "frugal/optim/optimizers.h"
#include "support.h"

namespace frugal::test {
namespace {

std::string tiny_config(const std::string& out_dir) {
  return "[run]\nout_dir = \"" + out_dir + "\"\nprogress = \"none\"\nthreads = 1\nmax_steps = 1\n"
         "[data]\ndataset = \"synthetic\"\nsamples = 96\nimage_size = 8\nclasses = 4\nbatch_size = 32\n"
         "[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n"
         "[optimizer]\nname = \"adam\"\nlr = 0.01\n"
         "[[stages]]\nname = \"first\"\nepochs = 1\nfreeze = [\"stem\"]\n";
}

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

int64_t dataset_bytes(const Dataset& d) { return bytes_of(d.images) + bytes_of(d.labels) + bytes_of(d.tokens); }

TEST(Preflight, TheEstimateFromShapesIsWhatARealRunHolds) {
  for (const std::string arch : {"mlp", "cnn"}) {  // cnn: BatchNorm buffers
    TempDir dir;
    std::string text = tiny_config(dir.file("out"));
    if (arch == "cnn") {
      text.replace(text.find("\"mlp\""), 5, "\"cnn\"");
      text.replace(text.find("[\"stem\"]"), 8, "[\"features1\"]");
      text.erase(text.find("depth = 1\n"), 10);  // the cnn has no depth
    }
    const Config c = parse_config(text, "tiny.toml");
    const std::string frozen = arch == "cnn" ? "features1" : "stem";
    const HeldBytes h = estimate_held_bytes(c);

    auto learner = make_learner(c);
    learner->fit(c.stages);  // one step: gradients and Adam's state exist
    int64_t params = 0, buffers = 0, trained = 0;
    for (const auto& np : learner->model()->named_parameters()) {
      params += bytes_of(np.value());
      if (np.key().rfind(frozen, 0) != 0) trained += bytes_of(np.value());
    }
    for (const auto& b : learner->model()->buffers()) buffers += bytes_of(b);
    EXPECT_EQ(h.parameters, params) << arch;
    EXPECT_EQ(h.buffers, buffers) << arch;
    EXPECT_EQ(arch == "cnn", buffers > 0) << arch;
    EXPECT_EQ(h.gradients, trained) << arch << ": the first stage's frozen block has no gradients";
    EXPECT_EQ(h.optimizer, "adam");
    EXPECT_EQ(h.optimizer_state, optimizer_state_bytes(learner->optimizer())) << arch;
    EXPECT_EQ(h.optimizer_state, 2 * trained) << arch << ": Adam, two moments per trained parameter";
    ASSERT_NE(learner->valid_data(), nullptr);
    EXPECT_EQ(h.data, dataset_bytes(learner->train_data().dataset()) +
                          dataset_bytes(learner->valid_data()->dataset())) << arch;
    EXPECT_TRUE(h.data_on_device);
  }
}

TEST(Preflight, FashionMnistAndTextAreEstimatedFromTheirFilesAsTheyAreLoaded) {
  TempDir dir;
  // A small Fashion-MNIST-shaped set (IDX files as Debian ships them) and a text corpus.
  std::filesystem::create_directories(dir.file("fm"));
  for (const auto& [split, n] : {std::pair<std::string, int64_t>{"train", 40}, {"t10k", 12}}) {
    write_idx(dir.file("fm/" + split + "-images-idx3-ubyte.gz"), torch::zeros({n, 28, 28}, torch::kUInt8));
    write_idx(dir.file("fm/" + split + "-labels-idx1-ubyte.gz"), torch::zeros({n}, torch::kUInt8));
  }
  write_text(dir.file("corpus.txt"), std::string(5000, 'a'));
  const std::string base = "[run]\nout_dir = \"" + dir.file("out") + "\"\nprogress = \"none\"\n";
  for (const std::string& data :
       {"[data]\ndataset = \"fashion-mnist\"\npath = \"" + dir.file("fm") + "\"\n",
        "[data]\ndataset = \"fashion-mnist\"\npath = \"" + dir.file("fm") + "\"\ntrain_samples = 16\nvalid_samples = -1\n",
        "[data]\ndataset = \"text\"\npaths = [\"" + dir.file("corpus.txt") + "\"]\nblock_size = 16\n",
        "[data]\ndataset = \"text\"\npaths = [\"" + dir.file("corpus.txt") + "\"]\nblock_size = 16\n"
        "train_samples = 10\nvalid_samples = 2\n"}) {
    const std::string model = data.find("text") != std::string::npos
                                  ? "[model]\narch = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 8\n"
                                  : "[model]\narch = \"mlp\"\nwidth = 8\ndepth = 1\n";
    const Config c = parse_config(base + data + model, "data.toml");
    auto learner = make_learner(c);
    int64_t held = dataset_bytes(learner->train_data().dataset());
    if (learner->valid_data()) held += dataset_bytes(learner->valid_data()->dataset());
    EXPECT_EQ(estimated_data_bytes(c), held) << data;
    // The model is built for the data (Fashion-MNIST: 1x28x28, whatever data.image_size says).
    int64_t params = 0;
    for (const auto& p : learner->model()->parameters()) params += bytes_of(p);
    EXPECT_EQ(estimate_held_bytes(c).parameters, params) << data;
  }
}

TEST(Preflight, ABudgetBelowTheHeldBytesIsRefusedByCheckAndTrainBeforeAnyWork) {
  TempDir dir;
  const std::string out = dir.file("out");
  write_text(dir.file("run.toml"), tiny_config(out));
  const HeldBytes h = estimate_held_bytes(parse_config(tiny_config(out), "run.toml"));
  const std::string below = std::to_string(h.total() - 1);
  for (const std::string cmd : {"check", "train"}) {
    auto r = run_cli(cmd + " " + dir.file("run.toml") + " --set run.memory_budget=\"" + below + "B\"");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("run.memory_budget = " + format_bytes(h.total() - 1) + " is below"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("optimizer state (adam) " + format_bytes(h.optimizer_state)), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("data " + format_bytes(h.data)), std::string::npos) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(out)) << "no work may start on bad input";
  // The estimate itself fits: check passes at exactly the held bytes.
  auto ok = run_cli("check " + dir.file("run.toml") + " --set run.memory_budget=\"" +
                    std::to_string(h.total()) + "B\"");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST(Preflight, TheBudgetCountsTheStepsTemporariesAndValidationsBatch) {
  // A budget that held the model, gradients and Adam's moments but not the step's temporaries
  // nor the validation batch (1000 samples by default) passed check and failed train at step 0.
  // LibTorch's Adam (fused = false) allocates temporaries; the fused step none.
  TempDir dir;
  const std::string out = dir.file("out");
  write_text(dir.file("run.toml"), tiny_config(out));
  EXPECT_EQ(estimate_held_bytes(parse_config(tiny_config(out), "run.toml")).step_temporaries, 0);
  const std::string plain = " --set optimizer.fused=false";
  const Config c = parse_config(tiny_config(out), "run.toml", {"optimizer.fused=false"});
  const HeldBytes h = estimate_held_bytes(c);
  EXPECT_GT(h.step_temporaries, 0) << "LibTorch's Adam step allocates temporaries";
  const int64_t sample = c.data.image_size * c.data.image_size * 4 + 8;  // float pixels, a label
  EXPECT_EQ(h.batch, std::max(c.data.batch_size, c.data.valid_batch_size) * sample);
  const int64_t without = h.total() - h.step_temporaries - h.batch;
  auto r = run_cli("check " + dir.file("run.toml") + plain + " --set run.memory_budget=\"" +
                   std::to_string(without) + "B\"");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the largest batch " + format_bytes(h.batch)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the step's temporaries " + format_bytes(h.step_temporaries)), std::string::npos)
      << r.output;
}

TEST(Preflight, AModelLargerThanTheMachineIsAConfigErrorNamingTheKeyAndTheBytes) {
  // 2x2 images keep the first layer small (4 x 300000 floats); the hidden layer asks 335 GiB.
  TempDir dir;
  const std::string out = dir.file("out");
  write_text(dir.file("run.toml"), tiny_config(out));
  for (const std::string cmd : {"check", "train"}) {
    auto r = run_cli(cmd + " " + dir.file("run.toml") + " --set data.image_size=2 --set model.width=300000");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("run.toml (with --set model.width=300000): model: the sizes it sets "
                            "need more memory than this machine's"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("tried to allocate 335.3 GiB"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("run.memory_budget"), std::string::npos) << "no budget was set: " << r.output;
    EXPECT_EQ(r.output.find("frame #"), std::string::npos) << "no allocator trace: " << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(out)) << "no work may start on bad input";
}

TEST(Preflight, CheckRefusesAnOutputFolderThatCannotBeMadeAndLeavesNothingBehind) {
  TempDir dir;
  write_text(dir.file("file"), "x");
  write_text(dir.file("run.toml"), tiny_config(dir.file("file") + "/out"));
  auto r = run_cli("check " + dir.file("run.toml"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("run.out_dir: output folder '" + dir.file("file") + "/out' cannot be created: '" +
                          dir.file("file") + "' is not a folder"),
            std::string::npos) << r.output;

  write_text(dir.file("ok.toml"), tiny_config(dir.file("a/b/out")));
  r = run_cli("check " + dir.file("ok.toml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.file("a"))) << "check creates nothing";
  size_t left = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) left += e.path().filename().string()[0] == '.';
  EXPECT_EQ(left, 0u) << "the probe folder is removed";
}

TEST(Preflight, CheckRefusesAFreezePrefixThatMatchesNoParameter) {
  TempDir dir;
  write_text(dir.file("run.toml"), tiny_config(dir.file("out")));
  auto r = run_cli("check " + dir.file("run.toml") + " --set 'stages.0.freeze=[\"stm\"]'");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("stages.freeze: stage 'first': freeze prefix 'stm' matches no parameter; "
                          "did you mean 'stem'?"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("The model's blocks: stem, block1, head"), std::string::npos) << r.output;
}

TEST(Preflight, ADisabledPluginsOptionsAreCheckedToo) {
  TempDir dir;
  write_text(dir.file("run.toml"), tiny_config(dir.file("out")) +
                                       "[plugins.detach_loss]\nenabled = false\nbogus = 1\n"
                                       "[plugins.not_installed]\nenabled = false\nwhatever = 2\n");
  auto r = run_cli("check " + dir.file("run.toml"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("run.toml:25:1: unknown key 'plugins.detach_loss.bogus'"), std::string::npos)
      << r.output;
  // Without the typo the config passes: a plugin that is not installed and turned off is ignored.
  write_text(dir.file("ok.toml"), tiny_config(dir.file("out")) +
                                      "[plugins.detach_loss]\nenabled = false\n"
                                      "[plugins.not_installed]\nenabled = false\nwhatever = 2\n"
                                      // Set aside with no trigger: its values wait until it is on.
                                      "[plugins.optim_swap]\nenabled = false\n");
  r = run_cli("check " + dir.file("ok.toml"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace frugal::test
