// `frugal predict RUN INPUTS...`: a trained run's predictions for new images or CSV rows, read
// from the run folder alone (config.toml, model.pt, data.json), as fastai's learn.predict.
#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "frugal/app/model_export.h"
#include "frugal/base/error.h"
#include "frugal/data/data.h"
#include "infer.h"

namespace frugal::cli {

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
