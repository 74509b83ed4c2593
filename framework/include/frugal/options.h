#pragma once
/// Typed options with their defaults in one place (the member initializers) and their
/// checks in one place (visit). Readers, writers and describers are FieldVisitors, so the
/// TOML loader, the resolved-config writer and `frugal plugins` all walk the same fields.
///
///   struct StepOptions : Options {
///     int64_t steps = 4;  ///< default 4
///     void visit(FieldVisitor& v) override { v.field("steps", steps, "micro-batches", at_least(1)); }
///   };
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace frugal {

/// Numeric limits of an int or float field; inclusive unless marked exclusive.
struct Limits {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  bool max_exclusive = false;  ///< [min, max): dropout, betas, label smoothing
  bool contains(double v) const {
    return (min_exclusive ? v > min : v >= min) && (max_exclusive ? v < max : v <= max);
  }
  /// "an integer >= 1", "a number in [0, 1]", "a number > 0"
  std::string describe(bool integer) const;
};
inline Limits any_value() { return {}; }
inline Limits at_least(double m) { return {m, std::numeric_limits<double>::infinity(), false}; }
inline Limits positive() { return {0.0, std::numeric_limits<double>::infinity(), true}; }
inline Limits between(double a, double b) { return {a, b, false}; }
/// [a, b): b itself is not allowed.
inline Limits half_open(double a, double b) { return {a, b, false, true}; }

class Options;

/// Walks the fields of an Options struct. Implemented by the host (libfrugal); plugins only
/// call it from their visit().
class FieldVisitor {
 public:
  virtual ~FieldVisitor();
  virtual void field(const char* key, bool& v, const char* help) = 0;
  virtual void field(const char* key, int64_t& v, const char* help, Limits l = {}) = 0;
  virtual void field(const char* key, double& v, const char* help, Limits l = {}) = 0;
  /// `choices` empty: any string.
  virtual void field(const char* key, std::string& v, const char* help,
                     const std::vector<std::string>& choices = {}) = 0;
  virtual void field(const char* key, std::vector<std::string>& v, const char* help) = 0;
  /// A nested table. `present` is set when the TOML has it (may be null).
  virtual void table(const char* key, Options& sub, const char* help, bool* present = nullptr) = 0;
};

class Options {
 public:
  virtual ~Options();
  /// Visits every field: key, reference, help text, limits or choices.
  virtual void visit(FieldVisitor& v) = 0;
  /// Checks that involve several fields; throw frugal::ConfigError naming the key. The reader
  /// adds the file and table to the message.
  virtual void check() const {}
};

/// The fields of `o` as JSON: [{key, type, default, help, allowed}], for `frugal plugins`
/// and the README. Reads the current values as defaults.
nlohmann::json describe_options(Options& o);
/// The current values of `o` as a JSON object (nested tables as objects).
nlohmann::json options_to_json(Options& o);

/// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);
/// The candidate nearest to `word`, or "" if none is close (distance > max(2, |word|/3)).
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace frugal
