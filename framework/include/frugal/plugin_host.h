#pragma once
/// Finds, loads, checks and unloads plugins (Boost.DLL).
///
/// Search path, in order: the build's plugin folder (build/lib/frugal/plugins) when this
/// libfrugal runs from the build tree, else <libdir>/frugal/plugins next to the libfrugal that
/// runs (so `cmake --install --prefix P` finds P's plugins), then the configured install
/// folder, FRUGAL_PLUGIN_PATH (':'-separated), then `[plugins] path` from the TOML (a string
/// or an array of strings, relative to the TOML file's folder).
///
/// Use: `PluginHost host(PluginHost::config_paths(cfg.plugins, cfg.source));` then
/// `host.load(cfg.plugins, cfg.source)` before check_config (plugins may register models,
/// datasets and losses the config names) and before the Learner is made.
///
/// Lifetime: the host keeps each library loaded while it lives, and every callback it hands
/// out keeps its library loaded too (its deleter owns a reference). Declare the host before
/// the Learner, so models a plugin registered die before their library unloads. On
/// destruction the host removes the plugins' registry entries, then unloads.
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>
#include <toml++/toml.h>

#include "frugal/callback.h"
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
  /// off), validates each table against the plugin's options, checks conflicts, runs on_load
  /// and creates the callbacks, then checks ordering needs (runs_before needs each callback's
  /// order()). Everything is checked before any callback is returned; the callbacks come
  /// sorted by order(). `[plugins] path` folders join the search path. Throws PluginError
  /// (not found: lists the available plugins and the folders searched; not a frugal plugin;
  /// ABI or LibTorch mismatch with both versions; a factory that throws; a conflict or order
  /// violation) or ConfigError (an option, with file:line:column). `source` names the TOML
  /// file in errors.
  std::vector<std::shared_ptr<Callback>> load(const toml::table& plugins, const std::string& source);

  /// The names of the plugins load() turned on, in order.
  const std::vector<std::string>& loaded() const { return loaded_names_; }

  /// The folders `[plugins] path` names, resolved against the config file's folder.
  static std::vector<std::string> config_paths(const toml::table& plugins, const std::string& source);

 private:
  struct Library;
  std::vector<std::string> search_path_;
  std::vector<std::shared_ptr<Library>> libraries_;
  std::vector<std::string> loaded_names_;
};

}  // namespace frugal
