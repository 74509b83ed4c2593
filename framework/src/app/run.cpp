#include "frugal/app/run.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <spdlog/spdlog.h>

#include "frugal/app/model_export.h"
#include "frugal/base/error.h"
#include "frugal/callbacks/checkpoint_writer.h"
#include "frugal/callbacks/early_stopping.h"
#include "frugal/callbacks/grad_clip.h"
#include "frugal/callbacks/metrics_log.h"
#include "frugal/callbacks/nonfinite.h"
#include "frugal/callbacks/schedule.h"
#include "frugal/callbacks/threads.h"
#include "frugal/callbacks/trace.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/distributed.h"
#include "frugal/io/weights.h"
#include "frugal/memory/memory.h"
#include "frugal/models/registry.h"

namespace frugal {

namespace {

int64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

// Prefixes a registry's error with the file and key it came from. What it builds on the CPU is
// held to the machine's physical memory (the tracking allocator refuses past it: overcommit
// would grant a model of terabytes and the kernel kill the process once its pages are touched),
// and an allocation refused is a ConfigError naming the key and the bytes.
template <class F>
auto named(const Config& c, const std::string& key, F&& f) -> decltype(f()) {
  const int64_t machine = physical_memory(), budget = MemoryMeter::get().budget();
  std::optional<ScopedMemoryBudget> guard;
  if (MemoryMeter::get().device().is_cpu() && machine > 0 && (budget == 0 || budget > machine))
    guard.emplace(machine);
  try {
    return f();
  } catch (const ConfigError& e) {
    throw ConfigError(c.where(key) + ": " + key + ": " + e.what());
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    if (what.find("can't allocate memory") == std::string::npos &&
        what.find("out of memory") == std::string::npos)
      throw;
    what = what.substr(0, what.find('\n'));
    if (!guard)
      throw ConfigError(c.where(key) + ": " + key + ": the sizes it sets need more memory than there "
                        "is: " + what);
    throw ConfigError(c.where(key) + ": " + key + ": the sizes it sets need more memory than this "
                      "machine's " + format_bytes(machine) + ": " +
                      what.substr(0, what.find(" of budget")));  // the budget is the machine's
  }
}

// Synthetic images are made in float (the image and its noise: 8 bytes a pixel) and kept as
// uint8: a count the machine cannot hold is refused before any of it is allocated (a large
// enough request would be granted by overcommit and killed later).
void check_synthetic_size(const Config& c) {
  const double pixels = static_cast<double>(c.data.channels) * static_cast<double>(c.data.image_size) *
                        static_cast<double>(c.data.image_size);
  const double need = static_cast<double>(c.data.samples) * pixels * 9.0;
  const int64_t have = physical_memory();
  if (have <= 0 || need <= static_cast<double>(have)) return;
  const std::string bytes = need >= 9.2e18 ? "more than 8 EiB" : format_bytes(static_cast<int64_t>(need));
  throw ConfigError(c.where("data.samples") + ": data.samples = " + std::to_string(c.data.samples) +
                    ": the synthetic dataset needs " + bytes + " while it is made (" +
                    std::to_string(c.data.samples) + " images of " + std::to_string(c.data.channels) +
                    "x" + std::to_string(c.data.image_size) + "x" + std::to_string(c.data.image_size) +
                    ", 9 bytes a pixel), more than this machine's " + format_bytes(have) +
                    "; lower data.samples or data.image_size");
}

// image_folder and csv: the model's input is what the files hold (the class folders; the CSV's
// feature columns and labels), not the synthetic-data keys: read without decoding the data.
void files_input(const DataOptions& d, int64_t& channels, int64_t& size, int64_t& classes) {
  if (d.dataset == "image_folder") {
    classes = static_cast<int64_t>(list_image_folder(d.path).classes.size());
  } else if (d.dataset == "csv") {
    const CsvShape s = csv_shape(d.path, CsvSpec{d.label_column, d.task == "regression"});
    channels = s.features;
    size = 1;
    classes = s.classes;
  }
}

ModelInput model_input(const Config& c, const Dataset* data) {
  ModelInput in;
  in.seed = static_cast<uint64_t>(c.run.seed);
  if (data ? data->is_text() : c.data.dataset == "text") {
    in.block_size = data ? data->block_size : c.data.block_size;
    in.num_classes = data ? data->num_classes : text_vocab_size(c.data);
    return in;
  }
  in.channels = data ? data->channels() : c.data.channels;
  int64_t native = data ? data->height() : c.data.image_size;
  in.num_classes = data ? data->num_classes : c.data.classes;
  if (!data) files_input(c.data, in.channels, native, in.num_classes);
  std::set<int64_t> sizes;
  for (const auto& s : c.stages) sizes.insert(s.image_size ? s.image_size : native);
  in.image_sizes.assign(sizes.begin(), sizes.end());
  in.image_size = in.image_sizes.empty() ? native : in.image_sizes.back();
  return in;
}

}  // namespace

namespace {
// image_folder and csv: the training files are listed (parsed, for a CSV) and the model built
// for what they hold, and the validation path must exist: a missing folder, a bad row or a model
// that cannot take the data stops here, before any work.
void check_own_data(const Config& c) {
  try {
    torch::NoGradGuard g;
    named(c, "model", [&] { return make_model(c.model, model_input(c, nullptr)); });
  } catch (const DataError& e) {
    throw ConfigError(c.where("data.path") + ": data.path: " + e.what());
  }
  std::error_code ec;
  if (c.data.valid_samples >= 0 && !std::filesystem::exists(c.data.valid_path, ec))
    throw ConfigError(c.where("data.valid_path") + ": data.valid_path: '" + c.data.valid_path + "' does not exist");
}
}  // namespace

ModelInput config_model_input(const Config& c, const Dataset* data) { return model_input(c, data); }

torch::nn::Sequential make_config_model(const Config& c) {
  return named(c, "model", [&] { return make_model(c.model, model_input(c, nullptr)); });
}

torch::Device resolve_device(const std::string& device) {
  if (device == "cpu") return torch::kCPU;
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda") {
#ifndef FRUGAL_WITH_CUDA
    throw_config_error("run.device = \"cuda\", but this frugal was built with a LibTorch without "
                       "CUDA; build against a CUDA LibTorch (CMAKE_PREFIX_PATH) or use \"cpu\"");
#endif
    if (!cuda) throw_config_error("run.device = \"cuda\", but no CUDA device is available");
    return torch::Device(torch::kCUDA, 0);
  }
#ifdef FRUGAL_WITH_CUDA
  if (cuda) return torch::Device(torch::kCUDA, 0);
#endif
  (void)cuda;
  return torch::kCPU;
}

namespace {
// data.crop_padding pads each side: past the image's own side most crops would be padding
// (and a huge one allocates a padded copy of every image).
void check_crop_padding(const Config& c) {
  if (c.data.crop_padding == 0) return;
  int64_t side = c.data.dataset == "fashion-mnist" ? 28 : c.data.image_size;
  for (const auto& s : c.stages)
    if (s.image_size > 0) side = std::min(side, s.image_size);
  if (c.data.crop_padding > side)
    throw ConfigError(c.where("data.crop_padding") + ": data.crop_padding = " + std::to_string(c.data.crop_padding) +
                      " is more than the image's side (" + std::to_string(side) + " pixels): the "
                      "crops would be mostly padding; use at most " + std::to_string(side) +
                      " (4 for 32-pixel images is usual)");
}
}  // namespace

void check_config_names(const Config& c) {
  named(c, "data.dataset", [&] { return datasets().get(c.data.dataset); });
  named(c, "loss.name", [&] { return losses().get(c.loss.name); });
  named(c, "model.arch", [&] { return models().get(c.model.arch); });
  try {
    check_keys_are_read(c.data, c.model, c.stages);
  } catch (const ConfigError& e) {  // the message starts with the key
    const std::string what = e.what();
    throw ConfigError(c.where(what.substr(0, what.find(' '))) + ": " + what);
  }
}

void check_config(const Config& c) {
  check_config_names(c);
  check_crop_padding(c);
  if (c.data.dataset == "text") {
    try {
      text_files(c.data.paths);
    } catch (const DataError& e) {
      throw ConfigError(c.where("data.paths") + ": data.paths: " + e.what());
    }
    try {
      if (!c.data.valid_path.empty()) text_files({c.data.valid_path});
    } catch (const DataError& e) {
      throw ConfigError(c.where("data.valid_path") + ": data.valid_path: " + e.what());
    }
  }
  if (c.data.dataset == "synthetic") check_synthetic_size(c);
  if (c.data.dataset == "fashion-mnist") {
    try {
      check_fashion_mnist(c.data.path);
    } catch (const DataError& e) {
      throw ConfigError(c.where("data.path") + ": data.path: " + e.what());
    }
  }
  if (c.data.dataset == "image_folder" || c.data.dataset == "csv") check_own_data(c);
  if (c.data.dataset == "synthetic" || c.data.dataset == "text") {
    // Cheap to build the model for the configured shape: catches e.g. a vit patch that does
    // not divide the image size before any data is loaded.
    torch::NoGradGuard g;
    named(c, "model", [&] { return make_model(c.model, model_input(c, nullptr)); });
  }
  resolve_device(c.run.device);
}

namespace {
// run.threads = "auto" on a CPU with several cores: ThreadTuner times the first steps, which
// then count as warm-up (left out of the step times). A run too short to measure in keeps
// LibTorch's default, with BLAS on the same count. Every run has a tuner (an inert one when
// nothing is tuned), so checkpoints resume across thread settings.
void add_thread_tuner(const Config& c, Learner& l) {
  int64_t planned = 0;  // training steps the stages ask for (image size changes aside)
  for (const auto& s : c.stages) planned += s.epochs * l.train_data().num_batches();
  if (c.run.max_steps > 0) planned = std::min(planned, c.run.max_steps);
  const int64_t cores = available_cores();
  const World& world = World::get();
  // Data parallel on CPU: the machine's cores shared out between its ranks, nothing timed (a
  // rank's timing would race its neighbours').
  const bool tune = c.run.threads == Limits::kAuto && l.device().is_cpu() && cores > 1 &&
                    planned >= 2 * ThreadTuner::kSteps && !world.distributed();
  if (c.run.threads == Limits::kAuto && world.distributed() && l.device().is_cpu())
    set_threads(std::max<int64_t>(1, cores / world.local_size()));
  else if (c.run.threads == Limits::kAuto && !tune)
    set_threads(at::get_num_threads());
  l.add_callback(std::make_shared<ThreadTuner>(tune ? cores : 0));
  if (tune) l.set_warmup_batches(std::max(c.run.warmup, ThreadTuner::kSteps));
}

// The stage's learning-rate schedule (every run: it keeps no state), and the metrics history,
// written by rank 0 only.
void add_history_callbacks(const Config& c, Learner& l) {
  l.add_callback(std::make_shared<ScheduleCallback>());
  if (!World::get().is_main() || !(c.run.metrics || c.run.tensorboard)) return;
  MetricsHistoryOptions h;
  h.dir = c.run.out_dir;
  h.log_every = c.run.log_every;
  h.tables = c.run.metrics;
  h.tensorboard = c.run.tensorboard;
  h.plots = c.run.plots;
  l.add_callback(std::make_shared<MetricsHistory>(h));
}

// run.on_nonfinite, run.save_best, run.early_stopping: the metrics are checked against the
// learner's task here, before any work.
void add_safety_nets(const Config& c, Learner& l) {
  // The gradients' check rides on the fused step: no pass of its own (nonfinite.h).
  l.add_callback(std::make_shared<NonFiniteCheck>(NonFiniteCheck::parse_mode(c.run.on_nonfinite),
                                                  NonFiniteCheck::Scan::InStep));
  // Gradient clipping, when [optimizer] or a stage's optimizer asks for it (the callback reads
  // the stage's keys at each step).
  bool clips = c.optimizer.clip_grad_norm > 0 || c.optimizer.clip_grad_value > 0;
  for (const auto& s : c.stages)
    clips = clips || (s.has_optimizer && (s.optimizer.clip_grad_norm > 0 || s.optimizer.clip_grad_value > 0));
  if (clips) l.add_callback(std::make_shared<GradClip>());
  auto monitor = [&](const std::string& key, const std::string& metric, double min_delta) {
    return named(c, key, [&] {
      MetricMonitor m(metric, min_delta);
      m.check(l.task(), "");  // named() prefixes the file and key
      if (!l.valid_data())
        throw_config_error("\"" + metric + "\" needs validation data, but data.valid_samples = -1 "
                           "(no validation)");
      return m;
    });
  };
  if (c.run.save_best != "off")  // on every rank (they decide together), rank 0 writes
    l.add_callback(std::make_shared<SaveBest>(
        monitor("run.save_best", c.run.save_best, 0.0), best_model_path(c.run),
        std::map<std::string, std::string>{{"frugal.model.arch", c.model.arch}},
        run_data(c, l.train_data().dataset())));
  if (c.run.early_stopping != "off")
    l.add_callback(std::make_shared<EarlyStopping>(
        monitor("run.early_stopping", c.run.early_stopping, c.run.min_delta), c.run.patience));
}

// Periodic checkpoints and a stop's share one history: a stop seals it.
void add_checkpointing(const Config& c, Learner& l, const StopRequest* stop) {
  auto history = std::make_shared<CheckpointHistory>(checkpoint_path(c.run), c.run.keep_checkpoints);
  if (c.run.checkpoint_every > 0 || c.run.checkpoint_epochs > 0) {
    auto writer = std::make_shared<CheckpointWriter>(checkpoint_path(c.run), c.run.checkpoint_every,
                                                     c.run.checkpoint_epochs, checkpoint_info(c),
                                                     spdlog::default_logger());
    writer->set_history(history);
    l.add_callback(writer);
  }
  if (stop)
    l.add_callback(std::make_shared<StopCallback>(*stop, history, checkpoint_info(c),
                                                  spdlog::default_logger()));
}
}  // namespace

namespace {
// run.threads past the machine's cores only slows a run (512 made a tiny one 30x slower;
// 100000 hung creating threads): held to the cores this process may run on.
void set_configured_threads(const Config& c) {
  if (c.run.threads <= 0) return;
  const int64_t cores = available_cores();
  if (c.run.threads > cores)
    spdlog::warn("{}: run.threads = {} is more than the {} core(s) this process may run on: "
                 "using {}", c.where("run.threads"), c.run.threads, cores, cores);
  set_threads(std::min(c.run.threads, cores));
}
}  // namespace

namespace {
// model.init_from: the weights a run starts from, checked as any key is (file, name, shape).
void init_model(const Config& c, torch::nn::Module& model) {
  if (c.model.init_from.empty()) return;
  try {
    const InitReport r = named(c, "model.init_from", [&] {
      return init_weights(model, c.model.init_from, c.model.init_strict, c.model.init_prefixes,
                          weight_names(c.model.arch));
    });
    spdlog::info("model.init_from: {}", r.summary());
  } catch (const CheckpointError& e) {
    throw ConfigError(c.where("model.init_from") + ": model.init_from: " + e.what());
  }
}
}  // namespace

std::unique_ptr<Learner> make_learner(const Config& c, const StopRequest* stop) {
  check_config(c);
  set_configured_threads(c);
  torch::manual_seed(static_cast<uint64_t>(c.run.seed));
  World& world = World::get();
  torch::Device device = resolve_device(c.run.device);
  // Data parallel on CUDA: each rank of a machine on its own GPU.
  if (world.distributed() && device.is_cuda())
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                             world.local_rank() % torch::cuda::device_count()));
  MemoryMeter::get().set_device(device);

  Dataset train = named(c, "data", [&] { return make_dataset(c.data, true); });
  std::optional<DataLoader> valid;
  if (c.data.valid_samples >= 0) {
    valid.emplace(named(c, "data", [&] { return make_dataset(c.data, false); }),
                  c.data.valid_batch_size, false, 0, device);
    if (c.data.valid_samples > valid->dataset().size())
      spdlog::warn("{}: data.valid_samples = {}, but the validation split holds {}: validating on "
                   "all {}", c.where("data.valid_samples"), c.data.valid_samples,
                   valid->dataset().size(), valid->dataset().size());
  }
  auto model = named(c, "model", [&] { return make_model(c.model, model_input(c, &train)); });
  init_model(c, *model);
  LossFn loss = make_loss(c.loss);
  DataLoader train_loader(std::move(train), c.data.batch_size, c.data.shuffle,
                          static_cast<uint64_t>(c.run.seed), device);
  if (world.distributed()) {  // each rank its shard of every batch; data.batch_size is global
    named(c, "data.batch_size", [&] { train_loader.set_shard(world.rank(), world.size()); });
    if (valid)
      named(c, "data.valid_batch_size",
            [&] { valid->set_shard(world.rank(), world.size(), /*every_sample=*/true); });
  }
  auto learner = std::make_unique<Learner>(std::move(model), std::move(train_loader),
                                           std::move(valid), c.optimizer, std::move(loss), device);
  if (world.distributed()) learner->set_collective(world);
  learner->set_run_info({c.run.out_dir, c.model.arch, c.model.init_from});
  learner->set_max_batches(c.run.max_steps);
  add_checkpointing(c, *learner, stop);
  if (world.distributed())
    learner->add_callback(std::make_shared<DataParallel>(c.distributed.bucket_size.bytes, c.distributed.overlap));
  if (world.is_main())  // rank 0 writes the run's files
    learner->add_callback(std::make_shared<ModelExport>(
        model_path(c.run), std::map<std::string, std::string>{{"frugal.model.arch", c.model.arch}},
        run_data(c, learner->train_data().dataset())));
  add_safety_nets(c, *learner);
  learner->set_warmup_batches(c.run.warmup);
  add_thread_tuner(c, *learner);
  if (!c.run.trace.empty() && world.is_main())
    learner->add_callback(std::make_shared<TraceCallback>(c.run.trace));
  add_history_callbacks(c, *learner);
  OomPolicy oom;
  oom.budget = c.run.memory_budget.bytes;
  oom.retry = c.run.on_oom == "retry";
  oom.max_retries = c.run.oom_retries;
  oom.auto_micro_batch = c.run.micro_batch == "auto";
  learner->set_oom_policy(oom);
  return learner;
}

std::unique_ptr<Learner> make_checked_learner(const Config& c, const StopRequest* stop) {
  auto learner = make_learner(c, stop);
  try {
    learner->check_fit(c.stages);
  } catch (const ConfigError& e) {
    throw ConfigError(c.where("stages") + ": stages: " + e.what());
  }
  return learner;
}

nlohmann::json safety_records(const Learner& l) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& cb : l.callbacks()) {
    if (const auto* n = dynamic_cast<const NonFiniteCheck*>(cb.get())) out["nonfinite"] = n->record();
    if (const auto* g = dynamic_cast<const GradClip*>(cb.get())) out["grad_clip"] = g->record();
    if (const auto* e = dynamic_cast<const EarlyStopping*>(cb.get())) out["early_stopping"] = e->record();
    if (const auto* b = dynamic_cast<const SaveBest*>(cb.get()); b && b->has_best())
      out["best_model"] = b->record();
  }
  return out;
}

std::string checkpoint_path(const RunOptions& r) {
  return (std::filesystem::path(r.out_dir) / "checkpoints" / "last.ckpt").string();
}

nlohmann::json checkpoint_info(const Config& c) { return {{"config", c.to_toml()}}; }

std::string resume_checkpoint(const std::string& where) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(where, ec)) return where;
  if (!fs::is_directory(where, ec))
    throw CheckpointError("--resume '" + where + "': no such file or folder");
  const std::string in_run = (fs::path(where) / "checkpoints" / "last.ckpt").string();
  if (fs::is_regular_file(in_run, ec)) return in_run;
  throw CheckpointError("--resume '" + where + "': no checkpoint in it (looked for " + in_run +
                        "; a run writes one with run.checkpoint_every or run.checkpoint_epochs)");
}

namespace {

// Every leaf of a TOML table as "dotted.key" -> its TOML text.
void flatten(const toml::node& n, const std::string& key, std::map<std::string, std::string>& out) {
  if (const auto* t = n.as_table()) {
    for (auto&& [k, v] : *t) flatten(v, key.empty() ? std::string(k.str()) : key + "." + std::string(k.str()), out);
  } else if (const auto* a = n.as_array(); a && a->is_array_of_tables()) {
    for (size_t i = 0; i < a->size(); ++i) flatten(*a->get(i), key + "." + std::to_string(i), out);
  } else {
    std::ostringstream os;
    if (const auto* arr = n.as_array())
      os << *arr;
    else
      n.visit([&](auto&& v) { os << v; });
    out[key] = os.str();
  }
}

/// The keys in which `now` differs from `saved`, leaving out those in `free`.
std::vector<std::string> training_diffs(const std::map<std::string, std::string>& saved,
                                        const std::map<std::string, std::string>& now,
                                        const std::set<std::string>& free,
                                        const std::string& source) {
  std::vector<std::string> diffs;
  for (const auto& [k, v] : saved) {
    if (free.count(k)) continue;
    auto it = now.find(k);
    if (it == now.end())
      diffs.push_back(k + " (checkpoint " + v + ", not in " + source + ")");
    else if (it->second != v)
      diffs.push_back(k + " (checkpoint " + v + ", " + source + " " + it->second + ")");
  }
  for (const auto& [k, v] : now)
    if (!free.count(k) && !saved.count(k))
      diffs.push_back(k + " (not in the checkpoint, " + source + " " + v + ")");
  return diffs;
}

}  // namespace

namespace {
// A finished fit of n stages may go on: stages.<n-1>.epochs and every key of stages.<n>... .
void add_extension_keys(const std::map<std::string, std::string>& saved,
                        const std::map<std::string, std::string>& now, std::set<std::string>& free) {
  size_t n = 0;
  while (saved.count("stages." + std::to_string(n) + ".name")) ++n;
  if (n == 0) return;
  free.insert("stages." + std::to_string(n - 1) + ".epochs");
  for (const auto& [k, v] : now) {
    if (k.rfind("stages.", 0) != 0) continue;
    const size_t index = std::strtoull(k.c_str() + 7, nullptr, 10);
    if (index >= n) free.insert(k);
  }
}
}  // namespace

void check_resume_config(const Config& c, const nlohmann::json& info, const std::string& path,
                         const std::vector<std::string>& plugin_keys_outside_training, bool finished) {
  if (!info.is_object() || !info.contains("config") || !info["config"].is_string())
    throw ConfigError("checkpoint '" + path + "' holds no run config; it was not written by "
                      "`frugal train` and cannot be resumed with --resume");
  std::map<std::string, std::string> saved, now;
  try {
    flatten(toml::parse(info["config"].get<std::string>()), "", saved);
  } catch (const toml::parse_error& e) {
    throw ConfigError("checkpoint '" + path + "' holds a damaged run config: " +
                      std::string(e.description()));
  }
  flatten(toml::parse(c.to_toml()), "", now);
  std::set<std::string> free;
  for (const auto& k : c.keys_outside_training()) free.insert(k);
  for (const auto& k : plugin_keys_outside_training) free.insert(k);
  free.insert("plugins.path");  // where plugins are found (absolute in a run's config.toml)
  if (finished) add_extension_keys(saved, now, free);
  const std::vector<std::string> diffs = training_diffs(saved, now, free, c.source);
  if (diffs.empty()) return;
  std::string list;
  for (size_t i = 0; i < diffs.size() && i < 8; ++i) list += "\n  " + diffs[i];
  if (diffs.size() > 8) list += "\n  ... and " + std::to_string(diffs.size() - 8) + " more";
  throw ConfigError("cannot resume from '" + path + "': " + c.source + " differs from the run's "
                    "config in " + std::to_string(diffs.size()) + " key(s) that change the "
                    "training:" + list + "\nResume with the run's own config (its config.toml)");
}

}  // namespace frugal
