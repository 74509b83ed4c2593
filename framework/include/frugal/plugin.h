#pragma once
/// Writing a plugin: one class deriving from frugal::Callback, an Options struct, and one
/// FRUGAL_PLUGIN line. Built as libfrugal_<name>.so with -fvisibility=hidden; the macro
/// exports the one factory table the host looks for.
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

#include "frugal/callback.h"
#include "frugal/learner.h"
#include "frugal/options.h"
#include "frugal/version.h"

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
  const ::frugal::PluginApi api = {::frugal::kAbiVersion, TORCH_VERSION, ::frugal::kVersion, \
                                   NAME,                  DESCRIPTION,   VERSION,            \
                                   &make_options,         &create,       ON_LOAD,            \
                                   RELATIONS};                                               \
  }                                                                                          \
  BOOST_DLL_ALIAS(frugal_plugin_detail::api, frugal_plugin)
