#pragma once
/// What an OwnKeys holds: a TOML table (for the config reader, the optimizer registry and the
/// schedules; not part of the SDK).
#include <toml++/toml.h>

#include "frugal/config/sections.h"

namespace frugal {

struct OwnKeys::Table {
  toml::table t;
};

/// The table of `k`.
inline toml::table& toml_of(OwnKeys& k) { return k.table().t; }
inline const toml::table& toml_of(const OwnKeys& k) { return k.table().t; }

}  // namespace frugal
