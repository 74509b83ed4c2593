#pragma once
// Captures what the loggers write while it lives: plugin loggers share the default logger's
// sinks (plugin_host.cpp's make_logger), so a plugin's log lines show up in text().
#include <memory>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

namespace frugal::test {

/// Makes the default logger write into a string while it lives ("name: message" lines).
class LogCapture {
 public:
  LogCapture() : old_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    sink->set_pattern("%n: %v");
    auto log = std::make_shared<spdlog::logger>("capture", sink);
    log->set_level(spdlog::level::debug);
    spdlog::set_default_logger(log);
  }
  ~LogCapture() { spdlog::set_default_logger(old_); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> old_;
};

/// `text` contains `part` (prints both when not).
inline ::testing::AssertionResult Has(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << part << "' not in:\n" << text;
}

}  // namespace frugal::test
