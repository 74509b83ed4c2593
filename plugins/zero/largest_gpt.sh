#!/bin/bash
# The zero method card's largest gpt per setting: plugins/zero/gpt_bench.toml trained on N ranks
# (default 2) under a per-rank run.memory_budget (default 64MiB) as plain data parallel, zero
# stages 1, 2, 3 and stages 2 and 3 with the offload plugin; for each, the largest n_layer that
# trains within the budget (doubling, then bisection), its parameters, each rank's peak, the
# median step time and the state on disk; then each setting's step time at the size plain data
# parallel reached (the cost, same model). A run over budget fails with frugal's OOM error.
# Usage: plugins/zero/largest_gpt.sh [build dir] [out dir] [budget] [N]
set -euo pipefail
build=${1:-build}
out=${2:-runs/zero-gpt}
budget=${3:-64MiB}
nproc=${4:-2}
here=$(dirname "$0")
mkdir -p "$out"
python3 - "$build/bin/frugal" "$here/gpt_bench.toml" "$out" "$budget" "$nproc" <<'PY'
import json, math, os, re, subprocess, sys
exe, toml, out, budget, nproc = sys.argv[1:]
settings = [("data parallel", False, 1, False, False), ("stage 1", True, 1, False, False),
            ("stage 2", True, 2, False, False), ("stage 2 + offload", True, 2, True, False),
            ("stage 3", True, 3, False, False), ("stage 3 + offload", True, 3, True, False),
            ("stage 3 + offload with parameters", True, 3, True, True)]

done = {}

def run(name, zero, stage, offload, params, layers):
    if (name, layers) in done:
        return done[name, layers]
    done[name, layers] = measure(name, zero, stage, offload, params, layers)
    return done[name, layers]

def measure(name, zero, stage, offload, params, layers):
    d = os.path.join(out, f"{name.replace(' ', '').replace('+', '-')}-L{layers}")
    cmd = [exe, "train", toml, "--nproc", nproc, "--set", f"model.n_layer={layers}",
           "--set", f'run.memory_budget="{budget}"', "--set", f"plugins.zero.enabled={str(zero).lower()}",
           "--set", f"plugins.zero.stage={stage}", "--set", f"plugins.offload.enabled={str(offload).lower()}",
           "--set", f"plugins.offload.parameters={str(params).lower()}",
           "--set", f'run.out_dir="{d}"']
    with open(d + ".log", "w") as log:
        ok = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode == 0
    if not ok:
        return None
    r = json.load(open(os.path.join(d, "report.json")))
    with open(os.path.join(d, "model.safetensors"), "rb") as f:  # the parameters, from the header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    r["model_parameters"] = sum(math.prod(v["shape"])
                                for k, v in header.items() if k != "__metadata__")
    log = open(d + ".log").read()
    r["disk"] = re.findall(r"optimizer state: (\S+ \S+) in memory-mapped files", log)
    r["disk"] = [a + (" + " + b + " parameters" if b else "") for a, b in
                 zip(r["disk"], re.findall(r"parameters: (\S+ \S+) in", log) or [""] * len(r["disk"]))]
    return r

print(f"per-rank budget {budget}, {nproc} ranks, gpt n_embd 256, block 32, batch 4, AdamW fp32")
print("| setting | largest n_layer | parameters | peak per rank (bytes) | step (ms, median) | state on disk per rank | step at plain data parallel's n_layer (ms) |")
print("|---|---:|---:|---|---:|---|---:|")
same = None  # plain data parallel's largest n_layer
for name, zero, stage, offload, params in settings:
    best, lo, hi, layers = None, 0, None, 1
    while hi is None or hi - lo > 1:  # doubling until a failure, then bisection
        r = run(name, zero, stage, offload, params, layers)
        if r:
            best, lo = (layers, r), layers
        else:
            hi = layers
        if hi is None and layers >= 64:
            break
        layers = layers * 2 if hi is None else (lo + hi) // 2
        if hi is not None and layers == lo:
            break
    if not best:
        print(f"| {name} | none fits | | | | | |")
        continue
    layers, r = best
    same = same or layers
    at_same = r if layers == same else run(name, zero, stage, offload, params, same)
    same_ms = f'{max(k["step_seconds_median"] for k in at_same["distributed"]["ranks"]) * 1000:.1f}' if at_same else "over budget"
    ranks = r["distributed"]["ranks"]
    count = f'{r["model_parameters"]:,}'
    peaks = " / ".join(f'{k["peak_bytes"]:,}' for k in ranks)
    step = max(k["step_seconds_median"] for k in ranks) * 1000
    disk = " / ".join(r["disk"])
    print(f"| {name} | {layers} | {count} | {peaks} | {step:.1f} | {disk} | {same_ms} |")
PY
