# frugal_add_plugin(<name> <source>... [OUTPUT_DIRECTORY <dir>] [NO_INSTALL])
#
# Builds the plugin library libfrugal_<name>.so (target frugal_plugin_<name>) with hidden
# symbols: only the FRUGAL_PLUGIN export is visible. Used by frugal's own plugins/ and, through
# find_package(frugal), by plugins built out of tree.
#
#   OUTPUT_DIRECTORY  where the library is written. Default: ${FRUGAL_PLUGIN_OUTPUT_DIR} in
#                     frugal's tree (build/lib/frugal/plugins), else the caller's build folder
#                     (point FRUGAL_PLUGIN_PATH or [plugins] path at it).
#   NO_INSTALL        no install rule (test fixtures). Otherwise `cmake --install` puts it in
#                     <prefix>/${CMAKE_INSTALL_LIBDIR}/frugal/plugins, where frugal looks.
include_guard(GLOBAL)
include(GNUInstallDirs)

# The plugins' shared precompiled header (in frugal's tree only): an object library compiled
# exactly as plugins are, so GCC's PCH matches their flags and visibility.
function(_frugal_plugin_pch)
  if(TARGET frugal_plugin_pch)
    return()
  endif()
  set(src ${CMAKE_BINARY_DIR}/frugal_plugin_pch.cpp)
  file(CONFIGURE OUTPUT ${src} CONTENT "// Holds the plugins' precompiled header.\n")
  add_library(frugal_plugin_pch OBJECT ${src})
  set_target_properties(frugal_plugin_pch PROPERTIES
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON POSITION_INDEPENDENT_CODE ON)
  target_compile_features(frugal_plugin_pch PRIVATE cxx_std_17)
  target_link_libraries(frugal_plugin_pch PRIVATE frugal)
  target_compile_options(frugal_plugin_pch PRIVATE -Winvalid-pch)
  target_precompile_headers(frugal_plugin_pch PRIVATE
    <torch/torch.h> <toml++/toml.h> <nlohmann/json.hpp> <spdlog/spdlog.h>)
endfunction()

function(frugal_add_plugin name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_INSTALL" "OUTPUT_DIRECTORY" "")
  set(sources ${arg_UNPARSED_ARGUMENTS})
  if(NOT name MATCHES "^[A-Za-z0-9_]+$")
    message(FATAL_ERROR "frugal_add_plugin: plugin name '${name}' must be letters, digits and _")
  endif()
  if(NOT sources)
    message(FATAL_ERROR "frugal_add_plugin(${name}): no source files")
  endif()
  set(out "${arg_OUTPUT_DIRECTORY}")
  if(NOT out)
    if(DEFINED FRUGAL_PLUGIN_OUTPUT_DIR)
      set(out "${FRUGAL_PLUGIN_OUTPUT_DIR}")
    else()
      set(out "${CMAKE_CURRENT_BINARY_DIR}")
    endif()
  endif()

  set(target frugal_plugin_${name})
  add_library(${target} MODULE ${sources})
  set_target_properties(${target} PROPERTIES
    PREFIX "lib"
    DEFINE_SYMBOL ""                    # no <target>_EXPORTS macro: all plugins share one PCH
    OUTPUT_NAME "frugal_${name}"
    SUFFIX ".so"
    LIBRARY_OUTPUT_DIRECTORY "${out}"
    CXX_VISIBILITY_PRESET hidden        # -fvisibility=hidden
    VISIBILITY_INLINES_HIDDEN ON        # -fvisibility-inlines-hidden
    POSITION_INDEPENDENT_CODE ON)
  target_compile_features(${target} PRIVATE cxx_std_17)
  target_link_libraries(${target} PRIVATE frugal::frugal)
  set_property(GLOBAL APPEND PROPERTY FRUGAL_PLUGIN_TARGETS ${target})

  # In frugal's tree every plugin reuses one precompiled header built with the plugin flags.
  # Not the library's: GCC accepts that one silently, but declarations parsed without
  # -fvisibility=hidden keep default visibility (a fixture exported 98 symbols instead of 27).
  if(TARGET frugal)
    get_target_property(imported frugal IMPORTED)
    if(NOT imported)
      _frugal_plugin_pch()
      target_compile_options(${target} PRIVATE -Winvalid-pch)
      target_precompile_headers(${target} REUSE_FROM frugal_plugin_pch)
    endif()
  endif()

  if(NOT arg_NO_INSTALL)
    install(TARGETS ${target} LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}/frugal/plugins")
  endif()
endfunction()
