// The `frugal` command: train, check.
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "ablation.h"
#include "frugal/frugal.h"
#include "frugal/plugin_host.h"
#include "frugal/progress.h"
#include "frugal/run.h"

namespace {

struct Common {
  std::string config;
  std::vector<std::string> sets;
  std::string resume;  // train only
};

void add_common(CLI::App* cmd, Common& c) {
  cmd->add_option("config", c.config, "the run's TOML file")->required();
  cmd->add_option("--set", c.sets, "override a key, e.g. --set data.batch_size=64 (repeatable)");
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

int run_check(const Common& opt, spdlog::logger& log) {
  frugal::Config cfg = frugal::load_config(opt.config, opt.sets);
  // Plugins load first: they may register the models, datasets or losses the config names.
  frugal::PluginHost host(frugal::PluginHost::config_paths(cfg.plugins, cfg.source));
  auto callbacks = host.load(cfg.plugins, cfg.source);
  frugal::check_config(cfg);
  log.info("{}: OK ({} stage(s), model {}, dataset {}, plugins: {})", opt.config, cfg.stages.size(),
           cfg.model.arch, cfg.data.dataset, joined(host.loaded()));
  return 0;
}

int run_plugins(const std::vector<std::string>& paths, bool json) {
  frugal::PluginHost host(paths);
  std::vector<std::string> problems;
  auto found = host.discover(&problems);
  if (json) {
    nlohmann::json out = {{"plugins", found}, {"search_path", host.search_path()}, {"problems", problems}};
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << "Searched: " << joined(host.search_path()) << "\n";
  if (found.empty()) std::cout << "No plugins found.\n";
  for (const auto& d : found) {
    std::cout << "\n" << d.name << " " << d.version << ": " << d.description << "\n  " << d.path
              << " (ABI " << d.abi_version << ", LibTorch " << d.torch_version << ")\n";
    // A nested table (optim_swap's `to`) lists its fields as table.key.
    std::function<void(const nlohmann::json&, const std::string&)> print =
        [&](const nlohmann::json& options, const std::string& prefix) {
          for (const auto& o : options) {
            const std::string key = prefix + o.value("key", "");
            if (o.value("type", "") == "table") {
              std::cout << "  " << key << ": " << o.value("help", "") << "\n";
              print(o["fields"], key + ".");
              continue;
            }
            std::cout << "  " << key << " = " << o["default"].dump() << "  ("
                      << o.value("allowed", "") << ") " << o.value("help", "") << "\n";
          }
        };
    print(d.options, "");
  }
  for (const auto& p : problems) std::cout << "\nnot loadable: " << p << "\n";
  return 0;
}

int run_train(const Common& opt, const std::shared_ptr<spdlog::logger>& log) {
  // Everything the config names is validated, and the output folder probed, before any work.
  frugal::Config cfg = frugal::load_config(opt.config, opt.sets);
  // The host outlives the learner: models a plugin registered die before their library.
  frugal::PluginHost host(frugal::PluginHost::config_paths(cfg.plugins, cfg.source));
  auto plugin_callbacks = host.load(cfg.plugins, cfg.source);
  frugal::check_config(cfg);
  frugal::ensure_writable_dir(cfg.run.out_dir);
  if (cfg.run.checkpoint_every > 0 || cfg.run.checkpoint_epochs > 0)
    frugal::ensure_writable_dir(std::filesystem::path(frugal::checkpoint_path(cfg.run)).parent_path().string());
  // A resume continues the same run: the checkpoint's config must be this one.
  std::string checkpoint;
  if (!opt.resume.empty()) {
    checkpoint = frugal::resume_checkpoint(opt.resume);
    frugal::check_resume_config(cfg, frugal::Learner::read_checkpoint(checkpoint)["info"], checkpoint);
  }

  auto learner = frugal::make_learner(cfg);
  for (auto& cb : plugin_callbacks) learner->add_callback(cb);
  log->info("plugins: {}", joined(host.loaded()));
  if (!checkpoint.empty()) {
    learner->load_checkpoint(checkpoint);
    const frugal::FitPosition p = *learner->pending_resume();
    if (p.done)
      log->info("resuming from {}: that fit had ended; nothing is left to train", checkpoint);
    else
      log->info("resuming from {}: stage {} epoch {} batch {} ({} batches, {} steps done)",
                checkpoint, p.stage + 1, p.epoch + 1, p.batch + 1, p.iteration, p.steps);
  }
  learner->add_callback(std::make_shared<frugal::ProgressCallback>(
      frugal::ProgressCallback::parse_mode(cfg.run.progress), cfg.run.log_every, log));
  log->info("training {} on {} ({} samples, batch {}) on {}, {} threads, LibTorch {}", cfg.model.arch,
            cfg.data.dataset, learner->train_data().dataset().size(), cfg.data.batch_size,
            learner->device().str(), at::get_num_threads(), frugal::compat::torch_version());

  nlohmann::json extra = {{"plugins", host.loaded()}};
  if (!checkpoint.empty()) extra["resumed_from"] = checkpoint;
  int rc = 0;
  try {
    learner->fit(cfg.stages);
  } catch (const frugal::OomError& e) {
    extra["error"] = e.what();
    log->error("{}", e.what());
    rc = 1;
    // Out of memory in forward or backward leaves the model as before the failed batch: a
    // checkpoint now resumes at that batch. A failed optimizer step may have updated part of
    // the parameters: no checkpoint then.
    if (e.phase() != frugal::OomError::Phase::Step) {
      const std::string path = frugal::checkpoint_path(cfg.run);
      try {
        learner->save_checkpoint(path, frugal::checkpoint_info(cfg));
        extra["checkpoint"] = path;
        log->info("checkpoint of the failed batch's start saved to {}", path);
      } catch (const std::exception& ce) {
        log->error("could not save a checkpoint after the out-of-memory error: {}", ce.what());
      }
    }
  } catch (const std::exception& e) {
    // The report still gets written, saying why the run stopped.
    extra["error"] = e.what();
    log->error("{}", e.what());
    rc = 1;
  }
  auto report = frugal::make_report(*learner, cfg, extra);
  frugal::write_report(cfg.run.out_dir, report, cfg);
  std::cout << frugal::report_markdown(report) << std::flush;
  log->info("report written to {}/report.md, report.json and config.toml", cfg.run.out_dir);
  return rc;
}

// Every key of the run configuration with its type, default, allowed values and help:
// the README's configuration reference is this command's output.
int run_keys(bool json) {
  frugal::RunOptions run;
  frugal::DataOptions data;
  frugal::ModelOptions model;
  frugal::OptimizerOptions optimizer;
  frugal::LossOptions loss;
  frugal::StageOptions stage;
  frugal::AblationOptions ablation;
  std::vector<std::pair<std::string, frugal::Options*>> sections = {
      {"run", &run}, {"data", &data}, {"model", &model}, {"optimizer", &optimizer},
      {"loss", &loss}, {"[stages]", &stage}, {"ablation", &ablation}};
  nlohmann::json all = nlohmann::json::object();
  for (auto& [name, o] : sections) all[name] = frugal::describe_options(*o);
  if (json) {
    std::cout << all.dump(2) << "\n";
    return 0;
  }
  std::function<void(const std::string&, const nlohmann::json&)> table;
  table = [&](const std::string& section, const nlohmann::json& fields) {
    std::cout << "\n### [" << section << "]\n\n| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
    std::vector<std::pair<std::string, nlohmann::json>> nested;
    for (const auto& f : fields) {
      if (f.value("type", "") == "table") {
        nested.emplace_back(section + "." + f["key"].get<std::string>(), f["fields"]);
        continue;
      }
      std::cout << "| `" << f["key"].get<std::string>() << "` | " << f.value("type", "") << " | `"
                << f["default"].dump() << "` | " << f.value("allowed", "") << " | "
                << f.value("help", "") << " |\n";
    }
    for (auto& [n, fs] : nested) table(n, fs);
  };
  for (auto& [name, o] : sections) table(name, all[name]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Count every tensor the run makes.
  frugal::MemoryMeter::install();

  CLI::App app{"frugal: train models that do not fit in memory, and measure what each technique buys"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("frugal ") + frugal::kVersion + ", LibTorch " +
                                        frugal::compat::torch_version());
  std::string level = "info";
  app.add_option("--log-level", level, "trace, debug, info, warn, error, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));

  Common train_opt, check_opt;
  auto* train = app.add_subcommand("train", "train a model as a TOML file describes, then write its report");
  add_common(train, train_opt);
  train->add_option("--resume", train_opt.resume,
                    "continue the run whose checkpoint is in this run folder (its "
                    "checkpoints/last.ckpt) or file; CONFIG must be that run's config");
  auto* check = app.add_subcommand("check", "validate a TOML file without training");
  add_common(check, check_opt);

  bool plugins_json = false;
  std::vector<std::string> plugin_paths;
  auto* plugins = app.add_subcommand("plugins", "list the plugins found, with their options and defaults");
  plugins->add_flag("--json", plugins_json, "print JSON instead");
  plugins->add_option("--path", plugin_paths, "also search this folder (repeatable)");

  bool keys_json = false;
  auto* keys = app.add_subcommand("keys", "list every configuration key with its default (Markdown)");
  keys->add_flag("--json", keys_json, "print JSON instead");

  frugal::cli::AblateArgs ablate_opt;
  auto* ablate = frugal::cli::add_ablate_command(app, ablate_opt);
  frugal::cli::PlanArgs plan_opt;
  auto* plan = frugal::cli::add_plan_command(app, plan_opt);

  CLI11_PARSE(app, argc, argv);

  auto log = spdlog::stderr_color_mt("frugal");
  log->set_level(spdlog::level::from_str(level));
  log->set_pattern("%^[%H:%M:%S %l]%$ %v");
  spdlog::set_default_logger(log);  // plugins' loggers share its sinks and level

  try {
    if (*train) return run_train(train_opt, log);
    if (*check) return run_check(check_opt, *log);
    if (*keys) return run_keys(keys_json);
    if (*plugins) return run_plugins(plugin_paths, plugins_json);
    if (*ablate) return frugal::cli::run_ablate(ablate_opt, *log, argv[0]);
    if (*plan) return frugal::cli::run_plan(plan_opt, *log, argv[0]);
  } catch (const frugal::ConfigError& e) {
    log->error("{}", e.what());
    return 2;
  } catch (const frugal::PluginError& e) {
    log->error("{}", e.what());
    return 2;
  } catch (const std::exception& e) {
    log->error("{}", e.what());
    return 1;
  }
  return 0;
}
