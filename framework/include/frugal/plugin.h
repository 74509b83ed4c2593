#pragma once
/// Writing a plugin: one class deriving from frugal::Callback, an Options struct, and one
/// FRUGAL_PLUGIN line; <name>.h declares them, <name>.cpp defines them and holds the line.
/// frugal_add_plugin(<name> <name>.cpp) builds libfrugal_<name>.so with -fvisibility=hidden,
/// exporting the one factory table the host looks for (frugal/plugin_export.h), and an object
/// library of the same code that tests link. In short (the definitions inline):
///
///   struct ClipOptions : frugal::Options {
///     double max_norm = 1.0;  ///< default 1.0
///     void visit(frugal::FieldVisitor& v) override {
///       v.field("max_norm", max_norm, "largest gradient norm", frugal::positive());
///     }
///   };
///   class Clip : public frugal::Callback {
///    public:
///     Clip(const ClipOptions& o, frugal::PluginContext ctx) : o_(o), log_(ctx.logger) {}
///     std::string name() const override { return "clip"; }
///     void before_step(frugal::Learner& l) override { ... }
///    private:
///     ClipOptions o_;
///     std::shared_ptr<spdlog::logger> log_;
///   };
///   FRUGAL_PLUGIN(Clip, ClipOptions, "clip", "clips the gradient norm", "1.0.0")
///
/// Lifetime rules (the host enforces them): the host keeps the library loaded while any
/// object from it lives (callbacks, options, registry entries); nothing from a plugin — a
/// std::function, a deleter, a type_info, an exception — outlives it. Exceptions thrown by a
/// plugin are copied into host-owned frugal errors. Plugins never call spdlog::get: the host
/// creates their logger and hands it in.
#include <memory>
#include <string>
#include <vector>

#include <boost/config.hpp>
#include <boost/dll/alias.hpp>
#include <spdlog/logger.h>
#include <torch/version.h>

#include "frugal/base/options.h"
#include "frugal/base/version.h"
#include "frugal/core/callback.h"
#include "frugal/core/learner.h"
#include "frugal/plugin_export.h"

namespace frugal {

/// What the host hands a plugin's factory.
struct PluginContext {
  std::string name;                        ///< the plugin's name
  std::shared_ptr<spdlog::logger> logger;  ///< created by the host, named after the plugin
};

/// Ordering needs and conflicts a plugin declares (CallbackRelations; names are plugin names).
/// The loader reads them before any plugin code runs (conflicts) and checks them against the
/// callbacks' order() once they exist; `frugal plugins` lists them. A plugin's callback returns
/// the same from Callback::relations(), which the Learner checks when the callback is added:
/// pass one function to both, as the in-tree plugins do.
using PluginRelations = CallbackRelations;

/// What the host asks of a plugin library. Exported by FRUGAL_PLUGIN with BOOST_DLL_ALIAS
/// under the name "frugal_plugin"; every field is plain data or a plain function pointer.
struct PluginApi {
  int abi_version;            ///< frugal::kAbiVersion the plugin was built with
  const char* torch_version;  ///< TORCH_VERSION the plugin was built with
  const char* frugal_version; ///< frugal::kVersion the plugin was built with
  const char* name;
  const char* description;    ///< one line
  const char* version;        ///< the plugin's own version
  /// Default options (the host reads [plugins.<name>] into them and describes them).
  std::unique_ptr<Options> (*make_options)();
  /// Builds the callback from validated options. May throw; the host names the plugin.
  std::unique_ptr<Callback> (*create)(const Options& options, const PluginContext& ctx);
  /// Optional: registers models, datasets or losses (owner = the plugin's name). The host
  /// removes them before the library unloads. May be null.
  void (*on_load)(const PluginContext& ctx);
  /// Optional: the plugin's ordering needs and conflicts. May be null.
  PluginRelations (*relations)();
};

}  // namespace frugal

/// Exports a plugin: CALLBACK is constructible from (const OPTIONS&, const PluginContext&).
#define FRUGAL_PLUGIN(CALLBACK, OPTIONS, NAME, DESCRIPTION, VERSION) \
  FRUGAL_PLUGIN_EX(CALLBACK, OPTIONS, NAME, DESCRIPTION, VERSION, nullptr, nullptr)

/// The same, with RELATIONS (a function returning frugal::PluginRelations, or nullptr) and
/// ON_LOAD (a function `void f(const frugal::PluginContext&)` run once the library loads, to
/// register models, datasets or losses with owner = ctx.name; or nullptr).
#define FRUGAL_PLUGIN_EX(CALLBACK, OPTIONS, NAME, DESCRIPTION, VERSION, RELATIONS, ON_LOAD) \
  namespace frugal_plugin_detail {                                                           \
  static std::unique_ptr<::frugal::Options> make_options() {                                 \
    return std::make_unique<OPTIONS>();                                                      \
  }                                                                                          \
  static std::unique_ptr<::frugal::Callback> create(const ::frugal::Options& o,             \
                                                    const ::frugal::PluginContext& ctx) {    \
    return std::make_unique<CALLBACK>(dynamic_cast<const OPTIONS&>(o), ctx);                 \
  }                                                                                          \
  }                                                                                          \
  FRUGAL_PLUGIN_TABLE_(NAME) = {::frugal::kAbiVersion,                                       \
                                TORCH_VERSION,                                               \
                                ::frugal::kVersion,                                          \
                                NAME,                                                        \
                                DESCRIPTION,                                                 \
                                VERSION,                                                     \
                                &frugal_plugin_detail::make_options,                         \
                                &frugal_plugin_detail::create,                               \
                                ON_LOAD,                                                     \
                                RELATIONS};                                                  \
  FRUGAL_PLUGIN_ALIAS_

namespace frugal::detail {
/// Whether two C strings are equal, at compile time.
constexpr bool same_name(const char* a, const char* b) {
  while (*a && *a == *b) ++a, ++b;
  return *a == *b;
}
}  // namespace frugal::detail

#ifdef FRUGAL_PLUGIN_ID
// Built by frugal_add_plugin: the table under its hidden name; the library's generated file
// exports it (frugal/plugin_export.h).
#define FRUGAL_PLUGIN_TABLE_(NAME)                                                          \
  static_assert(::frugal::detail::same_name(NAME, FRUGAL_PLUGIN_STR(FRUGAL_PLUGIN_ID)),    \
                "FRUGAL_PLUGIN's name must be the one given to frugal_add_plugin (the host " \
                "loads plugin <name> from libfrugal_<name>.so)");                           \
  extern "C" const ::frugal::PluginApi FRUGAL_PLUGIN_API_SYMBOL(FRUGAL_PLUGIN_ID)
#define FRUGAL_PLUGIN_ALIAS_
#else
// Built some other way: the table is exported here.
#define FRUGAL_PLUGIN_TABLE_(NAME) \
  namespace frugal_plugin_detail { \
  extern const ::frugal::PluginApi api; \
  }                                \
  const ::frugal::PluginApi frugal_plugin_detail::api
#define FRUGAL_PLUGIN_ALIAS_ BOOST_DLL_ALIAS(frugal_plugin_detail::api, frugal_plugin)
#endif
