#!/usr/bin/env bash
# Installs what is missing (Debian 12 packages), builds, and trains the Fashion-MNIST quick start,
# printing its memory report. Extra arguments go to `frugal train` (e.g. --set run.threads=2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash third_party/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON
cmake --build build -j "$(nproc)" --target frugal_cli
# --overwrite: running the quick start again replaces runs/quickstart (a run refuses a folder
# holding an earlier run's results unless told).
exec build/bin/frugal train examples/configs/quickstart.toml --overwrite "$@"
