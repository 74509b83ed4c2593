#include "frugal/run.h"

#include <set>

#include "frugal/error.h"
#include "frugal/registry.h"

namespace frugal {

namespace {

// Prefixes a registry's error with the file and key it came from.
template <class F>
auto named(const Config& c, const std::string& key, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ConfigError& e) {
    throw ConfigError(c.source + ": " + key + ": " + e.what());
  }
}

ModelInput model_input(const Config& c, const Dataset* data) {
  ModelInput in;
  in.channels = data ? data->channels() : c.data.channels;
  const int64_t native = data ? data->height() : c.data.image_size;
  in.num_classes = data ? data->num_classes : c.data.classes;
  std::set<int64_t> sizes;
  for (const auto& s : c.stages) sizes.insert(s.image_size ? s.image_size : native);
  in.image_sizes.assign(sizes.begin(), sizes.end());
  in.image_size = in.image_sizes.empty() ? native : in.image_sizes.back();
  return in;
}

}  // namespace

torch::Device resolve_device(const std::string& device) {
  if (device == "cpu") return torch::kCPU;
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda") {
#ifndef FRUGAL_WITH_CUDA
    throw_config_error("run.device = \"cuda\", but this frugal was built with a LibTorch without "
                       "CUDA; build against a CUDA LibTorch (CMAKE_PREFIX_PATH) or use \"cpu\"");
#endif
    if (!cuda) throw_config_error("run.device = \"cuda\", but no CUDA device is available");
    return torch::Device(torch::kCUDA, 0);
  }
#ifdef FRUGAL_WITH_CUDA
  if (cuda) return torch::Device(torch::kCUDA, 0);
#endif
  (void)cuda;
  return torch::kCPU;
}

void check_config(const Config& c) {
  named(c, "data.dataset", [&] { return datasets().get(c.data.dataset); });
  named(c, "loss.name", [&] { return losses().get(c.loss.name); });
  named(c, "model.arch", [&] { return models().get(c.model.arch); });
  if (c.data.dataset == "synthetic") {
    // Cheap to build the model for the configured shape: catches e.g. a vit patch that does
    // not divide the image size before any data is loaded.
    torch::NoGradGuard g;
    named(c, "model", [&] { return make_model(c.model, model_input(c, nullptr)); });
  }
  if (c.data.dataset == "fashion-mnist") {
    try {
      check_fashion_mnist(c.data.path);
    } catch (const DataError& e) {
      throw ConfigError(c.source + ": data.path: " + e.what());
    }
  }
  resolve_device(c.run.device);
}

std::unique_ptr<Learner> make_learner(const Config& c) {
  check_config(c);
  if (c.run.threads > 0) torch::set_num_threads(static_cast<int>(c.run.threads));
  torch::manual_seed(static_cast<uint64_t>(c.run.seed));
  const torch::Device device = resolve_device(c.run.device);
  MemoryMeter::get().set_device(device);

  Dataset train = make_dataset(c.data, true);
  std::optional<DataLoader> valid;
  if (c.data.valid_samples >= 0)
    valid.emplace(make_dataset(c.data, false), c.data.valid_batch_size, false, 0, device);
  auto model = named(c, "model", [&] { return make_model(c.model, model_input(c, &train)); });
  LossFn loss = make_loss(c.loss);
  DataLoader train_loader(std::move(train), c.data.batch_size, c.data.shuffle,
                          static_cast<uint64_t>(c.run.seed), device);
  auto learner = std::make_unique<Learner>(std::move(model), std::move(train_loader),
                                           std::move(valid), c.optimizer, std::move(loss), device);
  learner->set_max_batches(c.run.max_steps);
  OomPolicy oom;
  oom.budget = c.run.memory_budget_bytes();
  oom.retry = c.run.on_oom == "retry";
  oom.max_retries = c.run.oom_retries;
  oom.auto_micro_batch = c.run.micro_batch == "auto";
  learner->set_oom_policy(oom);
  return learner;
}

}  // namespace frugal
