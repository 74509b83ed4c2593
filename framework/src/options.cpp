// Options: the limits' wording, the JSON describer and writer, and "did you mean" helpers.
#include "frugal/options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
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

  void field(const char* key, bool& v, const char* help) override {
    add(key, "bool", v, help, "true or false");
  }
  void field(const char* key, int64_t& v, const char* help, Limits l) override {
    add(key, "int", v, help, l.describe(true));
  }
  void field(const char* key, double& v, const char* help, Limits l) override {
    add(key, "float", v, help, l.describe(false));
  }
  void field(const char* key, std::string& v, const char* help,
             const std::vector<std::string>& choices) override {
    add(key, "string", v, help, choices.empty() ? "any string" : "one of " + join(choices, ", "));
  }
  void field(const char* key, std::vector<std::string>& v, const char* help) override {
    add(key, "string[]", v, help, "a list of strings");
  }
  void table(const char* key, Options& sub, const char* help, bool*) override {
    nlohmann::json fields = nlohmann::json::array();
    Describer inner(fields);
    sub.visit(inner);
    out_.push_back({{"key", key}, {"type", "table"}, {"help", help}, {"fields", fields}});
  }

 private:
  template <class T>
  void add(const char* key, const char* type, const T& v, const char* help, std::string allowed) {
    out_.push_back({{"key", key},
                    {"type", type},
                    {"default", v},
                    {"help", help},
                    {"allowed", std::move(allowed)}});
  }
  nlohmann::json& out_;
};

/// {key: value}, nested tables as objects; a table whose `present` flag is false is left out.
class JsonWriter : public FieldVisitor {
 public:
  explicit JsonWriter(nlohmann::json& out) : out_(out) {}
  void field(const char* key, bool& v, const char*) override { out_[key] = v; }
  void field(const char* key, int64_t& v, const char*, Limits) override { out_[key] = v; }
  void field(const char* key, double& v, const char*, Limits) override { out_[key] = v; }
  void field(const char* key, std::string& v, const char*,
             const std::vector<std::string>&) override {
    out_[key] = v;
  }
  void field(const char* key, std::vector<std::string>& v, const char*) override { out_[key] = v; }
  void table(const char* key, Options& sub, const char*, bool* present) override {
    if (present && !*present) return;  // as Config::to_toml: a stage's own optimizer only
    nlohmann::json inner = nlohmann::json::object();
    JsonWriter w(inner);
    sub.visit(w);
    out_[key] = std::move(inner);
  }

 private:
  nlohmann::json& out_;
};

}  // namespace

std::string Limits::describe(bool integer) const {
  std::string noun = integer ? "an integer" : "a number";
  const bool has_min = std::isfinite(min), has_max = std::isfinite(max);
  if (has_min && has_max)
    return noun + " in " + (min_exclusive ? "(" : "[") + format_number(min) + ", " +
           format_number(max) + (max_exclusive ? ")" : "]");
  if (has_min) return noun + (min_exclusive ? " > " : " >= ") + format_number(min);
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
