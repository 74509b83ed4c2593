// The `frugal` command: check, keys, plugins (train: train.cpp; ablate and plan: ablate.cpp,
// plan.cpp).
#include <unistd.h>

#include <csignal>

#include <filesystem>
#include <functional>
#include <iostream>
#include <set>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "ablation.h"
#include "infer.h"
#include "lr_find.h"
#include "train.h"
#include "frugal/app/plugin_host.h"
#include "frugal/app/preflight.h"
#include "frugal/app/run.h"
#include "frugal/callbacks/progress.h"
#include "frugal/frugal.h"

namespace {

struct Common {
  std::string config;
  std::vector<std::string> sets;
  std::vector<std::string> checkpoints;  // check only
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

/// `check --checkpoint FILE`: each file's seal, resume record and weights load into the
/// config's model (what a resume reads first). Exit code 1 if any does not.
int check_checkpoints(const std::vector<std::string>& files, frugal::Learner& learner,
                      spdlog::logger& log) {
  int rc = 0;
  for (const auto& f : files) {
    try {
      const nlohmann::json saved = frugal::Learner::read_checkpoint(f);
      const nlohmann::json& p = saved["position"];
      learner.load(f, /*with_opt=*/false);
      const nlohmann::json info = saved.value("info", nlohmann::json::object());
      const int64_t world = info.is_object() ? info.value("world_size", int64_t{1}) : 1;
      const bool sharded = info.is_object() && info.value("optimizer_per_rank", false);
      const std::string written =
          "written by " + std::to_string(world) + (world == 1 ? " process" : " processes") +
          (sharded ? ", the optimizer sharded per rank" : "");
      if (p.value("done", false))
        log.info("{}: OK ({} steps; the fit's end; {})", f, p.value("steps", 0), written);
      else
        log.info("{}: OK ({} steps; resumes at stage {} epoch {} batch {}; {})", f, p.value("steps", 0),
                 p.value("stage", 0) + 1, p.value("epoch", 0) + 1, p.value("batch", 0) + 1, written);
    } catch (const std::exception& e) {
      log.error("{}", e.what());
      rc = 1;
    }
  }
  return rc;
}

int run_check(const Common& opt, spdlog::logger& log) {
  // Plugins load first: they may register the optimizers, models, datasets or losses the
  // config names.
  const frugal::ConfigWithPlugins loaded = frugal::load_config_with_plugins(opt.config, opt.sets);
  const frugal::Config& cfg = loaded.config;
  frugal::preflight(cfg, loaded.host->loaded());  // the folder, freeze prefixes, the budget
  // What `train` builds before its first step (data, model, callbacks, stages), nothing written:
  // check refuses what train would.
  auto learner = frugal::make_checked_learner(cfg);
  for (const auto& cb : loaded.callbacks) learner->add_callback(cb);
  log.info("{}: OK ({} stage(s), model {}, dataset {}, plugins: {})", opt.config, cfg.stages.size(),
           cfg.model.arch, cfg.data.dataset, joined(loaded.host->loaded()));
  return check_checkpoints(opt.checkpoints, *learner, log);
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

/// `fields` without the own keys of optimizer `name` (what the optimizer's section lists).
nlohmann::json common_optimizer_keys(const nlohmann::json& fields, const std::string& name) {
  std::set<std::string> own;
  for (const auto& f : frugal::describe_optimizer_keys(name)) own.insert(f["key"].get<std::string>());
  nlohmann::json out = nlohmann::json::array();
  for (const auto& f : fields)
    if (!own.count(f["key"].get<std::string>())) out.push_back(f);
  return out;
}

/// Every section's keys, then {"optimizers": {name: {description, owner, keys}}}.
nlohmann::json all_keys() {
  frugal::RunOptions run;
  frugal::DataOptions data;
  frugal::ModelOptions model;
  frugal::OptimizerOptions optimizer;
  frugal::ScheduleOptions schedule;
  frugal::LossOptions loss;
  frugal::StageOptions stage;
  frugal::AblationOptions ablation;
  frugal::DistributedOptions distributed;
  std::vector<std::pair<std::string, frugal::Options*>> sections = {
      {"run", &run}, {"data", &data}, {"model", &model}, {"optimizer", &optimizer},
      {"schedule", &schedule}, {"loss", &loss}, {"[stages]", &stage}, {"ablation", &ablation},
      {"distributed", &distributed}};
  nlohmann::json all = nlohmann::json::object();
  for (auto& [name, o] : sections) all[name] = frugal::describe_options(*o);
  // [optimizer] lists the keys every optimizer takes; each optimizer's own follow.
  all["optimizer"] = common_optimizer_keys(all["optimizer"], optimizer.name);
  for (auto& f : all["[stages]"])
    if (f["key"] == "optimizer") f["fields"] = common_optimizer_keys(f["fields"], optimizer.name);
  for (const auto& name : frugal::optimizers().names()) {
    const auto entry = frugal::optimizers().get(name);
    all["optimizers"][name] = {{"description", entry.description},
                               {"owner", entry.owner},
                               {"keys", frugal::describe_optimizer_keys(name)}};
  }
  return all;
}

void print_key_table(const std::string& section, const nlohmann::json& fields) {
  std::cout << "\n### " << section << "\n\n| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
  std::vector<std::pair<std::string, nlohmann::json>> nested;
  for (const auto& f : fields) {
    if (f.value("type", "") == "table") {
      nested.emplace_back(section.substr(0, section.size() - 1) + "." + f["key"].get<std::string>() + "]",
                          f["fields"]);
      continue;
    }
    std::cout << "| `" << f["key"].get<std::string>() << "` | " << f.value("type", "") << " | `"
              << f["default"].dump() << "` | " << f.value("allowed", "") << " | "
              << f.value("help", "")
              << (f.value("affects_training", true) ? "" : " (may differ on `--resume`)") << " |\n";
  }
  for (auto& [n, fs] : nested) print_key_table(n, fs);
}

// Every key of the run configuration with its type, default, allowed values and help:
// docs/configure.md's reference is this command's output.
int run_keys(bool json) {
  const nlohmann::json all = all_keys();
  if (json) {
    std::cout << all.dump(2) << "\n";
    return 0;
  }
  for (const char* section :
       {"run", "data", "model", "optimizer", "schedule", "loss", "[stages]", "ablation", "distributed"}) {
    print_key_table("[" + std::string(section) + "]", all[section]);
    if (std::string(section) != "optimizer") continue;
    for (const auto& [name, o] : all["optimizers"].items()) {
      const std::string title = "[optimizer] name = \"" + name + "\": " + o["description"].get<std::string>();
      if (o["keys"].empty())
        std::cout << "\n### " << title << "\n\nNo keys of its own.\n";
      else
        print_key_table(title, o["keys"]);
    }
  }
  return 0;
}

/// Every subcommand's arguments, and the subcommands.
struct Args {
  std::string level = "info";
  frugal::cli::TrainArgs train;
  Common check;
  bool plugins_json = false, keys_json = false;
  std::vector<std::string> plugin_paths;
  frugal::cli::AblateArgs ablate;
  frugal::cli::PlanArgs plan;
  frugal::cli::GenerateArgs generate;
  frugal::cli::EvaluateArgs evaluate;
  frugal::cli::PredictArgs predict;
  frugal::cli::LrFindArgs lr_find;
  CLI::App *train_cmd = nullptr, *check_cmd = nullptr, *plugins_cmd = nullptr,
           *keys_cmd = nullptr, *ablate_cmd = nullptr, *plan_cmd = nullptr,
           *generate_cmd = nullptr, *evaluate_cmd = nullptr, *predict_cmd = nullptr, *lr_find_cmd = nullptr;
};

void add_commands(CLI::App& app, Args& a) {
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("frugal ") + frugal::kVersion + ", LibTorch " +
                                        frugal::compat::torch_version());
  app.add_option("--log-level", a.level, "trace, debug, info, warn, error, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  a.train_cmd = frugal::cli::add_train_command(app, a.train);
  a.check_cmd = app.add_subcommand("check", "validate a TOML file without training");
  add_common(a.check_cmd, a.check);
  a.check_cmd->add_option("--checkpoint", a.check.checkpoints,
                          "also load this checkpoint (its seal, resume record and weights) "
                          "into the config's model (repeatable)");
  a.plugins_cmd = app.add_subcommand("plugins", "list the plugins found, with their options and defaults");
  a.plugins_cmd->add_flag("--json", a.plugins_json, "print JSON instead");
  a.plugins_cmd->add_option("--path", a.plugin_paths, "also search this folder (repeatable)");
  a.keys_cmd = app.add_subcommand("keys", "list every configuration key with its default (Markdown)");
  a.keys_cmd->add_flag("--json", a.keys_json, "print JSON instead");
  a.ablate_cmd = frugal::cli::add_ablate_command(app, a.ablate);
  a.plan_cmd = frugal::cli::add_plan_command(app, a.plan);
  a.generate_cmd = frugal::cli::add_generate_command(app, a.generate);
  a.evaluate_cmd = frugal::cli::add_evaluate_command(app, a.evaluate);
  a.predict_cmd = frugal::cli::add_predict_command(app, a.predict);
  a.lr_find_cmd = frugal::cli::add_lr_find_command(app, a.lr_find);
}

std::shared_ptr<spdlog::logger> make_log(const std::string& level) {
  auto log = spdlog::stderr_color_mt("frugal");
  log->set_level(spdlog::level::from_str(level));
  log->set_pattern("%^[%H:%M:%S %l]%$ %v");
  spdlog::set_default_logger(log);  // plugins' loggers share its sinks and level
  return log;
}

/// Runs the parsed subcommand; an error is logged, exit code 2 for a config or plugin error.
int dispatch(const Args& a, const std::shared_ptr<spdlog::logger>& log, const char* argv0) {
  try {
    if (*a.train_cmd) return frugal::cli::run_train(a.train, log);
    if (*a.check_cmd) return run_check(a.check, *log);
    if (*a.keys_cmd) return run_keys(a.keys_json);
    if (*a.plugins_cmd) return run_plugins(a.plugin_paths, a.plugins_json);
    if (*a.ablate_cmd) return frugal::cli::run_ablate(a.ablate, *log, argv0);
    if (*a.plan_cmd) return frugal::cli::run_plan(a.plan, *log, argv0);
    if (*a.generate_cmd) return frugal::cli::run_generate(a.generate);
    if (*a.evaluate_cmd) return frugal::cli::run_evaluate(a.evaluate);
    if (*a.predict_cmd) return frugal::cli::run_predict(a.predict);
    if (*a.lr_find_cmd) return frugal::cli::run_lr_find(a.lr_find, *log);
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

}  // namespace

int main(int argc, char** argv) {
  // Before any matrix product or thread: OpenBLAS's kernels for a CPU it does not know.
  const auto blas = frugal::select_blas_core();
  // Count every tensor the run makes.
  frugal::MemoryMeter::install();
  // A write past the file size limit (RLIMIT_FSIZE) fails with EFBIG, reported with the file
  // it was writing, instead of killing the process mid-checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"frugal: train models that do not fit in memory, and measure what each technique buys"};
  Args args;
  add_commands(app, args);
  CLI11_PARSE(app, argc, argv);
  args.train.argv.assign(argv, argv + argc);  // what the ranks of `train --nproc N` run
  auto log = make_log(args.level);
  if (blas && !blas->reason.empty()) log->debug("BLAS: {}", blas->reason);
  return dispatch(args, log, argv[0]);
}
