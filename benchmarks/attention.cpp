// The fused CPU causal attention (fused_causal_attention, attention.h) against the plain kernel
// the gpt runs otherwise (q, k, v views of the projection, matmul, scale, mask, softmax, matmul,
// the output transposed back): the time of a forward and a backward from the projection
// [B, T, 3C] to [B, T, C], and the bytes held for backward (live after the forward, above the
// inputs). Each thread setting frugal's `run.threads = "auto"` chooses among (1 + 1, N ATen + 1
// BLAS, 1 ATen + N BLAS) alternates the two kernels (ABAB after a warm-up each) and reports
// medians. Markdown on stdout.
//
//   build/bin/frugal_bench_attention [--batch 32] [--time 128] [--heads 4] [--width 128] [--reps 30]
#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>

#include "frugal/frugal.h"
#include "frugal/models/attention.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Run {
  double ms;
  int64_t held;  // bytes live after the forward, beyond the projection and the output weights
};

Run once(bool fused, const torch::Tensor& proj, const torch::Tensor& weight, int64_t heads) {
  auto& meter = frugal::MemoryMeter::get();
  const auto t0 = Clock::now();
  const int64_t before = meter.current();
  auto y = frugal::attention_from_projection(proj, heads, {}, 0, true, fused);
  auto loss = (y * weight).sum();
  const int64_t held = meter.current() - before;
  loss.backward();
  return {std::chrono::duration<double, std::milli>(Clock::now() - t0).count(), held};
}

}  // namespace

int main(int argc, char** argv) {
  frugal::select_blas_core();
  frugal::MemoryMeter::install();
  CLI::App app{"frugal_bench_attention: the fused CPU causal attention against the plain kernel"};
  int64_t batch = 32, time = 128, heads = 4, width = 128, reps = 30;
  app.add_option("--batch", batch, "B");
  app.add_option("--time", time, "T (sequence length)");
  app.add_option("--heads", heads, "H");
  app.add_option("--width", width, "C (H x D)");
  app.add_option("--reps", reps, "timed forward + backward per kernel and setting");
  CLI11_PARSE(app, argc, argv);
  if (!frugal::fused_attention_applies(torch::zeros({1, 1, 3}), 0, false)) {
    std::cerr << "no BLAS sgemm in this process: the fused kernel cannot run\n";
    return 1;
  }
  torch::manual_seed(0);
  auto proj = torch::randn({batch, time, 3 * width}).requires_grad_(true);
  const auto weight = torch::randn({batch, time, width});
  const int64_t n = frugal::available_cores();
  struct Setting {
    int64_t aten, blas;
  };
  std::vector<Setting> settings{{1, 1}};
  if (n > 1) {
    settings.push_back({n, 1});
    if (frugal::blas_threads() > 0) settings.push_back({1, n});
  }
  std::cout << "B " << batch << ", T " << time << ", H " << heads << ", C " << width
            << ", float32, forward + backward, medians of " << reps << "\n\n"
            << "| threads (ATen + BLAS) | plain ms | fused ms | fused / plain | held for backward, plain | fused |\n"
            << "|---|---:|---:|---:|---:|---:|\n";
  for (const auto& s : settings) {
    frugal::set_threads(s.aten, s.blas);
    std::vector<double> tf, tp;
    int64_t held_f = 0, held_p = 0;
    once(true, proj, weight, heads);
    once(false, proj, weight, heads);
    for (int64_t r = 0; r < reps; ++r)
      for (int k = 0; k < 2; ++k) {
        const bool fused = (k + r) % 2 == 0;
        proj.mutable_grad() = torch::Tensor();
        const auto run = once(fused, proj, weight, heads);
        (fused ? tf : tp).push_back(run.ms);
        (fused ? held_f : held_p) = run.held;
      }
    const double f = median(tf), p = median(tp);
    std::cout << "| " << s.aten << " + " << s.blas << " | " << std::fixed << std::setprecision(2) << p << " | "
              << f << " | " << std::setprecision(3) << f / p << " | " << std::setprecision(1)
              << held_p / 1048576.0 << " MiB | " << held_f / 1048576.0 << " MiB |\n";
  }
  return 0;
}
