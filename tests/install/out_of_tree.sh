#!/usr/bin/env bash
# What a user does with an installed frugal: install it, build examples/custom_plugin out of
# tree against the installed package and train with the plugin, then build examples/cpp_api
# out of tree and run it.
#   out_of_tree.sh <frugal build dir> <frugal source dir> [cmake]
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
cmake=${3:-cmake}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/frugal-install-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

step() { echo "== $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

step "cmake --install $build --prefix $prefix"
"$cmake" --install "$build" --prefix "$prefix" > "$tmp/install.log"
for f in bin/frugal include/frugal/plugin.h lib/cmake/frugal/frugalConfig.cmake \
         lib/cmake/frugal/frugalConfigVersion.cmake lib/cmake/frugal/FrugalPlugin.cmake; do
  [[ -e $prefix/$f ]] || fail "$f was not installed"
done

step "cmake --install $build --component sdk: the SDK's headers without the app layer"
"$cmake" --install "$build" --prefix "$tmp/sdk" --component sdk > "$tmp/install-sdk.log"
[[ -e $tmp/sdk/include/frugal/plugin.h && -e $tmp/sdk/include/frugal/core/learner.h ]] ||
  fail "the sdk component lacks frugal/plugin.h or frugal/core/learner.h"
[[ ! -e $tmp/sdk/include/frugal/app && ! -e $tmp/sdk/include/frugal/frugal.h ]] ||
  fail "the sdk component installed the app layer"

step "configure and build examples/custom_plugin against $prefix"
"$cmake" -S "$src/examples/custom_plugin" -B "$tmp/grad-clip" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
"$cmake" --build "$tmp/grad-clip" -j2
plugin=$tmp/grad-clip/libfrugal_grad_clip.so
[[ -f $plugin ]] || fail "the build did not produce $plugin"
# Hidden visibility: the factory table is exported, the plugin's own classes are not (std::
# and LibTorch templates with default visibility may be).
nm -D --defined-only "$plugin" | grep -w frugal_plugin > /dev/null || fail "$plugin does not export frugal_plugin"
if nm -DC --defined-only "$plugin" | grep -E 'GradClip'; then fail "the plugin's own symbols are exported"; fi

step "frugal train examples/custom_plugin/train.toml (from an unrelated folder)"
mkdir "$tmp/work" && cd "$tmp/work"
rc=0
FRUGAL_PLUGIN_PATH=$tmp/grad-clip "$prefix/bin/frugal" --log-level debug \
  train "$src/examples/custom_plugin/train.toml" --set "run.out_dir=$tmp/run" > "$tmp/train.log" 2>&1 || rc=$?
cat "$tmp/train.log"
[[ $rc -eq 0 ]] || fail "frugal train exited with $rc"
grep -q "plugins: grad_clip" "$tmp/train.log" || fail "the log does not list the plugin ('plugins: grad_clip')"
# The plugin logs through the logger the host made: the CLI's sinks and --log-level.
grep -Eq "step [0-9]+: gradient norm" "$tmp/train.log" ||
  fail "the plugin's debug lines are missing (--log-level debug must reach plugin loggers)"
grep -Eq "clipped [0-9]+ of [1-9][0-9]* steps" "$tmp/train.log" || fail "the plugin did not clip"
grep -q '"grad_clip"' "$tmp/run/report.json" || fail "report.json does not name grad_clip"

step "configure and build examples/cpp_api against $prefix, run it on 512 Fashion-MNIST samples"
"$cmake" -S "$src/examples/cpp_api" -B "$tmp/cpp-api" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" > "$tmp/configure-cpp-api.log" || { cat "$tmp/configure-cpp-api.log"; exit 1; }
"$cmake" --build "$tmp/cpp-api" -j2
[[ -x $tmp/cpp-api/frugal_cpp_api ]] || fail "the build did not produce frugal_cpp_api"
# Linked against the installed library, not the build tree's.
ldd "$tmp/cpp-api/frugal_cpp_api" | grep "$prefix/lib/libfrugal.so" > /dev/null ||  # not -q: an early exit SIGPIPEs ldd, and pipefail fails the check
  fail "frugal_cpp_api does not load $prefix/lib/libfrugal.so: $(ldd "$tmp/cpp-api/frugal_cpp_api" | grep frugal)"
rc=0
"$tmp/cpp-api/frugal_cpp_api" /usr/share/datasets/fashion-mnist 512 > "$tmp/cpp-api.log" 2>&1 || rc=$?
[[ $rc -eq 0 ]] || { cat "$tmp/cpp-api.log"; fail "frugal_cpp_api exited with $rc"; }
tail -n 1 "$tmp/cpp-api.log"
grep -q "validation accuracy" "$tmp/cpp-api.log" || fail "frugal_cpp_api printed no validation accuracy"
grep -q '"metric":"valid_loss"' "$tmp/cpp-api.log" || fail "frugal_cpp_api printed no early-stopping record"
echo "OK: an out-of-tree plugin and the C++ API example built against the installed frugal ran"
