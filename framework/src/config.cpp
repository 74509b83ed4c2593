// The run configuration: the built-in options' fields, the TOML reader that checks every key
// against them, `--set` overrides and the resolved-config writer.
#include "frugal/config.h"

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

#include "frugal/error.h"
#include "frugal/memory.h"

namespace frugal {

// ---- The built-in options: keys, help, limits. Defaults are the member initializers. ----

void RunOptions::visit(FieldVisitor& v) {
  v.field("seed", seed, "random seed for weights, data order and dropout");
  v.field("device", device, "where to train; auto = cuda when available, else cpu",
          {"cpu", "cuda", "auto"});
  v.field("out_dir", out_dir, "directory for the report, the resolved config and checkpoints");
  v.field("threads", threads, "intra-op CPU threads; 0 = LibTorch's default", at_least(0));
  v.field("max_steps", max_steps, "stop the fit after this many batches; 0 = no limit",
          at_least(0));
  v.field("log_every", log_every, "batches between log lines when not on a terminal",
          at_least(1));
  v.field("progress", progress,
          "progress display; auto = a bar on a terminal, log lines otherwise",
          {"auto", "bar", "log", "none"});
  v.field("checkpoint_every", checkpoint_every,
          "write <out_dir>/checkpoints/last.ckpt every N optimizer steps (and at the end of "
          "the fit), for `frugal train --resume`; 0 = off",
          at_least(0));
  v.field("checkpoint_epochs", checkpoint_epochs,
          "write the checkpoint every N epochs (and at the end of the fit); 0 = off",
          at_least(0));
  v.field("warmup", warmup,
          "training batches at the start of each stage left out of the step-time statistics",
          at_least(0));
  v.field("trace", trace,
          "write a Chrome-trace JSON (Perfetto) of phase spans and live memory to this path; "
          "\"\" = off");
  v.field("memory_budget", memory_budget,
          "memory the run may hold, e.g. \"1GiB\"; past it an allocation fails as out of "
          "memory (cpu: the tracking allocator; cuda: the allocator's memory fraction); "
          "\"\" = none");
  v.field("on_oom", on_oom,
          "out of memory in forward or backward: fail, or retry the batch with half the "
          "micro-batch (same effective batch and gradients)",
          {"fail", "retry"});
  v.field("oom_retries", oom_retries,
          "retry: out-of-memory errors allowed on one batch before the run stops", at_least(1));
  v.field("micro_batch", micro_batch,
          "auto = before each stage, find the largest micro-batch that fits memory_budget; "
          "off = whole batches (or the micro-batches a plugin sets)",
          {"off", "auto"});
}

void RunOptions::check() const {
  memory_budget_bytes();
  if (micro_batch == "auto" && memory_budget_bytes() == 0)
    throw_config_error("'run.micro_batch' = \"auto\" needs 'run.memory_budget' (the memory the "
                       "micro-batch must fit), e.g. memory_budget = \"1GiB\"");
}

int64_t RunOptions::memory_budget_bytes() const {
  return memory_budget.empty() ? 0 : parse_bytes(memory_budget, "run.memory_budget");
}

void DataOptions::visit(FieldVisitor& v) {
  v.field("dataset", dataset, "dataset: fashion-mnist, synthetic or one a plugin registers");
  v.field("path", path, "directory holding the dataset's files (fashion-mnist: the IDX files)");
  v.field("batch_size", batch_size, "training batch size", at_least(1));
  v.field("valid_batch_size", valid_batch_size, "validation batch size", at_least(1));
  v.field("train_samples", train_samples, "use the first N training samples; 0 = all",
          at_least(0));
  v.field("valid_samples", valid_samples,
          "use the first N validation samples; 0 = all, -1 = no validation", at_least(-1));
  v.field("shuffle", shuffle, "shuffle the training samples every epoch");
  v.field("channels", channels, "synthetic data: image channels", at_least(1));
  v.field("image_size", image_size, "synthetic data: image height and width in pixels",
          at_least(1));
  v.field("classes", classes, "synthetic data: number of classes", at_least(2));
  v.field("samples", samples, "synthetic data: number of training samples", at_least(1));
}

void ModelOptions::visit(FieldVisitor& v) {
  v.field("arch", arch, "architecture: mlp, cnn, resnet, vit or one a plugin registers");
  v.field("width", width,
          "hidden units (mlp), base channels (cnn, resnet), embedding size (vit)", at_least(1));
  v.field("depth", depth, "hidden blocks (mlp), residual blocks (resnet), layers (vit)",
          at_least(1));
  v.field("dropout", dropout, "dropout probability", half_open(0, 1));
  v.field("patch", patch, "vit: patch size in pixels", at_least(1));
  v.field("heads", heads, "vit: attention heads; must divide width", at_least(1));
}

void ModelOptions::check() const {
  if (arch == "vit" && width % heads != 0) {
    const int64_t fixed = (width / heads + 1) * heads;
    throw_config_error("'model.width' (" + std::to_string(width) +
                       ") must be divisible by 'model.heads' (" + std::to_string(heads) +
                       ") for arch \"vit\"; e.g. width = " + std::to_string(fixed));
  }
}

void OptimizerOptions::visit(FieldVisitor& v) {
  v.field("name", name, "optimizer", {"adam", "adamw", "sgd", "rmsprop", "adagrad"});
  v.field("lr", lr, "learning rate", positive());
  v.field("weight_decay", weight_decay, "weight decay (decoupled for adamw)", at_least(0));
  v.field("momentum", momentum, "momentum (sgd, rmsprop)", at_least(0));
  v.field("beta1", beta1, "first-moment decay (adam, adamw)", half_open(0, 1));
  v.field("beta2", beta2, "second-moment decay (adam, adamw)", half_open(0, 1));
  v.field("eps", eps, "term added to the denominator for stability", positive());
}

void LossOptions::visit(FieldVisitor& v) {
  v.field("name", name, "loss: cross_entropy or one a plugin registers");
  v.field("label_smoothing", label_smoothing, "cross_entropy: label smoothing", half_open(0, 1));
}

void StageOptions::visit(FieldVisitor& v) {
  v.field("name", name, "stage name, unique; shown in logs and the report");
  v.field("epochs", epochs, "epochs in this stage", at_least(0));
  v.field("freeze", freeze, "module-name prefixes whose parameters do not train in this stage");
  v.field("image_size", image_size, "resize inputs to this size; 0 = the data's own size",
          at_least(0));
  v.table("optimizer", optimizer, "this stage's optimizer; keys it omits inherit [optimizer]",
          &has_optimizer);
}

void AblationOptions::visit(FieldVisitor& v) {
  v.field("baseline", baseline, "plugins on in every run, the baseline included");
  v.field("techniques", techniques,
          "plugins varied (each alone, all together, all but one); empty = every plugin with a "
          "[plugins.X] table that is not in baseline");
  v.field("repeats", repeats, "runs of each combination; step times are their median",
          at_least(1));
  v.field("steps", steps, "training batches per run", at_least(1));
  v.field("warmup", warmup, "batches left out of the step-time statistics", at_least(0));
  v.field("leave_one_out", leave_one_out, "also run all techniques but one, for each");
}

void AblationOptions::check() const {
  auto dup = [](const std::vector<std::string>& v) -> std::string {
    for (size_t i = 0; i < v.size(); ++i)
      for (size_t j = i + 1; j < v.size(); ++j)
        if (v[i] == v[j]) return v[i];
    return "";
  };
  if (auto d = dup(techniques); !d.empty())
    throw_config_error("'ablation.techniques' names plugin '" + d + "' twice");
  if (auto d = dup(baseline); !d.empty())
    throw_config_error("'ablation.baseline' names plugin '" + d + "' twice");
  for (const auto& t : techniques)
    for (const auto& b : baseline)
      if (t == b)
        throw_config_error("plugin '" + t +
                           "' is in both 'ablation.baseline' and 'ablation.techniques'; a "
                           "baseline plugin is on in every run, so it cannot be varied");
  if (warmup >= steps)
    throw_config_error("'ablation.warmup' (" + std::to_string(warmup) +
                       ") must be less than 'ablation.steps' (" + std::to_string(steps) +
                       "): no step would be timed");
}

namespace {

const char* const kSetPrefix = "--set";

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

bool contains(const std::vector<std::string>& items, std::string_view s) {
  return std::find(items.begin(), items.end(), s) != items.end();
}

std::string location_of(const toml::source_region& r, const std::string& source) {
  const std::string& path = r.path && !r.path->empty() ? *r.path : source;
  if (path.rfind(kSetPrefix, 0) == 0 || r.begin.line == 0) return path;
  return path + ":" + std::to_string(r.begin.line) + ":" + std::to_string(r.begin.column);
}

/// Where a key is written; a key an override added has no position, so its value's is used.
std::string key_location(const toml::key& k, const toml::node& v, const std::string& source) {
  return k.source().begin.line != 0 ? location_of(k.source(), source) : location(v, source);
}

std::string format_number(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

/// A TOML basic string: "abc", "a\"b". (JSON's escapes are all valid TOML escapes.)
std::string quote(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
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

/// A value with its type, for "got ...": string "abc", float 2.5, an array.
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

[[noreturn]] void unknown_key(const std::string& loc, const std::string& key,
                              const std::vector<std::string>& allowed, const std::string& where,
                              const std::string& what_allowed) {
  std::string msg = loc + ": unknown key '" + dotted(where, key) + "'";
  const std::string near = nearest(key, allowed);
  msg += near.empty() ? "." : "; did you mean '" + dotted(where, near) + "'?";
  throw_config_error(msg + " " + what_allowed + ": " + join(allowed, ", "));
}

/// Lists the keys an Options struct declares.
class KeyLister : public FieldVisitor {
 public:
  std::vector<std::string> keys;
  void field(const char* key, bool&, const char*) override { keys.push_back(key); }
  void field(const char* key, int64_t&, const char*, Limits) override { keys.push_back(key); }
  void field(const char* key, double&, const char*, Limits) override { keys.push_back(key); }
  void field(const char* key, std::string&, const char*,
             const std::vector<std::string>&) override {
    keys.push_back(key);
  }
  void field(const char* key, std::vector<std::string>&, const char*) override {
    keys.push_back(key);
  }
  void table(const char* key, Options&, const char*, bool*) override { keys.push_back(key); }
};

/// Reads the keys present in a TOML table into an Options struct, checking types and limits.
/// Absent keys keep their member-initializer defaults.
class Reader : public FieldVisitor {
 public:
  Reader(const toml::table& t, const std::string& where, const std::string& source)
      : t_(t), where_(where), source_(source) {}

  void field(const char* key, bool& v, const char*) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* b = n->as_boolean();
    if (!b) fail(key, *n, "true or false, got " + describe_value(*n));
    v = b->get();
  }

  void field(const char* key, int64_t& v, const char*, Limits l) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* i = n->as_integer();
    if (!i) fail(key, *n, l.describe(true) + ", got " + describe_value(*n));
    if (!l.contains(static_cast<double>(i->get())))
      fail(key, *n, l.describe(true) + ", got " + show(*n));
    v = i->get();
  }

  void field(const char* key, double& v, const char*, Limits l) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    double d = 0;
    if (const auto* f = n->as_floating_point())
      d = f->get();
    else if (const auto* i = n->as_integer())
      d = static_cast<double>(i->get());
    else
      fail(key, *n, l.describe(false) + ", got " + describe_value(*n));
    if (!l.contains(d)) fail(key, *n, l.describe(false) + ", got " + show(*n));
    v = d;
  }

  void field(const char* key, std::string& v, const char*,
             const std::vector<std::string>& choices) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* s = n->as_string();
    if (choices.empty()) {
      if (!s) fail(key, *n, "a string, got " + describe_value(*n));
    } else if (!s || !contains(choices, s->get())) {
      std::string what = "one of " + join(choices, ", ") + "; got " +
                         (s ? show(*n) : describe_value(*n));
      const std::string near = s ? nearest(s->get(), choices) : "";
      if (!near.empty()) what += "; did you mean \"" + near + "\"?";
      fail(key, *n, what);
    }
    v = s->get();
  }

  void field(const char* key, std::vector<std::string>& v, const char*) override {
    const toml::node* n = t_.get(key);
    if (!n) return;
    const auto* a = n->as_array();
    if (!a) fail(key, *n, "an array of strings, got " + describe_value(*n));
    std::vector<std::string> out;
    for (size_t i = 0; i < a->size(); ++i) {
      const toml::node& e = *a->get(i);
      if (!e.is_string())
        fail(key, e, "an array of strings; element " + std::to_string(i) + " is " +
                         describe_value(e));
      out.push_back(e.as_string()->get());
    }
    v = std::move(out);
  }

  void table(const char* key, Options& sub, const char*, bool* present) override {
    const toml::node* n = t_.get(key);
    if (present) *present = n != nullptr;
    if (!n) return;
    const auto* t = n->as_table();
    if (!t) fail(key, *n, "a table, got " + describe_value(*n));
    read_options(*t, sub, dotted(where_, key), source_);
  }

 private:
  [[noreturn]] void fail(const char* key, const toml::node& n, const std::string& what) const {
    throw_config_error(location(n, source_) + ": '" + dotted(where_, key) + "' must be " + what);
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
  void field(const char* key, bool& v, const char*) override { out_.insert_or_assign(key, v); }
  void field(const char* key, int64_t& v, const char*, Limits) override {
    out_.insert_or_assign(key, v);
  }
  void field(const char* key, double& v, const char*, Limits) override {
    out_.insert_or_assign(key, v);
  }
  void field(const char* key, std::string& v, const char*,
             const std::vector<std::string>&) override {
    out_.insert_or_assign(key, v);
  }
  void field(const char* key, std::vector<std::string>& v, const char*) override {
    toml::array a;
    for (const auto& s : v) a.push_back(s);
    out_.insert_or_assign(key, std::move(a));
  }
  void table(const char* key, Options& sub, const char*, bool* present) override {
    if (present && !*present) return;
    out_.insert_or_assign(key, write(sub));
  }
  static toml::table write(Options& o) {
    toml::table t;
    TomlWriter w(t);
    o.visit(w);
    return t;
  }

 private:
  toml::table& out_;
};

// ---- `--set KEY=VALUE` overrides, applied to the parsed table before validation. ----

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
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

bool parse_index(const std::string& segment, size_t& index) {
  if (segment.empty() || segment.find_first_not_of("0123456789") != std::string::npos)
    return false;
  auto res = std::from_chars(segment.data(), segment.data() + segment.size(), index);
  return res.ec == std::errc();
}

void apply_override(toml::table& root, const std::string& assignment) {
  const auto eq = assignment.find('=');
  const std::string key = eq == std::string::npos ? "" : trim(assignment.substr(0, eq));
  std::vector<std::string> segments;
  for (size_t b = 0;; ) {
    const auto dot = key.find('.', b);
    segments.push_back(key.substr(b, dot == std::string::npos ? std::string::npos : dot - b));
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  if (key.empty() || contains(segments, ""))
    throw_config_error(std::string(kSetPrefix) + " '" + assignment + "': expected KEY=VALUE");
  const std::string origin = std::string(kSetPrefix) + " " + assignment;
  toml::table value = parse_value(trim(assignment.substr(eq + 1)), origin);

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

const std::vector<std::string> kSections = {"run",    "data",    "model",   "optimizer",
                                            "loss",   "stages",  "plugins", "ablation"};

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

}  // namespace

std::string location(const toml::node& n, const std::string& source) {
  return location_of(n.source(), source);
}

void read_options(const toml::table& t, Options& o, const std::string& where,
                  const std::string& source) {
  KeyLister lister;
  o.visit(lister);
  for (auto&& [k, v] : t)
    if (!contains(lister.keys, k.str()))
      unknown_key(key_location(k, v, source), std::string(k.str()), lister.keys, where,
                  where.empty() ? "Allowed keys" : "Allowed keys in [" + where + "]");
  Reader reader(t, where, source);
  o.visit(reader);
  try {
    o.check();
  } catch (const ConfigError& e) {
    throw_config_error(location(t, source) + ": " + e.what());
  }
}

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw_config_error(location_of(e.source(), source) +
                       ": TOML syntax error: " + std::string(e.description()));
  }
  for (const auto& o : overrides) apply_override(root, o);

  for (auto&& [k, v] : root)
    if (!contains(kSections, k.str()))
      unknown_key(key_location(k, v, source), std::string(k.str()), kSections, "",
                  "Allowed top-level tables");
  Config c;
  c.source = source;
  read_section(root, "run", c.run, source);
  read_section(root, "data", c.data, source);
  read_section(root, "model", c.model, source);
  read_section(root, "optimizer", c.optimizer, source);
  read_section(root, "loss", c.loss, source);
  read_stages(root, c);
  if (toml::node* p = root.get("plugins")) {
    auto* t = p->as_table();
    if (!t)
      throw_config_error(location(*p, source) + ": 'plugins' must be a table ([plugins]), got " +
                         describe_value(*p));
    c.plugins = std::move(*t);  // moved, not copied: the plugin loader's errors keep positions
  }
  if (const toml::node* a = root.get("ablation")) {
    read_section(root, "ablation", c.ablation, source);
    c.has_ablation = true;
    const toml::table& t = *a->as_table();
    const std::string here = location(*a, source);
    c.ablation.baseline_at = t.get("baseline") ? location(*t.get("baseline"), source) : here;
    c.ablation.techniques_at = t.get("techniques") ? location(*t.get("techniques"), source) : here;
  }
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw_config_error("cannot read config file '" + path + "': " + std::strerror(EISDIR));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_config_error("cannot read config file '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad())
    throw_config_error("cannot read config file '" + path + "': " + std::strerror(errno));
  return parse_config(text.str(), path, overrides);
}

std::string Config::to_toml() const {
  Config c = *this;  // visit() takes the fields by reference
  toml::table root;
  root.insert_or_assign("run", TomlWriter::write(c.run));
  root.insert_or_assign("data", TomlWriter::write(c.data));
  root.insert_or_assign("model", TomlWriter::write(c.model));
  root.insert_or_assign("optimizer", TomlWriter::write(c.optimizer));
  root.insert_or_assign("loss", TomlWriter::write(c.loss));
  toml::array stage_tables;
  for (auto& s : c.stages) stage_tables.push_back(TomlWriter::write(s));
  root.insert_or_assign("stages", std::move(stage_tables));
  if (!plugins.empty()) root.insert_or_assign("plugins", plugins);
  if (has_ablation) root.insert_or_assign("ablation", TomlWriter::write(c.ablation));
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

}  // namespace frugal
