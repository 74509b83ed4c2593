// The plugin loader: finds libfrugal_<name>.so files, checks what they declare, reads their
// options from [plugins.<name>] and hands out callbacks that keep their library loaded.
#include "frugal/app/plugin_host.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <boost/dll/shared_library.hpp>
#include <spdlog/spdlog.h>

#include "config/options_toml.h"
#include "frugal/app/run.h"
#include "frugal/base/compat.h"
#include "frugal/base/error.h"
#include "frugal/base/version.h"
#include "frugal/config/config.h"
#include "frugal/models/registry.h"
#include "frugal/models/script.h"
#include "frugal/optim/optimizers.h"
#include "frugal_build_paths.h"  // generated: FRUGAL_PLUGIN_BUILD_DIR, FRUGAL_PLUGIN_INSTALL_DIR

namespace fs = std::filesystem;

namespace frugal {

/// One loaded library and what the host made from it. Members die in reverse order: the
/// plugin's options and logger go before the library unloads.
struct PluginHost::Library {
  std::string name;  ///< from the file name (libfrugal_<name>.so)
  std::string path;
  boost::dll::shared_library lib;
  const PluginApi* api = nullptr;
  /// Made by the plugin and read from [plugins.<name>], one per load(): a callback may keep a
  /// reference to the options it was built from.
  std::vector<std::unique_ptr<Options>> options;
  std::shared_ptr<spdlog::logger> logger;
  bool on_load_ran = false;

  /// Opens `path` and checks what it declares: the frugal_plugin symbol, the plugin ABI, the
  /// LibTorch version and the name. Reuses a library in `held` with the same path.
  static std::shared_ptr<Library> open(const std::string& name, const std::string& path,
                                       const std::vector<std::shared_ptr<Library>>& held);

  ~Library() {
    options.clear();  // plugin code: before `lib` unloads (member order does it too)
    logger.reset();
  }
};

namespace {

constexpr const char* kPrefix = "libfrugal_";
constexpr const char* kSuffix = ".so";

[[noreturn]] void fail(const std::string& msg) { throw PluginError(msg); }

std::string join_names(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

/// "grad_clip" for ".../libfrugal_grad_clip.so", "" for any other file name.
std::string plugin_name_of(const fs::path& file) {
  const std::string f = file.filename().string();
  const size_t np = std::char_traits<char>::length(kPrefix);
  const size_t ns = std::char_traits<char>::length(kSuffix);
  if (f.size() <= np + ns || f.compare(0, np, kPrefix) != 0 ||
      f.compare(f.size() - ns, ns, kSuffix) != 0)
    return "";
  return f.substr(np, f.size() - np - ns);
}

std::string library_file(const std::string& name) { return kPrefix + name + kSuffix; }

/// "major.minor" of a version string ("2.1.0+cu121" -> "2.1").
std::string major_minor(const std::string& v) {
  const size_t a = v.find('.');
  if (a == std::string::npos) return v;
  const size_t b = v.find_first_not_of("0123456789", a + 1);
  return v.substr(0, b);
}

/// The folder libfrugal itself was loaded from.
void anchor() {}
fs::path own_folder() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&anchor), &info) == 0 || !info.dli_fname) return {};
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::path(info.dli_fname), ec);
  return (ec ? fs::path(info.dli_fname) : p).parent_path();
}

bool same_folder(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return !a.empty() && !b.empty() && fs::exists(a, ec) && fs::exists(b, ec) &&
         fs::equivalent(a, b, ec);
}

std::vector<std::string> split_path_list(const char* env) {
  std::vector<std::string> out;
  if (!env) return out;
  std::stringstream ss(env);
  std::string item;
  while (std::getline(ss, item, ':'))
    if (!item.empty()) out.push_back(item);
  return out;
}

/// The default folders: the build's plugin folder when this libfrugal runs from the build
/// tree, the one next to this libfrugal when it is installed (so an install with --prefix
/// still finds its plugins), the configured install folder, then FRUGAL_PLUGIN_PATH.
std::vector<std::string> default_search_path() {
  std::vector<std::string> out;
  const fs::path build_dir = FRUGAL_PLUGIN_BUILD_DIR;
  const fs::path here = own_folder();
  if (same_folder(here, build_dir.parent_path().parent_path()))
    out.push_back(build_dir.string());
  else if (!here.empty())
    out.push_back((here / "frugal" / "plugins").string());
  out.push_back(FRUGAL_PLUGIN_INSTALL_DIR);
  for (auto& p : split_path_list(std::getenv("FRUGAL_PLUGIN_PATH"))) out.push_back(p);
  return out;
}

void add_unique(std::vector<std::string>& v, const std::string& s) {
  if (std::find(v.begin(), v.end(), s) == v.end()) v.push_back(s);
}

/// `string "amp"`, `integer 3`, `a table`: what a TOML value is, for errors.
std::string describe_node(const toml::node& n) {
  std::ostringstream os;
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: os << "string " << toml::node_view<const toml::node>(n); break;
    case toml::node_type::integer: os << "integer " << toml::node_view<const toml::node>(n); break;
    case toml::node_type::floating_point: os << "float " << toml::node_view<const toml::node>(n); break;
    case toml::node_type::boolean: os << "boolean " << toml::node_view<const toml::node>(n); break;
    default: os << toml::node_view<const toml::node>(n); break;
  }
  return os.str();
}

/// The plugin's options plus the host's `enabled` key, so one read_options pass checks the
/// whole [plugins.<name>] table and keeps every key's line and column.
class WithEnabled : public Options {
 public:
  explicit WithEnabled(Options& inner) : inner_(inner) {}
  void visit(FieldVisitor& v) override {
    v.field("enabled", enabled_, "false keeps the plugin off (read by the loader)");
    inner_.visit(v);
  }
  void check() const override { inner_.check(); }
  std::string unknown_key_note(const std::string& key) const override { return inner_.unknown_key_note(key); }

 private:
  Options& inner_;
  bool enabled_ = true;
};

/// Runs plugin code; anything it throws comes back as a host-owned error with the message
/// copied, so no exception object or type_info from the plugin outlives the call.
template <class F>
auto guarded(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ConfigError& e) {
    throw ConfigError(e.what());
  } catch (const PluginError& e) {
    throw PluginError(e.what());
  } catch (const c10::Error& e) {
    throw PluginError(what + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw PluginError(what + ": " + e.what());
  } catch (...) {
    throw PluginError(what + ": unknown exception");
  }
}

/// Every libfrugal_<name>.so in `dirs`, the first found for a name winning, in search order.
std::vector<std::pair<std::string, fs::path>> scan(const std::vector<std::string>& dirs) {
  std::vector<std::pair<std::string, fs::path>> out;
  std::set<std::string> seen;
  for (const auto& d : dirs) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    std::vector<std::pair<std::string, fs::path>> here;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      const std::string name = plugin_name_of(e.path());
      if (!name.empty() && !e.is_directory(ec)) here.emplace_back(name, e.path());
    }
    std::sort(here.begin(), here.end());
    for (auto& h : here)
      if (seen.insert(h.first).second) out.push_back(std::move(h));
  }
  return out;
}

/// The spdlog logger a plugin gets: its name, the host's sinks and level. Not registered:
/// spdlog's registry is per shared library.
std::shared_ptr<spdlog::logger> make_logger(const std::string& name) {
  auto base = spdlog::default_logger();
  auto log = std::make_shared<spdlog::logger>(name, base->sinks().begin(), base->sinks().end());
  log->set_level(base->level());
  log->flush_on(base->flush_level());
  return log;
}

/// A callback made by load(), with its plugin's name, order and relations.
struct Made {
  std::string name;
  std::shared_ptr<Callback> cb;
  int order;
  CallbackFacts facts;
};

/// The relations as the Learner checks them (Callback::relations with the declared ones).
void check_relations(const std::vector<Made>& made) {
  std::vector<CallbackFacts> all;
  for (auto& m : made) all.push_back(m.facts);
  if (const std::string v = relation_violation(all); !v.empty()) fail(v);
}

}  // namespace

void to_json(nlohmann::json& j, const PluginDescription& d) {
  j = {{"name", d.name},
       {"description", d.description},
       {"version", d.version},
       {"path", d.path},
       {"abi_version", d.abi_version},
       {"torch_version", d.torch_version},
       {"frugal_version", d.frugal_version},
       {"options", d.options},
       {"runs_before", d.relations.runs_before},
       {"conflicts", d.relations.conflicts},
       {"innermost_forward", d.relations.innermost_forward}};
}

PluginHost::PluginHost(std::vector<std::string> extra) {
  for (auto& p : default_search_path()) add_unique(search_path_, p);
  for (auto& p : extra) add_unique(search_path_, p);
}

PluginHost::~PluginHost() {
  // Registry entries hold plugin code (std::function managers): drop them while it is loaded.
  for (const auto& lib : libraries_) {
    if (!lib->on_load_ran) continue;
    models().remove_owner(lib->name);
    remove_scripts(lib->name);
    datasets().remove_owner(lib->name);
    losses().remove_owner(lib->name);
    optimizers().remove_owner(lib->name);
  }
  // Each library unloads when its last callback dies (now, unless a Learner still holds one).
  libraries_.clear();
}

std::vector<PluginDescription> PluginHost::discover(std::vector<std::string>* problems) {
  std::vector<PluginDescription> out;
  for (const auto& [name, file] : scan(search_path_)) {
    try {
      std::shared_ptr<Library> lib = Library::open(name, file.string(), libraries_);
      const PluginApi& api = *lib->api;
      PluginDescription d;
      d.name = api.name;
      d.description = api.description ? api.description : "";
      d.version = api.version ? api.version : "";
      d.path = lib->path;
      d.abi_version = api.abi_version;
      d.torch_version = api.torch_version ? api.torch_version : "";
      d.frugal_version = api.frugal_version ? api.frugal_version : "";
      const std::string who = "plugin '" + name + "' (" + lib->path + ")";
      d.options = guarded(who + ": describing its options", [&] {
        std::unique_ptr<Options> o = api.make_options();  // dies here, the library still loaded
        if (!o) fail(who + ": make_options returned null");
        return describe_options(*o);
      });
      if (api.relations) d.relations = guarded(who + ": relations", [&] { return api.relations(); });
      out.push_back(std::move(d));
    } catch (const Error& e) {
      if (problems) problems->push_back(e.what());
    }
  }
  return out;
}

namespace {
/// What to do about a library the loader refused: a file that is not a shared library at all,
/// one missing symbols (built against another frugal or LibTorch), or the loader's reason alone.
std::string load_advice(const std::string& path, const std::string& why) {
  char magic[4] = {};
  std::ifstream f(path, std::ios::binary);
  f.read(magic, sizeof magic);
  if (f.gcount() == sizeof magic && std::memcmp(magic, "\x7f" "ELF", 4) != 0)
    return " (it is not a shared library: no ELF header; a plugin is built with frugal_add_plugin)";
  if (why.find("undefined symbol") != std::string::npos)
    return " (a plugin built against another frugal or LibTorch must be rebuilt against this one)";
  return "";
}
}  // namespace

std::shared_ptr<PluginHost::Library> PluginHost::Library::open(
    const std::string& name, const std::string& path,
    const std::vector<std::shared_ptr<Library>>& held) {
  for (const auto& l : held)
    if (l->path == path) return l;
  auto rec = std::make_shared<Library>();
  rec->name = name;
  rec->path = path;
  std::error_code ec;
  rec->lib.load(path, boost::dll::load_mode::rtld_local | boost::dll::load_mode::rtld_now, ec);
  if (ec) {
    const char* err = dlerror();  // Boost.DLL keeps only a generic error code
    const std::string why = err ? err : ec.message();
    fail("cannot load plugin '" + name + "' from '" + path + "': " + why + load_advice(path, why));
  }
  if (!rec->lib.has("frugal_plugin"))
    fail("'" + path + "' is not a frugal plugin (no 'frugal_plugin' symbol): a plugin exports "
         "one with FRUGAL_PLUGIN(...) from frugal/plugin.h");
  const PluginApi& api = rec->lib.get_alias<const PluginApi>("frugal_plugin");
  const std::string who = "plugin '" + name + "' (" + path + ")";
  // Only abi_version is read before it matches: the rest of the table may be laid out
  // differently in another ABI.
  if (api.abi_version != kAbiVersion)
    fail(who + " was built for plugin ABI " + std::to_string(api.abi_version) +
         ", this frugal has ABI " + std::to_string(kAbiVersion) + ": rebuild it against this frugal");
  const std::string torch = api.torch_version ? api.torch_version : "unknown";
  if (major_minor(torch) != major_minor(compat::torch_version()))
    fail(who + " was built with LibTorch " + torch + ", this frugal uses LibTorch " +
         compat::torch_version() + ": rebuild it against the LibTorch this frugal uses");
  if (!api.name || name != api.name)
    fail(who + " calls itself '" + (api.name ? api.name : "") + "': a plugin's library must be named " +
         library_file(api.name ? api.name : name));
  if (!api.make_options || !api.create) fail(who + " has no make_options or create function");
  rec->api = &api;
  return rec;
}

std::vector<std::string> PluginHost::config_paths(const toml::table& plugins,
                                                  const std::string& source, bool check_exists) {
  std::vector<std::string> out;
  const toml::node* n = plugins.get("path");
  if (!n) return out;
  const fs::path base = fs::path(source).parent_path();
  auto add = [&](const toml::node& item) {
    const auto* s = item.as_string();
    if (!s)
      throw_config_error(location(item, source) +
                         ": 'plugins.path' must be a folder or a list of folders (strings), got " +
                         describe_node(item));
    fs::path p = s->get();
    if (p.is_relative() && !base.empty()) p = base / p;
    // Absolute: the resolved config (config.toml in the run folder) must find it from anywhere.
    std::error_code ec;
    out.push_back(fs::absolute(p, ec).lexically_normal().string());
    if (check_exists && !fs::is_directory(out.back(), ec))
      throw_config_error(location(item, source) + ": 'plugins.path' names '" + s->get() +
                         "', which is not a folder (looked for " + out.back() +
                         "; a relative path is relative to the config file)");
  };
  if (const auto* a = n->as_array()) {
    for (const auto& item : *a) add(item);
  } else {
    add(*n);
  }
  return out;
}

struct PluginHost::Wanted {
  std::string name;
  const toml::table* table = nullptr;
  std::shared_ptr<Library> lib;
};

std::vector<std::shared_ptr<Callback>> PluginHost::load(const toml::table& plugins,
                                                        const std::string& source) {
  std::vector<Wanted> wanted = wanted_plugins(plugins, source);
  open_libraries(wanted, source);
  const auto relations = check_conflicts(wanted);  // before any plugin code runs
  // on_load first: a plugin's options may name an optimizer (model, ...) a plugin registers.
  for (auto& w : wanted) run_on_load(w);
  for (auto& w : wanted) read_plugin_options(w, source);
  check_disabled_options(plugins, source);
  return create_callbacks(wanted, relations);
}

/// The key names of the tables `enabled = false` turns off are checked against their plugin's
/// options, so a typo does not wait for the day the plugin is turned on; their values are not
/// (they may name what only a plugin that is on registers, and check() may want keys a user set
/// aside). A plugin that is not installed, or does not load, is left alone: turning it off is how
/// a user sets it aside.
void PluginHost::check_disabled_options(const toml::table& plugins, const std::string& source) {
  std::vector<std::pair<std::string, fs::path>> found;
  for (auto&& [key, node] : plugins) {
    const std::string name(key.str());
    const toml::table* t = node.as_table();
    const toml::node* e = t ? t->get("enabled") : nullptr;
    if (name == "path" || !e || !e->is_boolean() || e->as_boolean()->get()) continue;
    if (found.empty()) found = scan(search_path_);
    auto it = std::find_if(found.begin(), found.end(), [&](const auto& f) { return f.first == name; });
    if (it == found.end()) continue;
    // The library outlives the options it made (their code is in it).
    std::shared_ptr<Library> lib;
    std::unique_ptr<Options> opts;
    try {
      lib = Library::open(name, it->second.string(), libraries_);
      opts = guarded("plugin '" + name + "': make_options", [&] { return lib->api->make_options(); });
    } catch (const Error&) {
      continue;
    }
    if (!opts) continue;
    WithEnabled all(*opts);
    const std::vector<std::string> keys = detail::field_keys(all);
    const std::string where = "plugins." + name;
    for (auto&& [k, v] : *t)
      if (!detail::contains(keys, k.str()))
        detail::unknown_key(detail::key_location(k, v, source), std::string(k.str()), keys, where,
                            "Allowed keys in [" + where + "]", all.unknown_key_note(std::string(k.str())));
  }
}

void PluginHost::register_plugins(const toml::table& plugins, const std::string& source) {
  std::vector<Wanted> wanted = wanted_plugins(plugins, source);
  open_libraries(wanted, source);
  for (auto& w : wanted) run_on_load(w);
}

std::vector<std::string> PluginHost::keys_outside_training() const {
  std::vector<std::string> out;
  for (const auto& name : loaded_names_)
    for (const auto& lib : libraries_)
      if (lib->name == name && !lib->options.empty())
        for (auto& k : frugal::keys_outside_training(*lib->options.back(), "plugins." + name))
          out.push_back(std::move(k));
  return out;
}

/// The [plugins.<name>] tables turned on (`enabled` checked here); `[plugins] path` folders
/// join the search path.
std::vector<PluginHost::Wanted> PluginHost::wanted_plugins(const toml::table& plugins,
                                                           const std::string& source) {
  for (auto& p : config_paths(plugins, source)) add_unique(search_path_, p);
  std::vector<Wanted> wanted;
  for (auto&& [key, node] : plugins) {
    const std::string name(key.str());
    if (name == "path") continue;
    const auto* t = node.as_table();
    if (!t)
      throw_config_error(location(node, source) + ": 'plugins." + name + "' must be a table ([plugins." +
                         name + "], empty to use the defaults), got " + describe_node(node));
    if (const toml::node* e = t->get("enabled")) {
      if (!e->is_boolean())
        throw_config_error(location(*e, source) + ": 'plugins." + name +
                           ".enabled' must be true or false, got " + describe_node(*e));
      if (!e->as_boolean()->get()) continue;
    }
    wanted.push_back({name, t, nullptr});
  }
  return wanted;
}

/// Finds, opens and checks each library (not found: the available plugins, the nearest name
/// and the folders searched).
void PluginHost::open_libraries(std::vector<Wanted>& wanted, const std::string& source) {
  if (wanted.empty()) return;
  const std::vector<std::pair<std::string, fs::path>> found = scan(search_path_);
  for (auto& w : wanted) {
    auto it = std::find_if(found.begin(), found.end(), [&](const auto& f) { return f.first == w.name; });
    if (it == found.end()) {
      std::vector<std::string> names;
      for (auto& f : found) names.push_back(f.first);
      std::sort(names.begin(), names.end());
      std::string msg = location(*w.table, source) + ": plugin '" + w.name + "' not found";
      const std::string near = nearest(w.name, names);
      if (!near.empty()) msg += "; did you mean '" + near + "'?";
      const char* env = std::getenv("FRUGAL_PLUGIN_PATH");
      msg += " Available: " + (names.empty() ? std::string("none") : join_names(names)) +
             ". Searched: " + join_names(search_path_) + " (FRUGAL_PLUGIN_PATH: " +
             (env && *env ? env : "unset") + "). Add a folder with [plugins] path or FRUGAL_PLUGIN_PATH";
      fail(msg);
    }
    w.lib = Library::open(w.name, it->second.string(), libraries_);
    if (std::find(libraries_.begin(), libraries_.end(), w.lib) == libraries_.end())
      libraries_.push_back(w.lib);
  }
}

/// Each plugin's relations; throws when two plugins that are on conflict.
std::map<std::string, PluginRelations> PluginHost::check_conflicts(const std::vector<Wanted>& wanted) {
  std::map<std::string, PluginRelations> relations;
  for (auto& w : wanted)
    if (w.lib->api->relations)
      relations[w.name] = guarded("plugin '" + w.name + "': relations",
                                  [&] { return w.lib->api->relations(); });
  std::vector<CallbackFacts> declared;
  for (auto& w : wanted) declared.push_back({w.name, 0, false, relations[w.name]});
  if (const std::string v = conflict_violation(declared); !v.empty()) fail(v);
  return relations;
}

/// on_load, once per library; the host's destructor removes whatever it registered.
void PluginHost::run_on_load(Wanted& w) {
  Library& lib = *w.lib;
  if (!lib.logger) lib.logger = make_logger(w.name);
  if (!lib.api->on_load || lib.on_load_ran) return;
  lib.on_load_ran = true;  // set first: the destructor cleans up even if on_load threw
  const PluginContext ctx{w.name, lib.logger};
  guarded("plugin '" + w.name + "' failed in on_load", [&] { lib.api->on_load(ctx); });
}

/// The plugin's options, read from its table (every key, with line:column).
void PluginHost::read_plugin_options(Wanted& w, const std::string& source) {
  Library& lib = *w.lib;
  const std::string who = "plugin '" + w.name + "' (" + lib.path + ")";
  std::unique_ptr<Options> opts = guarded(who + ": make_options", [&] { return lib.api->make_options(); });
  if (!opts) fail(who + ": make_options returned null");
  WithEnabled all(*opts);
  guarded(who + ": reading [plugins." + w.name + "]",
          [&] { read_options(*w.table, all, "plugins." + w.name, source); });
  lib.options.push_back(std::move(opts));
}

/// The callbacks, then their relations as the Learner checks them (runs_before, conflicts,
/// innermost_forward); sorted by order().
std::vector<std::shared_ptr<Callback>> PluginHost::create_callbacks(
    std::vector<Wanted>& wanted, const std::map<std::string, PluginRelations>& relations) {
  std::vector<Made> made;
  for (auto& w : wanted) {
    Library& lib = *w.lib;
    const PluginContext ctx{w.name, lib.logger};
    const std::string who = "plugin '" + w.name + "'";
    std::unique_ptr<Callback> raw =
        guarded(who + " failed to start", [&] { return lib.api->create(*lib.options.back(), ctx); });
    if (!raw) fail(who + " failed to start: its factory returned null");
    // The deleter owns the library: the .so stays loaded while the callback lives.
    std::shared_ptr<Callback> cb(raw.release(), [keep = w.lib](Callback* c) { delete c; });
    CallbackFacts facts = guarded(who + ": order() or relations()", [&] { return facts_of(*cb); });
    facts.name = w.name;  // relations name plugins
    if (auto it = relations.find(w.name); it != relations.end()) {
      for (auto& b : it->second.runs_before) facts.relations.runs_before.push_back(b);
      for (auto& b : it->second.conflicts) facts.relations.conflicts.push_back(b);
    }
    made.push_back({w.name, std::move(cb), facts.order, std::move(facts)});
  }
  check_relations(made);
  std::stable_sort(made.begin(), made.end(), [](const Made& x, const Made& y) { return x.order < y.order; });
  std::vector<std::shared_ptr<Callback>> out;
  for (auto& m : made) {
    loaded_names_.push_back(m.name);
    out.push_back(std::move(m.cb));
  }
  return out;
}

ConfigWithPlugins load_config_with_plugins(const std::string& path,
                                           const std::vector<std::string>& overrides, bool read_data) {
  ConfigWithPlugins out;
  const toml::table plugins = read_plugins_table(path, overrides);
  const std::vector<std::string> folders = PluginHost::config_paths(plugins, path, /*check_exists=*/true);
  out.host = std::make_unique<PluginHost>(folders);
  out.callbacks = out.host->load(plugins, path);
  out.config = load_config(path, overrides);
  // The run folder's config.toml resumes as is: its plugin folders are the absolute ones found.
  if (out.config.plugins.contains("path")) {
    toml::array absolute;
    for (const auto& f : folders) absolute.push_back(f);
    out.config.plugins.insert_or_assign("path", std::move(absolute));
  }
  if (read_data)
    check_config(out.config);
  else
    check_config_names(out.config);
  return out;
}

}  // namespace frugal
