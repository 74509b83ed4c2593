#!/bin/bash
# The zero method card's bytes per rank: plugins/zero/bench.toml trained on 2 ranks as plain data
# parallel, stage 1 and stage 2; prints each rank's steady optimizer state and gradients from
# report.json (distributed.ranks). Usage: plugins/zero/measure.sh [build dir] [out dir]
set -euo pipefail
build=${1:-build}
out=${2:-runs/zero-measure}
here=$(dirname "$0")
mkdir -p "$(dirname "$out")"
for run in dp:false:1 stage1:true:1 stage2:true:2; do
  IFS=: read -r name on stage <<< "$run"
  "$build/bin/frugal" train "$here/bench.toml" --nproc 2 --set "plugins.zero.enabled=$on" \
    --set "plugins.zero.stage=$stage" --set "run.out_dir=\"$out/$name\"" > "$out-$name.log" 2>&1 ||
    { echo "$name failed: see $out-$name.log"; exit 1; }
  python3 - "$out/$name/report.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k in r["distributed"]["ranks"]:
    print(f'{sys.argv[2]:7} rank {k["rank"]}: optimizer_state {k["steady_optimizer_state"]:>9} B'
          f'  gradients {k["steady_gradients"]:>9} B  peak {k["peak_bytes"]:>9} B')
PY
done
