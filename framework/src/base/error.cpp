#include "frugal/base/error.h"

namespace frugal {

Error::Error(const std::string& what) : std::runtime_error(what) {}
Error::~Error() = default;
ConfigError::~ConfigError() = default;
DataError::~DataError() = default;
CheckpointError::~CheckpointError() = default;
PluginError::~PluginError() = default;
UsageError::~UsageError() = default;

OomError::OomError(const std::string& what, Phase phase, int64_t iteration)
    : Error(what), phase_(phase), iteration_(iteration) {}
OomError::~OomError() = default;

std::string_view to_string(OomError::Phase p) {
  switch (p) {
    case OomError::Phase::Start: return "start";
    case OomError::Phase::Load: return "load";
    case OomError::Phase::Forward: return "forward";
    case OomError::Phase::Backward: return "backward";
    case OomError::Phase::Step: return "step";
    case OomError::Phase::Event: return "event";
    case OomError::Phase::Probe: return "probe";
  }
  return "unknown";
}

CallbackError::CallbackError(std::string callback, std::string event, const std::string& reason)
    : Error("callback '" + callback + "' failed in event '" + event + "': " + reason),
      callback_(std::move(callback)),
      event_(std::move(event)),
      reason_(reason) {}
CallbackError::~CallbackError() = default;

void throw_config_error(const std::string& msg) { throw ConfigError(msg); }
void throw_data_error(const std::string& msg) { throw DataError(msg); }
void throw_usage_error(const std::string& msg) { throw UsageError(msg); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace frugal
