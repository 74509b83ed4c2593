#!/bin/bash
# The offload method card's figures: plugins/offload/bench.toml trained without the plugin, with
# it, and with it keeping the pages (drop_pages = false), `rounds` times each (alternating);
# prints each run's phase peaks (the allocator's live bytes) and median step time from
# report.json. Usage:
#   plugins/offload/measure.sh [build dir] [out dir] [rounds]
set -euo pipefail
build=${1:-build}
out=${2:-runs/offload-measure}
rounds=${3:-3}
here=$(dirname "$0")
mkdir -p "$out"
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  for run in off:false:true on:true:true keep_pages:true:false; do
    IFS=: read -r name on drop <<< "$run"
    dir="$out/$name-$round"
    "$build/bin/frugal" train "$here/bench.toml" --set "plugins.offload.enabled=$on" \
      --set "plugins.offload.drop_pages=$drop" --set "run.out_dir=\"$dir\"" > "$dir.log" 2>&1 ||
      { echo "$name failed: see $dir.log"; exit 1; }
    python3 - "$dir/report.json" "$name" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["fit"]["stages"][0]
p = s["phase_peaks"]
print(f'{sys.argv[2]:10}  forward peak {p["forward"]:>9} B  backward peak {p["backward"]:>9} B'
      f'  step peak {p["step"]:>9} B  step median {s["step_seconds"]["median"] * 1e3:6.2f} ms'
      f' (p10 {s["step_seconds"]["p10"] * 1e3:.2f}, p90 {s["step_seconds"]["p90"] * 1e3:.2f})')
PY
  done
done
