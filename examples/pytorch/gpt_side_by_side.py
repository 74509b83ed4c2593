"""frugal's byte-level GPT trained side by side in frugal and in plain PyTorch, from one config.

Same corpus, windows, batches, initial weights (the same generator draws) and optimizer. Each
side runs in its own child process, measured in one run on this machine: validation loss after
run.max_steps steps (mean nats per byte), final train loss (mean over the last epoch's batches),
median step time (after run.warmup steps), peak RSS (wait4's ru_maxrss) and peak live tensor
bytes; --rounds R alternates the sides R times (medians). The Markdown table goes to --out:

    /usr/bin/python3 examples/pytorch/gpt_side_by_side.py --frugal build/bin/frugal \
        --config examples/configs/gpt_side_by_side.toml --out examples/pytorch/gpt_side_by_side.md
"""
import argparse, json, math, os, statistics, subprocess, sys, tempfile, time, tomllib
from collections import OrderedDict
from pathlib import Path


def read_config(path):
    with open(path, "rb") as f:
        return config_from(tomllib.load(f))


def config_from(c):
    """The comparison's settings from a parsed config (side_by_side.py passes one with its --set
    overrides applied)."""
    run, data, model, opt = (c.get(k, {}) for k in ("run", "data", "model", "optimizer"))
    return dict(seed=run.get("seed", 0), max_steps=run["max_steps"], warmup=run.get("warmup", 2),
                threads=run.get("threads", 0), paths=data["paths"],
                block=data.get("block_size", 128),
                batch=data["batch_size"], windows=data.get("windows_per_epoch", 0),
                shuffle=data.get("shuffle", True), context=model.get("block_size", 0),
                valid_samples=data.get("valid_samples", 0),
                valid_batch=data.get("valid_batch_size", data["batch_size"]),
                n_layer=model["n_layer"], n_head=model["n_head"], n_embd=model["n_embd"],
                dropout=model.get("dropout", 0.0), opt=opt.get("name", "adam"),
                lr=opt.get("lr", 1e-3), weight_decay=opt.get("weight_decay", 0.0),
                decay=opt.get("decay", "auto"),
                betas=(opt.get("beta1", 0.9), opt.get("beta2", 0.999)), eps=opt.get("eps", 1e-8))


def param_groups(model, c):
    """frugal's [optimizer] decay: "matrices" ("auto" with adamw's decoupled decay) decays only
    the parameters of 2 or more dimensions and keeps the others in a second group without decay
    (nanoGPT's rule); "all" (and "auto" with adam) is one group."""
    ps, wd = list(model.parameters()), c["weight_decay"]
    if wd <= 0 or not (c["decay"] == "matrices" or (c["decay"] == "auto" and c["opt"] == "adamw")):
        return [{"params": ps, "weight_decay": wd}]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def corpus(paths):
    """The files' bytes in order, as frugal's text data reads them: a folder gives its regular
    files recursively, sorted by path string, skipping symlinks and binary files (a NUL byte in
    the first 8 KiB, such as the fortunes' .dat index files)."""
    out = bytearray()
    for p in paths:
        if not os.path.isdir(p):
            out += Path(p).read_bytes()
            continue
        files = [os.path.join(d, n) for d, _, names in os.walk(p) for n in names]  # no dir links
        for f in sorted(files, key=os.fsencode):
            if os.path.isfile(f) and not os.path.islink(f):
                data = Path(f).read_bytes()
                out += b"" if b"\0" in data[:8192] else data
    return out


# ---------------------------------------------------------------- the model and its init

def make_gpt(block, n_layer, n_head, n_embd, dropout):
    """frugal's gpt; module names and order fix the init order. Only the worker loads torch:
    a child's ru_maxrss starts from its parent's RSS at the spawn, so the driver stays small."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self, C, p):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(256, C), nn.Embedding(block, C)
            self.drop = nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))

    class Attention(nn.Module):
        def __init__(self, C, H, p):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.attn_drop, self.resid_drop, self.H = nn.Dropout(p), nn.Dropout(p), H
            mask = torch.tril(torch.ones(block, block, dtype=torch.bool)).view(1, 1, block, block)
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, x):  # no F.scaled_dot_product_attention in torch 1.13
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2)
                       for t in self.c_attn(x).split(C, dim=2))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.H))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf")).softmax(dim=-1)
            y = (self.attn_drop(att) @ v).transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_drop(self.c_proj(y))

    class Block(nn.Module):
        def __init__(self, C, H, p):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), Attention(C, H, p), nn.LayerNorm(C)
            self.mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(C, 4 * C), act=nn.GELU(),  # erf
                                                 c_proj=nn.Linear(4 * C, C), drop=nn.Dropout(p)))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    mods = [("embed", Embed(n_embd, dropout))]
    mods += [(f"block{i}", Block(n_embd, n_head, dropout)) for i in range(n_layer)]
    mods += [("ln_f", nn.LayerNorm(n_embd)), ("head", nn.Linear(n_embd, 256, bias=False))]
    return nn.Sequential(OrderedDict(mods))


def init_gpt(model, seed, n_layer):
    """frugal's init: parameters in order, one generator; ones and zeros draw nothing."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                p.normal_(0.0, std, generator=g)


# ---------------------------------------------------------------- the PyTorch side (a child)

def pytorch_worker(c, result_path):
    Path(result_path).write_text(json.dumps(train_pytorch(c), indent=1))


def train_pytorch(c, live_bytes=True):
    """Trains the gpt in PyTorch as frugal does; returns the measurements. live_bytes=False
    leaves out the profiled step (live tensor bytes: None) so that every step is timed alike
    (examples/pytorch/side_by_side.py times the whole training)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import profile, ProfilerActivity

    if c["threads"] > 0:
        torch.set_num_threads(c["threads"])
    torch.manual_seed(c["seed"])
    tokens = torch.frombuffer(corpus(c["paths"]), dtype=torch.uint8)
    n, T, B = len(tokens), c["block"], c["batch"]
    n_valid = n // 10
    n_train = n - n_valid
    train, valid, ar = tokens[:n_train], tokens[n_train:], torch.arange(T)
    windows = c["windows"] or n_train // T
    model = make_gpt(c["context"] or T, c["n_layer"], c["n_head"], c["n_embd"], c["dropout"])
    init_gpt(model, c["seed"], c["n_layer"])
    Opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[c["opt"]]
    opt = Opt(param_groups(model, c), lr=c["lr"], betas=c["betas"], eps=c["eps"])

    def step(x, y):
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def tensor_bytes(*extra):  # the storages alive now, each counted once
        ts = [*model.parameters(), *model.buffers(), tokens, *extra]
        ts += [p.grad for p in model.parameters() if p.grad is not None]
        ts += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return sum({t.storage().data_ptr(): t.storage().nbytes() for t in ts}.values())

    # Live tensor bytes: those alive before the first full batch after warm-up (else the last
    # step) plus the highest running sum of the profiler's "[memory]" events (+alloc, -free) in
    # that step, whose time is left out of the step times. torch 1.13 records these events even
    # though Debian's build has kineto_available() False: prof.profiler.kineto_results.events()
    # gives _KinetoEvent objects with name(), nbytes(), start_us() and device_type().
    model.train()
    times, live_peak, it, epoch, profiled = [], None, 0, 0, 0.0
    t_train = time.perf_counter()
    while it < c["max_steps"]:
        if c["shuffle"]:
            starts = torch.randint(0, n_train - T, (windows,),
                                   generator=torch.Generator().manual_seed(c["seed"] + epoch))
        else:  # consecutive windows, wrapping around
            starts = torch.arange(windows) % ((n_train - 1) // T) * T
        losses = []
        for i in range(math.ceil(windows / B)):
            idx = starts[i * B:(i + 1) * B].unsqueeze(1) + ar
            x, y = train[idx].long(), train[idx + 1].long()
            last = it == c["max_steps"] - 1
            if live_bytes and live_peak is None and (
                    last or it >= c["warmup"] and len(x) == min(B, windows)):
                t0 = time.perf_counter()
                base = tensor_bytes(x, y)
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    losses.append(step(x, y))
                run = top = 0
                for e in sorted((e for e in prof.profiler.kineto_results.events()
                                 if e.name() == "[memory]"), key=lambda e: e.start_us()):
                    run += e.nbytes()
                    top = max(top, run)
                live_peak = base + top
                profiled += time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                losses.append(step(x, y))
                times.append((it, time.perf_counter() - t0))
            it += 1
            if it >= c["max_steps"]:
                break
        epoch += 1
    train_seconds = time.perf_counter() - t_train - profiled  # the profiled step left out
    steady = [t for k, t in times if k >= c["warmup"]] or [t for _, t in times] or [float("nan")]

    valid_loss, valid_accuracy, total, count, correct = float("nan"), None, 0.0, 0, 0
    if c["valid_samples"] >= 0:  # -1: no validation
        nv = (n_valid - 1) // T
        nv = min(nv, c["valid_samples"]) if c["valid_samples"] > 0 else nv
        model.eval()
        with torch.no_grad():
            for b0 in range(0, nv, c["valid_batch"]):
                idx = (torch.arange(b0, min(b0 + c["valid_batch"], nv)) * T).unsqueeze(1) + ar
                x, y = valid[idx].long(), valid[idx + 1].long()
                logits = model(x).reshape(-1, 256)
                total += F.cross_entropy(logits, y.reshape(-1), reduction="sum").item()
                correct += (logits.argmax(1) == y.reshape(-1)).sum().item()
                count += y.numel()
        valid_loss = total / count if count else float("nan")
        valid_accuracy = correct / count if count else None  # next-byte accuracy, as frugal's
    return dict(valid_loss=valid_loss, valid_accuracy=valid_accuracy,
                final_loss=sum(losses) / len(losses), train_seconds=train_seconds,
                step_seconds=statistics.median(steady), live_peak_bytes=live_peak, steps=it,
                threads=torch.get_num_threads(), torch_version=torch.__version__)


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


def run_frugal(args, workdir):
    out = Path(workdir, "frugal")
    rss = run_child([args.frugal, "train", args.config, "--overwrite", "--set",
                     f'run.out_dir="{out}"', "--set", 'run.progress="none"'],
                    Path(workdir, "frugal.log"))
    path = out / "report.json"
    if not path.is_file():
        sys.exit(f"frugal exited 0 but wrote no {path}")
    report = json.loads(path.read_text())

    res = {"rss": rss}
    for name, key in [("valid_loss", "fit.valid_loss"), ("final_loss", "fit.final_loss"),
                      ("step_seconds", "fit.step_seconds.median"),
                      ("live_peak_bytes", "fit.peak_bytes")]:
        v = report
        for k in key.split("."):
            if not isinstance(v, dict) or k not in v:
                sys.exit(f"{path} has no '{key}' (is {args.frugal} older than this script?)")
            v = v[k]
        res[name] = v
    return res


def run_pytorch(args, workdir):
    result = Path(workdir, "pytorch.json")
    result.unlink(missing_ok=True)
    rss = run_child([sys.executable, os.path.abspath(__file__), "--worker", "pytorch", "--config",
                     args.config, "--result", str(result)], Path(workdir, "pytorch.log"))
    return dict(json.loads(result.read_text()), rss=rss)


def table(args, cfg, f, p):
    MiB = 1 << 20
    rows = [(f"validation loss after {cfg['max_steps']} steps (nats/byte)", "valid_loss", 1, 4),
            ("final train loss (nats/byte)", "final_loss", 1, 4),
            ("median step time (ms)", "step_seconds", 1e-3, 1), ("peak RSS (MiB)", "rss", MiB, 1),
            ("live tensor bytes (peak) (MiB)", "live_peak_bytes", MiB, 1)]
    lines = [f"Config `{args.config}`; torch {p['torch_version']}; {p['threads']} thread(s); "
             f"{args.rounds} round(s), medians.", "",
             "| | frugal | PyTorch | frugal / PyTorch |", "|---|---:|---:|---:|"]
    for label, key, unit, digits in rows:
        a, b = f[key] / unit, p[key] / unit
        ratio = a / b if b else math.nan
        lines.append(f"| {label} | {a:.{digits}f} | {b:.{digits}f} | {ratio:.2f} |")
    lines += ["", "Live tensor bytes (peak): frugal, its allocator's peak live bytes over the fit "
              "(report.json fit.peak_bytes); PyTorch, the parameters, buffers, gradients, "
              "optimizer state, corpus and batch alive before one step after warm-up plus the "
              "highest running sum of the allocations and frees torch.profiler "
              "(profile_memory=True) records in that step. Peak RSS: each child process's "
              "ru_maxrss (runtime and libraries included)."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frugal", help="the frugal binary")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", help="Markdown file for the table")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workdir", help="folder for the runs (default: a new temporary folder)")
    ap.add_argument("--worker", choices=["pytorch"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg = read_config(args.config)
    if cfg["dropout"] != 0:
        sys.exit(f"model.dropout = {cfg['dropout']}: the comparison needs 0 (no random masks)")
    if args.worker:
        return pytorch_worker(cfg, args.result)
    if not args.frugal or not (os.path.isfile(args.frugal) and os.access(args.frugal, os.X_OK)):
        sys.exit(f"--frugal: no executable at {args.frugal!r} (build it first)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpt_side_by_side_")
    os.makedirs(workdir, exist_ok=True)
    runs = {"frugal": [], "pytorch": []}
    for r in range(args.rounds):  # the sides alternate which goes first
        for side in ("frugal", "pytorch")[::1 if r % 2 == 0 else -1]:
            runs[side].append((run_frugal if side == "frugal" else run_pytorch)(args, workdir))
    metrics = ("valid_loss", "final_loss", "step_seconds", "live_peak_bytes", "rss")
    med = {s: {**rs[0], **{k: statistics.median(r[k] for r in rs) for k in metrics}}
           for s, rs in runs.items()}
    text = table(args, cfg, med["frugal"], med["pytorch"])
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
