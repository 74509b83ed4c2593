// The TOML config loader with --set overrides: parse_config(text, source, overrides).
//
// Input: the TOML text, then optionally a line "#--set" and one override ("key=value") per
// line (the TOML text stays valid TOML: the marker is a comment). Documented outcomes: a
// Config, or a ConfigError. A Config's resolved text (what `frugal train` writes) must parse
// back to the same keys and values. Anything else is a finding.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "frugal/base/error.h"
#include "frugal/config/config.h"
#include "fuzz_support.h"

namespace {

const std::string kSetMarker = "\n#--set\n";

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t nl = s.find('\n', at);
    out.push_back(s.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  return out;
}

/// The text as toml++ writes the table it holds: the same keys and values give the same text
/// (0.90000000000000002 and 0.9 are one double).
std::string normalized(const std::string& toml_text) {
  std::ostringstream out;
  out << toml::parse(toml_text);
  return out.str();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace frugal;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find(kSetMarker);
  const std::string text = input.substr(0, cut);
  std::vector<std::string> sets;
  if (cut != std::string::npos) sets = lines(input.substr(cut + kSetMarker.size()));
  std::string resolved;
  try {
    resolved = parse_config(text, "fuzz.toml", sets).to_toml();
  } catch (const ConfigError&) {
    return 0;
  }
  try {
    const std::string again = parse_config(resolved, "resolved.toml").to_toml();
    if (normalized(again) != normalized(resolved))
      fuzz::finding("the resolved config changes when read back:\n" + resolved + "\n--- became ---\n" + again);
  } catch (const ConfigError& e) {
    fuzz::finding(std::string("the resolved config is refused: ") + e.what() + "\n" + resolved);
  }
  return 0;
}
