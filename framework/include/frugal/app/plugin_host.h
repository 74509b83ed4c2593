#pragma once
/// Finds, loads, checks and unloads plugins (Boost.DLL).
///
/// Search path, in order: the build's plugin folder (build/lib/frugal/plugins) when this
/// libfrugal runs from the build tree, else <libdir>/frugal/plugins next to the libfrugal that
/// runs (so `cmake --install --prefix P` finds P's plugins), then the configured install
/// folder, FRUGAL_PLUGIN_PATH (':'-separated), then `[plugins] path` from the TOML (a string
/// or an array of strings, relative to the TOML file's folder).
///
/// Use: load_config_with_plugins(path, overrides), which reads [plugins] first, loads the
/// plugins (they may register the optimizers, models, datasets and losses the config names),
/// then reads and checks the rest of the config. By hand: `auto p = read_plugins_table(path);
/// PluginHost host(PluginHost::config_paths(p, path)); auto cbs = host.load(p, path);` then
/// load_config and check_config, before the Learner is made.
///
/// Lifetime: the host keeps each library loaded while it lives, and every callback it hands
/// out keeps its library loaded too (its deleter owns a reference). Declare the host before
/// the Learner, so models a plugin registered die before their library unloads. On
/// destruction the host removes the plugins' registry entries, then unloads.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>
#include <toml++/toml.h>

#include "frugal/config/config.h"
#include "frugal/core/callback.h"
#include "frugal/plugin.h"

namespace frugal {

/// One plugin as `frugal plugins` lists it.
struct PluginDescription {
  std::string name;
  std::string description;
  std::string version;
  std::string path;            ///< the library file
  int abi_version = 0;
  std::string torch_version;   ///< LibTorch it was built with
  std::string frugal_version;  ///< frugal it was built with
  nlohmann::json options;      ///< describe_options() of its defaults
  PluginRelations relations;
};
void to_json(nlohmann::json& j, const PluginDescription& d);

class PluginHost {
 public:
  /// `extra` folders are searched after the default ones (e.g. from `[plugins] path`).
  explicit PluginHost(std::vector<std::string> extra = {});
  ~PluginHost();
  PluginHost(const PluginHost&) = delete;
  PluginHost& operator=(const PluginHost&) = delete;

  /// The folders searched, in order (existing or not).
  const std::vector<std::string>& search_path() const { return search_path_; }

  /// Every plugin library (libfrugal_<name>.so) in the search path; the first found wins for
  /// a name. A library that is not a loadable frugal plugin is reported in `problems`.
  std::vector<PluginDescription> discover(std::vector<std::string>* problems = nullptr);

  /// Loads what `[plugins]` turns on (a [plugins.<name>] table; `enabled = false` keeps it
  /// off), checks conflicts, runs on_load (so a plugin's option table may name an optimizer
  /// another plugin registers), validates each table against the plugin's options, creates
  /// the callbacks, then checks ordering needs (runs_before needs each callback's order()).
  /// A table turned off has its key names checked against its plugin's options when the
  /// plugin is installed (a typo is found before the day it is turned on). Everything is
  /// checked before any callback is returned; the callbacks come sorted by order(). `[plugins] path` folders join the search path. Throws PluginError
  /// (not found: lists the available plugins and the folders searched; not a frugal plugin;
  /// ABI or LibTorch mismatch with both versions; a factory that throws; a conflict or order
  /// violation) or ConfigError (an option, with file:line:column). `source` names the TOML
  /// file in errors.
  std::vector<std::shared_ptr<Callback>> load(const toml::table& plugins, const std::string& source);

  /// Opens the plugins `[plugins]` turns on and runs their on_load, so the registries know the
  /// optimizers, models, datasets and losses they add; reads no options and makes no
  /// callback. For a process that reads a config without training it (frugal ablate, plan).
  void register_plugins(const toml::table& plugins, const std::string& source);

  /// The names of the plugins load() turned on, in order.
  const std::vector<std::string>& loaded() const { return loaded_names_; }

  /// The dotted keys ("plugins.<name>.<key>") of the loaded plugins' options marked
  /// outside_training: they may differ when a run resumes.
  std::vector<std::string> keys_outside_training() const;

  /// The folders `[plugins] path` names, resolved against the config file's folder, absolute.
  /// With `check_exists`, one that is not a folder is a ConfigError at its file:line:column.
  static std::vector<std::string> config_paths(const toml::table& plugins, const std::string& source,
                                               bool check_exists = false);

 private:
  struct Library;
  struct Wanted;  ///< a plugin [plugins] turns on: its table, then its library
  std::vector<Wanted> wanted_plugins(const toml::table& plugins, const std::string& source);
  void open_libraries(std::vector<Wanted>& wanted, const std::string& source);
  static std::map<std::string, PluginRelations> check_conflicts(const std::vector<Wanted>& wanted);
  static void run_on_load(Wanted& w);
  static void read_plugin_options(Wanted& w, const std::string& source);
  void check_disabled_options(const toml::table& plugins, const std::string& source);
  std::vector<std::shared_ptr<Callback>> create_callbacks(
      std::vector<Wanted>& wanted, const std::map<std::string, PluginRelations>& relations);

  std::vector<std::string> search_path_;
  std::vector<std::shared_ptr<Library>> libraries_;
  std::vector<std::string> loaded_names_;
};

/// A config file read with the plugins it turns on, in the order that lets a plugin register
/// what the config names. Members die config first, host last.
struct ConfigWithPlugins {
  std::unique_ptr<PluginHost> host;                  ///< keeps the plugins loaded
  std::vector<std::shared_ptr<Callback>> callbacks;  ///< the plugins' callbacks, by order()
  Config config;
};
/// Reads [plugins] of the file at `path` (read_plugins_table), loads those plugins, then reads
/// and validates the whole config (load_config) and checks what it names against the
/// registries (check_config; with `read_data` false only the names, not the data files: a run
/// folder's model is rebuilt without its training data). Throws ConfigError or PluginError.
ConfigWithPlugins load_config_with_plugins(const std::string& path,
                                           const std::vector<std::string>& overrides = {},
                                           bool read_data = true);

}  // namespace frugal
