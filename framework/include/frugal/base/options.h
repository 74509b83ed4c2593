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
  /// An integer field that also takes the string "auto", read as kAuto (run.threads).
  bool or_auto = false;
  static constexpr int64_t kAuto = -1;
  bool contains(double v) const {
    return (min_exclusive ? v > min : v >= min) && (max_exclusive ? v < max : v <= max);
  }
  /// "an integer >= 1", "a number in [0, 1]", "a number > 0"
  std::string describe(bool integer) const;
};
inline Limits any_value() { return {}; }
inline Limits at_least(double m) { return {m, std::numeric_limits<double>::infinity(), false}; }
inline Limits at_least_or_auto(double m) {
  Limits l = at_least(m);
  l.or_auto = true;
  return l;
}
inline Limits positive() { return {0.0, std::numeric_limits<double>::infinity(), true}; }
inline Limits between(double a, double b) { return {a, b, false}; }
/// [a, b): b itself is not allowed.
inline Limits half_open(double a, double b) { return {a, b, false, true}; }

/// A size in bytes. In TOML a string with a unit ("512MiB", "1.5GB", "2GiB", "1000B") or an
/// integer of bytes; "" or 0 = none. Read once, by the reader, with the value's file:line:column
/// in errors; written back as the shortest exact text ("2560KiB", "" for 0).
struct ByteSize {
  int64_t bytes = 0;
  /// Parses "512MiB", "1.5GB", "2GiB", "1000" (bytes), "" (0). False, with the reason in
  /// `why` ("must be a size such as ...", "has an unknown unit ..."), when it cannot.
  static bool parse(const std::string& text, int64_t& bytes, std::string& why);
  /// "" for 0, else the largest binary unit that divides it ("64MiB", "2560KiB", "1000B").
  std::string str() const;
};

/// A field's help text and its marks. A plain string converts to it, so a field with no mark
/// reads `v.field("seed", seed, "random seed")`.
struct Help {
  const char* text = "";
  /// False: the field does not change what a run computes (where its output goes, how it
  /// logs, how it handles memory), so it may differ when a run resumes (`--resume`).
  bool affects_training = true;
  Help(const char* t) : text(t) {}  // NOLINT(google-explicit-constructor): strings are help
  Help(const char* t, bool affects) : text(t), affects_training(affects) {}
};
/// Help for a field that does not affect training: `v.field("out_dir", out_dir,
/// outside_training("where the report goes"))`.
inline Help outside_training(const char* text) { return Help(text, false); }

class Options;

/// Walks the fields of an Options struct. Implemented by the host (libfrugal); plugins only
/// call it from their visit().
class FieldVisitor {
 public:
  virtual ~FieldVisitor();
  virtual void field(const char* key, bool& v, Help help) = 0;
  virtual void field(const char* key, int64_t& v, Help help, Limits l = {}) = 0;
  virtual void field(const char* key, double& v, Help help, Limits l = {}) = 0;
  /// `choices` empty: any string.
  virtual void field(const char* key, std::string& v, Help help,
                     const std::vector<std::string>& choices = {}) = 0;
  virtual void field(const char* key, std::vector<std::string>& v, Help help) = 0;
  /// A size in bytes ("512MiB"); see ByteSize.
  virtual void field(const char* key, ByteSize& v, Help help) = 0;
  /// A nested table. `present` is set when the TOML has it (may be null).
  virtual void table(const char* key, Options& sub, Help help, bool* present = nullptr) = 0;
};

class Options {
 public:
  virtual ~Options();
  /// Visits every field: key, reference, help text, limits or choices.
  virtual void visit(FieldVisitor& v) = 0;
  /// Checks that involve several fields; throw frugal::ConfigError naming the key. The reader
  /// adds the file and table to the message.
  virtual void check() const {}
  /// A sentence the reader adds to its "unknown key" error when the allowed keys depend on a
  /// value (an optimizer's keys depend on its name); "" = none.
  virtual std::string unknown_key_note(const std::string& key) const {
    (void)key;
    return "";
  }
};

/// The fields of `o` as JSON: [{key, type, default, help, allowed}], for `frugal plugins`
/// and docs/configure.md. Reads the current values as defaults.
nlohmann::json describe_options(Options& o);
/// The current values of `o` as a JSON object (nested tables as objects).
nlohmann::json options_to_json(Options& o);
/// The dotted keys of the fields of `o` marked outside_training, nested tables included,
/// each under `prefix` ("run" gives "run.out_dir"; "" gives "out_dir").
std::vector<std::string> keys_outside_training(Options& o, const std::string& prefix);

/// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);
/// The candidate nearest to `word`, or "" if none is close (distance > max(2, |word|/3)).
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace frugal
