#pragma once
/// The one symbol a plugin library exports. frugal_add_plugin compiles a plugin's sources with
/// FRUGAL_PLUGIN_ID=<name>, so FRUGAL_PLUGIN defines the table under a hidden name of its own
/// (frugal_plugin_api_<name>: several plugins' objects link into one test binary), and adds a
/// generated file to the library holding FRUGAL_PLUGIN_EXPORT(<name>): the alias
/// "frugal_plugin" the host looks up. No LibTorch here: that file compiles in a moment.
#include <boost/dll/alias.hpp>

#define FRUGAL_PLUGIN_CAT_(A, B) A##B
#define FRUGAL_PLUGIN_CAT(A, B) FRUGAL_PLUGIN_CAT_(A, B)
#define FRUGAL_PLUGIN_STR_(A) #A
#define FRUGAL_PLUGIN_STR(A) FRUGAL_PLUGIN_STR_(A)

/// The hidden name of plugin ID's table: frugal_plugin_api_<ID>.
#define FRUGAL_PLUGIN_API_SYMBOL(ID) FRUGAL_PLUGIN_CAT(frugal_plugin_api_, ID)

namespace frugal {
struct PluginApi;
}  // namespace frugal

/// Exports plugin ID's table (defined by FRUGAL_PLUGIN in another file) as "frugal_plugin".
#define FRUGAL_PLUGIN_EXPORT(ID)                                   \
  extern "C" const ::frugal::PluginApi FRUGAL_PLUGIN_API_SYMBOL(ID); \
  BOOST_DLL_ALIAS(FRUGAL_PLUGIN_API_SYMBOL(ID), frugal_plugin)
