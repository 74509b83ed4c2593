// `frugal generate`, `frugal evaluate` and `frugal predict`: fastai's load_learner + predict for a
// run folder (predict: new images or CSV rows, read from the run folder alone).
#include "infer.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <spdlog/spdlog.h>

#include "frugal/app/model_export.h"
#include "frugal/app/run.h"
#include "frugal/base/error.h"
#include "frugal/data/data.h"
#include "frugal/data/task.h"
#include "frugal/models/generate.h"
#include "frugal/models/registry.h"

namespace frugal::cli {

CLI::App* add_generate_command(CLI::App& app, GenerateArgs& a) {
  auto* cmd = app.add_subcommand("generate", "sample text from a trained language model's run folder");
  cmd->add_option("run_dir", a.run_dir, "the run's folder (its config.toml and model.pt)")->required();
  cmd->add_option("--prompt", a.prompt, "text the sample continues (default: a new line)");
  cmd->add_option("--tokens", a.tokens, "tokens to generate (bytes, for a byte-level model)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--temperature", a.temperature, "divides the logits; 0 = always the likeliest token")
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", a.top_k, "sample among the k likeliest tokens; 0 = all")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  cmd->add_option("--top-p", a.top_p, "sample among the likeliest tokens holding this share of the probability; 1 = all")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--stop", a.stop, "end the sample before this text (repeat for several)");
  cmd->add_option("--seed", a.seed, "the sampler's seed: the same seed, the same text");
  cmd->add_option("--samples", a.samples, "continuations drawn at once, as one batch (printed one after another)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_flag("--no-kv-cache", a.no_kv_cache,
                "compute the whole context for each byte (the keys and values are kept by default)");
  return cmd;
}

CLI::App* add_evaluate_command(CLI::App& app, EvaluateArgs& a) {
  auto* cmd = app.add_subcommand("evaluate", "score a trained run's model on its validation split");
  cmd->add_option("run_dir", a.run_dir, "the run's folder (its config.toml and model.pt)")->required();
  cmd->add_option("--samples", a.samples, "the first N samples (text: windows); 0 = the config's valid_samples")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--batch-size", a.batch_size, "batch size; 0 = the config's data.valid_batch_size")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", a.json, "print the result as JSON");
  cmd->add_option("--data", a.data,
                  "score this instead of the validation split: a text file or folder (every window), an "
                  "image folder (image_folder) or a CSV file (csv), prepared as training prepared its data");
  return cmd;
}

namespace {
/// The sampler's options from the command line; the context is the model's position table
/// (gpt's embed.wpe), whatever set its size.
SampleOptions sample_options(const GenerateArgs& a, const RunModel& run) {
  SampleOptions o;
  o.tokens = a.tokens;
  o.temperature = a.temperature;
  o.top_k = a.top_k;
  o.top_p = a.top_p;
  o.stop = a.stop;
  o.seed = a.seed;
  o.samples = a.samples;
  o.kv_cache = !a.no_kv_cache;
  const auto params = run.model->named_parameters();
  const torch::Tensor* wpe = params.find("embed.wpe.weight");
  o.block_size = wpe ? wpe->size(0) : run.loaded.config.data.block_size;
  return o;
}

/// The run's tokenizer (data.json names it; bytes when it names none): text to ids, an id's text.
struct RunText {
  std::shared_ptr<const Tokenizer> tok;
  std::vector<std::string> pieces;  ///< id -> its bytes (subword tokenizers)

  explicit RunText(const RunModel& run, const std::string& run_dir)
      : tok(run_tokenizer(run_dir, run.data, run.loaded.config.data.tokenizer)) {
    if (tok)
      for (int32_t id = 0; id < tok->vocab_size(); ++id) pieces.push_back(tok->token_text(id));
  }
  std::vector<int64_t> ids(const std::string& text) const {
    std::vector<int64_t> out;
    if (tok) {
      for (int32_t id : tok->encode(text)) out.push_back(id);
    } else {
      for (unsigned char ch : text) out.push_back(ch);
    }
    return out;
  }
  std::string text(int64_t id) const {
    return tok ? pieces.at(static_cast<size_t>(id)) : std::string(1, static_cast<char>(id));
  }
};
}  // namespace

int run_generate(const GenerateArgs& a) {
  RunModel run = load_run_model(a.run_dir);
  const Config& c = run.loaded.config;
  if (c.data.dataset != "text")
    throw ConfigError("frugal generate: '" + a.run_dir + "' holds a '" + c.model.arch +
                      "' model trained on '" + c.data.dataset + "'; generate samples text from a "
                      "language model (a run with data.dataset = \"text\"). Score it with "
                      "`frugal evaluate " + a.run_dir + "`");
  const SampleOptions o = sample_options(a, run);
  const RunText text(run, a.run_dir);
  const auto start = std::chrono::steady_clock::now();
  const auto samples = generate_tokens(run.model, text.ids(a.prompt.empty() ? std::string("\n") : a.prompt), o,
                                       [&](int64_t id) { return text.text(id); });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t bytes = 0, tokens = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (samples.size() > 1) std::cout << (i ? "\n" : "") << "--- sample " << i + 1 << " of " << samples.size() << " ---\n";
    std::cout << a.prompt << samples[i].text << "\n";
    bytes += samples[i].text.size();
    tokens += samples[i].ids.size();
  }
  std::cout << std::flush;
  spdlog::info("{} tokens ({} bytes) in {:.2f} s ({:.0f} tokens/s, {}{})", tokens, bytes, secs,
               secs > 0 ? static_cast<double>(tokens) / secs : 0.0, o.kv_cache ? "keys and values cached" : "--no-kv-cache",
               samples.size() > 1 ? ", " + std::to_string(samples.size()) + " samples in one batch" : "");
  return 0;
}

namespace {
/// The validation split, labelled and standardized as training did. image_folder and csv read
/// their training files for that (the class folders; the columns' statistics); a run folder's
/// data.json keeps them, so the training data may have moved.
Dataset validation_split(const DataOptions& d, const nlohmann::json& run_data) {
  if (!run_data.is_object() || (d.dataset != "image_folder" && d.dataset != "csv")) return make_dataset(d, false);
  if (d.valid_path.empty()) return make_dataset(d, false);  // names what is missing
  const auto classes = run_data.value("classes", std::vector<std::string>{});
  Dataset v;
  if (d.dataset == "image_folder") {
    v = load_image_folder(d.valid_path, d.channels, d.image_size, classes);
  } else {
    const auto& f = run_data.at("features");
    CsvStats train{f.at("names").get<std::vector<std::string>>(), f.at("mean").get<std::vector<double>>(),
                   f.at("std").get<std::vector<double>>(), classes};
    v = load_csv(d.valid_path, CsvSpec{d.label_column, d.task == "regression"}, train);
  }
  return d.valid_samples > 0 ? v.head(d.valid_samples) : v;
}
}  // namespace

int run_evaluate(const EvaluateArgs& a) {
  RunModel run = load_run_model(a.run_dir);
  DataOptions d = run.loaded.config.data;
  if (a.samples > 0) d.valid_samples = a.samples;
  if (d.valid_samples < 0) d.valid_samples = 0;  // the run trained without validation: all
  if (!a.data.empty()) {
    if (d.dataset != "text" && d.dataset != "image_folder" && d.dataset != "csv")
      throw ConfigError("frugal evaluate --data: the run '" + a.run_dir + "' trained on '" + d.dataset +
                        "'; --data takes the files of a text, image_folder or csv run");
    d.valid_path = a.data;  // each of those reads its held-out split from valid_path
    if (a.samples == 0) d.valid_samples = 0;  // every window / row / image of the file
  }
  // A subword run's tokenizer is read from its folder (data.json or its config names it), never
  // trained again.
  if (const std::string kind = run_tokenizer_kind(run.data, d.tokenizer); kind != "bytes") {
    d.tokenizer = kind;
    d.tokenizer_path = a.run_dir;
    d.vocab_size = DataOptions().vocab_size;  // the folder's model has its own
    d.tokenizer_model = DataOptions().tokenizer_model;
  }
  const Dataset data = validation_split(d, run.data);
  const Task task = task_for(data);
  const DataLoader loader(data, a.batch_size > 0 ? a.batch_size : d.valid_batch_size, false, 0);
  const MetricSums sums =
      score(loader, [&](const torch::Tensor& x) { return run.model->forward(x); }, torch::kCPU);
  nlohmann::json j = task.to_json(sums);
  j["run_dir"] = a.run_dir;
  j["model"] = run.loaded.config.model.arch;
  j["dataset"] = d.dataset;
  j["samples"] = data.size();
  if (a.json) {
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  std::cout << a.run_dir << ": " << j["model"].get<std::string>() << " on " << d.dataset << ", "
            << data.size() << " validation sample(s), " << sums.count << " " << task.element() << "s\n"
            << "  " << j["valid_metric"]["name"].get<std::string>() << ": "
            << j["valid_metric"]["text"].get<std::string>() << "\n";
  if (task.kind == TaskKind::Classification)
    std::cout << "  valid_loss: " << sums.mean_loss() << " nats/sample\n";
  else if (task.kind == TaskKind::LanguageModel)
    std::cout << "  next-token accuracy: " << 100.0 * sums.accuracy() << "%\n";
  else
    std::cout << "  valid_loss (MSE): " << sums.mean_loss() << "\n";
  std::cout << std::flush;
  return 0;
}

// ---------------------------------------------------------------- predict


namespace {

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string f; std::getline(ss, f, ',');) out.push_back(f);
  return out;
}

double number(const std::string& field, const std::string& where) {
  char* end = nullptr;
  const double v = std::strtod(field.c_str(), &end);
  if (end == field.c_str() || *end != '\0')
    throw DataError(where + ": '" + field + "' is not a number");
  return v;
}

/// One feature row standardized as the training split was: [1, F].
torch::Tensor row_tensor(const std::vector<double>& values, const nlohmann::json& f) {
  const auto mean = f.at("mean").get<std::vector<double>>(), sd = f.at("std").get<std::vector<double>>();
  auto x = torch::empty({1, static_cast<int64_t>(values.size())}, torch::kFloat);
  for (size_t i = 0; i < values.size(); ++i) x[0][static_cast<int64_t>(i)] = (values[i] - mean[i]) / sd[i];
  return x;
}

/// The rows an input names: a CSV file with a header naming the features (other columns, the
/// label's, are ignored), or one row of comma-separated features in the training order.
std::vector<std::pair<std::string, torch::Tensor>> csv_inputs(const std::string& input, const nlohmann::json& f) {
  const auto names = f.at("names").get<std::vector<std::string>>();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::ifstream file(input);
  if (!file) {  // a row given on the command line
    const auto fields = split(input);
    if (fields.size() != names.size())
      throw DataError("'" + input + "': " + std::to_string(fields.size()) + " values; the model takes " +
                      std::to_string(names.size()) + " features in this order: " + nlohmann::json(names).dump());
    std::vector<double> v;
    for (const auto& s : fields) v.push_back(number(s, "'" + input + "'"));
    out.emplace_back(input, row_tensor(v, f));
    return out;
  }
  std::string line;
  std::getline(file, line);
  const auto header = split(line);
  std::vector<size_t> at;
  for (const auto& n : names) {
    const auto it = std::find(header.begin(), header.end(), n);
    if (it == header.end())
      throw DataError("'" + input + "':1: no column '" + n + "'; the model takes " + nlohmann::json(names).dump());
    at.push_back(static_cast<size_t>(it - header.begin()));
  }
  for (int64_t no = 2; std::getline(file, line); ++no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto fields = split(line);
    const std::string where = "'" + input + "':" + std::to_string(no);
    if (fields.size() != header.size())
      throw DataError(where + ": " + std::to_string(fields.size()) + " fields, the header has " +
                      std::to_string(header.size()));
    std::vector<double> v;
    for (size_t i : at) v.push_back(number(fields[i], where));
    out.emplace_back(input + ":" + std::to_string(no), row_tensor(v, f));
  }
  return out;
}

torch::Tensor image_input(const std::string& file, const nlohmann::json& data, int64_t size) {
  const auto& im = data.at("images");
  const torch::Tensor u8 = decode_image(file, data.at("input").at("channels").get<int64_t>(),
                                        im.at("size").get<int64_t>());
  return prepare_images(u8.unsqueeze(0), im.at("mean").get<double>(), im.at("std").get<double>(), size);
}

nlohmann::json prediction(const std::string& input, const torch::Tensor& out, const nlohmann::json& data,
                          int64_t top) {
  nlohmann::json p = {{"input", input}};
  if (data.at("task") == "regression") {
    p["value"] = out.reshape({-1})[0].item<double>();
    return p;
  }
  const auto probs = torch::softmax(out.reshape({-1}).to(torch::kDouble), 0);
  const auto classes = data.value("classes", std::vector<std::string>{});
  const auto name = [&](int64_t i) { return i < static_cast<int64_t>(classes.size()) ? classes[i] : std::to_string(i); };
  const auto order = std::get<1>(probs.sort(0, /*descending=*/true));
  p["class"] = name(order[0].item<int64_t>());
  p["index"] = order[0].item<int64_t>();
  p["top"] = nlohmann::json::array();
  for (int64_t k = 0; k < std::min<int64_t>(top, probs.size(0)); ++k) {
    const int64_t i = order[k].item<int64_t>();
    p["top"].push_back({{"class", name(i)}, {"probability", probs[i].item<double>()}});
  }
  return p;
}

void print(const nlohmann::json& p) {
  std::cout << p["input"].get<std::string>() << ": ";
  if (p.contains("value")) {
    std::cout << p["value"].get<double>() << "\n";
    return;
  }
  for (size_t k = 0; k < p["top"].size(); ++k)
    std::cout << (k ? ", " : "") << p["top"][k]["class"].get<std::string>() << " " << std::fixed
              << std::setprecision(1) << 100.0 * p["top"][k]["probability"].get<double>() << "%";
  std::cout << "\n";
}

}  // namespace

CLI::App* add_predict_command(CLI::App& app, PredictArgs& a) {
  auto* cmd = app.add_subcommand("predict", "predict new images or CSV rows with a trained run's model");
  cmd->add_option("run_dir", a.run_dir, "the run's folder (config.toml, model.pt, data.json)")->required();
  cmd->add_option("inputs", a.inputs,
                  "image files (PNG, JPEG), CSV files with the training header, or rows "
                  "\"1.5,2,0\" of the features in training order")
      ->required();
  cmd->add_option("--top", a.top, "classes shown per input")->check(CLI::Range(int64_t{1}, int64_t{1000}));
  cmd->add_flag("--json", a.json, "print the predictions as JSON lines");
  return cmd;
}

int run_predict(const PredictArgs& a) {
  RunModel run = load_run_model(a.run_dir);
  const nlohmann::json& data = run.data;
  if (!data.is_object())
    throw ConfigError("frugal predict: '" + a.run_dir + "' has no data.json (it was trained by an "
                      "older frugal): retrain it, or score it with `frugal evaluate`");
  if (data.at("task") == "language_model")
    throw ConfigError("frugal predict: '" + a.run_dir + "' holds a language model: sample it with "
                      "`frugal generate " + a.run_dir + " --prompt ...`");
  const auto& stages = run.loaded.config.stages;
  const int64_t size = stages.empty() ? 0 : stages.back().image_size;  // the last stage's input size
  torch::NoGradGuard no_grad;
  for (const auto& input : a.inputs) {
    std::vector<std::pair<std::string, torch::Tensor>> xs;
    if (data.contains("features"))
      xs = csv_inputs(input, data["features"]);
    else
      xs.emplace_back(input, image_input(input, data, size));
    for (const auto& [name, x] : xs) {
      const nlohmann::json p = prediction(name, run.model->forward(x), data, a.top);
      if (a.json)
        std::cout << p.dump() << "\n";
      else
        print(p);
    }
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace frugal::cli
