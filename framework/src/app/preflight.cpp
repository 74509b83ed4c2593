#include "frugal/app/preflight.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "frugal/app/run.h"
#include "frugal/base/error.h"
#include "frugal/base/options.h"
#include "frugal/data/data.h"
#include "frugal/memory/memory.h"
#include "frugal/optim/optimizers.h"

namespace frugal {

namespace fs = std::filesystem;

namespace {

bool matches(const std::string& name, const std::vector<std::string>& prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return name.rfind(p, 0) == 0; });
}

// Samples held as uint8 images with int64 labels: the first `keep` of `n` (0 = all; head()).
int64_t image_bytes(int64_t n, int64_t keep, int64_t pixels) {
  const int64_t kept = keep > 0 ? std::min(keep, n) : n;
  return kept * (pixels + static_cast<int64_t>(sizeof(int64_t)));
}

// The first stage that trains: what the first step runs.
const StageOptions& first_stage(const Config& c) {
  static const StageOptions none;
  for (const auto& s : c.stages)
    if (s.epochs > 0) return s;
  return c.stages.empty() ? none : c.stages.front();
}

// The text corpus as text_dataset splits it (the last tenth validates) and head() cuts it.
int64_t text_bytes(const DataOptions& d) {
  int64_t n = 0;
  std::error_code ec;
  for (const auto& f : text_files(d.paths)) {
    const auto size = fs::file_size(f, ec);
    if (!ec) n += static_cast<int64_t>(size);
  }
  const int64_t n_valid = n / 10, n_train = n - n_valid;
  const auto kept = [&](int64_t bytes, int64_t windows) {
    return windows > 0 && windows * d.block_size + 1 < bytes ? windows * d.block_size + 1 : bytes;
  };
  return kept(n_train, d.train_samples) + (d.valid_samples < 0 ? 0 : kept(n_valid, d.valid_samples));
}

// image_folder's cache: every listed image as uint8 channels x image_size^2, and its label.
int64_t image_folder_bytes(const DataOptions& d, const std::string& source) {
  const int64_t pixels = d.channels * d.image_size * d.image_size;
  try {
    const ImageFolderListing train = list_image_folder(d.path);
    const auto n = [](const ImageFolderListing& l) { return static_cast<int64_t>(l.files.size()); };
    int64_t bytes = image_bytes(n(train), d.train_samples, pixels);
    if (d.valid_samples >= 0)
      bytes += image_bytes(n(list_image_folder(d.valid_path, train.classes)), d.valid_samples, pixels);
    return bytes;
  } catch (const DataError& e) {
    throw ConfigError(source + ": data.path: " + e.what());
  }
}

// A CSV's rows as float features and an int64 class or a float target each.
int64_t csv_bytes(const DataOptions& d, const std::string& source) {
  const CsvSpec spec{d.label_column, d.task == "regression"};
  const int64_t label = spec.regression ? 4 : 8;
  const auto split = [&](const std::string& path, int64_t keep) {
    const CsvShape s = csv_shape(path, spec);
    const int64_t kept = keep > 0 ? std::min(keep, s.rows) : s.rows;
    return kept * (s.features * 4 + label);
  };
  try {
    return split(d.path, d.train_samples) + (d.valid_samples < 0 ? 0 : split(d.valid_path, d.valid_samples));
  } catch (const DataError& e) {
    throw ConfigError(source + ": data.path: " + e.what());
  }
}

// The config the model is built for: Fashion-MNIST's images are 1x28x28 in 10 classes, whatever
// the keys for synthetic data say.
Config model_config(const Config& c) {
  Config m = c;
  if (c.data.dataset == "fashion-mnist") {
    m.data.channels = 1;
    m.data.image_size = 28;
    m.data.classes = 10;
  }
  return m;
}

}  // namespace

int64_t estimated_data_bytes(const Config& c) {
  const DataOptions& d = c.data;
  if (d.dataset == "fashion-mnist") {
    const auto split = [&](bool train, int64_t keep) {
      std::vector<int64_t> shape;
      try {
        shape = idx_shape(fashion_mnist_images(d.path, train));
      } catch (const DataError& e) {
        throw ConfigError(c.source + ": data.path: " + e.what());
      }
      int64_t pixels = 1;
      for (size_t i = 1; i < shape.size(); ++i) pixels *= shape[i];
      return image_bytes(shape.empty() ? 0 : shape[0], keep, pixels);
    };
    return split(true, d.train_samples) + (d.valid_samples < 0 ? 0 : split(false, d.valid_samples));
  }
  if (d.dataset == "synthetic") {
    const int64_t pixels = d.channels * d.image_size * d.image_size;
    return image_bytes(d.samples, d.train_samples, pixels) +
           (d.valid_samples < 0 ? 0 : image_bytes(std::max<int64_t>(d.samples / 4, 1), d.valid_samples, pixels));
  }
  if (d.dataset == "text") return text_bytes(d);
  if (d.dataset == "image_folder") return image_folder_bytes(d, c.source);
  if (d.dataset == "csv") return csv_bytes(d, c.source);
  return 0;
}

namespace {

HeldBytes held_bytes(const Config& c, torch::nn::Module& model) {
  HeldBytes h;
  const StageOptions& stage = first_stage(c);
  std::set<const void*> seen;  // a tied weight is one tensor
  TrainableBytes trained;
  for (const auto& np : model.named_parameters()) {
    if (!seen.insert(np.value().unsafeGetTensorImpl()).second) continue;
    const int64_t bytes = tensor_bytes(np.value());
    h.parameters += bytes;
    if (matches(np.key(), stage.freeze)) continue;
    trained.add(np.value());
  }
  for (const auto& b : model.buffers())
    if (seen.insert(b.unsafeGetTensorImpl()).second) h.buffers += tensor_bytes(b);
  h.gradients = trained.total;
  // What the optimizer's first step makes, as its registry entry says (what the micro-batch
  // probe uses); an entry without step_needs: one copy of the trained parameters.
  const OptimizerOptions& o = stage.has_optimizer ? stage.optimizer : c.optimizer;
  h.optimizer = o.name;
  const auto needs = optimizers().get(o.name).make.step_needs;
  h.optimizer_state = needs ? needs(o, trained).state : trained.total;
  h.data = estimated_data_bytes(c);
  h.data_on_device = resolve_device(c.run.device).is_cpu();
  return h;
}

}  // namespace

HeldBytes estimate_held_bytes(const Config& c) {
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = make_config_model(model_config(c));
  return held_bytes(c, *model);
}

void check_out_dir(const Config& c) {
  const std::string what = c.source + ": run.out_dir: output folder '" + c.run.out_dir + "' ";
  // The nearest part of the path that exists must be a folder this process can write in.
  std::error_code ec;
  fs::path existing = fs::absolute(c.run.out_dir, ec);
  while (!fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
    existing = existing.parent_path();
  if (!fs::is_directory(existing, ec))
    throw ConfigError(what + "cannot be created: '" + existing.string() +
                      "' is not a folder; set run.out_dir to a writable folder");
  std::string probe = (existing / ".frugal-check.XXXXXX").string();
  if (!::mkdtemp(probe.data()))
    throw ConfigError(what + "cannot be created or written: '" + existing.string() + "': " +
                      std::strerror(errno) + "; set run.out_dir to a writable folder");
  fs::remove(probe, ec);
}

void preflight(const Config& c, const std::vector<std::string>& plugins_on) {
  check_out_dir(c);
  if (c.data.dataset != "fashion-mnist" && c.data.dataset != "synthetic" && c.data.dataset != "text")
    return;  // a plugin's dataset: the model's shapes come from the data, known only once loaded
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = make_config_model(model_config(c));
  try {
    check_freeze_prefixes(*model, c.stages);
  } catch (const ConfigError& e) {
    throw ConfigError(c.source + ": stages.freeze: " + e.what());
  }
  const int64_t budget = c.run.memory_budget.bytes;
  if (budget <= 0) return;
  const HeldBytes h = held_bytes(c, *model);
  std::string parts = "parameters " + format_bytes(h.parameters);
  if (h.buffers) parts += ", buffers " + format_bytes(h.buffers);
  if (h.data_on_device) parts += ", data " + format_bytes(h.data);
  if (!plugins_on.empty()) {  // a plugin may change the first step: only what precedes it
    if (h.before_training() <= budget) return;
    throw ConfigError(c.source + ": run.memory_budget = " + format_bytes(budget) +
                      " is below what the run holds before its first batch, estimated from the "
                      "config's shapes: " + parts + " = " + format_bytes(h.before_training()) +
                      "; raise the budget or shrink the model or data");
  }
  if (h.total() <= budget) return;
  parts += ", gradients " + format_bytes(h.gradients) + ", optimizer state (" + h.optimizer + ") " +
           format_bytes(h.optimizer_state);
  throw ConfigError(c.source + ": run.memory_budget = " + format_bytes(budget) +
                    " is below what the run holds at its first step, estimated from the "
                    "config's shapes: " + parts + " = " + format_bytes(h.total()) +
                    " before any activation; raise the budget or shrink the model or data");
}

}  // namespace frugal
