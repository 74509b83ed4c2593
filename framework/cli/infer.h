#pragma once
// `frugal generate`, `frugal evaluate` and `frugal predict`: a trained run's model, loaded from
// its folder (config.toml, model.pt, data.json; no optimizer state), sampled, scored or asked.
// CLI-internal.
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace frugal::cli {

struct GenerateArgs {
  std::string run_dir;
  std::string prompt;
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 0;
  bool no_kv_cache = false;
  double top_p = 1.0;
  std::vector<std::string> stop;
  int64_t samples = 1;  ///< continuations drawn at once (one batch)
};

struct EvaluateArgs {
  std::string run_dir;
  int64_t samples = 0;     ///< the first N samples (windows) of the split; 0 = the config's
  int64_t batch_size = 0;  ///< 0 = the config's data.valid_batch_size
  bool json = false;
  /// Scores this instead of the run's validation split: a text file or folder (text), an image
  /// folder of class folders (image_folder) or a CSV file (csv); "" = the split.
  std::string data;
};

struct PredictArgs {
  std::string run_dir;
  std::vector<std::string> inputs;  ///< image files, CSV files or rows ("1.5,2,0")
  int64_t top = 3;                  ///< classes shown per input
  bool json = false;
};

CLI::App* add_generate_command(CLI::App& app, GenerateArgs& a);
CLI::App* add_predict_command(CLI::App& app, PredictArgs& a);
/// Prints each input's prediction (class and probabilities, or the value), read from the run
/// folder alone (config.toml, model.pt, data.json); exit 0.
int run_predict(const PredictArgs& a);
CLI::App* add_evaluate_command(CLI::App& app, EvaluateArgs& a);
/// Prints the prompt and its continuation; exit code 0. Throws for a folder that holds no
/// trained language model.
int run_generate(const GenerateArgs& a);
/// Prints the task's metric on the validation split (Fashion-MNIST: its test set); exit 0.
int run_evaluate(const EvaluateArgs& a);

}  // namespace frugal::cli
