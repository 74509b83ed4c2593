// `frugal train`: the run's folder (one run at a time, no silent overwrite, --resume and
// --resume auto), the fit, a clean stop on SIGTERM/SIGINT/run.preempt_signal, the report.
#include "train.h"

#include "launch.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include <spdlog/spdlog.h>

#include "frugal/app/model_export.h"
#include "frugal/app/plugin_host.h"
#include "frugal/app/preflight.h"
#include "frugal/app/run.h"
#include "frugal/callbacks/progress.h"
#include "frugal/callbacks/stop.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/distributed.h"
#include "frugal/frugal.h"
#include "frugal/io/file_writer.h"
#include "frugal/io/run_folder.h"

namespace fs = std::filesystem;

namespace frugal::cli {

namespace {

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

std::string checkpoint_dir(const Config& cfg) {
  return fs::path(checkpoint_path(cfg.run)).parent_path().string();
}

/// The output folders probed before any work.
void prepare_folders(const Config& cfg) {
  ensure_writable_dir(cfg.run.out_dir);
  ensure_writable_dir(checkpoint_dir(cfg));  // a stop writes a checkpoint, whatever the config
}

/// True when the run in `out` wrote its results: model.pt, and a report that says neither
/// "interrupted" nor "error". A run killed after its end-of-fit checkpoint but before these
/// (or while writing them) is resumed from that checkpoint, which writes them.
bool run_completed(const std::string& out) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::path(out) / "model.pt", ec)) return false;
  std::ifstream f(fs::path(out) / "report.json");
  const nlohmann::json report = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  return report.is_object() && !report.contains("interrupted") && !report.contains("error");
}

/// checkpoints/last.ckpt; without it (killed between the first numbered checkpoint's rename
/// and its link) the newest numbered checkpoint; "" when there is none.
std::string newest_checkpoint(const Config& cfg, spdlog::logger& log) {
  const std::string last = checkpoint_path(cfg.run);
  std::error_code ec;
  if (fs::exists(last, ec)) return last;
  const auto numbered = CheckpointHistory(last, cfg.run.keep_checkpoints).numbered();
  if (numbered.empty()) return "";
  log.warn("--resume auto: {} is missing (the run was killed before it linked its first "
           "checkpoint): continuing from the newest, {}", last, numbered.back());
  return numbered.back();
}

/// True when `cfg` has more epochs or stages than the finished fit of checkpoint record `rec`.
bool extends(const Config& cfg, const nlohmann::json& rec) {
  const auto& names = rec.value("stages", nlohmann::json::array());
  const auto& epochs = rec.value("stage_epochs", nlohmann::json::array());
  if (cfg.stages.size() != names.size()) return cfg.stages.size() > names.size();
  return !epochs.empty() && epochs.back().is_number_integer() &&
         cfg.stages.back().epochs > epochs.back().get<int64_t>();
}

/// `--resume auto`: the checkpoint of this config's unfinished run in run.out_dir, or "" when
/// the folder holds no run. Refuses (ConfigError, naming the differing keys) a run of another
/// config, and (Error) a finished run or results without a checkpoint.
std::string auto_resume(const ConfigWithPlugins& loaded, spdlog::logger& log) {
  const Config& cfg = loaded.config;
  const std::string& out = cfg.run.out_dir;
  const std::string ckpt = newest_checkpoint(cfg, log);
  if (!ckpt.empty()) {
    const nlohmann::json rec = Learner::read_checkpoint(ckpt);
    const bool finished = rec["position"].value("done", false);
    try {
      check_resume_config(cfg, rec["info"], ckpt, loaded.host->keys_outside_training(), finished);
    } catch (const ConfigError& e) {
      throw ConfigError("--resume auto: '" + out + "' holds a run of another config: " + e.what());
    }
    if (finished && run_completed(out) && !extends(cfg, rec))
      throw Error("--resume auto: the run in '" + out + "' has finished (" + ckpt + " is its "
                  "end): nothing is left to train. Give a new run another run.out_dir, or "
                  "replace this one with --overwrite");
    return ckpt;
  }
  const std::vector<std::string> files = earlier_run_files(out, checkpoint_dir(cfg));
  if (files.empty()) {
    log.info("--resume auto: '{}' holds no run yet: starting one", out);
    return "";
  }
  throw Error("--resume auto: '" + out + "' holds an earlier run (" + joined(files) +
              ") but no checkpoint to continue it from: it finished, or ended before its first "
              "checkpoint. Give a new run another run.out_dir, or replace it with --overwrite");
}

/// True when `file` lies inside folder `dir`.
bool inside(const std::string& file, const std::string& dir) {
  std::error_code ec;
  const fs::path f = fs::weakly_canonical(file, ec), d = fs::weakly_canonical(dir, ec);
  const std::string rel = f.lexically_relative(d).string();
  return !rel.empty() && rel.rfind("..", 0) != 0;
}

/// `--resume WHERE`: its checkpoint, checked against the config. A run that continues into
/// another run's folder would replace that run's results: refused.
std::string explicit_resume(const std::string& where, const ConfigWithPlugins& loaded) {
  const Config& cfg = loaded.config;
  const std::string checkpoint = resume_checkpoint(where);
  const nlohmann::json rec = Learner::read_checkpoint(checkpoint);
  check_resume_config(cfg, rec["info"], checkpoint, loaded.host->keys_outside_training(),
                      rec["position"].value("done", false));
  const auto files = earlier_run_files(cfg.run.out_dir, checkpoint_dir(cfg));
  if (!files.empty() && !inside(checkpoint, cfg.run.out_dir))
    throw Error("run.out_dir '" + cfg.run.out_dir + "' holds another run's results (" +
                joined(files) + "); resuming " + checkpoint + " there would replace them: give "
                "the resumed run its own folder (--set run.out_dir=...)");
  return checkpoint;
}

/// A fresh run: the folder must hold no earlier run's results, unless --overwrite.
void check_fresh_folder(const TrainArgs& a, const Config& cfg, spdlog::logger& log) {
  const std::string& out = cfg.run.out_dir;
  const auto files = earlier_run_files(out, checkpoint_dir(cfg));
  if (files.empty()) return;
  if (!a.overwrite)
    throw Error("run.out_dir '" + out + "' holds an earlier run's results (" + joined(files) +
                "), which this run would replace. Continue that run with --resume " + out +
                " (or --resume auto), give this one another folder (--set run.out_dir=...), "
                "or replace them with --overwrite");
  remove_earlier_run(out, checkpoint_dir(cfg));
  log.warn("--overwrite: removed the earlier run's {} from '{}'", joined(files), out);
}

/// The checkpoint this run continues from, "" for a fresh run; the folder checked either way.
std::string resume_point(const TrainArgs& a, const ConfigWithPlugins& loaded, spdlog::logger& log) {
  const Config& cfg = loaded.config;
  const std::string mode =
      !a.resume.empty() ? a.resume : (cfg.run.resume == "auto" && !a.overwrite ? "auto" : "");
  std::string checkpoint;
  if (mode == "auto")
    checkpoint = auto_resume(loaded, log);
  else if (!mode.empty())
    checkpoint = explicit_resume(mode, loaded);
  if (checkpoint.empty()) check_fresh_folder(a, cfg, log);
  return checkpoint;
}

void load_resume(Learner& learner, const std::string& checkpoint, spdlog::logger& log) {
  learner.load_checkpoint(checkpoint);
  const FitPosition p = *learner.pending_resume();
  if (p.done)
    log.info("resuming from {}: that fit had ended; what this config adds to it (epochs of its "
             "last stage, stages after it) trains now, if anything", checkpoint);
  else
    log.info("resuming from {}: stage {} epoch {} batch {} ({} batches, {} steps done)",
             checkpoint, p.stage + 1, p.epoch + 1, p.batch + 1, p.iteration, p.steps);
}

/// Runs the fit; an error is logged and recorded in `extra` (the report says why the run
/// stopped). Returns the exit code.
int fit(Learner& learner, const Config& cfg, nlohmann::json& extra, spdlog::logger& log) {
  try {
    learner.fit(cfg.stages);
  } catch (const OomError& e) {
    extra["error"] = e.what();
    log.error("{}", e.what());
    // Out of memory in forward or backward leaves the model as before the failed batch: a
    // checkpoint now resumes at that batch. A failed optimizer step may have updated part of
    // the parameters: no checkpoint then.
    // Data parallel: the other ranks are inside a collective this rank will not join; the
    // launcher stops them, and the last periodic checkpoint stays the run's.
    if (e.phase() != OomError::Phase::Step && !World::get().distributed()) {
      try {
        CheckpointHistory history(checkpoint_path(cfg.run), cfg.run.keep_checkpoints);
        extra["checkpoint"] = history.write(learner, checkpoint_info(cfg));
        log.info("checkpoint of the failed batch's start saved to {}", extra["checkpoint"].get<std::string>());
      } catch (const std::exception& ce) {
        log.error("could not save a checkpoint after the out-of-memory error: {}", ce.what());
      }
    }
    return 1;
  } catch (const std::exception& e) {
    extra["error"] = e.what();
    log.error("{}", e.what());
    return 1;
  }
  return 0;
}

/// The safety nets' records for the report. A fit a non-finite step stopped names the last
/// good checkpoint: the failed step was not taken, and nothing was written after it.
void note_safety_nets(const Learner& learner, const Config& cfg, int rc, nlohmann::json& extra,
                      spdlog::logger& log) {
  extra.update(safety_records(learner));
  if (extra.contains("best_model"))
    log.info("best model ({} = {}, stage {} epoch {}) kept in {}",
             extra["best_model"].value("metric", ""), extra["best_model"].value("value", 0.0),
             extra["best_model"].value("stage", 0) + 1, extra["best_model"].value("epoch", 0),
             extra["best_model"].value("pt", ""));
  if (rc == 0 || !extra.contains("nonfinite") || !extra["nonfinite"].contains("event") ||
      extra["nonfinite"].value("mode", "") != "fail")
    return;
  std::error_code ec;
  const std::string last = checkpoint_path(cfg.run);
  extra["nonfinite"]["checkpoint"] = fs::exists(last, ec) ? nlohmann::json(last) : nlohmann::json();
  if (fs::exists(last, ec))
    log.info("the last good checkpoint, {}, is kept: fix the cause (a lower learning rate, "
             "run.on_nonfinite = \"skip\") and resume from it with --resume", last);
}

const StopCallback* find_stop(const Learner& learner) {
  for (const auto& c : learner.callbacks())
    if (auto s = dynamic_cast<const StopCallback*>(c.get())) return s;
  return nullptr;
}

/// A fit a signal stopped: the report's "interrupted" record, exit code 75.
int note_interruption(const StopCallback& stop, const TrainArgs& a, nlohmann::json& extra,
                      spdlog::logger& log) {
  const FitPosition& p = stop.at();
  const int sig = StopRequest::process().signal();
  extra["interrupted"] = {{"signal", sig ? signal_name(sig) : "a stop request"},
                          {"stage", p.stage}, {"epoch", p.epoch}, {"batch", p.batch},
                          {"iteration", p.iteration}, {"steps", p.steps},
                          {"checkpoint", stop.checkpoint()}, {"exit_code", kExitInterrupted}};
  log.warn("interrupted (exit code {}): the same command with --resume auto continues it "
           "(`frugal train {} --resume auto`, and the same --set options)", kExitInterrupted, a.config);
  return kExitInterrupted;
}

}  // namespace

CLI::App* add_train_command(CLI::App& app, TrainArgs& a) {
  CLI::App* cmd = app.add_subcommand("train", "train a model as a TOML file describes, then write its report");
  cmd->add_option("config", a.config, "the run's TOML file")->required();
  cmd->add_option("--set", a.sets, "override a key, e.g. --set data.batch_size=64 (repeatable)");
  auto* resume = cmd->add_option(
      "--resume", a.resume,
      "continue a run: a run folder (its newest checkpoint), a checkpoint file, or auto (this "
      "config's unfinished run in run.out_dir; a fresh start when it holds none)");
  cmd->add_flag("--overwrite", a.overwrite,
                "start a new run in run.out_dir even though it holds an earlier run's results "
                "(report, config.toml, checkpoints): those are removed first")
      ->excludes(resume);
  cmd->add_option("--nproc", a.nproc,
                  "data parallel on this machine: start N ranks (torchrun's environment, "
                  "gloo on CPU), each on its shard of every batch")
      ->check(CLI::Range(1, 1024));
  cmd->footer("Exit codes: 0 done; 1 error; 2 bad config; 75 stopped by SIGTERM, SIGINT or "
              "run.preempt_signal after writing a checkpoint (rerun with --resume auto).");
  return cmd;
}

namespace {

/// Joins the run's ranks (torchrun's environment; one process without it). Ranks above 0 log
/// warnings and errors only, prefixed with their rank.
void join_world(const Config& cfg, const std::shared_ptr<spdlog::logger>& log) {
  const WorldEnv env = WorldEnv::from_environment();
  if (!env.distributed()) return;
  World::get().init(env, cfg.distributed, resolve_device(cfg.run.device));
  if (env.rank > 0) {
    for (auto* l : {log.get(), spdlog::default_logger().get()}) {
      l->set_level(std::max(l->level(), spdlog::level::warn));
      l->set_pattern("[rank " + std::to_string(env.rank) + "] [%l] %v");
    }
  } else {
    log->set_pattern("%^[%H:%M:%S %l]%$ [rank 0] %v");
  }
  // Every rank trains rank 0's config: the resolved configs are compared at the rendezvous
  // (ranks started by hand or by a launcher with different files or --set options).
  World& world = World::get();
  if (world.is_main()) world.store_set("frugal/config", cfg.to_toml());
  const bool differs = !world.is_main() && world.store_get("frugal/config") != cfg.to_toml();
  const int64_t first = world.min(differs ? env.rank : env.world_size);
  if (first < env.world_size)
    throw ConfigError("rank " + std::to_string(first) + " was started with another config than "
                      "rank 0 (their resolved configs differ): start every rank with the same "
                      "file and --set options");
  log->info("data parallel: rank {} of {} ({}), {} samples per rank of each batch of {}",
            env.rank, env.world_size, World::get().backend(),
            (cfg.data.batch_size + env.world_size - 1) / env.world_size, cfg.data.batch_size);
}

/// Data parallel: each rank's peak and median step time, and what the gradient sync carried,
/// for rank 0's report. A collective: every rank calls it after its fit.
nlohmann::json rank_summary(Learner& learner) {
  const nlohmann::json fit = learner.report();
  const double peak = fit.value("peak_bytes", 0.0);
  const double step = fit.contains("step_seconds") ? fit["step_seconds"].value("median", 0.0) : 0.0;
  // The first stage's steady state: what each rank holds (a sharded optimizer differs by rank).
  double params = 0, grads = 0, state = 0;
  if (fit.contains("stages") && !fit["stages"].empty() && fit["stages"][0].contains("steady")) {
    params = fit["stages"][0]["steady"].value("parameters", 0.0);
    grads = fit["stages"][0]["steady"].value("gradients", 0.0);
    state = fit["stages"][0]["steady"].value("optimizer_state", 0.0);
  }
  const auto all = World::get().all_gather(
      torch::tensor({peak, step, grads, state, params}, torch::kDouble).to(World::get().device()));
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < all.size(); ++r) {
    const auto v = all[r].cpu();
    ranks.push_back({{"rank", r},
                     {"peak_bytes", static_cast<int64_t>(v[0].item<double>())},
                     {"step_seconds_median", v[1].item<double>()},
                     {"steady_gradients", static_cast<int64_t>(v[2].item<double>())},
                     {"steady_optimizer_state", static_cast<int64_t>(v[3].item<double>())},
                     {"steady_parameters", static_cast<int64_t>(v[4].item<double>())}});
  }
  nlohmann::json out = {{"ranks", ranks}};
  for (const auto& c : learner.callbacks())
    if (const auto* dp = dynamic_cast<const DataParallel*>(c.get()); dp && dp->syncs() > 0) {
      out["gradient_syncs"] = dp->syncs();
      out["allreduce_bytes_per_step"] = dp->bytes_reduced() / dp->syncs();
      out["buckets_per_step"] = static_cast<double>(dp->buckets()) / static_cast<double>(dp->syncs());
      out["sync_reserve_bytes"] = learner.sync_reserve();  // what micro_batch = "auto" kept free
      out["overlap"] = {{"on", dp->overlaps()},
                        {"buckets_in_backward_per_step",
                         static_cast<double>(dp->buckets_in_backward()) / static_cast<double>(dp->syncs())}};
      if (!dp->overlaps()) out["overlap"]["why_off"] = dp->overlap_off_reason();
    }
  return out;
}

}  // namespace

namespace {

/// `--nproc N`: the ranks started here (their exit code), or nullopt to train in this process.
std::optional<int> launch_if_asked(const TrainArgs& a, spdlog::logger& log) {
  if (a.nproc <= 0) return std::nullopt;
  if (WorldEnv::from_environment().distributed())
    throw ConfigError("--nproc " + std::to_string(a.nproc) + ": this process is already rank " +
                      std::getenv("RANK") + " of a launched run (WORLD_SIZE is set): use "
                      "torchrun or --nproc, not both");
  if (a.nproc == 1) return std::nullopt;
  {  // a bad config fails once, before any rank
    const ConfigWithPlugins loaded = load_config_with_plugins(a.config, a.sets);
    preflight(loaded.config, loaded.host->loaded());
  }
  return launch_local(a.nproc, a.argv, log);
}

/// Rank 0 owns the run folder: it probes it, locks it (`lock`, held until the report is
/// written), decides where the run starts and publishes that; the other ranks read the same
/// checkpoint. Returns it ("" for a fresh run).
std::string claim_run_folder(const TrainArgs& a, const ConfigWithPlugins& loaded,
                             spdlog::logger& log, std::optional<RunLock>& lock) {
  World& world = World::get();
  if (!world.is_main()) return world.store_get("frugal/checkpoint");
  const Config& cfg = loaded.config;
  prepare_folders(cfg);
  lock.emplace(cfg.run.out_dir);
  const auto unfinished = remove_unfinished_files(cfg.run.out_dir, checkpoint_dir(cfg));
  if (!unfinished.empty())
    log.warn("removed {} unfinished file(s) an earlier run left when it was killed mid-write "
             "(the completed files are untouched): {}", unfinished.size(), joined(unfinished));
  const std::string checkpoint = resume_point(a, loaded, log);
  world.store_set("frugal/checkpoint", checkpoint);
  return checkpoint;
}

}  // namespace

int run_train(const TrainArgs& a, const std::shared_ptr<spdlog::logger>& log) {
  if (auto rc = launch_if_asked(a, *log)) return *rc;
  // A stop from here on is a clean one: before the run folder is claimed nothing is written.
  StopRequest::install(stop_signals("none"));
  // Everything the config names is validated, the output folder probed and the learner built
  // (data, model, callbacks, the stages checked) before the folder is claimed: a refused run
  // leaves no folder, lock or report. `loaded` outlives the learner: what a plugin registered
  // dies before its library.
  const ConfigWithPlugins loaded = load_config_with_plugins(a.config, a.sets);
  const Config& cfg = loaded.config;
  StopRequest::install(stop_signals(cfg.run.preempt_signal));
  preflight(cfg, loaded.host->loaded());
  join_world(cfg, log);
  const World& world = World::get();
  auto learner = make_checked_learner(cfg, &StopRequest::process());
  // The plugins' callbacks too: a conflict with a built-in one (step_in_backward and grad_clip)
  // is refused before the folder is claimed.
  for (auto& cb : loaded.callbacks) learner->add_callback(cb);
  if (StopRequest::process().requested() && !world.distributed()) {
    log->warn("stopped by {} before the run started: nothing was written",
              signal_name(StopRequest::process().signal()));
    return kExitInterrupted;
  }
  std::optional<RunLock> lock;
  const std::string checkpoint = claim_run_folder(a, loaded, *log, lock);
  if (world.is_main()) keep_run_tokenizer(cfg.run.out_dir, learner->train_data().dataset(), !checkpoint.empty());
  log->info("plugins: {}", joined(loaded.host->loaded()));
  if (!checkpoint.empty()) load_resume(*learner, checkpoint, *log);
  learner->add_callback(std::make_shared<ProgressCallback>(
      ProgressCallback::parse_mode(cfg.run.progress), cfg.run.log_every, log));
  log->info("training {} on {} ({} samples, batch {}) on {}, {} threads, LibTorch {}", cfg.model.arch,
            cfg.data.dataset, learner->train_data().dataset().size(), cfg.data.batch_size,
            learner->device().str(), at::get_num_threads(), compat::torch_version());

  nlohmann::json extra = {{"plugins", loaded.host->loaded()}};
  if (!checkpoint.empty()) extra["resumed_from"] = checkpoint;
  if (world.distributed())
    extra["distributed"] = {{"world_size", world.size()}, {"backend", world.backend()},
                            {"batch_per_rank", (cfg.data.batch_size + world.size() - 1) / world.size()},
                            {"bucket_bytes", cfg.distributed.bucket_size.bytes}};
  int rc = fit(*learner, cfg, extra, *log);
  note_safety_nets(*learner, cfg, rc, extra, *log);
  const StopCallback* stop = find_stop(*learner);
  if (rc == 0 && stop && stop->stopped()) rc = note_interruption(*stop, a, extra, *log);
  if (world.distributed() && (rc == 0 || rc == kExitInterrupted))
    extra["distributed"].update(rank_summary(*learner));
  if (!world.is_main()) return rc;  // rank 0 reports for the run
  write_run_data(cfg.run.out_dir, run_data(cfg, learner->train_data().dataset()));
  auto report = make_report(*learner, cfg, extra);
  write_report(cfg.run.out_dir, report, cfg);
  std::cout << report_markdown(report) << std::flush;
  log->info("report written to {}/report.md, report.json and config.toml", cfg.run.out_dir);
  return rc;
}

}  // namespace frugal::cli
