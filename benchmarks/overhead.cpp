// The Learner's overhead: the same model, data, seed and threads trained by the Learner with
// no plugins and by a hand-written LibTorch loop (forward, loss, backward, step, zero_grad),
// in one process, alternating rounds of N steps (ABBA order, so drift hits both alike).
// Both run with frugal's caching allocator installed (it is process-wide): the ratio is the
// cost of the loop, its events and its measurements, not of the allocator. Without --config it
// measures two built-in setups: a deep MLP at batch 256 (a step of several milliseconds) and a
// small 784-256-256-10 MLP at batch 32, where per-step costs show most.
//
//   build/bin/frugal_bench_overhead [--config FILE] [--steps 30] [--rounds 6] [--out FILE]
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <random>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/null_sink.h>

#include "frugal/frugal.h"

namespace {

using Clock = std::chrono::steady_clock;

// Models whose step is a few milliseconds or less: the Learner's per-step cost shows against it.
const char* kDefaultConfig = R"(
[run]
seed = 0
device = "cpu"
threads = 1
[data]
dataset = "synthetic"
image_size = 16
samples = 8192
valid_samples = -1
batch_size = 256
[model]
arch = "mlp"
width = 256
depth = 8
[optimizer]
name = "sgd"
lr = 0.01
[[stages]]
name = "train"
epochs = 1000
)";

// The small model: what the side-by-side benchmark trains on Fashion-MNIST, on synthetic data.
const std::vector<std::string> kSmallModel = {"data.image_size=28", "data.batch_size=32",
                                              "model.depth=1", "model.width=256"};

// Where a step's tensors land decides a few percent to 25% of a small step's time (cache sets,
// 4 KiB aliasing between activations, gradients and the optimizer's state): two loops whose
// allocations differ by one small tensor can land differently all run long. Both loops hold a
// tensor of a random size (512 B to 64 KiB, the same sequence for each loop) through each step,
// so each samples many placements and their medians compare the loops, not their luck.
class Jitter {
 public:
  void hold() { held_ = torch::empty({static_cast<int64_t>(512 * (1 + rng_() % 128))}, torch::kByte); }
  void drop() { held_ = torch::Tensor(); }
  void restart() { rng_.seed(1234); }

 private:
  std::mt19937 rng_{1234};
  torch::Tensor held_;
};

/// The Learner's side of the jitter: held from before_batch to after_batch.
struct JitterCallback : frugal::Callback {
  explicit JitterCallback(Jitter& j) : jitter(j) {}
  std::string name() const override { return "bench_jitter"; }
  void before_batch(frugal::Learner&) override { jitter.hold(); }
  void after_batch(frugal::Learner&) override { jitter.drop(); }
  Jitter& jitter;
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

nlohmann::json summary(const std::vector<double>& v) {
  return {{"median", percentile(v, 0.5)}, {"p10", percentile(v, 0.1)}, {"p90", percentile(v, 0.9)},
          {"steps", v.size()}};
}

// Trains the setup with the Learner and with the hand loop, alternating rounds; prints and
// returns the figures.
nlohmann::json measure(const std::string& config, const std::vector<std::string>& sets, int64_t steps,
                       int64_t rounds, int64_t warmup) {
  std::vector<std::string> overrides = {"data.valid_samples=-1"};
  overrides.insert(overrides.end(), sets.begin(), sets.end());
  frugal::Config cfg = config.empty() ? frugal::parse_config(kDefaultConfig, "<built-in>", overrides)
                                      : frugal::load_config(config, overrides);
  cfg.plugins = toml::table{};  // no plugins: the bare Learner
  cfg.run.trace.clear();

  // One setup, trained in turn by the Learner and by the hand-written loop: the same model,
  // optimizer and data at the same addresses (two copies differed by up to 15% per step,
  // either way, from where their tensors happened to lie).
  auto learner = frugal::make_learner(cfg);
  learner->set_max_batches(steps);
  learner->set_warmup_batches(0);
  // The callbacks `frugal train` adds besides make_learner's (non-finite check, metrics): the
  // progress display, logging to nowhere.
  learner->add_callback(std::make_shared<frugal::ProgressCallback>(
      frugal::ProgressCallback::Mode::Log, cfg.run.log_every,
      std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>())));
  Jitter learner_jitter, hand_jitter;
  learner->add_callback(std::make_shared<JitterCallback>(learner_jitter));
  torch::nn::Sequential model = learner->model();
  torch::optim::Optimizer& opt = learner->optimizer();
  frugal::DataLoader& data = learner->train_data();
  const frugal::LossFn& loss_fn = learner->loss_fn();
  model->train();
  int64_t epoch = 0, index = data.num_batches();

  std::vector<double> learner_steps, hand_steps;
  double learner_wall = 0, hand_wall = 0, learner_loop = 0;  // the hand loop is all loop
  auto run_learner = [&] {
    const auto t0 = Clock::now();
    learner->fit(cfg.stages);
    learner_wall += std::chrono::duration<double>(Clock::now() - t0).count();
    learner_loop += learner->stage_stats().at(0).train_seconds;
    const auto& s = learner->stage_stats().at(0).step_seconds;
    learner_steps.insert(learner_steps.end(), s.begin() + std::min<int64_t>(warmup, s.size()), s.end());
  };
  auto run_hand = [&] {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < steps; ++i) {
      if (index >= data.num_batches()) {
        data.set_epoch(epoch++);
        index = 0;
      }
      frugal::Batch b = data.batch(index++);
      hand_jitter.hold();
      // Timed like the Learner's step: from the loaded batch to the zeroed gradients.
      const auto s0 = Clock::now();
      torch::Tensor loss = loss_fn(model->forward(b.x), b.y);
      loss.backward();
      opt.step();
      for (auto& p : model->parameters()) p.mutable_grad().reset();
      const double dt = std::chrono::duration<double>(Clock::now() - s0).count();
      hand_jitter.drop();
      if (i >= warmup) hand_steps.push_back(dt);
    }
    hand_wall += std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (int64_t r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      run_learner();
      run_hand();
    } else {
      run_hand();
      run_learner();
    }
  }

  const double lm = percentile(learner_steps, 0.5), hm = percentile(hand_steps, 0.5);
  nlohmann::json result = {
      {"config", config.empty() ? "<built-in>" : config},
      {"model", cfg.model.arch + " width " + std::to_string(cfg.model.width) + " depth " +
                    std::to_string(cfg.model.depth)},
      {"batch_size", cfg.data.batch_size},
      {"threads", at::get_num_threads()},
      {"steps_per_round", steps},
      {"rounds", rounds},
      {"warmup_per_round", warmup},
      {"learner_step_seconds", summary(learner_steps)},
      {"hand_step_seconds", summary(hand_steps)},
      {"learner_wall_seconds", learner_wall},
      {"hand_wall_seconds", hand_wall},
      {"learner_loop_seconds", learner_loop},
      {"loop_time_ratio", hand_wall > 0 ? learner_loop / hand_wall : 0.0},
      {"step_time_ratio", hm > 0 ? lm / hm : 0.0},
      {"wall_time_ratio", hand_wall > 0 ? learner_wall / hand_wall : 0.0},
      {"allocator", "frugal's caching CPU allocator, for both"},
      {"libtorch", frugal::compat::torch_version()}};
  std::cout << "Learner (no plugins) vs hand-written loop, " << result["model"].get<std::string>()
            << ", batch " << cfg.data.batch_size << ", " << at::get_num_threads() << " threads, "
            << rounds << " rounds x " << steps << " steps:\n"
            << "  median step: Learner " << 1000 * lm << " ms, hand loop " << 1000 * hm
            << " ms; ratio " << result["step_time_ratio"].get<double>() << " (overhead "
            << 100 * (result["step_time_ratio"].get<double>() - 1) << "%)\n"
            << "  the batch loops (loading, every hook; the fit's start and end left out): ratio "
            << result["loop_time_ratio"].get<double>() << " (overhead "
            << 100 * (result["loop_time_ratio"].get<double>() - 1) << "%)\n"
            << "  wall time of the rounds (with each fit's start and end): ratio "
            << result["wall_time_ratio"].get<double>() << "\n";
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  frugal::select_blas_core();  // both loops run on the same kernels: the CPU's best
  frugal::MemoryMeter::install();
  CLI::App app{"frugal_bench_overhead: the Learner against a hand-written LibTorch loop"};
  std::string config, out = "runs/bench-overhead.json";
  int64_t steps = 30, rounds = 6, warmup = 2;
  std::vector<std::string> sets;
  app.add_option("--config", config, "a run TOML (default: a built-in MLP on synthetic data)");
  app.add_option("--steps", steps, "steps per round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "rounds of each loop, alternating")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "steps of each round left out")->check(CLI::NonNegativeNumber);
  app.add_option("--out", out, "JSON file for the results");
  app.add_option("--set", sets, "override a config key (repeatable)");
  CLI11_PARSE(app, argc, argv);
  if (warmup >= steps) {
    std::cerr << "--warmup must be less than --steps\n";
    return 2;
  }

  try {
    nlohmann::json results = nlohmann::json::array();
    std::vector<std::vector<std::string>> setups = {sets};
    if (config.empty()) {  // the built-in setups: the deep MLP at 256, the small one at 32
      setups.push_back(kSmallModel);
      setups.back().insert(setups.back().end(), sets.begin(), sets.end());
    }
    for (const auto& overrides : setups) results.push_back(measure(config, overrides, steps, rounds, warmup));
    const auto parent = std::filesystem::path(out).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    frugal::write_file_atomic(out, results.dump(2) + "\n");
    std::cout << "written to " << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
