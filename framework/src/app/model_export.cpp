#include "frugal/app/model_export.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <spdlog/spdlog.h>

#include "frugal/app/run.h"
#include "frugal/base/error.h"
#include "frugal/core/learner.h"
#include "frugal/data/tokenizer.h"
#include "frugal/io/file_writer.h"
#include "frugal/io/safetensors.h"
#include "frugal/io/weights.h"
#include "frugal/models/linear.h"
#include "frugal/models/registry.h"
#include "frugal/models/script.h"
#include "io/archive.h"

namespace frugal {

namespace fs = std::filesystem;

ModelExport::ModelExport(std::string path, std::map<std::string, std::string> metadata, nlohmann::json data)
    : path_(std::move(path)), metadata_(std::move(metadata)), data_(std::move(data)) {}

namespace {

std::string doubles(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + ScriptWriter::number(v[i]);
  return s + "]";
}

/// `def prepare(self, x)`: raw inputs to what forward takes, as the data pipeline prepares them
/// (data.json): pixel values 0-255 [B, C, H, W] at the model's image size to
/// x / (255 std) - mean / std in float32; a CSV's feature columns [B, F] standardized with the
/// training split's means and deviations in float64, then float32. Empty for tokens.
std::string prepare_source(const nlohmann::json& data) {
  if (!data.is_object()) return {};
  const std::string head = "def prepare(self, x: Tensor) -> Tensor:\n";
  if (data.contains("images")) {
    const double mean = data["images"].value("mean", 0.0), sd = data["images"].value("std", 1.0);
    return head + "    return x.float().mul(" + ScriptWriter::number(1.0 / (255.0 * sd)) + ").sub(" +
           ScriptWriter::number(mean / sd) + ")\n";
  }
  if (data.contains("features")) {
    const auto mean = data["features"].value("mean", std::vector<double>{});
    const auto sd = data["features"].value("std", std::vector<double>{});
    return head + "    mean = torch.tensor(" + doubles(mean) + ", dtype=7, device=x.device)\n" +
           "    std = torch.tensor(" + doubles(sd) + ", dtype=7, device=x.device)\n" +
           "    return ((x.double() - mean) / std).float()\n";
  }
  return {};
}

// (TorchScript compiled in C++ has no torch.float32 & co.: dtypes are their numbers, as in
// the code PyTorch itself serializes: 4 long, 6 float32, 7 float64, 11 bool.)

/// Defines model.pt's forward (and prepare) on the archive; a model with a module no emitter
/// knows is still saved, without them, and the log says why (model.safetensors stays the way
/// to its weights from Python).
void define_forward(archive::OutputArchive& a, const torch::nn::Module& model, const nlohmann::json& data) {
  const ScriptSource s = script_forward(model, "self.model");
  std::string why = s.missing;
  if (why.empty()) {
    try {
      archive::define_methods(a, s.code + prepare_source(data));
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  if (!why.empty())
    spdlog::warn("model.pt is saved without a TorchScript forward (Python loads its weights, not a "
                 "callable module): {}", why);
}

}  // namespace

void export_model(const torch::nn::Module& model, const std::string& path,
                  std::map<std::string, std::string> metadata, const nlohmann::json& data) {
  archive::OutputArchive a;
  archive::write_header(a);
  archive::write_model(a, model);
  define_forward(a, model, data);
  archive::write_file(a, path);
  metadata.emplace("format", "pt");  // what safetensors.torch.load_file expects of PyTorch weights
  auto tensors = safetensors::state_dict(model);
  const auto arch = metadata.find("frugal.model.arch");
  const auto names = arch == metadata.end() ? std::nullopt : weight_names(arch->second);
  if (names) {  // the names other tools know this model by (gpt2: Hugging Face's), and its config
    for (auto& [name, t] : tensors) name = names->to_file(name);
    if (names->config_json)
      write_file_atomic((fs::path(path).parent_path() / "config.json").string(), names->config_json(model));
  }
  safetensors::write(fs::path(path).replace_extension(".safetensors").string(), tensors, metadata);
}

void export_weights(Learner& l, const std::string& path, std::map<std::string, std::string> metadata,
                    const nlohmann::json& data) {
  const AdaptersMerged plain(*l.model());  // lora's adapters folded in, for this export only
  if (plain.size() > 0) metadata["frugal.adapters_merged"] = std::to_string(plain.size());
  export_model(*l.model(), path, std::move(metadata), data);
}

void ModelExport::after_fit(Learner& l) { export_weights(l, path_, metadata_, data_); }

// ---------------------------------------------------------------- the best model

SaveBest::SaveBest(MetricMonitor monitor, std::string path, std::map<std::string, std::string> metadata,
                   nlohmann::json data)
    : monitor_(std::move(monitor)), path_(std::move(path)), metadata_(std::move(metadata)), data_(std::move(data)) {}

void SaveBest::before_fit(Learner& l) {
  monitor_.check(l.task(), "run.save_best");
  if (!l.valid_data())
    throw_config_error("run.save_best = \"" + monitor_.metric() + "\" needs validation data; "
                       "this learner has none");
  in_epoch_ = has_best_ = false;
  best_ = 0;
  validations_ = 0;
  record_ = nullptr;
}

void SaveBest::after_validate(Learner& l) {
  if (!in_epoch_) return;  // a validate() called outside the fit's epochs
  ++validations_;
  const double v = monitor_.value(l.task(), l.valid_sums());
  // Rank 0's verdict on every rank: they export together when the parameters are sharded.
  Collective& world = l.collective();
  const bool main = world.rank() == 0;
  if (!world.any(main && monitor_.improves(l.task(), v, has_best_, best_))) return;
  has_best_ = true;
  best_ = v;
  const std::string st = fs::path(path_).replace_extension(".safetensors").string();
  record_ = {{"metric", monitor_.metric()}, {"value", v}, {"stage", l.stage_index()},
             {"stage_name", l.stage().name}, {"epoch", l.epoch() + 1}, {"steps", l.steps()},
             {"validation", validations_}, {"pt", path_}, {"safetensors", st}};
  auto metadata = metadata_;
  char value[32];  // every digit: an MSE of 1e-7 is not "0.000000"
  std::snprintf(value, sizeof value, "%.17g", v);
  metadata["frugal.best." + monitor_.metric()] = value;
  metadata["frugal.best.steps"] = std::to_string(l.steps());
  const FullParameters full(l);  // zero stage 3: every rank takes part in the gather
  if (main) export_weights(l, path_, metadata, data_);
}

void SaveBest::save_state(torch::serialize::OutputArchive& a) const {
  if (!has_best_) return;
  a.write("best", c10::IValue(best_));
  a.write("validations", c10::IValue(validations_));
  a.write("record", c10::IValue(record_.dump()));
}

void SaveBest::load_state(Learner&, torch::serialize::InputArchive& a) {
  c10::IValue best, validations, record;
  if (!a.try_read("best", best) || !a.try_read("validations", validations) ||
      !a.try_read("record", record))
    return;  // saved before any validation
  has_best_ = true;
  best_ = best.toDouble();
  validations_ = validations.toInt();
  record_ = nlohmann::json::parse(record.toStringRef(), nullptr, /*allow_exceptions=*/false);
}

std::string model_path(const RunOptions& r) { return (fs::path(r.out_dir) / "model.pt").string(); }

std::string best_model_path(const RunOptions& r) { return (fs::path(r.out_dir) / "best.pt").string(); }

nlohmann::json run_data(const Config& c, const Dataset& train) {
  const ModelInput in = config_model_input(c, &train);
  nlohmann::json j = {
      {"dataset", c.data.dataset},
      {"task", train.is_text() ? "language_model" : train.is_regression() ? "regression" : "classification"},
      {"input", {{"channels", in.channels}, {"image_size", in.image_size}, {"image_sizes", in.image_sizes},
                 {"num_classes", in.num_classes}, {"block_size", in.block_size}, {"seed", in.seed}}},
      {"classes", train.classes}};
  if (!train.is_text() && !train.is_tabular())  // images: decoded at their native size
    j["images"] = {{"mean", train.mean}, {"std", train.std}, {"size", train.height()}};
  if (train.is_tabular())
    j["features"] = {{"names", train.feature_names}, {"mean", train.feature_mean}, {"std", train.feature_std}};
  if (train.is_text())  // its files are saved beside data.json (save_run_tokenizer)
    j["tokenizer"] = {{"kind", train.tokenizer ? train.tokenizer->kind() : "bytes"}, {"vocab_size", train.num_classes}};
  return j;
}

std::vector<std::string> save_run_tokenizer(const std::string& out_dir, const Dataset& train) {
  return train.tokenizer ? train.tokenizer->save(out_dir) : std::vector<std::string>{};
}

namespace {
std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
}  // namespace

void keep_run_tokenizer(const std::string& out_dir, const Dataset& train, bool resuming) {
  if (!train.tokenizer) return;
  const fs::path dir(out_dir), check = dir / ".tokenizer-check";
  std::error_code ec;
  fs::remove_all(check, ec);
  const auto files = train.tokenizer->save(check.string());
  std::string changed;
  for (const auto& f : files)
    if (resuming && fs::exists(dir / f, ec) && file_bytes(dir / f) != file_bytes(check / f)) changed = f;
  fs::remove_all(check, ec);
  if (!changed.empty())
    throw Error(out_dir + "/" + changed + ": the tokenizer built for this resume differs from the one the run "
                "trained with (the corpus or a data.tokenizer key changed since): its token ids would mean other "
                "text. Resume with the same data, or start a new run");
  save_run_tokenizer(out_dir, train);
}

std::string run_tokenizer_kind(const nlohmann::json& data, const std::string& config_kind) {
  const auto it = data.is_object() ? data.find("tokenizer") : data.end();
  return it != data.end() ? it->value("kind", "bytes") : config_kind;
}

std::shared_ptr<const Tokenizer> run_tokenizer(const std::string& run_dir, const nlohmann::json& data,
                                               const std::string& config_kind) {
  const std::string kind = run_tokenizer_kind(data, config_kind);
  if (kind == "bytes") return nullptr;
  return load_tokenizer(kind, run_dir);
}

void write_run_data(const std::string& out_dir, const nlohmann::json& data) {
  write_file_atomic((fs::path(out_dir) / "data.json").string(), data.dump(2) + "\n");
}

namespace {
// The config's model for the input data.json records (no data file read).
torch::nn::Sequential built_for(const Config& c, const nlohmann::json& j) {
  ModelInput in;
  try {
    in.channels = j.at("channels").get<int64_t>();
    in.image_size = j.at("image_size").get<int64_t>();
    in.image_sizes = j.at("image_sizes").get<std::vector<int64_t>>();
    in.num_classes = j.at("num_classes").get<int64_t>();
    in.block_size = j.at("block_size").get<int64_t>();
    in.seed = j.at("seed").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError("data.json: damaged input record: " + std::string(e.what()));
  }
  torch::NoGradGuard g;
  return make_model(c.model, in);
}
}  // namespace

RunModel load_run_model(const std::string& run_dir, const torch::Device& device) {
  const fs::path dir(run_dir);
  const fs::path config = dir / "config.toml";
  if (!fs::is_directory(dir)) throw_config_error(run_dir + ": not a run folder (no such folder)");
  if (!fs::is_regular_file(config))
    throw_config_error(run_dir + ": not a run folder: it has no config.toml (frugal train writes "
                       "one into run.out_dir)");
  RunModel r;
  // data.json holds what the model is built for: the training files are not read again.
  r.loaded = load_config_with_plugins(config.string(), {}, !fs::is_regular_file(dir / "data.json"));
  const fs::path weights = dir / "model.pt";
  if (!fs::is_regular_file(weights))
    throw CheckpointError(weights.string() + ": no trained model in this run folder (a run writes "
                          "model.pt when its fit ends; this one did not finish)");
  std::error_code ec;
  if (fs::is_regular_file(dir / "data.json", ec)) {
    std::ifstream f(dir / "data.json");
    r.data = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
    if (r.data.is_discarded() || !r.data.is_object() || !r.data.contains("input"))
      throw CheckpointError((dir / "data.json").string() + ": damaged (not the JSON a run writes)");
  }
  // A model described by a file of its own (gpt2's config.json) is built from the run's copy:
  // the folder model.init_from named may have moved, or be relative to another directory.
  const auto names = weight_names(r.loaded.config.model.arch);
  if (names && names->config_json && fs::is_regular_file(dir / "config.json", ec))
    r.loaded.config.model.init_from = dir.string();
  r.model = r.data.is_object() ? built_for(r.loaded.config, r.data["input"])
                               : make_config_model(r.loaded.config);
  r.model->to(device);
  // The weights from model.safetensors (each tensor's CRC checked; our reader), not model.pt,
  // whose TorchScript code LibTorch would parse: a hand-made file could crash that parser.
  const fs::path safetensors = dir / "model.safetensors";
  if (!fs::is_regular_file(safetensors, ec))
    throw CheckpointError(safetensors.string() + ": missing (a run writes it beside model.pt)");
  try {
    init_weights(*r.model, safetensors.string(), /*strict=*/true, {}, names);
  } catch (const ConfigError& e) {
    throw CheckpointError(safetensors.string() + " does not fit the run's model: " + e.what());
  }
  r.model->eval();
  return r;
}

}  // namespace frugal
