// Options: the limits' wording, byte sizes, the JSON describer and writer, the keys marked
// outside training, and "did you mean" helpers.
#include "frugal/base/options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace frugal {

FieldVisitor::~FieldVisitor() = default;
Options::~Options() = default;

namespace {

/// The shortest text that reads back as `v`: "1", "0.5", "1e-08".
std::string format_number(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

/// [{key, type, default, help, allowed}], nested tables as {key, type: "table", fields}.
class Describer : public FieldVisitor {
 public:
  explicit Describer(nlohmann::json& out) : out_(out) {}

  void field(const char* key, bool& v, Help help) override {
    add(key, "bool", v, help, "true or false");
  }
  void field(const char* key, int64_t& v, Help help, Limits l) override {
    if (l.or_auto && v == Limits::kAuto)
      add(key, "int", "auto", help, l.describe(true));
    else
      add(key, "int", v, help, l.describe(true));
  }
  void field(const char* key, double& v, Help help, Limits l) override {
    add(key, "float", v, help, l.describe(false));
  }
  void field(const char* key, std::string& v, Help help,
             const std::vector<std::string>& choices) override {
    add(key, "string", v, help, choices.empty() ? "any string" : "one of " + join(choices, ", "));
  }
  void field(const char* key, std::vector<std::string>& v, Help help) override {
    add(key, "string[]", v, help, "a list of strings");
  }
  void field(const char* key, ByteSize& v, Help help) override {
    add(key, "bytes", v.str(), help,
        "a size: \"512MiB\", \"1.5GB\" or an integer of bytes; \"\" or 0 = none");
  }
  void table(const char* key, Options& sub, Help help, bool*) override {
    nlohmann::json fields = nlohmann::json::array();
    Describer inner(fields);
    sub.visit(inner);
    out_.push_back({{"key", key}, {"type", "table"}, {"help", help.text}, {"fields", fields}});
  }

 private:
  template <class T>
  void add(const char* key, const char* type, const T& v, Help help, std::string allowed) {
    nlohmann::json f = {{"key", key},
                        {"type", type},
                        {"default", v},
                        {"help", help.text},
                        {"allowed", std::move(allowed)}};
    if (!help.affects_training) f["affects_training"] = false;
    out_.push_back(std::move(f));
  }
  nlohmann::json& out_;
};

/// {key: value}, nested tables as objects; a table whose `present` flag is false is left out.
class JsonWriter : public FieldVisitor {
 public:
  explicit JsonWriter(nlohmann::json& out) : out_(out) {}
  void field(const char* key, bool& v, Help) override { out_[key] = v; }
  void field(const char* key, int64_t& v, Help, Limits l) override {
    if (l.or_auto && v == Limits::kAuto)
      out_[key] = "auto";
    else
      out_[key] = v;
  }
  void field(const char* key, double& v, Help, Limits) override { out_[key] = v; }
  void field(const char* key, std::string& v, Help, const std::vector<std::string>&) override {
    out_[key] = v;
  }
  void field(const char* key, std::vector<std::string>& v, Help) override { out_[key] = v; }
  void field(const char* key, ByteSize& v, Help) override { out_[key] = v.str(); }
  void table(const char* key, Options& sub, Help, bool* present) override {
    if (present && !*present) return;  // as Config::to_toml: a stage's own optimizer only
    nlohmann::json inner = nlohmann::json::object();
    JsonWriter w(inner);
    sub.visit(w);
    out_[key] = std::move(inner);
  }

 private:
  nlohmann::json& out_;
};

/// The dotted keys of the fields marked outside training.
class TrainingMarks : public FieldVisitor {
 public:
  TrainingMarks(std::vector<std::string>& out, std::string prefix)
      : out_(out), prefix_(std::move(prefix)) {}
  void field(const char* key, bool&, Help h) override { add(key, h); }
  void field(const char* key, int64_t&, Help h, Limits) override { add(key, h); }
  void field(const char* key, double&, Help h, Limits) override { add(key, h); }
  void field(const char* key, std::string&, Help h, const std::vector<std::string>&) override {
    add(key, h);
  }
  void field(const char* key, std::vector<std::string>&, Help h) override { add(key, h); }
  void field(const char* key, ByteSize&, Help h) override { add(key, h); }
  void table(const char* key, Options& sub, Help, bool*) override {
    TrainingMarks inner(out_, dotted(key));
    sub.visit(inner);
  }

 private:
  std::string dotted(const char* key) const { return prefix_.empty() ? key : prefix_ + "." + key; }
  void add(const char* key, Help h) {
    if (!h.affects_training) out_.push_back(dotted(key));
  }
  std::vector<std::string>& out_;
  std::string prefix_;
};

/// The units ByteSize reads, lower case, with their factors.
constexpr std::pair<const char*, double> kByteUnits[] = {
    {"", 1},          {"b", 1},           {"kb", 1e3},           {"mb", 1e6},
    {"gb", 1e9},      {"tb", 1e12},       {"kib", 1024.0},       {"mib", 1048576.0},
    {"gib", 1073741824.0}, {"tib", 1099511627776.0}, {"k", 1024.0}, {"m", 1048576.0},
    {"g", 1073741824.0}};

}  // namespace

std::string Limits::describe(bool integer) const {
  std::string noun = integer ? "an integer" : "a number";
  const bool has_min = std::isfinite(min), has_max = std::isfinite(max);
  if (has_min && has_max)
    return noun + " in " + (min_exclusive ? "(" : "[") + format_number(min) + ", " +
           format_number(max) + (max_exclusive ? ")" : "]");
  if (has_min)
    return noun + (min_exclusive ? " > " : " >= ") + format_number(min) + (or_auto ? " or \"auto\"" : "");
  if (has_max) return noun + (max_exclusive ? " < " : " <= ") + format_number(max);
  return noun;
}

nlohmann::json describe_options(Options& o) {
  nlohmann::json out = nlohmann::json::array();
  Describer d(out);
  o.visit(d);
  return out;
}

nlohmann::json options_to_json(Options& o) {
  nlohmann::json out = nlohmann::json::object();
  JsonWriter w(out);
  o.visit(w);
  return out;
}

std::vector<std::string> keys_outside_training(Options& o, const std::string& prefix) {
  std::vector<std::string> out;
  TrainingMarks marks(out, prefix);
  o.visit(marks);
  return out;
}

bool ByteSize::parse(const std::string& text, int64_t& bytes, std::string& why) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  if (s.empty()) {
    bytes = 0;
    return true;
  }
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(s, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos == 0 || value < 0 || !std::isfinite(value)) {
    why = "must be a size such as \"512MiB\" or \"2GiB\", got \"" + text + "\"";
    return false;
  }
  std::string unit = s.substr(pos);
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const auto& [name, factor] : kByteUnits)
    if (unit == name) {
      // 2^63 bytes and more do not fit an int64_t (llround would give INT64_MIN).
      if (value * static_cast<double>(factor) >= 9.2e18) {
        why = "is too large: \"" + text + "\" is more than 8 EiB";
        return false;
      }
      bytes = static_cast<int64_t>(std::llround(value * factor));
      return true;
    }
  why = "has an unknown unit \"" + unit + "\"; use B, KiB, MiB, GiB, TiB (or kB, MB, GB, TB)";
  return false;
}

std::string ByteSize::str() const {
  if (bytes == 0) return "";
  static const std::pair<const char*, int64_t> units[] = {
      {"TiB", int64_t{1} << 40}, {"GiB", int64_t{1} << 30}, {"MiB", int64_t{1} << 20},
      {"KiB", int64_t{1} << 10}};
  for (const auto& [name, factor] : units)
    if (bytes % factor == 0) return std::to_string(bytes / factor) + name;
  return std::to_string(bytes) + "B";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  // One row of the Levenshtein table at a time.
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  return best;
}

}  // namespace frugal
