"""What each of frugal's speed choices is worth: the same training run with one choice undone.

For each --config, frugal trains it as it ships, then once per choice turned off, --rounds
times (the variants in turn each round, so drift hits them alike), and prints the median and
range of the training epoch's time (report.json fit.train_seconds / epochs) per variant, and its
ratio to frugal as shipped:
- BLAS kernels as OpenBLAS found them (FRUGAL_BLAS_AS_FOUND=1): on a CPU it does not know,
  its generic "Prescott" kernels;
- LibTorch's optimizer (optimizer.fused = false);
- no caching CPU allocator (FRUGAL_CPU_CACHE=0): every tensor from malloc;
- run.threads = 1 instead of "auto" (the thread pools' choice);
- the gpt only: its attention on the plain kernel (FRUGAL_FUSED_ATTENTION=0) instead of the
  fused one (frugal/models/attention.h).
Usage (the table in docs/speed.md):

    /usr/bin/python3 benchmarks/speed_shares.py --frugal build/bin/frugal \
        --config examples/configs/side_by_side_mlp.toml \
        --config examples/configs/side_by_side_cnn.toml \
        --config examples/configs/side_by_side_gpt.toml --rounds 3
"""
import argparse, json, os, statistics, subprocess, sys, tempfile
from pathlib import Path

VARIANTS = [
    ("frugal as shipped", {}, []),
    ("OpenBLAS kernels as found", {"FRUGAL_BLAS_AS_FOUND": "1"}, []),
    ("LibTorch's optimizer", {}, ["optimizer.fused=false"]),
    ("no caching allocator", {"FRUGAL_CPU_CACHE": "0"}, []),
    ("run.threads = 1", {}, ["run.threads=1"]),
    ("plain attention", {"FRUGAL_FUSED_ATTENTION": "0"}, []),  # the gpt only
]


def variants(config):
    """The variants that change something for this config: the attention kernel only with one."""
    text = Path(config).read_text()
    gpt = 'arch = "gpt"' in text
    return [v for v in VARIANTS if gpt or v[0] != "plain attention"]


def run(frugal, config, env, sets, out):
    cmd = [frugal, "train", config, "--set", f'run.out_dir="{out}"', "--set", 'run.progress="none"',
           "--set", "run.plots=false"]
    for s in sets:
        cmd += ["--set", s]
    e = dict(os.environ)
    e.update(env)
    subprocess.run(cmd, env=e, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads((Path(out) / "report.json").read_text())
    epochs = sum(s.get("epochs", 1) for s in r["config"].get("stages", [{}])) or 1
    return r["fit"]["train_seconds"] / epochs, r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frugal", required=True)
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="also write the table here (markdown)")
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit("--rounds must be >= 1")
    load_before = os.getloadavg()
    lines = ["| config | variant | epoch (s), median | range | / as shipped |", "|---|---|---:|---|---:|"]
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in a.config:
            vs = variants(config)
            times = {name: [] for name, _, _ in vs}
            for r in range(a.rounds):
                order = vs if r % 2 == 0 else vs[::-1]
                for name, env, sets in order:
                    out = Path(tmp) / f"{Path(config).stem}-{len(times[name])}-{abs(hash(name))}"
                    t, report = run(a.frugal, config, env, sets, str(out))
                    times[name].append(t)
                    if name == "frugal as shipped" and r == 0:
                        notes.append(f"{Path(config).name}: {report.get('threads')} ATen thread(s), "
                                     f"BLAS {report.get('blas_threads')}, "
                                     f"{report.get('blas', {}).get('core', '?')} kernels"
                                     + (f" (OpenBLAS chose {report['blas']['detected']})"
                                        if report.get('blas', {}).get('detected') not in
                                        (None, report.get('blas', {}).get('core')) else ""))
                    print(f"{Path(config).name} round {r + 1} {name}: {t:.2f} s", file=sys.stderr)
            base = statistics.median(times["frugal as shipped"])
            for name, _, _ in vs:
                m = statistics.median(times[name])
                lines.append(f"| {Path(config).name} | {name} | {m:.2f} | {min(times[name]):.2f}-"
                             f"{max(times[name]):.2f} | {m / base:.2f} |")
    load_after = os.getloadavg()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    table = "\n".join(lines) + "\n\n" + (
        f"{a.rounds} round(s), the variants in turn (reversed every other round); {cpu}, "
        f"{os.cpu_count()} cores; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after. "
        + "; ".join(notes) + ".\n`/usr/bin/python3 benchmarks/speed_shares.py --frugal " + a.frugal + " "
        + " ".join(f"--config {c}" for c in a.config) + f" --rounds {a.rounds}`\n")
    print(table)
    if a.out:
        Path(a.out).write_text(table)


if __name__ == "__main__":
    main()
