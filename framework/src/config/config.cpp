// The run configuration: the built-in options' fields, the top level of the file, `--set`
// overrides and the resolved-config writer. The reader that checks every key is in
// options_toml.cpp; the optimizer's keys come from its registry entry (optimizers.cpp).
#include "frugal/config/config.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/options_toml.h"
#include "frugal/base/error.h"

namespace frugal {

using detail::contains;
using detail::describe_value;
using detail::dotted;
using detail::quote;

// ---- The built-in options: keys, help, limits. Defaults are the member initializers. ----

void RunOptions::visit(FieldVisitor& v) {
  v.field("seed", seed, "random seed for weights, data order and dropout");
  v.field("device", device,
          outside_training("where to train; auto = cuda when available, else cpu"),
          {"cpu", "cuda", "auto"});
  v.field("out_dir", out_dir,
          outside_training("directory for the report, the resolved config and checkpoints"));
  v.field("threads", threads,
          outside_training("intra-op CPU threads; auto = time the first batch's forward and "
                           "backward with 1 thread and with LibTorch's default and keep the "
                           "faster; 0 = LibTorch's default"),
          at_least_or_auto(0));
  v.field("max_steps", max_steps,
          outside_training("stop the fit after this many batches; 0 = no limit"), at_least(0));
  v.field("log_every", log_every,
          outside_training("batches between log lines when not on a terminal, and between rows "
                           "of the metrics history"),
          at_least(1));
  v.field("progress", progress,
          outside_training("progress display; auto = a bar on a terminal, log lines otherwise"),
          {"auto", "bar", "log", "none"});
  v.field("checkpoint_every", checkpoint_every,
          outside_training("write <out_dir>/checkpoints/last.ckpt every N optimizer steps (and "
                           "at the end of the fit), for `frugal train --resume`; 0 = off"),
          at_least(0));
  v.field("checkpoint_epochs", checkpoint_epochs,
          outside_training("write the checkpoint every N epochs (and at the end of the fit); "
                           "0 = off"),
          at_least(0));
  v.field("keep_checkpoints", keep_checkpoints,
          outside_training("checkpoints kept: 1 = one file, checkpoints/last.ckpt; K > 1 = the "
                           "newest K as checkpoints/step-N.ckpt, last.ckpt linking the newest"),
          at_least(1));
  v.field("resume", resume,
          outside_training("auto = continue the unfinished run of this config in out_dir, start "
                           "fresh when out_dir holds none (as `frugal train --resume auto`)"),
          {"off", "auto"});
  v.field("preempt_signal", preempt_signal,
          outside_training("a signal that, like SIGTERM and SIGINT, makes the run checkpoint and "
                           "exit with code 75 (Slurm: --signal=USR1@120); \"none\" = off"),
          {"SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM", "SIGXCPU", "none"});
  v.field("warmup", warmup,
          "training batches at the start of each stage left out of the step-time statistics",
          at_least(0));
  v.field("trace", trace,
          "write a Chrome-trace JSON (Perfetto) of phase spans and live memory to this path; "
          "\"\" = off");
  visit_memory(v);
  visit_history(v);
  visit_safety(v);
}

// The run's safety nets: the best model kept, a diverged step, early stopping.
void RunOptions::visit_safety(FieldVisitor& v) {
  v.field("save_best", save_best,
          "also keep the best model by this validation metric, as best.pt and best.safetensors "
          "in out_dir: valid_loss, accuracy or the task's metric; off = only the final model");
  v.field("on_nonfinite", on_nonfinite,
          "a step whose loss or gradient is inf/NaN: fail = stop the run with an error naming "
          "stage, epoch, batch and parameter; skip = skip the step and count it",
          {"fail", "skip"});
  v.field("early_stopping", early_stopping,
          "stop the fit when this validation metric (valid_loss, accuracy or the task's metric) "
          "has not improved by more than min_delta for patience epochs; off = never");
  v.field("patience", patience, "early stopping: epochs without an improvement", at_least(1));
  v.field("min_delta", min_delta,
          "early stopping: the least change of the metric that counts as an improvement",
          at_least(0));
}

// Memory settings do not change the numbers: micro-batches keep the step's gradients.
void RunOptions::visit_memory(FieldVisitor& v) {
  v.field("memory_budget", memory_budget,
          outside_training("memory the run may hold, e.g. \"1GiB\"; past it an allocation "
                           "fails as out of memory (cpu: the tracking allocator; cuda: the "
                           "allocator's memory fraction); \"\" = none"));
  v.field("on_oom", on_oom,
          outside_training("out of memory in forward or backward: fail, or retry the batch with "
                           "half the micro-batch (same effective batch and gradients)"),
          {"fail", "retry"});
  v.field("oom_retries", oom_retries,
          outside_training("retry: out-of-memory errors allowed on one batch before the run "
                           "stops"),
          at_least(1));
  v.field("micro_batch", micro_batch,
          outside_training("auto = before each stage, find the largest micro-batch that fits "
                           "memory_budget; off = whole batches (or a plugin's split)"),
          {"off", "auto"});
}

// The metrics history's outputs; they do not change what a run computes.
void RunOptions::visit_history(FieldVisitor& v) {
  v.field("metrics", metrics,
          outside_training("write out_dir/metrics.csv and metrics.jsonl: a row every log_every "
                           "batches and per epoch (loss, lr, samples/s, step time, live and peak "
                           "memory, validation)"));
  v.field("tensorboard", tensorboard,
          outside_training("write the same scalars as TensorBoard event files in "
                           "out_dir/tensorboard (tensorboard --logdir runs/)"));
  v.field("plots", plots,
          outside_training("draw loss, learning rate, validation and memory from metrics.csv "
                           "into out_dir/metrics.svg and .png with gnuplot when the fit ends"));
}

void RunOptions::check() const {
  if (save_best.empty() || early_stopping.empty())
    throw_config_error(std::string("'run.") + (save_best.empty() ? "save_best" : "early_stopping") +
                       "' = \"\": name a validation metric (valid_loss, accuracy or the task's) "
                       "or \"off\"");
  if (micro_batch == "auto" && memory_budget.bytes == 0)
    throw_config_error("'run.micro_batch' = \"auto\" needs 'run.memory_budget' (the memory the "
                       "micro-batch must fit), e.g. memory_budget = \"1GiB\"");
}

void DataOptions::visit(FieldVisitor& v) {
  v.field("dataset", dataset,
          "dataset: fashion-mnist, synthetic, text, image_folder, csv or one a plugin registers");
  v.field("path", path,
          "the dataset's files: fashion-mnist's IDX folder, image_folder's training folder (one "
          "sub-folder per class), csv's training file");
  v.field("batch_size", batch_size, "training batch size", at_least(1));
  v.field("valid_batch_size", valid_batch_size, "validation batch size", at_least(1));
  v.field("train_samples", train_samples, "use the first N training samples; 0 = all",
          at_least(0));
  v.field("valid_samples", valid_samples,
          "use the first N validation samples; 0 = all, -1 = no validation", at_least(-1));
  v.field("shuffle", shuffle, "shuffle the training samples every epoch");
  v.field("channels", channels, "synthetic data and image_folder: image channels (image_folder: 1 or 3)",
          at_least(1));
  v.field("image_size", image_size,
          "synthetic data and image_folder: image height and width in pixels (image_folder "
          "resizes to it)",
          at_least(1));
  v.field("classes", classes, "synthetic data: number of classes", at_least(2));
  v.field("samples", samples, "synthetic data: number of training samples", at_least(1));
  v.field("paths", paths,
          "text data: files or folders (their text files, recursively, sorted) read as one byte "
          "corpus");
  v.field("block_size", block_size, "text data: tokens (bytes) per window", at_least(2));
  v.field("windows_per_epoch", windows_per_epoch,
          "text data: random training windows per epoch; 0 = training bytes / block_size",
          at_least(0));
  v.field("valid_path", valid_path,
          "image_folder: the validation folder; csv: the validation file");
  v.field("label_column", label_column, "csv: the label column's header name; \"\" = the last column");
  v.field("task", task, "csv: what the label is: class labels or regression targets",
          {"classification", "regression"});
  v.field("flip", flip, "images: mirror training images left-right with probability 1/2 (seeded)");
  v.field("crop_padding", crop_padding,
          "images: pad training images by N pixels and crop back at a random offset (seeded); 0 = off",
          at_least(0));
}

void DataOptions::check() const {
  if (task == "regression" && dataset != "csv")
    throw_config_error("'data.task' = \"regression\" needs 'data.dataset' = \"csv\" (a float "
                       "label column); dataset \"" + dataset + "\" has class labels");
  if (dataset == "image_folder" && channels != 1 && channels != 3)
    throw_config_error("'data.channels' = " + std::to_string(channels) +
                       ": image_folder reads images as 1 (grey) or 3 (RGB) channels");
  if ((dataset == "image_folder" || dataset == "csv") && valid_path.empty() && valid_samples >= 0)
    throw_config_error("'data.valid_path' is empty: name the " +
                       std::string(dataset == "csv" ? "validation CSV file" : "validation folder") +
                       " of the " + dataset + " dataset, or set 'data.valid_samples' = -1 (no validation)");
  if ((dataset == "csv" || dataset == "text") && (flip || crop_padding > 0))
    throw_config_error("'data.flip' and 'data.crop_padding' augment images; dataset \"" + dataset +
                       "\" has none");
}

void ModelOptions::visit(FieldVisitor& v) {
  v.field("arch", arch, "architecture: mlp, cnn, resnet, vit or one a plugin registers");
  v.field("width", width,
          "hidden units (mlp), base channels (cnn, resnet), embedding size (vit)", at_least(1));
  v.field("depth", depth, "hidden blocks (mlp), residual blocks (resnet), layers (vit)",
          at_least(1));
  v.field("dropout", dropout, "dropout probability", half_open(0, 1));
  v.field("patch", patch, "vit: patch size in pixels", at_least(1));
  v.field("heads", heads, "vit: attention heads; must divide width", at_least(1));
  v.field("n_layer", n_layer, "gpt: transformer blocks", at_least(1));
  v.field("n_head", n_head, "gpt: attention heads; must divide n_embd", at_least(1));
  v.field("n_embd", n_embd, "gpt: embedding size", at_least(1));
  v.field("block_size", block_size, "gpt: longest context in tokens; 0 = data.block_size",
          at_least(0));
}

void ModelOptions::check() const {
  if (arch == "vit" && width % heads != 0) {
    const int64_t fixed = (width / heads + 1) * heads;
    throw_config_error("'model.width' (" + std::to_string(width) +
                       ") must be divisible by 'model.heads' (" + std::to_string(heads) +
                       ") for arch \"vit\"; e.g. width = " + std::to_string(fixed));
  }
  if (arch == "gpt" && n_embd % n_head != 0) {
    const int64_t fixed = (n_embd / n_head + 1) * n_head;
    throw_config_error("'model.n_embd' (" + std::to_string(n_embd) +
                       ") must be divisible by 'model.n_head' (" + std::to_string(n_head) +
                       ") for arch \"gpt\"; e.g. n_embd = " + std::to_string(fixed));
  }
}

void LossOptions::visit(FieldVisitor& v) {
  v.field("name", name, "loss: cross_entropy or one a plugin registers");
  v.field("label_smoothing", label_smoothing, "cross_entropy: label smoothing", half_open(0, 1));
}

void StageOptions::visit(FieldVisitor& v) {
  v.field("name", name, "stage name, unique; shown in logs and the report");
  v.field("epochs", epochs, "epochs in this stage", at_least(0));
  v.field("freeze", freeze, "module-name prefixes whose parameters do not train in this stage");
  v.field("image_size", image_size, "resize inputs to this size; 0 = the data's own size",
          at_least(0));
  v.field("seq_len", seq_len,
          "text: train on windows of this many tokens (sequence-length warm-up); 0 = "
          "data.block_size",
          at_least(0));
  v.table("optimizer", optimizer, "this stage's optimizer; keys it omits inherit [optimizer]",
          &has_optimizer);
  v.table("schedule", schedule, "this stage's learning-rate schedule (schedule.h)");
}

void StageOptions::check() const {
  if (schedule.name == "cosine" && schedule.min_lr > optimizer.lr)
    throw_config_error("'schedule.min_lr' (" + std::to_string(schedule.min_lr) +
                       ") must not exceed the stage's optimizer lr (" +
                       std::to_string(optimizer.lr) + ")");
}

void AblationOptions::visit(FieldVisitor& v) {
  v.field("baseline", baseline, "plugins on in every run, the baseline included");
  v.field("techniques", techniques,
          "plugins varied (each alone, all together, all but one); empty = every plugin with a "
          "[plugins.X] table that is not in baseline");
  v.field("repeats", repeats, "runs of each combination; step times are their median",
          at_least(1));
  v.field("steps", steps, "training batches per run", at_least(1));
  v.field("warmup", warmup, "batches left out of the step-time statistics", at_least(0));
  v.field("leave_one_out", leave_one_out, "also run all techniques but one, for each");
}

void AblationOptions::check() const {
  auto dup = [](const std::vector<std::string>& v) -> std::string {
    for (size_t i = 0; i < v.size(); ++i)
      for (size_t j = i + 1; j < v.size(); ++j)
        if (v[i] == v[j]) return v[i];
    return "";
  };
  if (auto d = dup(techniques); !d.empty())
    throw_config_error("'ablation.techniques' names plugin '" + d + "' twice");
  if (auto d = dup(baseline); !d.empty())
    throw_config_error("'ablation.baseline' names plugin '" + d + "' twice");
  for (const auto& t : techniques)
    for (const auto& b : baseline)
      if (t == b)
        throw_config_error("plugin '" + t +
                           "' is in both 'ablation.baseline' and 'ablation.techniques'; a "
                           "baseline plugin is on in every run, so it cannot be varied");
  if (warmup >= steps)
    throw_config_error("'ablation.warmup' (" + std::to_string(warmup) +
                       ") must be less than 'ablation.steps' (" + std::to_string(steps) +
                       "): no step would be timed");
}

namespace {

const char* const kSetPrefix = "--set";

// ---- `--set KEY=VALUE` overrides, applied to the parsed table before validation. ----

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

/// TOML is UTF-8 text; an override is not read by the TOML parser that checks it. (A key of
/// other bytes was stored as is and written to the resolved config as another key.)
bool valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();  // the strict error handler refuses invalid UTF-8
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

/// {v = VALUE}: the value as TOML, or as a plain string when it is not TOML, parsed with
/// `origin` as its source so that errors about it name the override. (Moving a node keeps
/// its source; copying drops it.)
toml::table parse_value(const std::string& text, const std::string& origin) {
  const std::string_view origin_view = origin;
  try {
    toml::table t = toml::parse("v = " + text, origin_view);
    if (t.size() == 1 && t.contains("v")) return t;
  } catch (const toml::parse_error&) {
  }
  try {
    return toml::parse("v = " + quote(text), origin_view);
  } catch (const toml::parse_error& e) {  // e.g. a control character TOML strings refuse
    throw_config_error(origin + ": the value is neither TOML nor a valid string: " +
                       std::string(e.description()));
  }
}

bool parse_index(const std::string& segment, size_t& index) {
  if (segment.empty() || segment.find_first_not_of("0123456789") != std::string::npos)
    return false;
  auto res = std::from_chars(segment.data(), segment.data() + segment.size(), index);
  return res.ec == std::errc();
}

void apply_override(toml::table& root, const std::string& assignment) {
  const auto eq = assignment.find('=');
  const std::string key = eq == std::string::npos ? "" : trim(assignment.substr(0, eq));
  std::vector<std::string> segments;
  for (size_t b = 0;; ) {
    const auto dot = key.find('.', b);
    segments.push_back(key.substr(b, dot == std::string::npos ? std::string::npos : dot - b));
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  if (key.empty() || contains(segments, ""))
    throw_config_error(std::string(kSetPrefix) + " '" + assignment + "': expected KEY=VALUE");
  const std::string origin = std::string(kSetPrefix) + " " + assignment;
  if (!valid_utf8(assignment))
    throw_config_error(origin + ": not UTF-8 text (TOML keys and strings are Unicode)");
  toml::table value = parse_value(trim(assignment.substr(eq + 1)), origin);

  toml::node* at = &root;
  std::string path;  // the dotted key of `at`
  for (size_t i = 0; i < segments.size(); ++i) {
    const std::string& seg = segments[i];
    const bool last = i + 1 == segments.size();
    if (auto* t = at->as_table()) {
      if (last) {
        t->insert_or_assign(seg, std::move(*value.get("v")));
        return;
      }
      if (!t->contains(seg)) {
        size_t index = 0;
        if (parse_index(segments[i + 1], index))
          throw_config_error(origin + ": index " + segments[i + 1] + " is out of range: '" +
                             dotted(path, seg) + "' is not set");
        toml::table fresh = toml::parse("v = {}", std::string_view(origin));
        t->insert_or_assign(seg, std::move(*fresh.get("v")));
        t->get(seg)->as_table()->is_inline(false);
      }
      at = t->get(seg);
    } else if (auto* a = at->as_array()) {
      size_t index = 0;
      if (!parse_index(seg, index))
        throw_config_error(origin + ": '" + path + "' is an array; '" + seg +
                           "' is not an index (0, 1, ...)");
      if (index >= a->size())
        throw_config_error(origin + ": index " + seg + " is out of range: '" + path + "' has " +
                           std::to_string(a->size()) + " element" +
                           (a->size() == 1 ? "" : "s"));
      if (last) {
        a->replace(a->cbegin() + static_cast<std::ptrdiff_t>(index),
                   std::move(*value.get("v")));
        return;
      }
      at = a->get(index);
    } else {
      throw_config_error(origin + ": '" + path + "' is " + describe_value(*at) +
                         ", not a table");
    }
    path = path.empty() ? seg : path + "." + seg;
  }
}

// ---- The top level. ----

const std::vector<std::string> kSections = {"run",    "data",    "model",   "optimizer",  "loss",
                                            "stages", "plugins", "ablation", "distributed"};

void read_section(const toml::table& root, const char* name, Options& o,
                  const std::string& source) {
  const toml::node* n = root.get(name);
  if (!n) {
    read_options(toml::table{}, o, name, source);  // still runs check()
    return;
  }
  const auto* t = n->as_table();
  if (!t)
    throw_config_error(location(*n, source) + ": '" + name + "' must be a table ([" + name +
                       "]), got " + describe_value(*n));
  read_options(*t, o, name, source);
}

void read_stages(const toml::table& root, Config& c) {
  const toml::node* n = root.get("stages");
  if (!n) {
    c.stages.emplace_back();
    c.stages.back().optimizer = c.optimizer;
    return;
  }
  const auto* a = n->as_array();
  if (!a || a->empty() || !a->is_array_of_tables())
    throw_config_error(location(*n, c.source) +
                       ": 'stages' must be an array of tables (one [[stages]] section per "
                       "stage), got " + describe_value(*n));
  std::map<std::string, std::string> first_use;  // name -> "stages.i at file:line:column"
  for (size_t i = 0; i < a->size(); ++i) {
    const toml::table& t = *a->get(i)->as_table();
    const std::string where = "stages." + std::to_string(i);
    StageOptions s;
    s.optimizer = c.optimizer;  // [optimizer] is the base of the stage's own table
    read_options(t, s, where, c.source);
    const toml::node* name_node = t.get("name");
    const std::string loc = name_node ? location(*name_node, c.source) : location(t, c.source);
    if (s.name.empty())
      throw_config_error(loc + ": '" + where + ".name' must not be empty");
    auto [it, fresh] = first_use.emplace(s.name, where + " at " + loc);
    if (!fresh)
      throw_config_error(loc + ": '" + where + ".name' repeats the stage name \"" + s.name +
                         "\" of " + it->second + "; stage names must be unique");
    c.stages.push_back(std::move(s));
  }
}

/// The file's TOML with the overrides applied; not yet validated.
toml::table parse_root(const std::string& text, const std::string& source,
                       const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw_config_error(detail::location_of(e.source(), source) +
                       ": TOML syntax error: " + std::string(e.description()));
  }
  for (const auto& o : overrides) apply_override(root, o);
  return root;
}

/// [plugins], moved out of `root` (moved, not copied: the plugin loader's errors keep positions).
toml::table take_plugins(toml::table& root, const std::string& source) {
  toml::node* p = root.get("plugins");
  if (!p) return {};
  auto* t = p->as_table();
  if (!t)
    throw_config_error(location(*p, source) + ": 'plugins' must be a table ([plugins]), got " +
                       describe_value(*p));
  return std::move(*t);
}

void read_ablation(const toml::table& root, Config& c) {
  const toml::node* a = root.get("ablation");
  if (!a) return;
  read_section(root, "ablation", c.ablation, c.source);
  c.has_ablation = true;
  const toml::table& t = *a->as_table();
  const std::string here = location(*a, c.source);
  c.ablation.baseline_at = t.get("baseline") ? location(*t.get("baseline"), c.source) : here;
  c.ablation.techniques_at =
      t.get("techniques") ? location(*t.get("techniques"), c.source) : here;
}

std::string read_text(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw_config_error("cannot read config file '" + path + "': " + std::strerror(EISDIR));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_config_error("cannot read config file '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad())
    throw_config_error("cannot read config file '" + path + "': " + std::strerror(errno));
  return text.str();
}

}  // namespace

namespace {
/// A regression trains with mse, classes with cross_entropy: the built-in loss that cannot take
/// the data's labels is refused before any work (a plugin's loss is its own business).
void check_task_loss(const Config& c) {
  const bool regression = c.data.dataset == "csv" && c.data.task == "regression";
  if (regression && c.loss.name == "cross_entropy")
    throw ConfigError(c.source + ": 'loss.name' = \"cross_entropy\" cannot train 'data.task' = "
                      "\"regression\" (float targets); set [loss] name = \"mse\"");
  if (!regression && c.loss.name == "mse")
    throw ConfigError(c.source + ": 'loss.name' = \"mse\" needs float targets: 'data.dataset' = "
                      "\"csv\" with 'data.task' = \"regression\"; class labels train with "
                      "\"cross_entropy\"");
}
}  // namespace

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  toml::table root = parse_root(text, source, overrides);
  for (auto&& [k, v] : root)
    if (!contains(kSections, k.str()))
      detail::unknown_key(detail::key_location(k, v, source), std::string(k.str()), kSections,
                          "", "Allowed top-level tables");
  Config c;
  c.source = source;
  read_section(root, "run", c.run, source);
  read_section(root, "data", c.data, source);
  read_section(root, "model", c.model, source);
  read_section(root, "optimizer", c.optimizer, source);
  read_section(root, "loss", c.loss, source);
  read_stages(root, c);
  check_task_loss(c);
  read_section(root, "distributed", c.distributed, source);
  c.plugins = take_plugins(root, source);
  read_ablation(root, c);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_text(path), path, overrides);
}

toml::table read_plugins_table(const std::string& path,
                               const std::vector<std::string>& overrides) {
  toml::table root = parse_root(read_text(path), path, overrides);
  return take_plugins(root, path);
}

std::string Config::to_toml() const {
  Config c = *this;  // visit() takes the fields by reference
  toml::table root;
  root.insert_or_assign("run", detail::write_fields(c.run));
  root.insert_or_assign("data", detail::write_fields(c.data));
  root.insert_or_assign("model", detail::write_fields(c.model));
  root.insert_or_assign("optimizer", detail::write_fields(c.optimizer));
  root.insert_or_assign("loss", detail::write_fields(c.loss));
  toml::array stage_tables;
  for (auto& s : c.stages) stage_tables.push_back(detail::write_fields(s));
  root.insert_or_assign("stages", std::move(stage_tables));
  root.insert_or_assign("distributed", detail::write_fields(c.distributed));
  if (!plugins.empty()) root.insert_or_assign("plugins", plugins);
  if (has_ablation) root.insert_or_assign("ablation", detail::write_fields(c.ablation));
  // The shortest floats (0.9, not 0.90000000000000002) when every value reads back exactly.
  std::ostringstream shortest;
  shortest << toml::toml_formatter{root, toml::toml_formatter::default_flags |
                                             toml::format_flags::relaxed_float_precision}
           << "\n";
  try {
    if (toml::parse(shortest.str()) == root) return shortest.str();
  } catch (const toml::parse_error&) {
  }
  std::ostringstream exact;
  exact << root << "\n";
  return exact.str();
}

std::vector<std::string> Config::keys_outside_training() const {
  Config c = *this;  // visit() takes the fields by reference
  std::vector<std::string> out;
  auto add = [&](Options& o, const std::string& prefix) {
    for (auto& k : frugal::keys_outside_training(o, prefix)) out.push_back(std::move(k));
  };
  add(c.run, "run");
  add(c.data, "data");
  add(c.model, "model");
  add(c.optimizer, "optimizer");
  add(c.loss, "loss");
  for (size_t i = 0; i < c.stages.size(); ++i) add(c.stages[i], "stages." + std::to_string(i));
  add(c.distributed, "distributed");
  if (has_ablation) add(c.ablation, "ablation");
  return out;
}

void DistributedOptions::visit(FieldVisitor& v) {
  v.field("backend", backend,
          outside_training("collectives: auto = nccl for CUDA devices (when LibTorch has it), "
                           "else gloo"),
          {"auto", "gloo", "nccl"});
  v.field("timeout", timeout,
          outside_training("seconds the rendezvous and each collective may wait for the other "
                           "ranks before the run fails"),
          Limits{1, 86400});
  v.field("bucket_size", bucket_size,
          outside_training("gradient bytes per all-reduce (DDP's bucket_cap_mb)"));
}

}  // namespace frugal
