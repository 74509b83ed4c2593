#include "frugal/app/report.h"
#include "frugal/io/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <toml++/toml.h>

#include "frugal/base/compat.h"
#include "frugal/base/error.h"
#include "frugal/base/version.h"
#include "frugal/base/blas.h"
#include "frugal/callbacks/threads.h"
#include "frugal/config/config.h"
#include "frugal/core/learner.h"

namespace frugal {

namespace fs = std::filesystem;

nlohmann::json make_report(const Learner& l, const Config& c, const nlohmann::json& extra) {
  nlohmann::json config;
  {
    std::ostringstream os;
    os << toml::json_formatter{toml::parse(c.to_toml())};
    config = nlohmann::json::parse(os.str());
  }
  nlohmann::json r = {
      {"frugal_version", kVersion},
      {"libtorch_version", compat::torch_version()},
      {"device", l.device().str()},
      {"threads", at::get_num_threads()},
      {"blas_threads", blas_threads()},
      {"config_file", c.source},
      {"config", config},
      {"fit", l.destroyed() ? nlohmann::json() : l.report()},
  };
  // The caching allocator (CPU or CUDA) holds more than the live bytes: that is what the system
  // sees. Peak reserved is since the process started (CPU) or the last reset (CUDA).
  if (auto t = last_thread_choice())
    r["threads_auto"] = {{"chosen", t->chosen}, {"blas_chosen", t->blas}, {"many", t->many},
                         {"one_thread_ms", t->one_ms}, {"many_threads_ms", t->many_ms},
                         {"many_blas_threads_ms", t->blas_ms}, {"chosen_steps_timed", t->samples},
                         {"steps_timed", t->timed}};
  if (auto b = blas_info())
    r["blas"] = {{"library", b->library}, {"core", b->core}, {"detected", b->detected},
                 {"reason", b->reason}};
  const AllocatorStats a = MemoryMeter::get().allocator_stats();
  r["reserved_bytes"] = a.reserved;
  r["reserved_peak_bytes"] = a.reserved_peak;
  for (auto it = extra.begin(); extra.is_object() && it != extra.end(); ++it) r[it.key()] = it.value();
  return r;
}

namespace {
std::string pct(double v) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << 100.0 * v << '%';
  return os.str();
}
std::string num(double v, int precision) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << v;
  return os.str();
}
int64_t get_i(const nlohmann::json& j, const char* k) { return j.contains(k) ? j[k].get<int64_t>() : 0; }

/// One row per stage: its peaks, step times, loss and the task's validation metric.
void stage_table(std::ostream& md, const nlohmann::json& fit, bool lm) {
  const bool regression = fit.value("task", "") == "regression";
  md << "| stage | peak live | forward peak | backward peak | step peak | step time median (p10-p90) | samples/s | loss | "
     << (regression ? "valid RMSE" : lm ? "valid loss (nats/token)" : "valid accuracy") << " |\n";
  md << "|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& s : fit["stages"]) {
    std::string valid = "-";
    if (lm && s.contains("valid_loss")) valid = num(s["valid_loss"].get<double>(), 4);
    if (regression && s.contains("valid_loss")) valid = num(std::sqrt(s["valid_loss"].get<double>()), 4);
    if (!lm && s.contains("valid_accuracy")) valid = pct(s["valid_accuracy"].get<double>());
    const auto& p = s["phase_peaks"];
    const auto& t = s["step_seconds"];
    std::string name = s["name"].get<std::string>();
    if (s.contains("seq_len")) name += " (seq_len " + std::to_string(get_i(s, "seq_len")) + ")";
    md << "| " << name << " | " << format_bytes(get_i(s, "peak_bytes")) << " | "
       << format_bytes(get_i(p, "forward")) << " | " << format_bytes(get_i(p, "backward")) << " | "
       << format_bytes(get_i(p, "step")) << " | " << num(1000 * t["median"].get<double>(), 1) << " ms ("
       << num(1000 * t["p10"].get<double>(), 1) << "-" << num(1000 * t["p90"].get<double>(), 1) << ") | "
       << num(s["samples_per_second"].get<double>(), 0) << " | " << num(s["loss"].get<double>(), 4) << " | "
       << valid << " |\n";
  }
}
/// What the safety nets did: the non-finite steps, early stopping, the best model kept.
void safety_lines(std::ostream& md, const nlohmann::json& r) {
  if (r.contains("nonfinite") && r["nonfinite"].is_object()) {
    const auto& n = r["nonfinite"];
    if (n.value("mode", "") == "skip" && get_i(n, "skipped_steps") > 0)
      md << "**Non-finite steps skipped:** " << get_i(n, "skipped_steps")
         << " (run.on_nonfinite = \"skip\"; the loss or a gradient was inf/NaN).\n\n";
    if (n.value("mode", "") == "fail" && n.contains("event") && n.contains("checkpoint")) {
      md << "**Stopped at a non-finite " << n["event"].value("what", "value") << "** ("
         << (n["event"].value("step_ran", false)
                 ? "found by the optimizer's step, whose update stayed in memory: nothing was written after it"
                 : "the step was not taken")
         << "); ";
      if (n["checkpoint"].is_string())
        md << "the last good checkpoint, `" << n["checkpoint"].get<std::string>() << "`, is kept.\n\n";
      else
        md << "no checkpoint was written before it (run.checkpoint_every, run.checkpoint_epochs).\n\n";
    }
  }
  if (r.contains("early_stopping") && r["early_stopping"].value("stopped", false)) {
    const auto& e = r["early_stopping"];
    md << "**Stopped early** after " << get_i(e, "stopped_epoch") << " epochs: "
       << e.value("metric", "") << " did not improve by more than " << e.value("min_delta", 0.0)
       << " for " << get_i(e, "patience") << " epochs (best " << e.value("best", 0.0)
       << " after epoch " << get_i(e, "best_epoch") << ").\n\n";
  }
  if (r.contains("best_model") && r["best_model"].is_object()) {
    const auto& b = r["best_model"];
    md << "Best model (" << b.value("metric", "") << " = " << b.value("value", 0.0) << ", stage "
       << b.value("stage_name", "") << " epoch " << get_i(b, "epoch") << ", " << get_i(b, "steps")
       << " steps): `" << b.value("pt", "") << "`, `" << b.value("safetensors", "") << "`.\n\n";
  }
}

// What holds the memory in each stage's steady state (its third batch).
void steady_table(std::ostringstream& md, const nlohmann::json& fit) {
  md << "\nSteady state (a stage's third batch): what holds the memory\n\n";
  md << "| stage | parameters | gradients | optimizer state | activations | data | held by callbacks | other |\n";
  md << "|---|---|---|---|---|---|---|---|\n";
  for (const auto& s : fit["stages"]) {
    const auto& b = s["steady"];
    md << "| " << s["name"].get<std::string>();
    for (const char* k : {"parameters", "gradients", "optimizer_state", "activations", "data", "callbacks", "other"})
      md << " | " << format_bytes(get_i(b, k));
    md << " |\n";
  }
}
// The report's first line: config, LibTorch, device, threads, BLAS kernels, auto's timings.
void setup_line(std::ostream& md, const nlohmann::json& r) {
  md << "config `" << r.value("config_file", "") << "`, LibTorch " << r.value("libtorch_version", "")
     << ", device " << r.value("device", "") << ", " << r.value("threads", 0) << " threads";
  if (r.value("blas_threads", 0) > 0) md << " (BLAS " << r.value("blas_threads", 0) << ")";
  if (r.contains("blas")) {
    const auto& b = r["blas"];
    md << ", " << b.value("library", "") << " " << b.value("core", "");
    if (b.value("core", "") != b.value("detected", ""))
      md << " (chosen by frugal; it detected " << b.value("detected", "") << ")";
  }
  if (r.contains("threads_auto")) {
    const auto& t = r["threads_auto"];
    md << " (run.threads = auto: a step took " << num(t.value("one_thread_ms", 0.0), 2)
       << " ms on 1 thread, " << num(t.value("many_threads_ms", 0.0), 2) << " ms on "
       << t.value("many", 0) << " ATen threads";
    if (t.value("many_blas_threads_ms", 0.0) > 0)
      md << ", " << num(t.value("many_blas_threads_ms", 0.0), 2) << " ms on " << t.value("many", 0)
         << " BLAS threads";
    md << ")";
  }
}

}  // namespace

std::string report_markdown(const nlohmann::json& r) {
  std::ostringstream md;
  const auto& fit = r["fit"];
  md << "# frugal run report\n\n";
  setup_line(md, r);
  md << "\n\n";
  if (r.contains("error")) md << "**The run stopped with an error:** " << r["error"].get<std::string>() << "\n\n";
  if (r.contains("interrupted") && r["interrupted"].is_object()) {
    const auto& i = r["interrupted"];
    md << "**The run was interrupted** by " << i.value("signal", "a stop request") << " after stage "
       << i.value("stage", 0) + 1 << " epoch " << i.value("epoch", 0) + 1 << " batch "
       << i.value("batch", 0) << " (" << i.value("steps", 0) << " optimizer steps); its checkpoint `"
       << i.value("checkpoint", "") << "` continues it (the same command with `--resume auto`).\n\n";
  }
  safety_lines(md, r);
  if (fit.is_null()) return md.str();

  const bool lm = fit.value("task", "") == "language_model";
  stage_table(md, fit, lm);
  steady_table(md, fit);
  md << "\nPeak live memory " << format_bytes(get_i(fit, "peak_bytes"));
  if (r.contains("reserved_peak_bytes"))
    md << " (the allocator held at most " << format_bytes(get_i(r, "reserved_peak_bytes")) << ")";
  md << "; "
     << num(fit["samples_per_second"].get<double>(), 0) << " samples/s over "
     << num(fit["train_seconds"].get<double>(), 1) << " s of training; final loss "
     << num(fit["final_loss"].get<double>(), 4);
  if (fit.contains("valid_metric"))
    md << "; validation " << (fit.value("task", "") == "regression" ? "" : lm ? "loss " : "accuracy ")
       << fit["valid_metric"].value("text", "");
  else if (fit.contains("valid_accuracy"))
    md << "; validation accuracy " << pct(fit["valid_accuracy"].get<double>());
  md << ".\n";
  if (fit.contains("oom")) {
    const auto& o = fit["oom"];
    md << "\nMemory budget " << (get_i(o, "budget") > 0 ? format_bytes(get_i(o, "budget")) : "none")
       << ", on_oom = " << o.value("on_oom", "") << ": " << get_i(o, "count")
       << " out-of-memory errors caught; the last batch ran in micro-batches of "
       << get_i(o, "micro_batch");
    for (const auto& a : o["auto"])
      md << "; micro_batch = auto chose " << get_i(a, "micro_batch") << " for stage "
         << a.value("stage", "");
    md << ".\n";
  }
  return md.str();
}

void write_report(const std::string& dir, const nlohmann::json& report, const Config& c) {
  fs::create_directories(dir);
  write_file_atomic((fs::path(dir) / "config.toml").string(), c.to_toml());
  write_file_atomic((fs::path(dir) / "report.json").string(), report.dump(2) + "\n");
  write_file_atomic((fs::path(dir) / "report.md").string(), report_markdown(report));
}

}  // namespace frugal
