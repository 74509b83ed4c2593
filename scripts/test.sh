#!/usr/bin/env bash
# Installs what is missing (Debian 12 packages), builds, and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash third_party/install-deps.sh
jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFRUGAL_BUILD_TESTS=ON
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
