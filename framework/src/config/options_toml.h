#pragma once
// libfrugal-internal: Options read from and written to TOML tables, and the wording of values
// in errors. config.cpp (the run configuration) and optimizers.cpp (an optimizer's own keys)
// share them; read_options and location in frugal/config.h are the public face.
#include <string>
#include <string_view>
#include <vector>

#include <toml++/toml.h>

#include "frugal/base/options.h"

namespace frugal::detail {

/// Reads the keys of `t` that `o` declares into `o`, checking types and limits (errors at the
/// value's file:line:column); absent keys keep their values, other keys are left alone, and
/// check() is not run.
void read_fields(const toml::table& t, Options& o, const std::string& where,
                 const std::string& source);
/// The keys `o` declares, in order.
std::vector<std::string> field_keys(Options& o);
/// Every field of `o` as a TOML table; a table whose `present` flag is false is left out.
toml::table write_fields(Options& o);

/// "file:line:column" of a source region, "file" when it has no position, or the override
/// ("--set a.b=c") a value came from.
std::string location_of(const toml::source_region& r, const std::string& source);
/// Where a key is written; a key an override added has no position, so its value's is used.
std::string key_location(const toml::key& k, const toml::node& v, const std::string& source);
/// A TOML basic string: "abc", "a\"b".
std::string quote(const std::string& s);
/// A value with its type, for "got ...": string "abc", float 2.5, an array.
std::string describe_value(const toml::node& n);
/// "where.key", or "key" when `where` is empty.
std::string dotted(const std::string& where, std::string_view key);
std::string join(const std::vector<std::string>& items, const char* sep);
bool contains(const std::vector<std::string>& items, std::string_view s);
/// Throws the "unknown key" ConfigError: the key, the nearest allowed one, `note` (a sentence,
/// may be empty) and the allowed keys.
[[noreturn]] void unknown_key(const std::string& loc, const std::string& key,
                              const std::vector<std::string>& allowed, const std::string& where,
                              const std::string& what_allowed, const std::string& note = "");

}  // namespace frugal::detail
