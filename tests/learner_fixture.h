#pragma once
// A tiny learner on synthetic data, for tests that drive the real loop through real events.
#include <memory>
#include <string>
#include <vector>

#include "frugal/frugal.h"
#include "support.h"

namespace frugal::test {

struct TinySetup {
  int64_t samples = 64;
  int64_t batch_size = 16;
  int64_t image_size = 8;
  int64_t classes = 4;
  int64_t valid_samples = 32;
  std::string arch = "mlp";
  int64_t width = 16;
  int64_t depth = 1;
  double dropout = 0.0;
  std::string optimizer = "adam";
  double lr = 1e-2;
  bool shuffle = true;
  uint64_t seed = 0;
};

/// For exactness tests: an MLP without batch-dependent layers, plain SGD, data in order, no
/// validation.
inline TinySetup exact_setup(int64_t samples, int64_t batch, double lr) {
  TinySetup s;
  s.samples = samples;
  s.batch_size = batch;
  s.valid_samples = 0;
  s.shuffle = false;
  s.depth = 2;
  s.optimizer = "sgd";
  s.lr = lr;
  return s;
}

inline std::unique_ptr<Learner> make_tiny_learner(const TinySetup& s = {}) {
  torch::manual_seed(s.seed);
  Dataset train = make_synthetic(s.samples, 1, s.image_size, s.image_size, s.classes, 1);
  std::optional<DataLoader> valid;
  if (s.valid_samples > 0)
    valid.emplace(make_synthetic(s.valid_samples, 1, s.image_size, s.image_size, s.classes, 2),
                  s.valid_samples, false, 0);
  ModelOptions mo;
  mo.arch = s.arch;
  mo.width = s.width;
  mo.depth = s.depth;
  mo.dropout = s.dropout;
  ModelInput in;
  in.channels = 1;
  in.image_size = s.image_size;
  in.num_classes = s.classes;
  in.image_sizes = {s.image_size};
  OptimizerOptions oo;
  oo.name = s.optimizer;
  oo.lr = s.lr;
  return std::make_unique<Learner>(make_model(mo, in),
                                   DataLoader(std::move(train), s.batch_size, s.shuffle, s.seed),
                                   std::move(valid), oo, make_loss(LossOptions{}));
}

/// The [plugins] table of a TOML text, moved out so its positions stay (errors show
/// line:column; toml++ drops them on copy).
inline toml::table plugins_of(const std::string& text, const std::string& source = "cfg.toml") {
  toml::table root = toml::parse(text, source);
  toml::table* p = root["plugins"].as_table();
  return p ? std::move(*p) : toml::table{};
}

inline Stage make_stage(const std::string& name, int64_t epochs,
                        std::vector<std::string> freeze = {}) {
  Stage s;
  s.name = name;
  s.epochs = epochs;
  s.freeze = std::move(freeze);
  return s;
}

inline std::vector<torch::Tensor> clone_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

inline bool params_equal(torch::nn::Module& m, const std::vector<torch::Tensor>& ref) {
  auto ps = m.parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    if (!torch::equal(ps[i].detach(), ref[i])) return false;
  return true;
}

/// A zoo model (mlp, cnn, resnet, vit) for 1-channel `image` x `image` inputs and 4 classes,
/// its weights drawn after torch::manual_seed(seed).
inline torch::nn::Sequential make_zoo_model(const std::string& arch, int64_t depth, int64_t width,
                                            double dropout, uint64_t seed = 0, int64_t image = 8) {
  torch::manual_seed(seed);
  ModelOptions mo;
  mo.arch = arch;
  mo.depth = depth;
  mo.width = width;
  mo.dropout = dropout;
  ModelInput in;
  in.channels = 1;
  in.image_size = image;
  in.num_classes = 4;
  in.image_sizes = {image};
  return make_model(mo, in);
}

/// Learner::find_micro_batch under the meter's budget, or 0 when nothing fits (its OomError) or
/// not even the batch can be made (the allocator's refusal, a c10::Error).
inline int64_t micro_batch_that_fits(Learner& l) {
  try {
    return l.find_micro_batch();
  } catch (const OomError&) {
    return 0;
  } catch (const c10::Error&) {
    return 0;
  }
}

}  // namespace frugal::test
