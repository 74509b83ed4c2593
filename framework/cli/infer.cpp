// `frugal generate` and `frugal evaluate`: fastai's load_learner + predict for a run folder.
#include "infer.h"

#include <iostream>

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
  cmd->add_option("--tokens", a.tokens, "bytes to generate")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--temperature", a.temperature, "divides the logits; 0 = always the likeliest byte")
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", a.top_k, "sample among the k likeliest bytes; 0 = all")
      ->check(CLI::Range(int64_t{0}, int64_t{256}));
  cmd->add_option("--seed", a.seed, "the sampler's seed: the same seed, the same text");
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
  return cmd;
}

int run_generate(const GenerateArgs& a) {
  RunModel run = load_run_model(a.run_dir);
  const Config& c = run.loaded.config;
  if (c.data.dataset != "text")
    throw ConfigError("frugal generate: '" + a.run_dir + "' holds a '" + c.model.arch +
                      "' model trained on '" + c.data.dataset + "'; generate samples text from a "
                      "language model (a run with data.dataset = \"text\"). Score it with "
                      "`frugal evaluate " + a.run_dir + "`");
  SampleOptions o;
  o.tokens = a.tokens;
  o.temperature = a.temperature;
  o.top_k = a.top_k;
  o.seed = a.seed;
  // The longest context is the model's position table (gpt's embed.wpe), whatever set its size.
  const auto params = run.model->named_parameters();
  const torch::Tensor* wpe = params.find("embed.wpe.weight");
  o.block_size = wpe ? wpe->size(0) : c.data.block_size;
  const std::string text = generate_text(run.model, a.prompt, o);
  std::cout << a.prompt << text << std::endl;
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
    std::cout << "  next-byte accuracy: " << 100.0 * sums.accuracy() << "%\n";
  else
    std::cout << "  valid_loss (MSE): " << sums.mean_loss() << "\n";
  std::cout << std::flush;
  return 0;
}

}  // namespace frugal::cli
