// The fused CPU optimizers against LibTorch's (optim/fused.h): the time of one step over one
// parameter of 1 K to 100 M float32 elements, for Adam, AdamW (weight decay 0.01), SGD with
// momentum 0.9 and 8-bit Adam (the fused block pass against its tensor operations; 10 M at
// most), on 1 thread and on every intra-op thread. Each size alternates the two
// implementations (ABAB, after a warm-up step each) and reports the medians; the table goes to
// stdout (markdown) and --out (JSON). The optimizers card (docs/optimizers.md) holds its output.
//
//   build/bin/frugal_bench_optimizers [--max-elements 100000000] [--optimizer NAME ...] [--out FILE]
//                                     [--check-gradients]
// --check-gradients: every fused step also checks its gradients for inf/NaN (GradientVerdict,
// what `frugal train` asks): its cost is the difference to a run without it.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>

#include "frugal/frugal.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::unique_ptr<torch::optim::Optimizer> build(const std::string& name, bool fused,
                                               const torch::Tensor& p) {
  frugal::OptimizerOptions o;
  o.name = name;
  o.lr = 1e-3;
  o.weight_decay = name == "adamw" ? 0.01 : 0.0;
  if (name == "sgd") o.set("momentum", 0.9);
  o.set("fused", fused);
  return frugal::make_optimizer(o, {p});
}

// Median seconds of one step of each implementation over `n` elements, alternating.
std::pair<double, double> time_steps(const std::string& name, int64_t n, bool check) {
  torch::manual_seed(0);
  auto pf = torch::randn({n}).requires_grad_(true);
  auto pp = pf.detach().clone().requires_grad_(true);
  pf.mutable_grad() = torch::randn({n});
  pp.mutable_grad() = pf.grad().clone();
  auto fused = build(name, true, pf), plain = build(name, false, pp);
  auto* verdict = check ? dynamic_cast<frugal::GradientVerdict*>(fused.get()) : nullptr;
  fused->step();  // the state exists: a later step's time
  plain->step();
  // About 0.3 s of each at this size, at least 5 steps.
  const int64_t reps = std::clamp<int64_t>(int64_t{300000000} / std::max<int64_t>(n, 1) / 20, 5, 2000);
  std::vector<double> tf, tp;
  for (int64_t r = 0; r < reps; ++r)
    for (int k = 0; k < 2; ++k) {
      auto& opt = (k + r) % 2 == 0 ? *fused : *plain;
      if (verdict && &opt == fused.get()) verdict->check_next_step();
      const auto t0 = Clock::now();
      opt.step();
      (&opt == fused.get() ? tf : tp).push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  return {median(tf), median(tp)};
}

std::string human(int64_t n) {
  if (n >= 1000000) return std::to_string(n / 1000000) + " M";
  if (n >= 1000) return std::to_string(n / 1000) + " K";
  return std::to_string(n);
}

}  // namespace

int main(int argc, char** argv) {
  frugal::select_blas_core();
  frugal::MemoryMeter::install();
  CLI::App app{"frugal_bench_optimizers: fused CPU optimizers against LibTorch's, per step"};
  int64_t max_elements = 100000000;
  std::string out = "runs/bench-optimizers.json";
  app.add_option("--max-elements", max_elements, "the largest parameter (elements)")
      ->check(CLI::Range(int64_t{1000}, int64_t{1000000000}));
  app.add_option("--out", out, "JSON file for the results");
  std::vector<std::string> names = {"adam", "adamw", "sgd", "adam8bit"};
  app.add_option("--optimizer", names, "the optimizers to time (repeatable; default all four)")
      ->check(CLI::IsMember({"adam", "adamw", "sgd", "adam8bit"}));
  bool check = false;
  app.add_flag("--check-gradients", check, "the fused steps also check their gradients (inf/NaN)");
  CLI11_PARSE(app, argc, argv);

  const int all_threads = at::get_num_threads() > 1 ? at::get_num_threads()
                                                    : static_cast<int>(std::thread::hardware_concurrency());
  std::vector<int> thread_counts = {1};
  if (all_threads > 1) thread_counts.push_back(all_threads);
  nlohmann::json rows = nlohmann::json::array();
  std::ostringstream md;
  md << "| optimizer | elements | threads | LibTorch (ms) | fused (ms) | speed-up |\n"
     << "|---|---:|---:|---:|---:|---:|\n";
  for (const std::string& name : names)
    for (int threads : thread_counts) {
      at::set_num_threads(threads);
      // adam8bit's tensor operations hold about 40 bytes per element of temporaries: 10 M at most
      const int64_t largest = name == "adam8bit" ? std::min<int64_t>(max_elements, 10000000) : max_elements;
      for (int64_t n = 1000; n <= largest; n *= 10) {
        const auto [fused, plain] = time_steps(name, n, check);
        rows.push_back({{"optimizer", name}, {"elements", n}, {"threads", threads},
                        {"libtorch_seconds", plain}, {"fused_seconds", fused},
                        {"speedup", fused > 0 ? plain / fused : 0.0}});
        md << "| " << name << (name == "sgd" ? " (momentum 0.9)" : name == "adamw" ? " (wd 0.01)" : "")
           << " | " << human(n) << " | " << threads << " | " << std::fixed << std::setprecision(3)
           << 1e3 * plain << " | " << 1e3 * fused << " | " << std::setprecision(1)
           << (fused > 0 ? plain / fused : 0.0) << "x |\n";
        std::cerr << name << " " << human(n) << " x" << threads << ": " << 1e3 * plain << " ms / "
                  << 1e3 * fused << " ms\n";
      }
    }
  md << "\nLibTorch " << frugal::compat::torch_version() << ", float32 on the CPU, medians of "
     << "alternating steps; `build/bin/frugal_bench_optimizers`.\n";
  std::cout << md.str();
  try {
    const auto parent = std::filesystem::path(out).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    frugal::write_file_atomic(out, nlohmann::json{{"rows", rows}, {"markdown", md.str()}}.dump(2) + "\n");
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  std::cout << "written to " << out << "\n";
  return 0;
}
