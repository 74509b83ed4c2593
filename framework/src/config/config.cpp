// The run configuration: the top level of the file, `--set` overrides and the resolved-config
// writer (the sections' fields are in sections.cpp). The reader that checks every key is in
// options_toml.cpp; the optimizer's keys come from its registry entry (optimizers.cpp).
#include "frugal/config/config.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/options_toml.h"
#include "frugal/base/error.h"

namespace frugal {

using detail::contains;
using detail::describe_value;
using detail::dotted;
using detail::quote;

namespace {

const char* const kSetPrefix = "--set";
/// A run's config is a few KiB; the cap only stops a file that is not one (/dev/zero).
constexpr int64_t kMaxConfigBytes = int64_t{4} << 20;

// ---- `--set KEY=VALUE` overrides, applied to the parsed table before validation. ----

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

/// TOML is UTF-8 text; an override is not read by the TOML parser that checks it. (A key of
/// other bytes was stored as is and written to the resolved config as another key.)
bool valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();  // the strict error handler refuses invalid UTF-8
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

/// {v = VALUE}: the value as TOML, or as a plain string when it is not TOML, parsed with
/// `origin` as its source so that errors about it name the override. (Moving a node keeps
/// its source; copying drops it.)
toml::table parse_value(const std::string& text, const std::string& origin) {
  const std::string_view origin_view = origin;
  try {
    toml::table t = toml::parse("v = " + text, origin_view);
    if (t.size() == 1 && t.contains("v")) return t;
  } catch (const toml::parse_error&) {
  }
  try {
    return toml::parse("v = " + quote(text), origin_view);
  } catch (const toml::parse_error& e) {  // e.g. a control character TOML strings refuse
    throw_config_error(origin + ": the value is neither TOML nor a valid string: " +
                       std::string(e.description()));
  }
}

// A control character (a tab, a newline) in a key: toml++ writes such a key back unquoted, so
// the resolved config.toml could not be read again (the fuzzer's finding). No key frugal or a
// plugin reads has one.
bool has_control(const std::string& key) {
  for (const unsigned char ch : key)
    if (ch < 0x20 || ch == 0x7f) return true;
  return false;
}

void refuse_control_keys(const toml::table& t, const std::string& where, const std::string& source) {
  for (const auto& [k, v] : t) {
    const std::string key(k.str());
    if (has_control(key))
      throw_config_error(location(v, source) + ": a key under " + where +
                         " holds a control character (a tab, a newline): keys are names");
    if (const auto* sub = v.as_table()) refuse_control_keys(*sub, where + "." + key, source);
  }
}

bool parse_index(const std::string& segment, size_t& index) {
  if (segment.empty() || segment.find_first_not_of("0123456789") != std::string::npos)
    return false;
  auto res = std::from_chars(segment.data(), segment.data() + segment.size(), index);
  return res.ec == std::errc();
}

// The dotted key of a --set assignment, cut at its dots (an empty segment: a malformed key).
std::vector<std::string> set_key_segments(const std::string& key) {
  std::vector<std::string> segments;
  for (size_t b = 0;; ) {
    const auto dot = key.find('.', b);
    segments.push_back(key.substr(b, dot == std::string::npos ? std::string::npos : dot - b));
    if (dot == std::string::npos) return segments;
    b = dot + 1;
  }
}

// The --set assignment's key cut into its segments, refused (naming the --set) when it is not
// KEY=VALUE or its key could not be written back and read again.
std::vector<std::string> checked_set_key(const std::string& assignment, const std::string& origin) {
  const auto eq = assignment.find('=');
  const std::string key = eq == std::string::npos ? "" : trim(assignment.substr(0, eq));
  const std::vector<std::string> segments = set_key_segments(key);
  if (key.empty() || contains(segments, ""))
    throw_config_error(std::string(kSetPrefix) + " '" + assignment + "': expected KEY=VALUE");
  // A quote in a key was written back unquoted by the resolved-config writer (a fuzzer's
  // triple-quoted key), and the run's config.toml could not be read again.
  if (key.find_first_of("'\"") != std::string::npos)
    throw_config_error(std::string(kSetPrefix) + " '" + assignment + "': a key holds no quote; "
                       "--set takes dotted keys (data.batch_size, stages.0.epochs)");
  for (const auto& seg : segments)
    if (has_control(seg))
      throw_config_error(origin + ": a key holds no control character (a tab, a newline)");
  if (!valid_utf8(assignment))
    throw_config_error(origin + ": not UTF-8 text (TOML keys and strings are Unicode)");
  return segments;
}

void apply_override(toml::table& root, const std::string& assignment) {
  const std::string origin = std::string(kSetPrefix) + " " + assignment;
  const std::vector<std::string> segments = checked_set_key(assignment, origin);
  toml::table value = parse_value(trim(assignment.substr(assignment.find('=') + 1)), origin);

  toml::node* at = &root;
  std::string path;  // the dotted key of `at`
  for (size_t i = 0; i < segments.size(); ++i) {
    const std::string& seg = segments[i];
    const bool last = i + 1 == segments.size();
    if (auto* t = at->as_table()) {
      if (last) {
        t->insert_or_assign(seg, std::move(*value.get("v")));
        return;
      }
      if (!t->contains(seg)) {
        size_t index = 0;
        if (parse_index(segments[i + 1], index))
          throw_config_error(origin + ": index " + segments[i + 1] + " is out of range: '" +
                             dotted(path, seg) + "' is not set");
        toml::table fresh = toml::parse("v = {}", std::string_view(origin));
        t->insert_or_assign(seg, std::move(*fresh.get("v")));
        t->get(seg)->as_table()->is_inline(false);
      }
      at = t->get(seg);
    } else if (auto* a = at->as_array()) {
      size_t index = 0;
      if (!parse_index(seg, index))
        throw_config_error(origin + ": '" + path + "' is an array; '" + seg +
                           "' is not an index (0, 1, ...)");
      if (index >= a->size())
        throw_config_error(origin + ": index " + seg + " is out of range: '" + path + "' has " +
                           std::to_string(a->size()) + " element" +
                           (a->size() == 1 ? "" : "s"));
      if (last) {
        a->replace(a->cbegin() + static_cast<std::ptrdiff_t>(index),
                   std::move(*value.get("v")));
        return;
      }
      at = a->get(index);
    } else {
      throw_config_error(origin + ": '" + path + "' is " + describe_value(*at) +
                         ", not a table");
    }
    path = path.empty() ? seg : path + "." + seg;
  }
}

// ---- The top level. ----

const std::vector<std::string> kSections = {"run",    "data",     "model",    "optimizer",  "schedule",
                                            "loss",   "stages",   "plugins",  "ablation",   "distributed"};

void read_section(const toml::table& root, const char* name, Options& o,
                  const std::string& source) {
  const toml::node* n = root.get(name);
  if (!n) {
    read_options(toml::table{}, o, name, source);  // still runs check()
    return;
  }
  const auto* t = n->as_table();
  if (!t)
    throw_config_error(location(*n, source) + ": '" + name + "' must be a table ([" + name +
                       "]), got " + describe_value(*n));
  read_options(*t, o, name, source);
}

void read_stages(const toml::table& root, Config& c) {
  const toml::node* n = root.get("stages");
  if (!n) {
    c.stages.emplace_back();
    c.stages.back().optimizer = c.optimizer;
    c.stages.back().schedule = c.schedule;
    return;
  }
  const auto* a = n->as_array();
  if (!a || a->empty() || !a->is_array_of_tables())
    throw_config_error(location(*n, c.source) +
                       ": 'stages' must be an array of tables (one [[stages]] section per "
                       "stage), got " + describe_value(*n));
  std::map<std::string, std::string> first_use;  // name -> "stages.i at file:line:column"
  for (size_t i = 0; i < a->size(); ++i) {
    const toml::table& t = *a->get(i)->as_table();
    const std::string where = "stages." + std::to_string(i);
    StageOptions s;
    s.optimizer = c.optimizer;  // [optimizer] is the base of the stage's own table
    s.schedule = c.schedule;    // and [schedule] of its [stages.schedule]
    read_options(t, s, where, c.source);
    const toml::node* name_node = t.get("name");
    const std::string loc = name_node ? location(*name_node, c.source) : location(t, c.source);
    if (s.name.empty())
      throw_config_error(loc + ": '" + where + ".name' must not be empty");
    auto [it, fresh] = first_use.emplace(s.name, where + " at " + loc);
    if (!fresh)
      throw_config_error(loc + ": '" + where + ".name' repeats the stage name \"" + s.name +
                         "\" of " + it->second + "; stage names must be unique");
    c.stages.push_back(std::move(s));
  }
}

/// The file's TOML with the overrides applied; not yet validated.
toml::table parse_root(const std::string& text, const std::string& source,
                       const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw_config_error(detail::location_of(e.source(), source) +
                       ": TOML syntax error: " + std::string(e.description()));
  }
  for (const auto& o : overrides) apply_override(root, o);
  return root;
}

/// [plugins], moved out of `root` (moved, not copied: the plugin loader's errors keep positions).
toml::table take_plugins(toml::table& root, const std::string& source) {
  toml::node* p = root.get("plugins");
  if (!p) return {};
  auto* t = p->as_table();
  if (!t)
    throw_config_error(location(*p, source) + ": 'plugins' must be a table ([plugins]), got " +
                       describe_value(*p));
  refuse_control_keys(*t, "[plugins]", source);
  return std::move(*t);
}

void read_ablation(const toml::table& root, Config& c) {
  const toml::node* a = root.get("ablation");
  if (!a) return;
  read_section(root, "ablation", c.ablation, c.source);
  c.has_ablation = true;
  const toml::table& t = *a->as_table();
  const std::string here = location(*a, c.source);
  c.ablation.baseline_at = t.get("baseline") ? location(*t.get("baseline"), c.source) : here;
  c.ablation.techniques_at =
      t.get("techniques") ? location(*t.get("techniques"), c.source) : here;
}

std::string read_text(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw_config_error("cannot read config file '" + path + "': " + std::strerror(EISDIR));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_config_error("cannot read config file '" + path + "': " + std::strerror(errno));
  // Read at most one byte past the cap: /dev/zero or a FIFO that never ends is refused, not read
  // until memory runs out.
  std::string text(static_cast<size_t>(kMaxConfigBytes) + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad())
    throw_config_error("cannot read config file '" + path + "': " + std::strerror(errno));
  text.resize(static_cast<size_t>(in.gcount()));
  if (static_cast<int64_t>(text.size()) > kMaxConfigBytes)
    throw_config_error("config file '" + path + "' is larger than " +
                       std::to_string(kMaxConfigBytes >> 20) + " MiB: not a run's TOML config");
  return text;
}

}  // namespace

namespace {
/// A regression trains with mse, classes with cross_entropy: the built-in loss that cannot take
/// the data's labels is refused before any work (a plugin's loss is its own business).
void check_task_loss(const Config& c) {
  const bool regression = c.data.dataset == "csv" && c.data.task == "regression";
  if (regression && c.loss.name == "cross_entropy")
    throw ConfigError(c.source + ": 'loss.name' = \"cross_entropy\" cannot train 'data.task' = "
                      "\"regression\" (float targets); set [loss] name = \"mse\"");
  if (!regression && c.loss.name == "mse")
    throw ConfigError(c.source + ": 'loss.name' = \"mse\" needs float targets: 'data.dataset' = "
                      "\"csv\" with 'data.task' = \"regression\"; class labels train with "
                      "\"cross_entropy\"");
}
}  // namespace

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  toml::table root = parse_root(text, source, overrides);
  for (auto&& [k, v] : root)
    if (!contains(kSections, k.str()))
      detail::unknown_key(detail::key_location(k, v, source), std::string(k.str()), kSections,
                          "", "Allowed top-level tables");
  Config c;
  c.source = source;
  for (const auto& o : overrides)
    if (const auto eq = o.find('='); eq != std::string::npos)
      c.set_by[trim(o.substr(0, eq))] = std::string(kSetPrefix) + " " + o;
  read_section(root, "run", c.run, source);
  read_section(root, "data", c.data, source);
  read_section(root, "model", c.model, source);
  read_section(root, "optimizer", c.optimizer, source);
  read_section(root, "schedule", c.schedule, source);
  read_section(root, "loss", c.loss, source);
  read_stages(root, c);
  check_task_loss(c);
  read_section(root, "distributed", c.distributed, source);
  c.plugins = take_plugins(root, source);
  read_ablation(root, c);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_text(path), path, overrides);
}

toml::table read_plugins_table(const std::string& path,
                               const std::vector<std::string>& overrides) {
  toml::table root = parse_root(read_text(path), path, overrides);
  return take_plugins(root, path);
}

std::string Config::to_toml() const {
  Config c = *this;  // visit() takes the fields by reference
  toml::table root;
  root.insert_or_assign("run", detail::write_fields(c.run));
  root.insert_or_assign("data", detail::write_fields(c.data));
  root.insert_or_assign("model", detail::write_fields(c.model));
  root.insert_or_assign("optimizer", detail::write_fields(c.optimizer));
  root.insert_or_assign("schedule", detail::write_fields(c.schedule));
  root.insert_or_assign("loss", detail::write_fields(c.loss));
  toml::array stage_tables;
  for (auto& s : c.stages) stage_tables.push_back(detail::write_fields(s));
  root.insert_or_assign("stages", std::move(stage_tables));
  root.insert_or_assign("distributed", detail::write_fields(c.distributed));
  if (!plugins.empty()) root.insert_or_assign("plugins", plugins);
  if (has_ablation) root.insert_or_assign("ablation", detail::write_fields(c.ablation));
  // The shortest floats (0.9, not 0.90000000000000002) when every value reads back exactly.
  std::ostringstream shortest;
  shortest << toml::toml_formatter{root, toml::toml_formatter::default_flags |
                                             toml::format_flags::relaxed_float_precision}
           << "\n";
  try {
    if (toml::parse(shortest.str()) == root) return shortest.str();
  } catch (const toml::parse_error&) {
  }
  std::ostringstream exact;
  exact << root << "\n";
  return exact.str();
}

std::string Config::where(const std::string& key) const {
  if (auto it = set_by.find(key); it != set_by.end()) return it->second;
  std::string with;
  for (const auto& [k, origin] : set_by)
    if (k.rfind(key + ".", 0) == 0 || key.rfind(k + ".", 0) == 0) with += (with.empty() ? "" : ", ") + origin;
  return with.empty() ? source : source + " (with " + with + ")";
}

std::vector<std::string> Config::keys_outside_training() const {
  Config c = *this;  // visit() takes the fields by reference
  std::vector<std::string> out;
  auto add = [&](Options& o, const std::string& prefix) {
    for (auto& k : frugal::keys_outside_training(o, prefix)) out.push_back(std::move(k));
  };
  add(c.run, "run");
  add(c.data, "data");
  add(c.model, "model");
  add(c.optimizer, "optimizer");
  add(c.schedule, "schedule");
  add(c.loss, "loss");
  for (size_t i = 0; i < c.stages.size(); ++i) add(c.stages[i], "stages." + std::to_string(i));
  add(c.distributed, "distributed");
  if (has_ablation) add(c.ablation, "ablation");
  return out;
}


}  // namespace frugal
