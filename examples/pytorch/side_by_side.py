"""frugal's image models trained side by side in frugal and in plain PyTorch, one table per run.

Each --config (Fashion-MNIST, model.arch "mlp" or "cnn") is trained by frugal and by a plain
PyTorch loop, each in its own child process, --rounds times with the sides alternating which goes
first (medians over the rounds). Both sides do the same work, with the same LibTorch kernels, so
their losses agree (checked: the first batch's loss is bitwise equal, the epoch's mean loss and
the validation accuracy to every printed digit):
- data: the IDX files read as uint8 and kept in memory; batch = index_select of the epoch's order,
  then (x / 255 - 0.2860) / 0.3530 in float32 as frugal computes it; the last batch may be short.
  The order is frugal's Fisher-Yates shuffle on std::mt19937_64 seeded run.seed + epoch
  (written out below); validation is the first data.valid_samples test images, in order.
- model: the same modules built in the same order after torch.manual_seed(run.seed), so
  LibTorch's default init (kaiming-uniform) draws the same weights from the same generator;
- loss and optimizer: cross entropy (with loss.label_smoothing), torch.optim.Adam/AdamW with
  frugal's betas, eps and weight decay; the step: zero_grad(set_to_none), forward, backward, step.
Timed: the training epoch, from its first batch to its last, batch gathering included,
validation, data loading and process start-up excluded (frugal's report.json fit.train_seconds);
the step: forward, loss, backward and optimizer step of one batch, its gathering excluded (frugal's
fit.step_seconds.median), the first run.warmup steps of each stage left out. Peak RSS: each child's
ru_maxrss (wait4). Neither side sets a thread count unless the config has run.threads:

    /usr/bin/python3 examples/pytorch/side_by_side.py --frugal build/bin/frugal \
        --config examples/configs/side_by_side_mlp.toml \
        --config examples/configs/side_by_side_cnn.toml --rounds 3 \
        --out examples/pytorch/side_by_side.md
"""
import argparse, gzip, json, os, shlex, statistics, subprocess, sys, tempfile, time, tomllib
from pathlib import Path

MEAN, STD = 0.2860, 0.3530  # frugal's Fashion-MNIST statistics (data.cpp)


def read_config(path, sets):
    with open(path, "rb") as f:
        c = tomllib.load(f)
    for s in sets:  # --set a.b=VALUE, VALUE in TOML as frugal's --set takes it
        key, _, value = s.partition("=")
        *tables, leaf = key.strip().split(".")
        t = c
        for k in tables:
            t = t.setdefault(k, {})
        t[leaf] = tomllib.loads(f"v = {value}")["v"]
    run, data, model, opt, loss = (c.get(k, {}) for k in ("run", "data", "model", "optimizer",
                                                          "loss"))
    stages = c.get("stages", [{}])
    bad = [k for s in stages for k in ("optimizer", "image_size", "freeze", "seq_len") if k in s]
    if data.get("dataset", "fashion-mnist") != "fashion-mnist" or bad or run.get("max_steps", 0):
        sys.exit(f"{path}: the comparison takes Fashion-MNIST, stages with epochs only (found "
                 f"{bad}) and no run.max_steps")
    if model.get("arch", "cnn") not in ("mlp", "cnn") or model.get("dropout", 0.0) != 0:
        sys.exit(f"{path}: the comparison takes model.arch mlp or cnn, with no dropout")
    return dict(seed=run.get("seed", 0), threads=run.get("threads", 0), warmup=run.get("warmup", 2),
                path=data.get("path", "/usr/share/datasets/fashion-mnist"),
                batch=data.get("batch_size", 128), valid_batch=data.get("valid_batch_size", 1000),
                train_samples=data.get("train_samples", 0),
                valid_samples=data.get("valid_samples", 0), shuffle=data.get("shuffle", True),
                arch=model.get("arch", "cnn"), width=model.get("width", 32),
                depth=model.get("depth", 2), opt=opt.get("name", "adam"), lr=opt.get("lr", 1e-3),
                weight_decay=opt.get("weight_decay", 0.0), eps=opt.get("eps", 1e-8),
                betas=(opt.get("beta1", 0.9), opt.get("beta2", 0.999)),
                smoothing=loss.get("label_smoothing", 0.0),
                stages=[s.get("epochs", 1) for s in stages])


def mt19937_64(seed):
    """std::mt19937_64's raw output (the C++ standard fixes it)."""
    N, M, mask = 312, 156, (1 << 64) - 1
    mt = [seed & mask]
    for i in range(1, N):
        mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & mask)
    while True:
        for k in range(N):
            x = (mt[k] & ~0x7FFFFFFF & mask) | (mt[(k + 1) % N] & 0x7FFFFFFF)
            mt[k] = mt[(k + M) % N] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
        for y in mt:
            y ^= (y >> 29) & 0x5555555555555555
            y ^= (y << 17) & 0x71D67FFFEDA60000
            y ^= (y << 37) & 0xFFF7EEE000000000
            yield (y ^ (y >> 43)) & mask


def permutation(n, seed):
    """frugal's DataLoader::set_epoch: Fisher-Yates with uniform_upto's rejection sampling."""
    rng, order, top = mt19937_64(seed), list(range(n)), (1 << 64) - 1
    for i in range(n - 1, 0, -1):
        limit = top - top % (i + 1)
        while (v := next(rng)) >= limit:
            pass
        j = v % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def read_idx(path):
    import torch
    with gzip.open(path, "rb") as f:
        head = f.read(4)
        dims = [int.from_bytes(f.read(4), "big") for _ in range(head[3])]
        out = torch.empty(dims, dtype=torch.uint8)
        view, got = memoryview(out.numpy()).cast("B"), 0
        while got < out.numel() and (k := f.readinto(view[got:])):
            got += k
    if got != out.numel():
        sys.exit(f"{path} is truncated")
    return out


def fashion_mnist(c, train):
    """Images [N, 1, 28, 28] uint8 and labels int64: the first train_samples / valid_samples."""
    name = "train" if train else "t10k"
    x = read_idx(f"{c['path']}/{name}-images-idx3-ubyte.gz").unsqueeze(1)
    y = read_idx(f"{c['path']}/{name}-labels-idx1-ubyte.gz").long()
    n = c["train_samples"] if train else c["valid_samples"]
    return (x[:n].clone(), y[:n].clone()) if 0 < n < len(y) else (x, y)


def make_model(c):
    """frugal's mlp and cnn (models.cpp): the same modules in the same order."""
    from torch import nn
    w = c["width"]
    if c["arch"] == "mlp":
        layers = [nn.Flatten(), nn.Linear(28 * 28, w), nn.ReLU()]
        for _ in range(c["depth"]):
            layers += [nn.Linear(w, w), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(w, 10))
    layers = []
    for cin, cout in ((1, w), (w, 2 * w), (2 * w, 4 * w)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                   nn.ReLU(), nn.MaxPool2d(2) if cout < 4 * w else nn.AdaptiveAvgPool2d(7)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * w * 7 * 7, 10))


# ---------------------------------------------------------------- the PyTorch side (a child)

def pytorch_worker(c, result_path):
    import torch
    import torch.nn.functional as F

    if c["threads"] > 0:
        torch.set_num_threads(c["threads"])
    torch.manual_seed(c["seed"])
    train_x, train_y = fashion_mnist(c, True)
    valid = fashion_mnist(c, False) if c["valid_samples"] >= 0 else None
    model = make_model(c)
    Opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[c["opt"]]
    opt = Opt(model.parameters(), lr=c["lr"], betas=c["betas"], eps=c["eps"],
              weight_decay=c["weight_decay"])
    scale, shift = 1.0 / (255.0 * STD), MEAN / STD

    n, B, epoch = len(train_y), c["batch"], 0
    epoch_seconds, epoch_losses, steps = [], [], []
    model.train()
    for epochs in c["stages"]:
        stage_steps = []
        for _ in range(epochs):
            order = torch.tensor(permutation(n, c["seed"] + epoch)) if c["shuffle"] else None
            epoch += 1
            total, count = 0.0, 0
            t_epoch = time.perf_counter()
            for i in range(0, n, B):
                if order is None:
                    x, y = train_x[i:i + B], train_y[i:i + B]
                else:
                    idx = order[i:i + B]
                    x, y = train_x.index_select(0, idx), train_y.index_select(0, idx)
                x = x.float().mul_(scale).sub_(shift)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y, label_smoothing=c["smoothing"])
                loss.backward()
                opt.step()
                total += loss.item()
                count += 1
                stage_steps.append(time.perf_counter() - t0)
            epoch_seconds.append(time.perf_counter() - t_epoch)
            epoch_losses.append(total / count)
        steps += stage_steps[c["warmup"]:] or stage_steps

    acc = valid_loss = None
    if valid is not None:
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(valid[1]), c["valid_batch"]):
                x, y = (t[i:i + c["valid_batch"]] for t in valid)
                logits = model(x.float().mul_(scale).sub_(shift))
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                correct += (logits.argmax(1) == y).sum().item()
        acc, valid_loss = correct / len(valid[1]), loss_sum / len(valid[1])
    Path(result_path).write_text(json.dumps(dict(
        train_seconds=sum(epoch_seconds), step_seconds=statistics.median(steps),
        final_loss=epoch_losses[-1], valid_accuracy=acc, valid_loss=valid_loss,
        threads=torch.get_num_threads(), torch_version=torch.__version__), indent=1))


# ---------------------------------------------------------------- the driver

def run_child(argv, log):
    """Runs argv with its output in `log`; returns its peak RSS in bytes (wait4's ru_maxrss)."""
    with open(log, "w") as f:
        pid = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT).pid
        _, status, usage = os.wait4(pid, 0)
    if (code := os.waitstatus_to_exitcode(status)) != 0:
        tail = Path(log).read_text(errors="replace")[-3000:]
        sys.exit(f"{argv[0]} {argv[1]} failed (exit {code}); the end of {log}:\n{tail}")
    return usage.ru_maxrss * 1024


def run_frugal(args, config, workdir):
    out = Path(workdir, "frugal")
    rss = run_child([args.frugal, "train", config, "--overwrite", *args.set_argv, "--set",
                     f'run.out_dir="{out}"', "--set", 'run.progress="none"'],
                    Path(workdir, "frugal.log"))
    path = out / "report.json"
    if not path.is_file():
        sys.exit(f"frugal exited 0 but wrote no {path}")
    report = json.loads(path.read_text())
    fit = report.get("fit", {})
    if "train_seconds" not in fit or "median" not in fit.get("step_seconds", {}):
        sys.exit(f"{path} has no fit.train_seconds or fit.step_seconds.median")
    return dict(train_seconds=fit["train_seconds"], step_seconds=fit["step_seconds"]["median"],
                final_loss=fit["final_loss"], valid_accuracy=fit.get("valid_accuracy"),
                valid_loss=fit.get("valid_loss"), threads=report.get("threads"), rss=rss)


def run_pytorch(args, config, workdir):
    result = Path(workdir, "pytorch.json")
    result.unlink(missing_ok=True)
    rss = run_child([sys.executable, os.path.abspath(__file__), "--worker", "pytorch", "--config",
                     config, *args.set_argv, "--result", str(result)], Path(workdir, "pytorch.log"))
    return dict(json.loads(result.read_text()), rss=rss)


def describe(c):
    epochs = sum(c["stages"])
    net = (f"mlp {'-'.join(map(str, [784] + [c['width']] * (c['depth'] + 1) + [10]))}"
           if c["arch"] == "mlp" else f"cnn width {c['width']}")
    return f"{net}, batch {c['batch']}, {c['opt']} lr {c['lr']:g}, {epochs} epoch(s)"


def table(args, rows):
    MiB, r = 1 << 20, lambda a, b: f"{a / b:.2f}" if b else "-"
    pct = lambda a: "-" if a is None else f"{100 * a:.2f}%"
    lines = [f"`{shlex.join([sys.executable] + sys.argv)}`", "",
             "| model | epoch (s) frugal | epoch (s) PyTorch | frugal / PyTorch "
             "| step (ms) frugal | step (ms) PyTorch | frugal / PyTorch "
             "| peak RSS (MiB) frugal | peak RSS (MiB) PyTorch | frugal / PyTorch "
             "| train loss frugal | train loss PyTorch | valid acc frugal | valid acc PyTorch |",
             "|---" + "|---:" * 13 + "|"]
    for cfg, f, p in rows:
        ef, ep = (s["train_seconds"] / sum(cfg["stages"]) for s in (f, p))
        lines.append(
            f"| {describe(cfg)} | {ef:.2f} | {ep:.2f} | {r(ef, ep)} "
            f"| {1e3 * f['step_seconds']:.2f} | {1e3 * p['step_seconds']:.2f} "
            f"| {r(f['step_seconds'], p['step_seconds'])} "
            f"| {f['rss'] / MiB:.1f} | {p['rss'] / MiB:.1f} | {r(f['rss'], p['rss'])} "
            f"| {f['final_loss']:.4f} | {p['final_loss']:.4f} "
            f"| {pct(f['valid_accuracy'])} | {pct(p['valid_accuracy'])} |")
    threads = "; ".join(f"{Path(n).name}: frugal {f['threads']}, PyTorch {p['threads']}"
                        for n, (_, f, p) in zip(args.config, rows))
    lines += ["", f"Fashion-MNIST on the CPU; torch {rows[0][2]['torch_version']}; threads: "
              f"{threads}; {args.rounds} round(s), each side in its own process, medians. "
              "Epoch: the training epoch's wall time from its first batch to its last "
              "(gathering and normalizing the batches included; data loading, validation and "
              "start-up excluded; frugal's report.json fit.train_seconds / epochs). Step: the "
              "median time of one batch's forward, loss, backward and optimizer step after "
              "run.warmup batches (fit.step_seconds.median). Peak RSS: each child process's "
              "ru_maxrss (runtime, libraries and both data splits included). Train loss: the "
              "mean over the last epoch's batches; valid acc: on the validation samples after "
              "training. Same initial weights, batches and optimizer on both sides."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frugal", help="the frugal binary")
    ap.add_argument("--config", action="append", required=True, help="repeat for several")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key on both sides, as frugal's --set")
    ap.add_argument("--out", help="Markdown file for the table")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workdir", help="folder for the runs (default: a new temporary folder)")
    ap.add_argument("--worker", choices=["pytorch"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfgs = [read_config(path, args.set) for path in args.config]
    if args.worker:
        return pytorch_worker(cfgs[0], args.result)
    if not args.frugal or not (os.path.isfile(args.frugal) and os.access(args.frugal, os.X_OK)):
        sys.exit(f"--frugal: no executable at {args.frugal!r} (build it first)")
    args.set_argv = [a for s in args.set for a in ("--set", s)]
    workdir = args.workdir or tempfile.mkdtemp(prefix="side_by_side_")
    rows = []
    for n, (config, cfg) in enumerate(zip(args.config, cfgs)):
        wd = Path(workdir, f"{n}-{Path(config).stem}")
        wd.mkdir(parents=True, exist_ok=True)
        runs = {"frugal": [], "pytorch": []}
        for k in range(args.rounds):  # the sides alternate which goes first
            for side in ("frugal", "pytorch")[::1 if k % 2 == 0 else -1]:
                run = run_frugal if side == "frugal" else run_pytorch
                runs[side].append(run(args, config, wd))
            f, p = runs["frugal"][-1], runs["pytorch"][-1]
            print(f"{config} round {k + 1}: final train loss frugal {f['final_loss']:.6f}, "
                  f"PyTorch {p['final_loss']:.6f}; epoch {f['train_seconds']:.2f} s / "
                  f"{p['train_seconds']:.2f} s", file=sys.stderr)
        med = {s: {**rs[0], **{k: statistics.median(r[k] for r in rs) for k in
                               ("train_seconds", "step_seconds", "rss")}}
               for s, rs in runs.items()}
        rows.append((cfg, med["frugal"], med["pytorch"]))
    text = table(args, rows)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
