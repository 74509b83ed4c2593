#pragma once
/// The run configuration: TOML to typed options (config/sections.h), every key validated before
/// any work.
/// Errors name file:line:column, the key, what is allowed and the nearest key for a typo.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "frugal/config/sections.h"

namespace frugal {

struct Config {
  RunOptions run;
  DataOptions data;
  ModelOptions model;
  OptimizerOptions optimizer;
  /// [schedule]: every stage's schedule unless its [stages.schedule] says otherwise; with
  /// span = "fit" one curve over the whole fit.
  ScheduleOptions schedule;
  LossOptions loss;
  std::vector<StageOptions> stages;  ///< at least one
  DistributedOptions distributed;    ///< how ranks talk in a data-parallel run
  /// [plugins]: `path` and one [plugins.<name>] table per plugin; validated by the plugin
  /// loader against each plugin's declared options.
  toml::table plugins;
  AblationOptions ablation;   ///< used by `frugal ablate` and `frugal plan`
  bool has_ablation = false;  ///< the file has an [ablation] table
  std::string source;  ///< the config file's path (for errors)
  /// The keys `--set` gave a value ("data.paths" -> "--set data.paths=[...]"), for errors.
  std::map<std::string, std::string> set_by;

  /// Where `key`'s value came from, for an error about it: "--set data.paths=[...]" when an
  /// override set it; the file, "(with --set ...)" added when an override set a key under it
  /// ("model" after --set model.width=8); else the file.
  std::string where(const std::string& key) const;

  /// The resolved configuration, every key with its value, as TOML text.
  std::string to_toml() const;
  /// The dotted keys of the built-in sections' fields marked outside_training ("run.out_dir",
  /// "run.memory_budget", ...): they may differ when a run resumes.
  std::vector<std::string> keys_outside_training() const;
};

/// Reads and validates `path`, applying `overrides` ("a.b=value", value in TOML syntax or a
/// bare string) first. Throws ConfigError: missing file, malformed TOML, unknown key (with
/// the nearest), wrong type, value out of range.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
/// The [plugins] table of the config file at `path` after `overrides`, read before the rest of
/// the file: plugins load first because a plugin may register the optimizer (model, dataset,
/// loss) the rest names. Moved out of the parsed file, so errors keep their positions. Throws
/// ConfigError for a missing file, malformed TOML, a bad override or a [plugins] that is not a
/// table.
toml::table read_plugins_table(const std::string& path,
                               const std::vector<std::string>& overrides = {});
/// The same as load_config from TOML text; `source` names it in errors.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

/// Fills `o` from `t` (an Options struct's keys), rejects unknown keys, then runs o.check().
/// `where` is the table's dotted path ("data", "plugins.amp") and `source` the file, both for
/// errors. The keys are read before unknown ones are looked for: which keys `o` has may depend
/// on a value it read (an optimizer's name).
void read_options(const toml::table& t, Options& o, const std::string& where,
                  const std::string& source);

/// "file:line:column" of a node, or "file" / "--set a.b=c" when it has none.
std::string location(const toml::node& n, const std::string& source);

}  // namespace frugal
