// A model's starting weights from a safetensors file: matched by name, checked by shape.
#include "frugal/io/weights.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "frugal/base/error.h"
#include "frugal/io/safetensors.h"

namespace frugal {

namespace {

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

bool under(const std::string& name, const std::vector<std::string>& prefixes) {
  return prefixes.empty() || std::any_of(prefixes.begin(), prefixes.end(), [&](const std::string& p) {
           return name.rfind(p, 0) == 0;
         });
}

/// "a, b, c and 4 more"
std::string some(const std::vector<std::string>& v, size_t shown = 6) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < shown; ++i) s += (i ? ", " : "") + v[i];
  if (v.size() > shown) s += " and " + std::to_string(v.size() - shown) + " more";
  return s;
}

}  // namespace

std::string InitReport::summary() const {
  std::string s = std::to_string(loaded.size()) + " tensor(s) loaded from " + file;
  if (!missing.empty()) s += "; not in the file (fresh values kept): " + some(missing);
  if (!misshaped.empty()) s += "; of another shape (fresh values kept): " + some(misshaped, 3);
  if (!unexpected.empty()) s += "; in the file but not in the model (ignored): " + some(unexpected);
  return s;
}

std::string weights_file(const std::string& from) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(from, ec)) {
    for (const char* name : {"model.safetensors", "model.safetensors.index.json"}) {
      const std::string in = (fs::path(from) / name).string();
      if (fs::is_regular_file(in, ec)) return in;
    }
    throw CheckpointError("'" + from + "' is a folder without a model.safetensors or a "
                          "model.safetensors.index.json (a finished run writes the first)");
  }
  if (!fs::is_regular_file(from, ec))
    throw CheckpointError("'" + from + "': no such file or run folder");
  if (fs::path(from).extension() != ".safetensors")
    throw CheckpointError("'" + from + "' is not a .safetensors file: give a run's "
                          "model.safetensors or its folder");
  return from;
}

namespace {
/// A sharded checkpoint: {"weight_map": {tensor: shard file}} beside its shards.
std::map<std::string, torch::Tensor> read_sharded(const std::string& index) {
  std::ifstream in(index);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw CheckpointError("'" + index + "' is not a safetensors index (no \"weight_map\" object)");
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
      throw CheckpointError("'" + index + "': tensor '" + name + "' names no shard file beside the index");
    shard_of[name] = file.get<std::string>();
  }
  std::map<std::string, std::map<std::string, torch::Tensor>> shards;
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, file] : shard_of) {
    if (!shards.count(file))
      shards[file] = safetensors::read((std::filesystem::path(index).parent_path() / file).string());
    auto it = shards[file].find(name);
    if (it == shards[file].end())
      throw CheckpointError("'" + index + "' puts tensor '" + name + "' in " + file + ", which does not hold it");
    out[name] = it->second;
  }
  return out;
}
}  // namespace

std::map<std::string, torch::Tensor> read_weights(const std::string& from) {
  const std::string file = weights_file(from);
  const std::string suffix = ".index.json";
  if (file.size() > suffix.size() && file.compare(file.size() - suffix.size(), suffix.size(), suffix) == 0)
    return read_sharded(file);
  return safetensors::read(file);
}

namespace {
/// The file's tensors under the model's names (names->from_file); a name two file tensors give
/// (a tied head beside its embedding) keeps one, when they are equal.
std::map<std::string, torch::Tensor> by_model_names(std::map<std::string, torch::Tensor> file,
                                                    const std::optional<WeightNames>& names,
                                                    const std::string& path) {
  if (!names) return file;
  std::map<std::string, torch::Tensor> out;
  std::map<std::string, std::string> first;  // model name -> the file name that gave it
  for (auto& [file_name, t] : file) {
    const std::string name = names->from_file(file_name);
    if (name.empty()) continue;  // held by design elsewhere (an attention mask)
    auto [it, fresh] = out.emplace(name, t);
    if (fresh) first[name] = file_name;
    else if (!(it->second.sizes().equals(t.sizes()) && torch::equal(it->second.to(torch::kFloat), t.to(torch::kFloat))))
      throw_config_error("'" + path + "': '" + first[name] + "' and '" + file_name + "' differ, and both are the "
                         "model's '" + name + "' (a head that is not tied to its embedding?)");
  }
  return out;
}
}  // namespace

InitReport init_weights(torch::nn::Module& model, const std::string& from, bool strict,
                        const std::vector<std::string>& prefixes, const std::optional<WeightNames>& names) {
  InitReport r;
  r.file = weights_file(from);
  const std::map<std::string, torch::Tensor> file = by_model_names(read_weights(from), names, r.file);
  std::map<std::string, torch::Tensor> own;
  for (const auto& [name, t] : safetensors::state_dict(model))
    if (under(name, prefixes)) own.emplace(name, t);
  for (const auto& [name, t] : own) {
    auto it = file.find(name);
    if (it == file.end())
      r.missing.push_back(name);
    else if (!it->second.sizes().equals(t.sizes()))
      r.misshaped.push_back(name + ": file " + shape_of(it->second) + ", model " + shape_of(t));
    else
      r.loaded.push_back(name);
  }
  for (const auto& [name, t] : file)
    if (under(name, prefixes) && !own.count(name)) r.unexpected.push_back(name);
  if (strict && (!r.missing.empty() || !r.misshaped.empty() || !r.unexpected.empty())) {
    std::string why;
    if (!r.missing.empty()) why += "\n  missing from the file: " + some(r.missing, 10);
    if (!r.misshaped.empty()) why += "\n  of another shape: " + some(r.misshaped, 10);
    if (!r.unexpected.empty()) why += "\n  in the file, not in the model: " + some(r.unexpected, 10);
    throw_config_error("'" + r.file + "' does not match the model" + why +
                       "\nSet model.init_strict = false to load what matches (the rest keeps its "
                       "fresh values), or model.init_prefixes to load some blocks only");
  }
  if (r.loaded.empty())
    throw_config_error("'" + r.file + "' holds none of the model's tensors" +
                       (prefixes.empty() ? std::string() : " under model.init_prefixes") +
                       ": is it another model's?");
  torch::NoGradGuard no_grad;
  for (const auto& name : r.loaded) {
    torch::Tensor& t = own.at(name);
    t.copy_(file.at(name).to(t.device(), t.scalar_type()));
  }
  return r;
}

}  // namespace frugal
