// A model's starting weights from a safetensors file: matched by name, checked by shape.
#include "frugal/io/weights.h"

#include <algorithm>
#include <filesystem>
#include <map>

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
    const std::string in_run = (fs::path(from) / "model.safetensors").string();
    if (fs::is_regular_file(in_run, ec)) return in_run;
    throw CheckpointError("'" + from + "' is a folder without a model.safetensors (a finished "
                          "run writes one)");
  }
  if (!fs::is_regular_file(from, ec))
    throw CheckpointError("'" + from + "': no such file or run folder");
  if (fs::path(from).extension() != ".safetensors")
    throw CheckpointError("'" + from + "' is not a .safetensors file: give a run's "
                          "model.safetensors or its folder");
  return from;
}

InitReport init_weights(torch::nn::Module& model, const std::string& from, bool strict,
                        const std::vector<std::string>& prefixes) {
  InitReport r;
  r.file = weights_file(from);
  const std::map<std::string, torch::Tensor> file = safetensors::read(r.file);
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
