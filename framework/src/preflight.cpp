#include "frugal/preflight.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "frugal/data.h"
#include "frugal/error.h"
#include "frugal/memory.h"
#include "frugal/optimizers.h"
#include "frugal/options.h"
#include "frugal/run.h"

namespace frugal {

namespace fs = std::filesystem;

namespace {

bool matches(const std::string& name, const std::vector<std::string>& prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return name.rfind(p, 0) == 0; });
}

// Images held as uint8 [N, C, H, W] with int64 labels: the first `keep` of `n` (0 = all).
int64_t image_bytes(int64_t n, int64_t keep, int64_t pixels) {
  const int64_t kept = keep > 0 ? std::min(keep, n) : n;
  return kept * (pixels + static_cast<int64_t>(sizeof(int64_t)));
}

const StageOptions& first_stage(const Config& c) {
  static const StageOptions none;
  return c.stages.empty() ? none : c.stages.front();
}

}  // namespace

int64_t estimated_data_bytes(const Config& c) {
  const DataOptions& d = c.data;
  const int64_t valid_keep = d.valid_samples;  // -1: no validation split is loaded
  auto both = [&](int64_t train_n, int64_t valid_n, int64_t pixels) {
    return image_bytes(train_n, d.train_samples, pixels) +
           (valid_keep < 0 ? 0 : image_bytes(valid_n, valid_keep, pixels));
  };
  if (d.dataset == "fashion-mnist") return both(60000, 10000, 28 * 28);  // the dataset's splits
  if (d.dataset == "synthetic")
    return both(d.samples, std::max<int64_t>(d.samples / 4, 1), d.channels * d.image_size * d.image_size);
  if (d.dataset == "text") {  // both splits together are the corpus, one byte a token
    int64_t bytes = 0;
    std::error_code ec;
    for (const auto& f : text_files(d.paths)) bytes += static_cast<int64_t>(fs::file_size(f, ec));
    return bytes;
  }
  return 0;
}

namespace {

HeldBytes held_bytes(const Config& c, torch::nn::Module& model) {
  HeldBytes h;
  const StageOptions& stage = first_stage(c);
  std::vector<torch::Tensor> trained;
  for (const auto& np : model.named_parameters()) {
    const int64_t bytes = np.value().numel() * static_cast<int64_t>(np.value().element_size());
    h.parameters += bytes;
    if (matches(np.key(), stage.freeze)) continue;
    h.gradients += bytes;
    trained.push_back(np.value());
  }
  // The state an optimizer makes is known once it has stepped: one step on zero gradients.
  const OptimizerOptions& o = stage.has_optimizer ? stage.optimizer : c.optimizer;
  h.optimizer = o.name;
  if (!trained.empty()) {
    for (auto& p : trained) p.mutable_grad() = torch::zeros_like(p);
    std::unique_ptr<torch::optim::Optimizer> opt = make_optimizer(o, trained);
    opt->step();
    h.optimizer_state = optimizer_state_bytes(*opt);
  }
  h.data = estimated_data_bytes(c);
  h.data_on_device = resolve_device(c.run.device).is_cpu();
  return h;
}

}  // namespace

HeldBytes estimate_held_bytes(const Config& c) {
  torch::nn::Sequential model = make_config_model(c);
  return held_bytes(c, *model);
}

void check_freeze_prefixes(const torch::nn::Module& model, const std::vector<StageOptions>& stages) {
  std::vector<std::string> names;
  for (const auto& np : model.named_parameters()) names.push_back(np.key());
  for (const auto& s : stages) {
    for (const auto& prefix : s.freeze) {
      if (std::any_of(names.begin(), names.end(), [&](const std::string& n) { return matches(n, {prefix}); }))
        continue;
      std::vector<std::string> blocks;
      for (const auto& child : model.named_children()) blocks.push_back(child.key());
      std::string list;
      for (const auto& b : blocks) list += (list.empty() ? "" : ", ") + b;
      const std::string near = nearest(prefix, blocks);
      throw_config_error("stage '" + s.name + "': freeze prefix '" + prefix + "' matches no parameter" +
                         (near.empty() ? "" : "; did you mean '" + near + "'?") +
                         " The model's blocks: " + list);
    }
  }
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

void preflight(const Config& c) {
  check_out_dir(c);
  if (c.data.dataset != "fashion-mnist" && c.data.dataset != "synthetic" && c.data.dataset != "text")
    return;  // a plugin's dataset: the model's shapes come from the data, known only once loaded
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = make_config_model(c);
  try {
    check_freeze_prefixes(*model, c.stages);
  } catch (const ConfigError& e) {
    throw ConfigError(c.source + ": stages.freeze: " + e.what());
  }
  const int64_t budget = c.run.memory_budget.bytes;
  if (budget <= 0) return;
  const HeldBytes h = held_bytes(c, *model);
  if (h.total() <= budget) return;
  std::string parts = "parameters " + format_bytes(h.parameters) + ", gradients " +
                      format_bytes(h.gradients) + ", optimizer state (" + h.optimizer + ") " +
                      format_bytes(h.optimizer_state);
  if (h.data_on_device) parts += ", data " + format_bytes(h.data);
  throw ConfigError(c.source + ": run.memory_budget = " + format_bytes(budget) +
                    " is below what the run holds at its first step, estimated from the "
                    "config's shapes: " + parts + " = " + format_bytes(h.total()) +
                    " before any activation; raise the budget or shrink the model or data");
}

}  // namespace frugal
