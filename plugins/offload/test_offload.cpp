// The offload plugin: state tensors moved into memory-mapped files keep their values and are
// stepped in place; a fit with the state on disk gives bitwise the weights of one without, the
// live bytes the budget counts no longer hold the state, and nothing is left in the folder.
#include <filesystem>
#include <sstream>

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "cli_support.h"
#include "frugal/base/compat.h"
#include "frugal/io/safetensors.h"
#include "learner_fixture.h"
#include "offload.h"

namespace frugal::test {
namespace {

namespace off = frugal::offload;

size_t files_in(const std::string& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

std::vector<torch::Tensor> all_state(torch::optim::Optimizer& opt) {
  std::vector<torch::Tensor> out;
  for (const auto& group : opt.param_groups()) {  // in the parameters' order (the map's differs)
    for (const auto& p : group.params()) {
      auto it = opt.state().find(compat::optimizer_state_key(p));
      if (it == opt.state().end()) continue;
      const auto ts = off::state_tensors(*it->second);
      EXPECT_TRUE(ts.has_value());
      if (!ts) continue;
      for (const auto& t : *ts)
        if (t.defined()) out.push_back(t);
    }
  }
  return out;
}

/// Two equal layers, each with its optimizer `name` (lr 0.01; sgd with momentum).
struct Twins {
  Twins(const std::string& name, int64_t in, int64_t out) : a(in, out), b(in, out) {
    { torch::NoGradGuard g; b->weight.copy_(a->weight); b->bias.copy_(a->bias); }
    OptimizerOptions o;
    o.name = name;
    o.lr = 0.01;
    if (name == "sgd") o.set("momentum", 0.9);
    oa = make_optimizer(o, a->parameters());
    ob = make_optimizer(o, b->parameters());
  }
  torch::nn::Linear a, b;
  std::unique_ptr<torch::optim::Optimizer> oa, ob;
};

// Fused Adam's state moved after one step: the values stay, the optimizer's own tensors now live
// in the file (on_disk), the second step updates them there and gives the reference's bits, and
// the live bytes drop by the state's. The file is unlinked at once; the mapping goes with the
// last tensor.
TEST(OffloadMath, MovedStateKeepsItsValuesAndIsSteppedInPlace) {
  TempDir dir;
  MemoryMeter::get().install();
  for (const std::string name : {"adam", "sgd", "adam8bit"}) {
    torch::manual_seed(1);
    Twins twins(name, 64, 300);
    auto &a = twins.a, &b = twins.b;
    auto &oa = twins.oa, &ob = twins.ob;
    const auto step = [](torch::nn::Linear& m, torch::optim::Optimizer& opt, int i) {
      opt.zero_grad();
      torch::manual_seed(10 + i);
      m->forward(torch::randn({8, 64})).pow(2).sum().backward();
      opt.step();
    };
    step(a, *oa, 0);
    step(b, *ob, 0);
    std::vector<torch::Tensor> before;
    for (const auto& t : all_state(*oa)) before.push_back(t.clone());
    const int64_t live = MemoryMeter::get().current();
    const off::Moved m = off::move_to_disk(all_state(*oa), dir.file(""));
    EXPECT_GT(m.tensors, 1) << name;
    EXPECT_LE(MemoryMeter::get().current(), live - m.bytes) << name << ": the state left the allocator";
    EXPECT_EQ(files_in(dir.file("")), 0u) << "unlinked as soon as mapped";
    EXPECT_GE(off::disk_bytes(), m.bytes);
    {
      const auto moved = all_state(*oa);
      ASSERT_EQ(moved.size(), before.size());
      for (size_t i = 0; i < moved.size(); ++i) {
        EXPECT_TRUE(off::on_disk(moved[i])) << name << " " << i;
        EXPECT_TRUE(torch::equal(moved[i], before[i])) << name << " " << i;
      }
      EXPECT_EQ(off::move_to_disk(moved, dir.file("")).tensors, 0) << "already there";
    }
    EXPECT_EQ(off::state_bytes(*oa).in_memory, 0) << name;
    off::drop_pages();  // the next step faults them back in from the page cache
    step(a, *oa, 1);
    step(b, *ob, 1);
    EXPECT_TRUE(torch::equal(a->weight, b->weight)) << name;
    EXPECT_TRUE(torch::equal(a->bias, b->bias)) << name;
    for (const auto& t : all_state(*oa)) EXPECT_TRUE(off::on_disk(t)) << name << ": stepped in place";
    oa.reset();
    EXPECT_EQ(off::disk_bytes(), 0) << name << ": unmapped with the last tensor";
  }
}

std::shared_ptr<off::Offload> make_plugin(const std::string& dir, std::ostringstream& out,
                                          bool parameters = false, const std::string& to = "disk") {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%n: %v");
  off::OffloadOptions o;
  o.dir = dir;
  o.parameters = parameters;
  o.to = to;
  return std::make_shared<off::Offload>(o, PluginContext{"offload", std::make_shared<spdlog::logger>("offload", sink)});
}

// to = "cpu" on the CPU (the test seam: the same path, plain memory for pinned).
std::shared_ptr<off::Offload> make_host_plugin(std::ostringstream& out) {
  auto plugin = make_plugin("", out, false, "cpu");
  plugin->allow_host_step_on_cpu();
  return plugin;
}

std::vector<std::vector<float>> weights_of(torch::nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (const auto& p : m.parameters()) {
    const torch::Tensor c = p.detach().contiguous();
    out.emplace_back(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

// to = "cpu"'s step (ZeRO-Offload) on two copies of a layer: stepped through host masters it
// gives bitwise the weights of the step on the parameters themselves, also after something else
// wrote the parameters between steps (in place: the version counter; a new storage, as a load
// makes: the pointer) and after a step that failed (the parameters untouched, the next step
// copies the master afresh). The parameters keep their tensors; the state lives in the host
// buffers it made, and the device (here the same memory) holds no gradient after the step.
TEST(OffloadMath, TheHostStepGivesBitwiseTheWeightsOfTheStepOnTheParameters) {
  for (const std::string name : {"adam", "sgd"}) {
    torch::manual_seed(1);
    Twins twins(name, 32, 200);
    auto &a = twins.a, &b = twins.b;
    auto &oa = twins.oa, &ob = twins.ob;
    off::HostStep host(torch::kCPU, 16 << 10);  // chunks of 16 KiB: the weight and its moments alone
    const c10::TensorImpl* weight = b->weight.unsafeGetTensorImpl();
    const auto backward = [](torch::nn::Linear& m, int i) {
      torch::manual_seed(10 + i);
      m->forward(torch::randn({8, 32})).pow(2).sum().backward();
    };
    for (int i = 0; i < 6; ++i) {
      backward(a, i);
      backward(b, i);
      if (i == 3) {  // the step fails: nothing moves, the gradients go
        host.to_host(*ob);
        EXPECT_TRUE(host.on_host());
        host.to_device(/*stepped=*/false);
        EXPECT_FALSE(b->weight.grad().defined()) << name;
        oa->zero_grad();
        EXPECT_EQ(weights_of(*a), weights_of(*b)) << name;
        continue;
      }
      oa->step();
      host.to_host(*ob);
      EXPECT_NE(b->weight.grad().data_ptr(), a->weight.grad().data_ptr());
      ob->step();
      for (auto& p : b->parameters()) p.mutable_grad().reset();  // the Learner's zero_grad
      host.to_device(/*stepped=*/true);
      oa->zero_grad();
      EXPECT_FALSE(host.on_host());
      EXPECT_EQ(b->weight.unsafeGetTensorImpl(), weight) << "the same tensor";
      EXPECT_EQ(weights_of(*a), weights_of(*b)) << name << " step " << i;
      torch::NoGradGuard g;
      if (i == 1) {  // written in place between steps
        a->weight.mul_(0.5);
        b->weight.mul_(0.5);
      }
      if (i == 4) {  // a new storage with other values, as a load
        a->bias.set_data(a->bias.detach().clone() + 1);
        b->bias.set_data(b->bias.detach().clone() + 1);
      }
    }
    EXPECT_EQ(weights_of(*a), weights_of(*b)) << name;
    const int64_t params = static_cast<int64_t>((32 * 200 + 200) * sizeof(float));
    const off::HostStep::Bytes bytes = host.bytes();
    EXPECT_EQ(bytes.masters, params) << name;
    EXPECT_EQ(bytes.gradients, params) << name;
    EXPECT_EQ(bytes.state, (name == "adam" ? 2 : 1) * params) << name;
    for (const auto& t : all_state(*ob)) EXPECT_TRUE(host.holds_state(t)) << name;
  }
}

/// One tiny fit (2 epochs, Adam), with or without the plugin, measured alone (every tensor of
/// it gone when this returns): its weights as numbers, the first stage's step phase peak, and
/// the state's bytes on disk and in memory at the end.
struct TinyFit {
  std::vector<std::vector<float>> weights;
  int64_t step_peak = 0;
  off::StateBytes state;
  off::Moved moved;
  int64_t resident_state = 0;  ///< optimizer_state_bytes: what is in memory
  int64_t steady_state = 0;    ///< the report's steady optimizer_state
};

TinyFit tiny_fit(const std::string& dir, std::ostringstream* log) {
  auto l = make_tiny_learner();
  std::shared_ptr<off::Offload> plugin;
  if (log) l->add_callback(plugin = make_plugin(dir, *log));
  l->fit(2);
  TinyFit f;
  for (const auto& p : l->model()->parameters()) {
    const torch::Tensor c = p.contiguous();
    f.weights.emplace_back(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  f.step_peak = l->report()["stages"][0]["phase_peaks"]["step"].get<int64_t>();
  f.state = off::state_bytes(l->optimizer());
  f.resident_state = optimizer_state_bytes(l->optimizer());
  f.steady_state = l->report()["stages"][0]["steady"]["optimizer_state"].get<int64_t>();
  if (plugin) f.moved = plugin->moved();
  return f;
}

// The plugin in a fit: the first step makes the state on disk (its peak, the allocator's, lacks
// the state), every later step updates it there, the weights are bitwise those of the same fit
// without it, and a save reads the state back like any tensor.
TEST(Offload, AFitWithTheStateOnDiskEqualsOneWithout) {
  TempDir dir;
  std::ostringstream log;
  const TinyFit plain = tiny_fit("", nullptr), off_fit = tiny_fit(dir.file("state"), &log);
  EXPECT_EQ(off_fit.weights, plain.weights);
  EXPECT_GT(off_fit.state.on_disk, 0);
  EXPECT_EQ(off_fit.state.in_memory, 0);
  EXPECT_EQ(plain.state.in_memory, off_fit.state.on_disk);
  EXPECT_EQ(off_fit.moved.bytes, off_fit.state.on_disk) << "made on disk, packed once, stepped in place";
  EXPECT_LE(off_fit.step_peak, plain.step_peak - off_fit.state.on_disk)
      << off_fit.step_peak << " vs " << plain.step_peak;
  EXPECT_EQ(files_in(dir.file("state")), 0u);
  EXPECT_NE(log.str().find("in memory-mapped files in " + dir.file("state")), std::string::npos) << log.str();
  // What is counted as in memory: the state on disk is not (the meter never saw it).
  EXPECT_EQ(plain.resident_state, plain.state.in_memory);
  EXPECT_EQ(plain.steady_state, plain.state.in_memory);
  EXPECT_EQ(off_fit.resident_state, 0);
  EXPECT_EQ(off_fit.steady_state, 0);

  // Saved with its state and loaded into a learner without the plugin: the same moments.
  auto l = make_tiny_learner();
  l->add_callback(make_plugin(dir.file("state"), log));
  l->fit(1);
  // Not in memory, but there: the next step makes no new state (what micro_batch = "auto"
  // reserves also without the plugin, in a later fit).
  EXPECT_EQ(optimizer_state_bytes(l->optimizer()), 0);
  EXPECT_EQ(optimizer_step_needs(*l->model(), l->optimizer(), l->optimizer_options()).state, 0);
  l->save(dir.file("m.pt"), /*with_opt=*/true);
  auto back = make_tiny_learner();
  back->load(dir.file("m.pt"), /*with_opt=*/true);
  const auto saved = all_state(l->optimizer()), loaded = all_state(back->optimizer());
  ASSERT_EQ(saved.size(), loaded.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(off::on_disk(saved[i])) << i;
    EXPECT_TRUE(torch::equal(saved[i], loaded[i])) << i;
  }
}

// parameters = true: the parameters the optimizer steps live in the files too, from the fit's
// start. The forward reads them there, the step writes them in place: the weights are bitwise
// the plain fit's, and the meter's parameter bytes (the report's steady parameters) hold none.
TEST(Offload, ParametersOnDiskTrainTheSameWeights) {
  TempDir dir;
  std::ostringstream log;
  const TinyFit plain = tiny_fit("", nullptr);
  auto l = make_tiny_learner();
  auto plugin = make_plugin(dir.file("p"), log, /*parameters=*/true);
  l->add_callback(plugin);
  l->fit(2);
  std::vector<std::vector<float>> weights;
  int64_t bytes = 0;
  for (const auto& p : l->model()->parameters()) {
    EXPECT_TRUE(off::on_disk(p));
    bytes += static_cast<int64_t>(p.nbytes());
    const torch::Tensor c = p.contiguous();
    weights.emplace_back(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  EXPECT_EQ(weights, plain.weights);
  EXPECT_EQ(plugin->parameters_moved().bytes, bytes) << "moved once, stepped in place";
  int64_t buffers = 0;
  for (const auto& b : l->model()->buffers()) buffers += static_cast<int64_t>(b.nbytes());
  EXPECT_EQ(parameter_bytes(*l->model()), buffers);
  EXPECT_EQ(l->report()["stages"][0]["steady"]["parameters"].get<int64_t>(), buffers);
  EXPECT_NE(log.str().find("parameters: "), std::string::npos) << log.str();
}

// to = "cpu" in a fit (on the CPU through the test seam): bitwise the weights of the fit
// without it, the state in the host step's buffers; saved with the optimizer and resumed in
// another learner with the plugin, the next epoch equals the same resume without it (the loaded
// parameters and state are taken up: copied to the masters, moved into host buffers).
TEST(Offload, TheHostStepInAFitEqualsTheStepOnTheDevice) {
  TempDir dir;
  std::ostringstream log;
  const TinyFit plain = tiny_fit("", nullptr);
  auto l = make_tiny_learner();
  auto plugin = make_host_plugin(log);
  l->add_callback(plugin);
  l->fit(2);
  EXPECT_EQ(weights_of(*l->model()), plain.weights);
  ASSERT_NE(plugin->host_step(), nullptr);
  EXPECT_EQ(plugin->host_step()->bytes().state, plain.state.in_memory);
  for (const auto& t : all_state(l->optimizer())) EXPECT_TRUE(plugin->host_step()->holds_state(t));
  EXPECT_NE(log.str().find("the step ran on the host"), std::string::npos) << log.str();
  EXPECT_TRUE(l->optimizer_state_offloaded());

  l->save(dir.file("m.pt"), /*with_opt=*/true);
  const auto resumed = [&](bool with) {
    auto r = make_tiny_learner();
    if (with) r->add_callback(make_host_plugin(log));
    r->load(dir.file("m.pt"), /*with_opt=*/true);
    r->fit(1);
    return weights_of(*r->model());
  };
  const auto without = resumed(false);
  EXPECT_EQ(resumed(true), without);
  EXPECT_NE(without, plain.weights) << "the resumed epoch trained";
}

/// Whether the learner counts the optimizer state as offloaded, at each stage's start.
struct OffloadedSeen : Callback {
  std::string name() const override { return "offloaded_seen"; }
  void before_stage(Learner& l) override { seen.push_back(l.optimizer_state_offloaded()); }
  std::vector<bool> seen;
};

// The micro-batch search (micro_batch = auto) reserves the bytes the first step's state will
// take, unless the state goes to disk: the plugin says so at each fit's start (and a fit
// without it does not inherit it), and under budgets that hold the probe but not the state's
// reserve the search then finds a micro-batch where it found none.
TEST(Offload, TheMicroBatchSearchReservesNothingForStateOnDisk) {
  TempDir dir;
  std::ostringstream log;
  TinySetup s;
  s.width = 512;  // Adam's state (2 x 140 KB) outweighs a sample's activations (2 KB)
  auto l = make_tiny_learner(s);
  auto seen = std::make_shared<OffloadedSeen>();
  l->add_callback(seen);
  auto plugin = make_plugin(dir.file("state"), log);
  l->add_callback(plugin);
  l->fit(1);
  l->remove_callback(plugin->name());
  l->fit(1);
  EXPECT_EQ(seen->seen, (std::vector<bool>{true, false}));

  auto fresh = make_tiny_learner(s);  // no state yet: the search reserves all of it
  const int64_t live = MemoryMeter::get().current();
  const auto search = [&](bool offloaded) {
    fresh->set_optimizer_state_offloaded(offloaded);
    return micro_batch_that_fits(*fresh);
  };
  int64_t more = 0, reserved = 0;
  // Up the budget in steps of 64 KiB (the state's reserve is 280 KB) until the whole batch fits.
  for (int64_t extra = 0; extra <= (8 << 20) && reserved < s.batch_size; extra += 64 << 10) {
    ScopedMemoryBudget budget(live + extra);
    reserved = search(false);
    const int64_t not_reserved = search(true);
    EXPECT_GE(not_reserved, reserved) << extra;
    if (not_reserved > reserved) ++more;
  }
  EXPECT_EQ(reserved, s.batch_size);
  EXPECT_GT(more, 0) << "no budget where the state's reserve made the difference";
}

/// Removes the offload folder before the first step: the step's first state file cannot be made.
struct FolderRemover : Callback {
  explicit FolderRemover(std::string d) : dir(std::move(d)) {}
  std::string name() const override { return "folder_remover"; }
  void before_step(Learner&) override { std::filesystem::remove_all(dir); }
  std::string dir;
};

// A first step that fails inside the redirect (its state file cannot be made) ends the fit with
// an error naming the folder, and the redirect with it: LibTorch's CPU allocator is the one it
// was, and a tensor made afterwards lives in memory.
TEST(Offload, AStepThatFailsInsideTheRedirectEndsIt) {
  TempDir dir;
  auto l = make_tiny_learner();
  c10::Allocator* before = c10::GetCPUAllocator();
  std::ostringstream log;
  l->add_callback(make_plugin(dir.file("gone"), log));
  l->add_callback(std::make_shared<FolderRemover>(dir.file("gone")));
  std::string error;
  try {
    l->fit(1);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("plugins.offload: cannot create '" + dir.file("gone")), std::string::npos) << error;
  EXPECT_EQ(c10::GetCPUAllocator(), before);
  EXPECT_FALSE(off::on_disk(torch::ones({4096})));
}

// From the command line: the key's values are checked, the run's weights are those without it.
TEST(OffloadCli, TrainsWithTheStateOnDiskAndRefusesATargetForAnotherDevice) {
  TempDir dir;
  const auto config = [&](const std::string& out, const std::string& extra) {
    return "[run]\nout_dir = \"" + out + "\"\nthreads = 1\nseed = 2\nprogress = \"log\"\n"
           "[data]\ndataset = \"synthetic\"\nsamples = 96\nimage_size = 8\nclasses = 4\n"
           "batch_size = 32\nvalid_samples = -1\n[model]\narch = \"mlp\"\nwidth = 32\n"
           "[optimizer]\nname = \"adamw\"\nlr = 0.01\n[[stages]]\nepochs = 2\n" + extra;
  };
  const std::string with = dir.file("with"), without = dir.file("without");
  write_text(dir.file("with.toml"), config(with, "[plugins.offload]\n"));
  write_text(dir.file("without.toml"), config(without, ""));
  const auto r = run_cli("train " + dir.file("with.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("in memory-mapped files in " + with + "/offload"), std::string::npos) << r.output;
  ASSERT_EQ(run_cli("train " + dir.file("without.toml")).exit_code, 0);
  const auto a = safetensors::read(with + "/model.safetensors"), b = safetensors::read(without + "/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, t] : a) EXPECT_TRUE(torch::equal(t, b.at(k))) << k;

  // to = "cpu" is for a CUDA run: check refuses it on the CPU as train would, and its
  // disk-only keys by name.
  const auto cpu = run_cli("check " + dir.file("with.toml") + " --set plugins.offload.to='\"cpu\"'");
  EXPECT_NE(cpu.exit_code, 0);
  EXPECT_NE(cpu.output.find("plugins.offload.to = \"cpu\" moves a CUDA run"), std::string::npos) << cpu.output;
  EXPECT_NE(cpu.output.find("set plugins.offload.to = \"disk\""), std::string::npos) << cpu.output;
  const auto dir_key = run_cli("check " + dir.file("with.toml") + " --set plugins.offload.to='\"cpu\"'" +
                               " --set plugins.offload.dir='\"x\"'");
  EXPECT_NE(dir_key.exit_code, 0);
  EXPECT_NE(dir_key.output.find("plugins.offload.dir applies to to = \"disk\" only"), std::string::npos)
      << dir_key.output;
  const auto bad = run_cli("check " + dir.file("with.toml") + " --set plugins.offload.to='\"nvme\"'");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("plugins.offload.to"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace frugal::test
