#pragma once
/// Assembles a Learner from a Config: the same path for `frugal train`, `frugal check`
/// and the C++ API.
#include <memory>

#include "frugal/config.h"
#include "frugal/learner.h"

namespace frugal {

/// The device `run.device` names: "auto" is CUDA when this build and machine have it.
torch::Device resolve_device(const std::string& device);

/// Checks what the config names against the registries (dataset, model, loss) and that the
/// model can be built for the stages' image sizes, without loading data. Throws ConfigError
/// naming the file and key.
void check_config(const Config& c);

/// Loads the data, builds the model, loss and optimizer: a Learner ready to fit(c.stages).
/// Seeds LibTorch with run.seed and sets run.threads first.
std::unique_ptr<Learner> make_learner(const Config& c);

}  // namespace frugal
