#pragma once
/// frugal's one error hierarchy. Every error names the culprit (file:line:column, key, plugin,
/// callback and event), what was allowed, what was received and, where possible, how to fix it.
///
/// The classes' key functions live in libfrugal, so their type_info belongs to the host:
/// an error thrown by a plugin never pins the plugin's library (the lifetime rules in plugin.h).
#include <stdexcept>
#include <string>

namespace frugal {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what);
  ~Error() override;
};

/// Bad configuration: TOML syntax, unknown key, wrong type, value out of range.
class ConfigError : public Error {
 public:
  using Error::Error;
  ~ConfigError() override;
};

/// Missing or corrupt data files (IDX), impossible data shapes.
class DataError : public Error {
 public:
  using Error::Error;
  ~DataError() override;
};

/// Unreadable, truncated or foreign checkpoint files.
class CheckpointError : public Error {
 public:
  using Error::Error;
  ~CheckpointError() override;
};

/// Plugin discovery, loading, ABI and option errors.
class PluginError : public Error {
 public:
  using Error::Error;
  ~PluginError() override;
};

/// An exception escaped a callback: names the callback and the event.
class CallbackError : public Error {
 public:
  CallbackError(std::string callback, std::string event, const std::string& reason);
  ~CallbackError() override;
  const std::string& callback() const { return callback_; }
  const std::string& event() const { return event_; }
  /// The original message, without the "callback X failed in event Y" prefix.
  const std::string& reason() const { return reason_; }

 private:
  std::string callback_, event_, reason_;
};

/// Misuse of the API (e.g. using a destroyed Learner).
class UsageError : public Error {
 public:
  using Error::Error;
  ~UsageError() override;
};

/// Training ran out of memory and could not go on: on_oom = "fail", or on_oom = "retry" after
/// run.oom_retries failures on one batch or at micro-batch size 1. Names the budget, the
/// micro-batch tried and the allocation refused.
class OomError : public Error {
 public:
  using Error::Error;
  ~OomError() override;
};

[[noreturn]] void throw_config_error(const std::string& msg);
[[noreturn]] void throw_data_error(const std::string& msg);
[[noreturn]] void throw_usage_error(const std::string& msg);

}  // namespace frugal
