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

// The text corpus as the text dataset splits it (the last tenth validates, or data.valid_path
// does) and head() cuts it: bytes, or an upper bound for subword tokens.
int64_t text_bytes(const DataOptions& d) {
  const auto bytes_of = [](const std::vector<std::string>& paths) {
    int64_t n = 0;
    std::error_code ec;
    for (const auto& f : text_files(paths)) {
      const auto size = fs::file_size(f, ec);
      if (!ec) n += static_cast<int64_t>(size);
    }
    return n;
  };
  const int64_t n = bytes_of(d.paths);
  const bool held_out = !d.valid_path.empty();
  const int64_t n_valid = held_out ? (d.valid_samples < 0 ? 0 : bytes_of({d.valid_path})) : n / 10;
  const int64_t n_train = held_out ? n : n - n_valid;
  const auto kept = [&](int64_t bytes, int64_t windows) {
    return windows > 0 && windows * d.block_size + 1 < bytes ? windows * d.block_size + 1 : bytes;
  };
  const int64_t units = kept(n_train, d.train_samples) + (d.valid_samples < 0 ? 0 : kept(n_valid, d.valid_samples));
  // Subword tokens are int32, at most one per byte (every piece stands for a byte or more): an
  // upper bound, as the text is not encoded here; and each split's float bytes-per-token table.
  if (d.tokenizer != "bytes") return 4 * units + 2 * 4 * text_vocab_size(d);
  return units;
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

}  // namespace

int64_t estimated_data_bytes(const Config& c) {
  const DataOptions& d = c.data;
  if (d.dataset == "fashion-mnist") {
    const auto split = [&](bool train, int64_t keep) {
      std::vector<int64_t> shape;
      try {
        shape = idx_shape(fashion_mnist_images(d.path, train));
      } catch (const DataError& e) {
        throw ConfigError(c.where("data.path") + ": data.path: " + e.what());
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
  if (d.dataset == "image_folder") return image_folder_bytes(d, c.where("data.path"));
  if (d.dataset == "csv") return csv_bytes(d, c.where("data.path"));
  return 0;
}

namespace {

// One sample's input and target as the loader puts them on the device: images as float with an
// int64 label, token windows as int64 inputs and targets, CSV rows as float features.
int64_t sample_bytes_on_device(const Config& c) {
  const DataOptions& d = c.data;
  if (d.dataset == "text") return d.block_size * 2 * 8;
  if (d.dataset == "csv") {
    try {
      return csv_shape(d.path, CsvSpec{d.label_column, d.task == "regression"}).features * 4 + 8;
    } catch (const DataError&) {
      return 0;  // estimated_data_bytes names the file
    }
  }
  if (d.dataset != "fashion-mnist" && d.dataset != "synthetic" && d.dataset != "image_folder") return 0;
  int64_t side = d.dataset == "fashion-mnist" ? 28 : d.image_size;
  for (const auto& s : c.stages) side = std::max(side, s.image_size);
  const int64_t channels = d.dataset == "fashion-mnist" ? 1 : d.channels;
  return channels * side * side * 4 + 8;
}

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
  const StepNeeds step = needs ? needs(o, trained) : StepNeeds{trained.total, 0};
  h.optimizer_state = step.state;
  h.step_temporaries = step.temporaries;
  h.data = estimated_data_bytes(c);
  const int64_t sample = sample_bytes_on_device(c);
  h.batch = sample * std::max(c.data.batch_size, c.data.valid_samples < 0 ? 0 : c.data.valid_batch_size);
  h.data_on_device = resolve_device(c.run.device).is_cpu();
  return h;
}

}  // namespace

HeldBytes estimate_held_bytes(const Config& c) {
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = make_config_model(c);
  return held_bytes(c, *model);
}

namespace {

// The longest name one folder entry may have where `dir` is, and the longest path.
void check_name_lengths(const std::string& what, const fs::path& path, const fs::path& existing) {
  const long name_max = ::pathconf(existing.c_str(), _PC_NAME_MAX);
  const long path_max = ::pathconf(existing.c_str(), _PC_PATH_MAX);
  for (const auto& part : path)
    if (name_max > 0 && static_cast<long>(part.string().size()) > name_max)
      throw ConfigError(what + "has a name of " + std::to_string(part.string().size()) +
                        " bytes, more than the " + std::to_string(name_max) + " this file system "
                        "allows for one name; use a shorter one");
  if (path_max > 0 && static_cast<long>(path.string().size()) >= path_max)
    throw ConfigError(what + "is a path of " + std::to_string(path.string().size()) +
                      " bytes, more than the " + std::to_string(path_max - 1) + " allowed; use a "
                      "shorter one");
}

// The nearest part of `path` (of its folder, for a file) that exists must be a folder this
// process can write in (probed with a temporary folder, removed again), and every name on it
// short enough.
void check_creatable(const std::string& what, const std::string& path, bool file, const std::string& fix) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  fs::path existing = file ? absolute.parent_path() : absolute;
  while (!fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
    existing = existing.parent_path();
  if (!fs::is_directory(existing, ec))
    throw ConfigError(what + "cannot be created: '" + existing.string() + "' is not a folder; " + fix);
  check_name_lengths(what, absolute, existing);
  std::string probe = (existing / ".frugal-check.XXXXXX").string();
  if (!::mkdtemp(probe.data()))
    throw ConfigError(what + "cannot be created or written: '" + existing.string() + "': " +
                      std::strerror(errno) + "; " + fix);
  fs::remove(probe, ec);
}

}  // namespace

void check_out_dir(const Config& c) {
  check_creatable(c.where("run.out_dir") + ": run.out_dir: output folder '" + c.run.out_dir + "' ", c.run.out_dir, false,
                  "set run.out_dir to a writable folder");
  if (c.run.trace.empty()) return;
  const std::string what = c.where("run.trace") + ": run.trace: trace file '" + c.run.trace + "' ";
  std::error_code ec;
  if (fs::is_directory(c.run.trace, ec))
    throw ConfigError(what + "is a folder; name a file (e.g. '" +
                      (fs::path(c.run.trace) / "trace.json").string() + "')");
  check_creatable(what, c.run.trace, true, "set run.trace to a file in a writable folder");
}

void preflight(const Config& c, const std::vector<std::string>& plugins_on) {
  check_out_dir(c);
  if (c.data.dataset != "fashion-mnist" && c.data.dataset != "synthetic" && c.data.dataset != "text")
    return;  // a plugin's dataset: the model's shapes come from the data, known only once loaded
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = make_config_model(c);
  try {
    check_freeze_prefixes(*model, c.stages);
  } catch (const ConfigError& e) {
    throw ConfigError(c.where("stages") + ": stages.freeze: " + e.what());
  }
  const int64_t budget = c.run.memory_budget.bytes;
  if (budget <= 0) return;
  const HeldBytes h = held_bytes(c, *model);
  std::string parts = "parameters " + format_bytes(h.parameters);
  if (h.buffers) parts += ", buffers " + format_bytes(h.buffers);
  if (h.data_on_device) parts += ", data " + format_bytes(h.data);
  if (!plugins_on.empty()) {  // a plugin may change the first step: only what precedes it
    if (h.before_training() <= budget) return;
    throw ConfigError(c.where("run.memory_budget") + ": run.memory_budget = " + format_bytes(budget) +
                      " is below what the run holds before its first batch, estimated from the "
                      "config's shapes: " + parts + " = " + format_bytes(h.before_training()) +
                      "; raise the budget or shrink the model or data");
  }
  if (h.total() <= budget) return;
  parts += ", gradients " + format_bytes(h.gradients) + ", optimizer state (" + h.optimizer + ") " +
           format_bytes(h.optimizer_state);
  if (h.step_temporaries) parts += ", the step's temporaries " + format_bytes(h.step_temporaries);
  if (h.batch) parts += ", the largest batch " + format_bytes(h.batch);
  throw ConfigError(c.where("run.memory_budget") + ": run.memory_budget = " + format_bytes(budget) +
                    " is below what the run holds at its first step, estimated from the "
                    "config's shapes: " + parts + " = " + format_bytes(h.total()) +
                    " before any activation; raise the budget or shrink the model or data");
}

}  // namespace frugal
