#include "frugal/base/error.h"

#include <algorithm>

namespace frugal {

std::string readable_message(const std::string& s) {
  // what() is a C string: a NUL would end the message where it stands (a key "a\0b" named as
  // "a"), and other control bytes garble a terminal.
  std::string out;
  out.reserve(std::min(s.size(), kMaxMessageBytes) + 16);
  const auto append = [&](size_t from, size_t to) {
    static const char* const hex = "0123456789abcdef";
    for (size_t i = from; i < to; ++i) {
      const auto c = static_cast<unsigned char>(s[i]);
      if (c >= 0x20 || c == '\n' || c == '\t' || c == 0x1b) {  // ESC: spdlog's colours
        out += s[i];
      } else {
        out += "\\x";
        out += hex[c >> 4];
        out += hex[c & 15];
      }
    }
  };
  if (s.size() <= kMaxMessageBytes) {
    append(0, s.size());
    return out;
  }
  // A 10 MB value quoted in a message: its start and the message's end (the fix) are kept.
  const size_t head = kMaxMessageBytes / 2, tail = kMaxMessageBytes / 4;
  append(0, head);
  out += " [... " + std::to_string(s.size() - head - tail) + " bytes left out ...] ";
  append(s.size() - tail, s.size());
  return out;
}

Error::Error(const std::string& what) : std::runtime_error(readable_message(what)) {}
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
