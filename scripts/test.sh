#!/usr/bin/env bash
# Installs what is missing (Debian 12 packages), builds, and runs every test with ctest; then
# builds the `asan` preset (AddressSanitizer + UndefinedBehaviorSanitizer, CMakePresets.json)
# and runs the suite again under it. FRUGAL_SKIP_SANITIZERS=1 skips the second part.
set -euo pipefail
cd "$(dirname "$0")/.."
bash third_party/install-deps.sh
# The house rules no compiler checks: includes point down the layers (ARCHITECTURE.md), and
# every file includes what it uses (not only through the precompiled header).
bash scripts/check_layers.sh
bash scripts/check_includes.sh
jobs=$(nproc)
# Unity batches (8 files per compiler run) instantiate LibTorch's templates once per batch
# instead of once per file: about half the compile time of a fresh build. Developers who
# rebuild one file at a time leave it off (the default).
# Warnings are errors here (-Wall -Wextra -Wshadow on every target: frugal_warnings).
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFRUGAL_BUILD_TESTS=ON -DCMAKE_UNITY_BUILD=ON \
  -DFRUGAL_WERROR=ON
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900

if [ "${FRUGAL_SKIP_SANITIZERS:-0}" != 1 ]; then
  start=$(date +%s)
  cmake --preset asan
  cmake --build --preset asan -j "$jobs"
  # The out-of-tree install test (label "install") is left out: it rebuilds a project outside
  # the preset's flags; so is the crash soak (label "soak"): it SIGKILLs the CLI at moments it
  # times, and the sanitized CLI's start-up would triple its minute. Everything else, fuzz,
  # resume and hostile-input tests included, runs.
  ctest --preset asan -j "$jobs"
  echo "sanitizer build and tests: $(( $(date +%s) - start )) s"
fi
