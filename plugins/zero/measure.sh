#!/bin/bash
# The zero method card's bytes per rank: plugins/zero/bench.toml trained on N ranks (default 2)
# as plain data parallel, stage 1, stage 2, stage 2 with the offload plugin (the state on
# disk) and stage 3; prints each rank's steady parameters, optimizer state and gradients from
# report.json
# (distributed.ranks) and its peak. Usage: plugins/zero/measure.sh [build dir] [out dir] [N]
set -euo pipefail
build=${1:-build}
out=${2:-runs/zero-measure}
nproc=${3:-2}
here=$(dirname "$0")
mkdir -p "$(dirname "$out")"
for run in dp:false:1:false stage1:true:1:false stage2:true:2:false stage2+offload:true:2:true \
  stage3:true:3:false; do
  IFS=: read -r name on stage offload <<< "$run"
  "$build/bin/frugal" train "$here/bench.toml" --nproc "$nproc" --set "plugins.zero.enabled=$on" \
    --set "plugins.zero.stage=$stage" --set "plugins.offload.enabled=$offload" \
    --set "run.out_dir=\"$out/$name\"" > "$out-$name.log" 2>&1 ||
    { echo "$name failed: see $out-$name.log"; exit 1; }
  python3 - "$out/$name/report.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k in r["distributed"]["ranks"]:
    print(f'{sys.argv[2]:14} rank {k["rank"]}: parameters {k["steady_parameters"]:>9} B'
          f'  optimizer_state {k["steady_optimizer_state"]:>9} B'
          f'  gradients {k["steady_gradients"]:>9} B  peak {k["peak_bytes"]:>9} B'
          f'  step {k["step_seconds_median"]*1000:.1f} ms')
PY
done
