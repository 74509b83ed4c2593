#!/usr/bin/env bash
# Data parallel on this machine, measured: for the docs' models (the side-by-side MLP, the
# quick start's CNN, the gpt example), `frugal train` on 1 process and with --nproc 2 (two ranks
# on loopback, Gloo): median step time, samples/s, bytes all-reduced per step, each rank's peak.
# Then, on paper, the alpha-beta estimate of a ring all-reduce of the same gradients on 8 and
# 64 GPUs over NVLink and InfiniBand. Prints Markdown; docs/data-parallel.md's table is its output:
#
#   bash benchmarks/data_parallel.sh [BUILD_DIR] > benchmarks/data_parallel.md
#
# Run it on an idle machine: a compile next to it spoils the times.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
FRUGAL="$BUILD/bin/frugal"
STEPS=${STEPS:-80}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

for cfg in side_by_side_mlp quickstart gpt_fortunes; do
  for n in 1 2; do
    "$FRUGAL" train "examples/configs/$cfg.toml" --nproc "$n" --overwrite \
      --set run.max_steps="$STEPS" --set run.warmup=10 --set run.progress='"none"' \
      --set run.checkpoint_epochs=0 --set run.checkpoint_every=0 \
      --set run.out_dir="\"$OUT/$cfg-$n\"" > "$OUT/$cfg-$n.log" 2>&1 ||
      { echo "run $cfg --nproc $n failed:" >&2; tail -5 "$OUT/$cfg-$n.log" >&2; exit 1; }
  done
done

/usr/bin/python3 - "$OUT" "$STEPS" <<'PY'
import json, os, platform, sys
out, steps = sys.argv[1], int(sys.argv[2])
def report(cfg, n):
    return json.load(open(os.path.join(out, f"{cfg}-{n}", "report.json")))
def mib(b):
    return f"{b / 2**20:.2f} MiB"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"Measured by `bash benchmarks/data_parallel.sh` on {cpu}, {os.cpu_count()} logical cores; "
      f"{steps} steps per run, the first 10 left out; 1 process on all cores (run.threads = auto) "
      "against 2 ranks of 1 thread each, same global batch.\n")
print("| model | batch | step, 1 process | step, 2 ranks | samples/s, 1 process | samples/s, 2 ranks | "
      "all-reduced per step | peak per rank (1 process: its peak) |")
print("|---|---|---|---|---|---|---|---|")
grads = {}
for cfg in ["side_by_side_mlp", "quickstart", "gpt_fortunes"]:
    one, two = report(cfg, 1), report(cfg, 2)
    d = two["distributed"]
    grads[cfg] = d["allreduce_bytes_per_step"]
    batch = json.loads(json.dumps(two["config"]))["data"]["batch_size"] if isinstance(two["config"], dict) else "?"
    peaks = " / ".join(mib(r["peak_bytes"]) for r in d["ranks"])
    print(f"| {cfg} | {batch} | {one['fit']['step_seconds']['median'] * 1e3:.2f} ms | "
          f"{two['fit']['step_seconds']['median'] * 1e3:.2f} ms | "
          f"{one['fit']['samples_per_second']:.0f} | {two['fit']['samples_per_second']:.0f} | "
          f"{mib(d['allreduce_bytes_per_step'])} in {d['buckets_per_step']:.0f} bucket(s) | "
          f"{peaks} ({mib(one['fit']['peak_bytes'])}) |")

# A ring all-reduce moves 2(N-1)/N of the gradient bytes through each GPU's link and takes
# 2(N-1) latency hops: T = 2(N-1) alpha + 2(N-1)/N * B / beta.
fabrics = [("NVLink (A100 NVSwitch, ~200 GB/s bus bandwidth, alpha 10 us)", 200e9, 10e-6),
           ("InfiniBand HDR (200 Gb/s = 25 GB/s per GPU, alpha 20 us)", 25e9, 20e-6)]
print("\nOn paper: a ring all-reduce of the same gradients, T = 2(N-1) alpha + 2(N-1)/N x bytes / beta "
      "(assumed link figures, not measured: no GPU cluster is at hand). Data parallelism pays when "
      "a GPU's step takes longer than T (bucketed overlap hides it) or T is small against it.\n")
print("| model | gradient bytes | " + " | ".join(f"{name}, N = {n}" for name, _, _ in fabrics for n in (8, 64)) + " |")
print("|---|---|" + "---|" * (2 * len(fabrics)))
for cfg, b in grads.items():
    cells = []
    for _, beta, alpha in fabrics:
        for n in (8, 64):
            t = 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / beta
            cells.append(f"{t * 1e3:.3f} ms")
    print(f"| {cfg} | {mib(b)} | " + " | ".join(cells) + " |")
PY
