// Options to and from TOML: the reader that checks every key's type and limits at its
// file:line:column, the key lister, the TOML writer, and the wording of values in errors.
#include "config/options_toml.h"

#include <algorithm>
#include <charconv>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "frugal/base/error.h"
#include "frugal/config/config.h"

namespace frugal {
namespace detail {
namespace {

std::string format_number(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

/// A scalar as TOML text: 3, 2.5, "abc", true.
std::string show(const toml::node& n) {
  if (auto s = n.as_string()) return quote(s->get());
  if (auto f = n.as_floating_point()) {
    std::string s = format_number(f->get());  // 2.0 shows as "2.0", not "2"
    return s.find_first_of(".eEin") == std::string::npos ? s + ".0" : s;
  }
  if (n.is_array()) return "an array";
  if (n.is_table()) return "a table";
  std::ostringstream os;
  n.visit([&](auto&& value) { os << value; });
  return os.str();
}

/// Lists the keys an Options struct declares.
class KeyLister : public FieldVisitor {
 public:
  std::vector<std::string> keys;
  void field(const char* key, bool&, Help) override { keys.push_back(key); }
  void field(const char* key, int64_t&, Help, Limits) override { keys.push_back(key); }
  void field(const char* key, double&, Help, Limits) override { keys.push_back(key); }
  void field(const char* key, std::string&, Help, const std::vector<std::string>&) override {
    keys.push_back(key);
  }
  void field(const char* key, std::vector<std::string>&, Help) override { keys.push_back(key); }
  void field(const char* key, ByteSize&, Help) override { keys.push_back(key); }
  void table(const char* key, Options&, Help, bool*) override { keys.push_back(key); }
};

/// Reads the keys present in a TOML table into an Options struct, checking types and limits.
/// Absent keys keep their member-initializer defaults.
class Reader : public FieldVisitor {
 public:
  Reader(const toml::table& t, const std::string& where, const std::string& source)
      : t_(t), where_(where), source_(source) {}

  void field(const char* key, bool& v, Help) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* b = n->as_boolean();
    if (!b) fail(key, *n, "must be true or false, got " + describe_value(*n));
    v = b->get();
  }

  void field(const char* key, int64_t& v, Help, Limits l) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    if (const auto* s = n->as_string(); s && l.or_auto && s->get() == "auto") {
      v = Limits::kAuto;
      return;
    }
    const auto* i = n->as_integer();
    if (!i) fail(key, *n, "must be " + l.describe(true) + ", got " + describe_value(*n));
    if (!l.contains(static_cast<double>(i->get())))
      fail(key, *n, "must be " + l.describe(true) + ", got " + show(*n));
    v = i->get();
  }

  void field(const char* key, double& v, Help, Limits l) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    double d = 0;
    if (const auto* f = n->as_floating_point())
      d = f->get();
    else if (const auto* i = n->as_integer())
      d = static_cast<double>(i->get());
    else
      fail(key, *n, "must be " + l.describe(false) + ", got " + describe_value(*n));
    if (!l.contains(d)) fail(key, *n, "must be " + l.describe(false) + ", got " + show(*n));
    v = d;
  }

  void field(const char* key, std::string& v, Help,
             const std::vector<std::string>& choices) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* s = n->as_string();
    if (choices.empty()) {
      if (!s) fail(key, *n, "must be a string, got " + describe_value(*n));
    } else if (!s || !contains(choices, s->get())) {
      std::string what = "must be one of " + join(choices, ", ") + "; got " +
                         (s ? show(*n) : describe_value(*n));
      const std::string near = s ? nearest(s->get(), choices) : "";
      if (!near.empty()) what += "; did you mean \"" + near + "\"?";
      fail(key, *n, what);
    }
    v = s->get();
  }

  void field(const char* key, std::vector<std::string>& v, Help) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* a = n->as_array();
    if (!a) fail(key, *n, "must be an array of strings, got " + describe_value(*n));
    std::vector<std::string> out;
    for (size_t i = 0; i < a->size(); ++i) {
      const toml::node& e = *a->get(i);
      if (!e.is_string())
        fail(key, e, "must be an array of strings; element " + std::to_string(i) + " is " +
                         describe_value(e));
      out.push_back(e.as_string()->get());
    }
    v = std::move(out);
  }

  /// "512MiB" or an integer of bytes; the error names the value's own position.
  void field(const char* key, ByteSize& v, Help) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const char* wanted = "must be a size such as \"512MiB\" or \"2GiB\", or an integer of bytes";
    if (const auto* i = n->as_integer()) {
      if (i->get() < 0) fail(key, *n, std::string(wanted) + " >= 0, got " + show(*n));
      // The limit the text form has (the resolved config writes "<n>B", which must read back).
      if (static_cast<double>(i->get()) >= 9.2e18)
        fail(key, *n, "is too large: " + show(*n) + " is more than 8 EiB");
      v.bytes = i->get();
      return;
    }
    const auto* s = n->as_string();
    if (!s) fail(key, *n, std::string(wanted) + ", got " + describe_value(*n));
    std::string why;
    int64_t bytes = 0;
    if (!ByteSize::parse(s->get(), bytes, why)) fail(key, *n, why);
    v.bytes = bytes;
  }

  void table(const char* key, Options& sub, Help, bool* present) override {
    const toml::node* n = t_.get(key);
    if (present) *present = n != nullptr;
    if (!n) return;
    const auto* t = n->as_table();
    if (!t) fail(key, *n, "must be a table, got " + describe_value(*n));
    read_options(*t, sub, dotted(where_, key), source_);
  }

 private:
  [[noreturn]] void fail(const char* key, const toml::node& n, const std::string& what) const {
    throw_config_error(location(n, source_) + ": '" + dotted(where_, key) + "' " + what);
  }

  const toml::table& t_;
  const std::string& where_;
  const std::string& source_;
};

/// Writes every field's value into a TOML table; a table whose `present` flag is false is
/// left out (a stage without its own optimizer).
class TomlWriter : public FieldVisitor {
 public:
  explicit TomlWriter(toml::table& out) : out_(out) {}
  void field(const char* key, bool& v, Help) override { out_.insert_or_assign(key, v); }
  void field(const char* key, int64_t& v, Help, Limits l) override {
    if (l.or_auto && v == Limits::kAuto)
      out_.insert_or_assign(key, "auto");
    else
      out_.insert_or_assign(key, v);
  }
  void field(const char* key, double& v, Help, Limits) override { out_.insert_or_assign(key, v); }
  void field(const char* key, std::string& v, Help, const std::vector<std::string>&) override {
    out_.insert_or_assign(key, v);
  }
  void field(const char* key, std::vector<std::string>& v, Help) override {
    toml::array a;
    for (const auto& s : v) a.push_back(s);
    out_.insert_or_assign(key, std::move(a));
  }
  void field(const char* key, ByteSize& v, Help) override { out_.insert_or_assign(key, v.str()); }
  void table(const char* key, Options& sub, Help, bool* present) override {
    if (present && !*present) return;
    out_.insert_or_assign(key, write_fields(sub));
  }

 private:
  toml::table& out_;
};

}  // namespace

void read_fields(const toml::table& t, Options& o, const std::string& where,
                 const std::string& source) {
  Reader reader(t, where, source);
  o.visit(reader);
}

std::vector<std::string> field_keys(Options& o) {
  KeyLister lister;
  o.visit(lister);
  return std::move(lister.keys);
}

toml::table write_fields(Options& o) {
  toml::table t;
  TomlWriter w(t);
  o.visit(w);
  return t;
}

std::string location_of(const toml::source_region& r, const std::string& source) {
  const std::string& path = r.path && !r.path->empty() ? *r.path : source;
  if (path.rfind("--set", 0) == 0 || r.begin.line == 0) return path;
  return path + ":" + std::to_string(r.begin.line) + ":" + std::to_string(r.begin.column);
}

std::string key_location(const toml::key& k, const toml::node& v, const std::string& source) {
  return k.source().begin.line != 0 ? location_of(k.source(), source) : location(v, source);
}

/// JSON's escapes are all valid TOML escapes.
std::string quote(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string describe_value(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string " + show(n);
    case toml::node_type::integer: return "integer " + show(n);
    case toml::node_type::floating_point: return "float " + show(n);
    case toml::node_type::boolean: return "boolean " + show(n);
    case toml::node_type::date: return "date " + show(n);
    case toml::node_type::time: return "time " + show(n);
    case toml::node_type::date_time: return "date-time " + show(n);
    case toml::node_type::array: return n.as_array()->empty() ? "an empty array" : "an array";
    case toml::node_type::table: return "a table";
    default: return "nothing";
  }
}

std::string dotted(const std::string& where, std::string_view key) {
  return where.empty() ? std::string(key) : where + "." + std::string(key);
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

bool contains(const std::vector<std::string>& items, std::string_view s) {
  return std::find(items.begin(), items.end(), s) != items.end();
}

void unknown_key(const std::string& loc, const std::string& key,
                 const std::vector<std::string>& allowed, const std::string& where,
                 const std::string& what_allowed, const std::string& note) {
  std::string msg = loc + ": unknown key '" + dotted(where, key) + "'";
  const std::string near = nearest(key, allowed);
  msg += near.empty() ? "." : "; did you mean '" + dotted(where, near) + "'?";
  if (!note.empty()) msg += " " + note;
  throw_config_error(msg + " " + what_allowed + ": " + join(allowed, ", "));
}

}  // namespace detail

std::string location(const toml::node& n, const std::string& source) {
  return detail::location_of(n.source(), source);
}

void read_options(const toml::table& t, Options& o, const std::string& where,
                  const std::string& source) {
  detail::read_fields(t, o, where, source);
  const std::vector<std::string> keys = detail::field_keys(o);
  for (auto&& [k, v] : t) {
    const std::string key(k.str());
    if (!detail::contains(keys, key))
      detail::unknown_key(detail::key_location(k, v, source), key, keys, where,
                          where.empty() ? "Allowed keys" : "Allowed keys in [" + where + "]",
                          o.unknown_key_note(key));
  }
  try {
    o.check();
  } catch (const ConfigError& e) {
    throw_config_error(location(t, source) + ": " + e.what());
  }
}

}  // namespace frugal
