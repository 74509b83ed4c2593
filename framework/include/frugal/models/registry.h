#pragma once
/// Name -> factory registries for models, losses and datasets, so a TOML file can name what
/// frugal or a plugin provides (optimizers have theirs in optimizers.h). A plugin that
/// registers must unregister before it unloads (the plugin loader does this for it).
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/base/error.h"
#include "frugal/config/sections.h"
#include "frugal/data/data.h"

namespace frugal {

/// What a model is built for.
struct ModelInput {
  int64_t channels = 1;
  int64_t image_size = 28;  ///< the largest image size any stage uses
  int64_t num_classes = 10;
  /// Every image size the stages use (a model with a fixed input size rejects several).
  std::vector<int64_t> image_sizes;
  /// Text: tokens per window (the longest sequence the model sees); 0 = the data are images.
  /// num_classes is then the vocabulary (256 bytes).
  int64_t block_size = 0;
  /// run.seed, for a model that draws its initial weights from its own generator (gpt).
  uint64_t seed = 0;
};

/// Every model is a Sequential of named blocks, so checkpointing can split it and freeze
/// prefixes name blocks ("features" matches "features1.0.weight").
using ModelFactory = std::function<torch::nn::Sequential(const ModelOptions&, const ModelInput&)>;
using LossFn = std::function<torch::Tensor(const torch::Tensor& pred, const torch::Tensor& target)>;
using LossFactory = std::function<LossFn(const LossOptions&)>;
/// Loads the train (train = true) or validation split.
using DatasetFactory = std::function<Dataset(const DataOptions&, bool train)>;

template <class Factory>
class Registry {
 public:
  struct Entry {
    Factory make;
    std::string description;
    std::string owner;  ///< "frugal" or the plugin's name
    /// The keys of its section it reads beyond the loader's own ([data]: path, flip, ...;
    /// [model]: width, depth, ...; "stages.image_size" / "stages.seq_len" for a dataset whose
    /// stages may resize images or shorten windows). nullopt = undeclared: nothing is checked.
    /// A declared entry makes a key it does not read, set away from its default, an error
    /// (check_keys_are_read) instead of a run that silently trains on something else.
    std::optional<std::vector<std::string>> reads;
  };
  explicit Registry(std::string what) : what_(std::move(what)) {}

  void add(const std::string& name, Factory f, std::string description,
           std::string owner = "frugal",
           std::optional<std::vector<std::string>> reads = std::nullopt) {
    std::lock_guard<std::mutex> g(m_);
    entries_[name] = Entry{std::move(f), std::move(description), std::move(owner), std::move(reads)};
  }
  /// Removes every entry `owner` added (a plugin's, before its library unloads).
  void remove_owner(const std::string& owner) {
    std::lock_guard<std::mutex> g(m_);
    for (auto it = entries_.begin(); it != entries_.end();)
      it = it->second.owner == owner ? entries_.erase(it) : std::next(it);
  }
  bool contains(const std::string& name) const {
    std::lock_guard<std::mutex> g(m_);
    return entries_.count(name) != 0;
  }
  /// Throws ConfigError naming the unknown entry, the nearest name and all available ones.
  Entry get(const std::string& name) const;
  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> g(m_);
    std::vector<std::string> out;
    for (auto& kv : entries_) out.push_back(kv.first);
    return out;
  }
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  mutable std::mutex m_;
  std::map<std::string, Entry> entries_;
};

template <class Factory>
typename Registry<Factory>::Entry Registry<Factory>::get(const std::string& name) const {
  std::vector<std::string> all;
  {
    std::lock_guard<std::mutex> g(m_);
    auto it = entries_.find(name);
    if (it != entries_.end()) return it->second;
    for (auto& kv : entries_) all.push_back(kv.first);
  }
  std::string msg = "unknown " + what_ + " '" + name + "'";
  std::string near = nearest(name, all);
  if (!near.empty()) msg += "; did you mean '" + near + "'?";
  msg += " Available: ";
  for (size_t i = 0; i < all.size(); ++i) msg += (i ? ", " : "") + all[i];
  throw_config_error(msg);
}

Registry<ModelFactory>& models();
Registry<LossFactory>& losses();
Registry<DatasetFactory>& datasets();

/// How a model's state-dict names appear in the weight files it exchanges, when they differ from
/// frugal's: gpt2's "block3.attn.c_attn.weight" is Hugging Face's "transformer.h.3.attn.c_attn.weight".
struct WeightNames {
  /// A state-dict name's name in files.
  std::function<std::string(const std::string&)> to_file;
  /// A file's name's state-dict name; "" for a tensor the model does not hold by design (GPT-2's
  /// attention-mask buffers). Several file names may give one (a tied head: must be equal).
  std::function<std::string(const std::string&)> from_file;
  /// The file that describes the model to other tools (Hugging Face's config.json), written
  /// beside model.safetensors; empty when none.
  std::function<std::string(const torch::nn::Module&)> config_json;
};
/// Sets (or, with an empty `to_file`, removes) `arch`'s names. A plugin's own model may set
/// them in on_load and must remove them before it unloads.
void set_weight_names(const std::string& arch, WeightNames names);
/// `arch`'s names; nullopt = the state-dict names, as they are.
std::optional<WeightNames> weight_names(const std::string& arch);

/// Builds the model named by `o.arch`. Throws ConfigError for an unknown name or a
/// configuration the model cannot take.
torch::nn::Sequential make_model(const ModelOptions& o, const ModelInput& in);
LossFn make_loss(const LossOptions& o);
Dataset make_dataset(const DataOptions& o, bool train);

/// The keys of [data] and [model] (and the stages' image_size and seq_len) that the chosen
/// dataset or model does not read, set to another value than their default: ConfigError naming
/// the key, what ignores it and which entries read it. Entries that do not declare what they
/// read (a plugin's, by default) are not checked.
void check_keys_are_read(const DataOptions& d, const ModelOptions& m,
                         const std::vector<StageOptions>& stages);

}  // namespace frugal
