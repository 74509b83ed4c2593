#pragma once
/// frugal's one error hierarchy. Every error names the culprit (file:line:column, key, plugin,
/// callback and event), what was allowed, what was received and, where possible, how to fix it.
///
/// The classes' key functions live in libfrugal, so their type_info belongs to the host:
/// an error thrown by a plugin never pins the plugin's library (the lifetime rules in plugin.h).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace frugal {

/// Messages longer than this are shortened (their start and end kept).
inline constexpr size_t kMaxMessageBytes = 8192;
/// `s` as an error message can carry it: control bytes other than newline and tab written as
/// \xNN (a NUL would end what()), and past kMaxMessageBytes the middle left out.
std::string readable_message(const std::string& s);

class Error : public std::runtime_error {
 public:
  /// The message passes through readable_message.
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
  /// Where the fit ran out of memory.
  enum class Phase {
    Start,     ///< before the first batch: the budget is below what the learner already holds
    Load,      ///< loading a training batch
    Forward,   ///< a micro-batch's forward and loss (no gradient touched)
    Backward,  ///< a micro-batch's backward (gradients may hold part of it)
    Step,      ///< the optimizer step (parameters may be partly updated)
    Event,     ///< a callback's hook, or validation
    Probe,     ///< run.micro_batch = "auto": not even one sample fits
  };
  OomError(const std::string& what, Phase phase, int64_t iteration);
  ~OomError() override;
  Phase phase() const { return phase_; }
  /// The fit's training batch (Learner::iteration()) that ran out of memory.
  int64_t iteration() const { return iteration_; }

 private:
  Phase phase_;
  int64_t iteration_;
};
/// "start", "load", "forward", "backward", "step", "event", "probe".
std::string_view to_string(OomError::Phase p);

[[noreturn]] void throw_config_error(const std::string& msg);
[[noreturn]] void throw_data_error(const std::string& msg);
[[noreturn]] void throw_usage_error(const std::string& msg);

/// The first line of an error message (LibTorch appends backtraces and hints after it).
std::string first_line(const std::string& s);

}  // namespace frugal
