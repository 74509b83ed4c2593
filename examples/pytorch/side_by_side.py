"""frugal trained side by side with plain PyTorch at its best, one Markdown table per run.

Each --config is trained by frugal and by a plain PyTorch loop, each in its own child process:
Fashion-MNIST with model.arch "mlp" or "cnn", or (data.dataset "text", model.arch "gpt") the
byte-level language model, whose PyTorch side is examples/pytorch/gpt_side_by_side.py's. The
README's table (docs/speed.md) is made on an idle machine by

    /usr/bin/python3 examples/pytorch/side_by_side.py --frugal build/bin/frugal \\
        --config examples/configs/side_by_side_mlp.toml \\
        --config examples/configs/side_by_side_cnn.toml \\
        --config examples/configs/side_by_side_gpt.toml --rounds 3 \\
        --out examples/pytorch/side_by_side.md

PyTorch at its best: each round runs frugal once and the PyTorch child three times, with glibc's
malloc (no preload) and with jemalloc and tcmalloc preloaded (LD_PRELOAD of Debian's
libjemalloc2 and libtcmalloc-minimal4: /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 and
libtcmalloc_minimal.so.4; a missing one is skipped and the footnote says so; `bash
third_party/install-deps.sh --bench` installs them). The variant with the lowest median epoch
time is PyTorch's best, and the frugal / PyTorch ratios (epoch, step, peak RSS) are against it.
The same BLAS kernels on both sides: Debian's OpenBLAS 0.3.21 does not recognise some CPUs and
falls back to its slowest kernels (Prescott); frugal then switches to the CPU's (report.json
"blas"), and the PyTorch child starts with OPENBLAS_CORETYPE set to the same core, unless
OPENBLAS_CORETYPE is already set (then both sides inherit it) or --pytorch-blas-as-found is given
(PyTorch keeps what OpenBLAS chose: what frugal's choice is worth). Both sides' cores, read in
each process, are in the footnote.

The spread: --rounds R (default 3; fewer is warned of in the footnote) rounds, the order of the
four processes reversed every other round (frugal first, then last). Each time is the median
over the rounds with its range (min-max) beside it. The footnote has the CPU model, the core
count and the load average before the first round and after the last; a 1-minute load above 0.5
at the start is warned of (stderr and footnote): the machine was not idle.

Both sides do the same work, with the same LibTorch kernels:
- data: the IDX files read as uint8 and kept in memory; batch = index_select of the epoch's order,
  then (x / 255 - 0.2860) / 0.3530 in float32 as frugal computes it; the last batch may be short.
  The order is frugal's Fisher-Yates shuffle on std::mt19937_64 seeded run.seed + epoch
  (written out below); validation is the first data.valid_samples test images, in order. The
  gpt: the corpus's bytes, frugal's random windows, the first data.valid_samples validation
  windows (gpt_side_by_side.py);
- model: the same modules built in the same order after torch.manual_seed(run.seed), so
  LibTorch's default init (kaiming-uniform) draws the same weights from the same generator (the
  gpt: frugal's init, one generator);
- loss and optimizer: cross entropy (with loss.label_smoothing), torch.optim.Adam/AdamW with
  frugal's betas, eps and weight decay; the step: zero_grad(set_to_none), forward, backward, step.
Checked, per model: every PyTorch run (all allocators, all rounds) ends with bitwise the same
train loss, validation loss and accuracy (an allocator must not change a number: else the table
is still written, marked, and the exit status is 1), and so does every frugal round; frugal's
against PyTorch's: equal to every printed digit, else a warning (stderr, footnote) with the
difference. They can differ when the two sides run OpenBLAS on different thread counts or
kernels (a GEMM split another way sums in another order): frugal puts OpenBLAS on its own thread
count, PyTorch leaves it on all cores; OPENBLAS_NUM_THREADS=N with --set run.threads=N gives
both N.
Timed: the training epoch, from its first batch to its last, batch gathering included,
validation, data loading and process start-up excluded (frugal's report.json fit.train_seconds;
the gpt's epoch is its run.max_steps steps); the step: forward, loss, backward and optimizer step
of one batch, its gathering excluded (frugal's fit.step_seconds.median), the first run.warmup
steps of each stage left out. Peak RSS: each child's ru_maxrss (wait4). Neither side sets a
thread count unless the config has run.threads.

Data parallel, --nproc N (N > 1; the mlp and cnn configs, a gpt config is refused): frugal's own
data parallel, `frugal train CONFIG --nproc N --set run.threads=1` (N ranks on loopback, Gloo),
against PyTorch's DistributedDataParallel with the Gloo backend on N processes, which this script
starts itself with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port; Debian's torchrun for torch 1.13 does not
start). The table in benchmarks/ddp_side_by_side.md is made on an idle machine by

    /usr/bin/python3 examples/pytorch/side_by_side.py --frugal build/bin/frugal --nproc 2 \\
        --config examples/configs/side_by_side_mlp.toml \\
        --config examples/configs/side_by_side_cnn.toml --rounds 3 \\
        --out benchmarks/ddp_side_by_side.md

- threads as torchrun sets them for nproc > 1, on both sides: OMP_NUM_THREADS=1 and
  OPENBLAS_NUM_THREADS=1 in every rank's environment, frugal with --set run.threads=1 (its
  report.json threads and blas_threads are in the footnote), each PyTorch rank with
  torch.set_num_threads(1) (what torch and OpenBLAS report, every rank, in the footnote);
- PyTorch at its best: every round runs DDP with each allocator (glibc, jemalloc, tcmalloc
  preloaded in every rank) and, with --bucket-view both (the default), with
  gradient_as_bucket_view False (DDP's default) and True: six variants; the fastest median epoch
  is DDP's best. DDP's other defaults stay (bucket_cap_mb 25, broadcast_buffers on);
- the same work: data.batch_size is the global batch; every rank draws frugal's one seeded order
  and rank r takes rows [n*r//N, n*(r+1)//N) of each batch of n (frugal's
  DataLoader::set_shard); a batch that splits unevenly multiplies a rank's loss by its rows x N /
  n before backward (DataParallel::before_batch), a last training batch smaller than N is dropped
  (DataLoader::num_batches) and a last validation batch kept (a rank without a row skips it); gradients are averaged over the ranks;
  BatchNorm's running statistics are rank 0's, sent to every rank after each epoch's training;
  validation scores each rank's rows of every validation batch and all-reduces the float64 sums
  (examples/pytorch/ddp_worker.py has the PyTorch rank and the details);
- timed: rank 0's training epoch and median step (frugal's report.json fit.train_seconds and
  fit.step_seconds.median come from rank 0); peak RSS: each PyTorch rank's ru_maxrss, and for
  frugal the wait4 ru_maxrss of its --nproc launcher, which covers the ranks it waited for (the
  largest process of the tree; report.json's distributed.ranks[].peak_bytes is tracked tensor
  bytes, not RSS);
- checked: every PyTorch DDP run (all variants and rounds) ends bitwise equal, and so does every
  frugal round (else the exit status is 1); frugal against DDP: rank 0's train loss (its shard
  losses summed in float32, as frugal) and the validation loss and accuracy, with every
  difference, a warning when the printed digits differ.
"""
import argparse, gzip, json, math, os, shlex, statistics, subprocess, sys, tempfile, time, tomllib
from pathlib import Path

MEAN, STD = 0.2860, 0.3530  # frugal's Fashion-MNIST statistics (data.cpp)
LIBDIR = "/usr/lib/x86_64-linux-gnu"
# The PyTorch child's allocators: (name, the library preloaded; None: glibc's malloc).
ALLOCATORS = [("glibc", None), ("jemalloc", f"{LIBDIR}/libjemalloc.so.2"),
              ("tcmalloc", f"{LIBDIR}/libtcmalloc_minimal.so.4")]


def gpt_module():
    """examples/pytorch/gpt_side_by_side.py: the gpt's config, model, init and PyTorch loop."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import gpt_side_by_side
    return gpt_side_by_side


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
    if data.get("dataset") == "text" or model.get("arch") == "gpt":
        return read_gpt_config(path, c, stages, bad)
    if data.get("dataset", "fashion-mnist") != "fashion-mnist" or bad or run.get("max_steps", 0):
        sys.exit(f"{path}: the comparison takes Fashion-MNIST, stages with epochs only (found "
                 f"{bad}) and no run.max_steps")
    if model.get("arch", "cnn") not in ("mlp", "cnn") or model.get("dropout", 0.0) != 0:
        sys.exit(f"{path}: the comparison takes model.arch mlp or cnn, with no dropout")
    threads = run.get("threads", 0)
    return dict(kind="image", seed=run.get("seed", 0),
                threads=threads if isinstance(threads, int) else 0, warmup=run.get("warmup", 2),
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


def read_gpt_config(path, c, stages, bad):
    """The gpt: one learning rate, whole windows, and run.max_steps = the stages' epochs of
    data.windows_per_epoch windows (the PyTorch loop stops at max_steps, frugal at both)."""
    run, data, model = (c.get(k, {}) for k in ("run", "data", "model"))
    smoothing = c.get("loss", {}).get("label_smoothing", 0.0)
    if data.get("dataset") != "text" or model.get("arch") != "gpt" or bad or smoothing:
        sys.exit(f"{path}: the gpt comparison takes data.dataset text, model.arch gpt, no "
                 f"loss.label_smoothing and stages with epochs only (found {bad})")
    try:
        g = gpt_module().config_from(c)
    except KeyError as e:
        sys.exit(f"{path}: the gpt comparison needs {e.args[0]} (run.max_steps, data.paths, "
                 "data.batch_size, model.n_layer, n_head, n_embd)")
    epochs = [s.get("epochs", 1) for s in stages]
    per_epoch = math.ceil(g["windows"] / g["batch"]) if g["windows"] > 0 else 0
    if not per_epoch or g["max_steps"] != per_epoch * sum(epochs):
        sys.exit(f"{path}: the gpt comparison needs data.windows_per_epoch and run.max_steps = "
                 f"its batches times the epochs ({per_epoch} x {sum(epochs)}), found "
                 f"{g['max_steps']}")
    if g["dropout"] != 0:
        sys.exit(f"{path}: model.dropout = {g['dropout']}: the comparison needs 0")
    if not isinstance(g["threads"], int):
        g["threads"] = 0
    return dict(g, kind="gpt", stages=epochs)


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

def train_image(c):
    """Trains the mlp or cnn in PyTorch as frugal does; returns the measurements."""
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
    return dict(train_seconds=sum(epoch_seconds), step_seconds=statistics.median(steps),
                final_loss=epoch_losses[-1], valid_accuracy=acc, valid_loss=valid_loss,
                threads=torch.get_num_threads(), torch_version=torch.__version__)


def blas_core():
    """The OpenBLAS kernels in use in this process ("SkylakeX", "Prescott", ...) and its thread
    count; (None, None) when torch does not run on OpenBLAS or the library cannot be asked."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            if "openblas" not in f.read():
                return None, None  # not loaded: a fresh copy would answer for nothing in use
        lib = ctypes.CDLL("libopenblas.so.0")
        get = lib.openblas_get_corename
        get.restype = ctypes.c_char_p
        name = get()
        return (name.decode() if name else None), lib.openblas_get_num_threads()
    except (OSError, AttributeError, UnicodeDecodeError):
        return None, None


def allocator_in_use():
    """Which malloc this process runs on: a preloaded jemalloc or tcmalloc, else glibc's."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    stems = [(n, "/" + Path(lib).name.split(".so")[0]) for n, lib in ALLOCATORS if lib]
    return next((n for n, stem in stems if stem in maps), "glibc")


def ddp_module():
    """examples/pytorch/ddp_worker.py: one rank of PyTorch DDP, trained as frugal's rank."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import ddp_worker
    return ddp_worker


def pytorch_worker(c, result_path, ddp=False):
    if ddp:
        res = ddp_module().train_ddp(c, sys.modules[__name__])
    else:
        res = (gpt_module().train_pytorch(c, live_bytes=False) if c["kind"] == "gpt"
               else train_image(c))
    core, threads = blas_core()
    res.update(blas_core=core, blas_threads=threads, allocator=allocator_in_use())
    Path(result_path).write_text(json.dumps(res, indent=1))


# ---------------------------------------------------------------- the driver

def run_child(argv, log, env=None):
    """Runs argv with its output in `log`; returns its peak RSS in bytes (wait4's ru_maxrss)."""
    with open(log, "w") as f:
        pid = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env).pid
        _, status, usage = os.wait4(pid, 0)
    if (code := os.waitstatus_to_exitcode(status)) != 0:
        tail = Path(log).read_text(errors="replace")[-3000:]
        sys.exit(f"{argv[0]} {argv[1]} failed (exit {code}); the end of {log}:\n{tail}")
    return usage.ru_maxrss * 1024


def run_frugal(args, config, workdir, extra=(), env=None):
    out = Path(workdir, "frugal")
    rss = run_child([args.frugal, "train", config, "--overwrite", *args.set_argv, "--set",
                     f'run.out_dir="{out}"', "--set", 'run.progress="none"', *extra],
                    Path(workdir, "frugal.log"), env)
    path = out / "report.json"
    if not path.is_file():
        sys.exit(f"frugal exited 0 but wrote no {path}")
    report = json.loads(path.read_text())
    fit = report.get("fit", {})
    if "train_seconds" not in fit or "median" not in fit.get("step_seconds", {}):
        sys.exit(f"{path} has no fit.train_seconds or fit.step_seconds.median")
    blas = report.get("blas")  # absent before frugal chose OpenBLAS's core: unknown
    return dict(train_seconds=fit["train_seconds"], step_seconds=fit["step_seconds"]["median"],
                final_loss=fit["final_loss"], valid_accuracy=fit.get("valid_accuracy"),
                valid_loss=fit.get("valid_loss"), threads=report.get("threads"),
                blas_threads=report.get("blas_threads"), rss=rss,
                probed=json.dumps(report.get("threads_auto", {}).get("steps_timed")),
                blas=blas if isinstance(blas, dict) else None,
                **({"distributed": report["distributed"]} if "distributed" in report else {}))


def frugal_switched(blas):
    """The core frugal switched OpenBLAS to, None when it kept what OpenBLAS chose (or is older
    than report.json's "blas")."""
    if blas and blas.get("core") and blas.get("detected") and blas["core"] != blas["detected"]:
        return blas["core"]
    return None


def pytorch_env(args, lib, frugal_blas):
    """The PyTorch child's environment: lib preloaded (None: no preload, glibc's malloc) and
    OpenBLAS on frugal's kernels unless the user set them or asked for them as found."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if lib:
        env["LD_PRELOAD"] = lib
    core = frugal_switched(frugal_blas)
    if core and not args.pytorch_blas_as_found and "OPENBLAS_CORETYPE" not in os.environ:
        env["OPENBLAS_CORETYPE"] = core
    return env


def run_pytorch(args, config, workdir, variant, lib, frugal_blas):
    result = Path(workdir, f"pytorch-{variant}.json")
    result.unlink(missing_ok=True)
    env = pytorch_env(args, lib, frugal_blas)
    rss = run_child([sys.executable, os.path.abspath(__file__), "--worker", "pytorch", "--config",
                     config, *args.set_argv, "--result", str(result)],
                    Path(workdir, f"pytorch-{variant}.log"), env)
    res = json.loads(result.read_text())
    if res.get("allocator") != variant:  # the preload did not take: the row would be a lie
        sys.exit(f"the PyTorch child for {variant} ran on {res.get('allocator')}'s malloc "
                 f"(LD_PRELOAD={lib}); see {Path(workdir, f'pytorch-{variant}.log')}")
    return dict(res, rss=rss, coretype=env.get("OPENBLAS_CORETYPE"))


# ---------------------------------------------------------------- data parallel (--nproc N)

# torchrun's variables: none inherited (frugal's launcher and the PyTorch ranks get their own).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "TORCHELASTIC_RUN_ID")


def rank_env(env):
    """A rank's threads as torchrun sets them for nproc > 1 (OMP_NUM_THREADS=1), and OpenBLAS
    on one thread too; no torchrun variables inherited."""
    for k in TORCHRUN_VARS:
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def ddp_variants(args):
    """(key, allocator, preloaded library, gradient_as_bucket_view) of each PyTorch DDP run."""
    views = {"both": [False, True], "off": [False], "on": [True]}[args.bucket_view]
    return [(n + ("+view" if v else ""), n, lib, v) for v in views for n, lib in args.variants]


def ddp_label(key):
    alloc, _, view = key.partition("+")
    return alloc + (", bucket view" if view else "")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_frugal_ddp(args, config, workdir):
    """`frugal train CONFIG --nproc N` on one thread per rank; its peak RSS: wait4's ru_maxrss of
    the launcher, which covers the ranks it waited for (the largest process of the tree)."""
    res = run_frugal(args, config, workdir,
                     ["--nproc", str(args.nproc), "--set", "run.threads=1"],
                     rank_env(dict(os.environ)))
    resolved = json.loads(Path(workdir, "frugal", "report.json").read_text()).get("config")
    if isinstance(resolved, dict):  # the [distributed] options it ran with (bucket size, ...)
        res["distributed_config"] = resolved.get("distributed")
    return res


def run_pytorch_ddp(args, config, workdir, key, alloc, lib, view, frugal_blas):
    """N PyTorch DDP ranks (side_by_side.py --worker ddp), torchrun's environment, a free port on
    loopback; rank 0's measurements with every rank's peak RSS (wait4 of each rank)."""
    n = args.nproc
    env = rank_env(pytorch_env(args, lib, frugal_blas))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n),
               LOCAL_WORLD_SIZE=str(n))
    results = [Path(workdir, f"ddp-{key}-rank{r}.json") for r in range(n)]
    logs = [Path(workdir, f"ddp-{key}-rank{r}.log") for r in range(n)]
    procs = []
    for r in range(n):
        results[r].unlink(missing_ok=True)
        with open(logs[r], "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", "ddp", "--config", config,
                 *args.set_argv, "--nproc", str(n), "--bucket-view", "on" if view else "off",
                 "--result", str(results[r])],
                stdout=f, stderr=subprocess.STDOUT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
    rank_of = {p.pid: r for r, p in enumerate(procs)}
    rss, failed = [0] * n, None
    while rank_of:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in rank_of:
            continue
        r = rank_of.pop(pid)
        procs[r].returncode = code = os.waitstatus_to_exitcode(status)  # reaped here
        rss[r] = usage.ru_maxrss * 1024
        if code != 0 and failed is None:
            failed = (r, code)
            for p in procs:  # the others would wait in a collective until the timeout
                if p.pid in rank_of:
                    p.terminate()
    if failed:
        r, code = failed
        tail = logs[r].read_text(errors="replace")[-3000:]
        sys.exit(f"PyTorch DDP rank {r} ({key}) failed (exit {code}); the end of {logs[r]}:\n{tail}")
    ranks = [json.loads(p.read_text()) for p in results]
    for r, res in enumerate(ranks):
        if res.get("allocator") != alloc:  # the preload did not take: the row would be a lie
            sys.exit(f"PyTorch DDP rank {r} for {key} ran on {res.get('allocator')}'s malloc "
                     f"(LD_PRELOAD={lib}); see {logs[r]}")
    return dict(ranks[0], rss=max(rss), rss_ranks=rss, coretype=env.get("OPENBLAS_CORETYPE"),
                rank_threads=[(res["threads"], res.get("blas_threads")) for res in ranks])


def ddp_exactness(name, f_runs, p_runs):
    """(problems that fail the run, warnings, a sentence for the footnote): PyTorch's runs must
    be bitwise equal among themselves, and frugal's rounds (one thread per rank: no choice left
    to run.threads); frugal against PyTorch, every difference."""
    keys = ("final_loss", "valid_loss", "valid_accuracy")
    exact = lambda rs: len({json.dumps([r.get(k) for k in keys]) for r in rs}) == 1
    fails, warns = [], []
    pt = [r for rs in p_runs.values() for r in rs]
    if not exact(pt):
        fails.append(f"{name}: the PyTorch DDP runs differ among themselves: " + "; ".join(
            f"{ddp_label(v)} round {i + 1}: train loss {r['final_loss']!r}, valid loss "
            f"{r.get('valid_loss')!r}, valid acc {r.get('valid_accuracy')!r}"
            for v, rs in p_runs.items() for i, r in enumerate(rs)))
    if not exact(f_runs):
        fails.append(f"{name}: frugal's rounds differ among themselves: train losses "
                     + ", ".join(f"{r['final_loss']!r}" for r in f_runs))
    f, p = f_runs[0], pt[0]
    fmt = lambda k, a: "-" if a is None else (f"{100 * a:.2f}%" if k == "valid_accuracy"
                                              else f"{a:.8g}")
    parts = []
    for k, label in zip(keys, ("train loss", "valid loss", "valid acc")):
        a, b = f.get(k), p.get(k)
        d = "" if a is None or b is None else f" (|difference| {abs(a - b):.2g})"
        parts.append(f"{label} {fmt(k, a)} / {fmt(k, b)}{d}")
    bitwise = all(f.get(k) == p.get(k) for k in keys)
    if printed(f) != printed(p):
        warns.append(f"{name}: frugal {args_nproc_text(f)} and PyTorch DDP differ in the printed "
                     "digits (" + ", ".join(parts) + ")")
    same = lambda rs: "bitwise equal" if exact(rs) else "NOT all equal (see the warnings)"
    return fails, warns, (
        f"{name}: PyTorch DDP's {len(pt)} runs (all allocators"
        + (", both gradient_as_bucket_view settings" if any("+" in k for k in p_runs)
           and any("+" not in k for k in p_runs) else "") + f" and rounds) "
        f"{same(pt)}, frugal's {len(f_runs)} round(s) {same(f_runs)}; frugal against PyTorch "
        "DDP (rank 0's train loss, the all-reduced validation): "
        + ("bitwise equal, " if bitwise else "") + ", ".join(parts))


def args_nproc_text(f):
    return f"{(f.get('distributed') or {}).get('world_size', '?')}-rank"


def ddp_cell_rss(s):
    ranks = s.get("rss_ranks_median")
    return " / ".join(f"{b / (1 << 20):.1f}" for b in ranks) if ranks else \
        f"{s['rss'] / (1 << 20):.1f} (largest process)"


def ddp_table(args, rows, machine, notes):
    MiB, r = 1 << 20, lambda a, b: f"{a / b:.2f}" if b else "-"
    keys = [k for k, *_ in ddp_variants(args)]
    n = args.nproc
    lines = [f"`{shlex.join([sys.executable] + sys.argv)}`", "",
             f"| model | epoch (s) frugal {n} ranks | "
             + " | ".join(f"epoch (s) DDP {ddp_label(k)}" for k in keys)
             + " | DDP at its best | frugal / best "
             "| step (ms) frugal | step (ms) DDP | frugal / DDP "
             "| peak RSS (MiB) frugal, largest process | peak RSS (MiB) DDP, largest rank "
             "| frugal / DDP "
             "| train loss frugal | train loss DDP | valid loss frugal | valid loss DDP "
             "| valid acc frugal | valid acc DDP |",
             "|---|---:|" + "---:|" * len(keys) + "---|" + "---:|" * 13]
    for cfg, f, ps, best in rows:
        p = ps[best]
        fp, pp = printed(f), printed(p)
        what = describe(cfg).replace(f"batch {cfg['batch']},",
                                     f"global batch {cfg['batch']} ({n} ranks),")
        lines.append(
            f"| {what} | {cell(f)} | " + " | ".join(cell(ps.get(k)) for k in keys)
            + f" | {ddp_label(best)} | {r(f['epoch'], p['epoch'])} "
            f"| {1e3 * f['step_seconds']:.2f} | {1e3 * p['step_seconds']:.2f} "
            f"| {r(f['step_seconds'], p['step_seconds'])} "
            f"| {f['rss'] / MiB:.1f} | {p['rss'] / MiB:.1f} | {r(f['rss'], p['rss'])} "
            f"| {fp['train_loss']} | {pp['train_loss']} | {fp['valid_loss']} | {pp['valid_loss']} "
            f"| {fp['valid_acc']} | {pp['valid_acc']} |")
    lines += ["", "Each run's medians (epoch: median and range over the rounds; rank 0's epoch and "
              "step):", "",
              "| config | run | epoch (s) | step (ms) | peak RSS (MiB), " +
              " / ".join(f"rank {i}" for i in range(n)) + " |", "|---|---|---:|---:|---:|"]
    for (cfg, f, ps, best), config in zip(rows, args.config):
        for who, s in [(f"frugal --nproc {n}", f)] + [
                (f"DDP {ddp_label(k)}" + (" (best)" if k == best else ""), ps[k])
                for k in keys if k in ps]:
            lines.append(f"| {Path(config).stem} | {who} | {cell(s)} "
                         f"| {1e3 * s['step_seconds']:.2f} | {ddp_cell_rss(s)} |")
    lb, la = (", ".join(f"{x:.2f}" for x in machine[k]) for k in ("load_before", "load_after"))
    lines += ["", f"{machine['cpu']}, {machine['cores']} cores; load average (1, 5, 15 min) "
              f"{lb} before the first round, {la} after the last"
              + (f". **The machine was not idle** (1-minute load {machine['load_before'][0]:.2f} "
                 "> 0.5 at the start): these times are not the README's"
                 if machine["load_before"][0] > 0.5 else "") + ".", ""]
    lines += [f"{args.rounds} round(s), each run on its own (its {n} ranks together), the order "
              f"(frugal, then PyTorch DDP with " + ", ".join(ddp_label(k) for k in keys)
              + ") reversed every other round; each figure is the median over the rounds, the "
              "epoch's range (min-max) in brackets."
              + (" **Fewer than 3 rounds: no spread worth the name**; the README's figures take "
                 "3 or more." if args.rounds < 3 else ""), ""]
    view = {"both": "each with gradient_as_bucket_view False (DDP's default) and True",
            "off": "gradient_as_bucket_view False (DDP's default; --bucket-view off)",
            "on": "gradient_as_bucket_view True (--bucket-view on)"}[args.bucket_view]
    lines += [f"Data parallel on {n} processes of this machine, Gloo on loopback "
              "(127.0.0.1, a free port each run). frugal: `frugal train CONFIG --nproc "
              f"{n} --set run.threads=1` (its own launcher and data parallel: gradients "
              "all-reduced in buckets, summed then times 1/N; its [distributed] options below). "
              "PyTorch: "
              "torch.nn.parallel.DistributedDataParallel, backend gloo, one process per rank "
              "started by this script with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, "
              "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), DDP's defaults (bucket_cap_mb 25, "
              "broadcast_buffers on, the all-reduce overlapped with the backward), " + view
              + "; each allocator variant preloaded in every rank: glibc's malloc (no preload) "
              "and " + " and ".join(f"{a} (LD_PRELOAD={lib})" for a, lib in args.variants if lib)
              + "; the variant with the lowest median epoch is DDP at its best, and the step, "
              "peak RSS and frugal / DDP columns are against it."
              + "".join(f" **{a} skipped**: {lib} is missing (`apt-get install "
                        f"{'libjemalloc2' if a == 'jemalloc' else 'libtcmalloc-minimal4'}`, or "
                        "`bash third_party/install-deps.sh --bench`)."
                        for a, lib in args.skipped), ""]
    lines += [notes["threads"], ""]
    lines += [notes["blas"], ""]
    lines += ["Exactness: " + "; ".join(notes["exact"]) + "." + "".join(
        f" **Warning: {w}.**" for w in notes["warnings"]), ""]
    lines += [f"On the CPU; torch {rows[0][2][rows[0][3]]['torch_version']}. The same work on "
              "both sides: the same initial weights (torch.manual_seed(run.seed), modules built "
              "in frugal's order, rank 0's sent to every rank), every rank drawing frugal's one "
              f"seeded order, data.batch_size the global batch: rank r of {n} trains on rows "
              f"[B*r/{n}, B*(r+1)/{n}) of each batch of B (frugal's DataLoader::set_shard), a "
              "batch that splits unevenly weighted per sample (a rank's loss times its rows x "
              "ranks / B before backward, as frugal's DataParallel::before_batch; "
              f"{notes['weighted']}), a last training batch smaller than the world dropped (a validation one kept); gradients "
              f"averaged over the ranks; BatchNorm's running statistics rank 0's, sent to every "
              "rank after the epoch's training. Epoch: rank 0's training epoch, its first batch "
              "to its last (gathering and normalizing its shard included; data loading, "
              "validation and start-up excluded; frugal's report.json fit.train_seconds / "
              "epochs). Step: rank 0's median forward, loss, backward, all-reduce and optimizer "
              "step after run.warmup batches (fit.step_seconds.median). Peak RSS: ru_maxrss "
              "(runtime, libraries and the whole dataset, which every rank holds): each PyTorch "
              "rank's from wait4; frugal's from wait4 of its `--nproc` launcher, whose ru_maxrss "
              "covers the ranks it waited for, so it is the largest process of the tree, not "
              "each rank's (report.json's distributed.ranks[].peak_bytes counts frugal's tracked "
              "tensor bytes, not RSS), and the ratio compares it with DDP's largest rank. Train "
              "loss: rank 0's, the mean of its shard losses over the last epoch (summed in "
              "float32, as frugal); valid loss and acc: every validation sample once, each rank "
              "scoring its rows of every validation batch, the sums all-reduced."]
    return "\n".join(lines) + "\n"


def ddp_threads_note(args, rows_runs):
    """What each side ran on, as the processes reported it."""
    f_threads = sorted({f"{r.get('threads')} + BLAS {r.get('blas_threads')}"
                        for f_runs, _ in rows_runs for r in f_runs})
    p_threads = sorted({f"{t} + BLAS {b}" for _, p_runs in rows_runs for rs in p_runs.values()
                        for r in rs for t, b in r["rank_threads"]})
    dist = sorted({f"{d.get('backend')}, world {d.get('world_size')}, "
                   f"{d.get('buckets_per_step', 0):g} bucket(s) per step"
                   for f_runs, _ in rows_runs for r in f_runs
                   if (d := r.get("distributed"))})
    views = sorted({str(r.get("grads_are_bucket_views")) for _, p_runs in rows_runs
                    for k, rs in p_runs.items() if k.endswith("+view") for r in rs})
    opts = sorted({json.dumps(r.get("distributed_config"), sort_keys=True)
                   for f_runs, _ in rows_runs for r in f_runs if r.get("distributed_config")})
    dist = [d + (f" (resolved [distributed]: {'; '.join(opts)})" if opts else "") for d in dist]
    return (f"Threads, as torchrun sets them for nproc > 1: OMP_NUM_THREADS=1 and "
            "OPENBLAS_NUM_THREADS=1 in every rank's environment on both sides, frugal with "
            "`--set run.threads=1`, each PyTorch rank with torch.set_num_threads(1). What ran "
            "(intra-op threads + OpenBLAS's threads): frugal rank 0 (report.json threads + "
            "blas_threads) " + "/".join(f_threads) + "; PyTorch, every rank "
            "(torch.get_num_threads() + openblas_get_num_threads()) " + "/".join(p_threads)
            + ". frugal's report.json distributed: " + ("; ".join(dist) or "absent")
            + "." + (f" DDP with gradient_as_bucket_view: the gradients were views of its "
                     f"buckets after training: {'/'.join(views)}." if views else ""))


def main_ddp(args, cfgs):
    """--nproc N: frugal's N-rank data parallel against PyTorch DDP on N processes."""
    for config, cfg in zip(args.config, cfgs):
        if cfg["kind"] != "image":
            sys.exit(f"{config}: --nproc {args.nproc} compares data parallel on the Fashion-MNIST "
                     "mlp and cnn only; the gpt config is for the single-process comparison "
                     "(drop --nproc)")
        if cfg["batch"] < args.nproc:
            sys.exit(f"{config}: data.batch_size = {cfg['batch']} is smaller than the "
                     f"{args.nproc} ranks (frugal refuses it too)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="side_by_side_ddp_")
    machine = machine_info()
    if machine["load_before"][0] > 0.5:
        print(f"side_by_side: warning: the 1-minute load is {machine['load_before'][0]:.2f} "
              "(> 0.5): the machine is not idle, the times will say so", file=sys.stderr)
    variants = ddp_variants(args)
    rows_runs = []
    for i, (config, cfg) in enumerate(zip(args.config, cfgs)):
        wd = Path(workdir, f"{i}-{Path(config).stem}")
        wd.mkdir(parents=True, exist_ok=True)
        f_runs, p_runs = [], {k: [] for k, *_ in variants}
        for k in range(args.rounds):  # the order reversed every other round
            order = [("frugal", None, None, None)] + variants
            for key, alloc, lib, view in order[::1 if k % 2 == 0 else -1]:
                if key == "frugal":
                    f_runs.append(run_frugal_ddp(args, config, wd))
                    continue
                blas = f_runs[-1]["blas"] if f_runs else None  # frugal went first in round 1
                p_runs[key].append(run_pytorch_ddp(args, config, wd, key, alloc, lib, view, blas))
            print(f"{config} --nproc {args.nproc} round {k + 1}: final train loss frugal "
                  f"{f_runs[-1]['final_loss']:.6f}"
                  + "".join(f", DDP {ddp_label(v)} {rs[-1]['final_loss']:.6f}"
                            for v, rs in p_runs.items())
                  + f"; epoch {f_runs[-1]['train_seconds']:.2f} s" + "".join(
                      f" / {rs[-1]['train_seconds']:.2f} s" for rs in p_runs.values()),
                  file=sys.stderr)
        rows_runs.append((f_runs, p_runs))
    machine["load_after"] = os.getloadavg()
    rows, fails = [], []
    notes = dict(exact=[], warnings=[])
    for config, cfg, (f_runs, p_runs) in zip(args.config, cfgs, rows_runs):
        ps = {}
        for v, rs in p_runs.items():
            ps[v] = summary(cfg, rs)
            ps[v]["rss_ranks_median"] = [statistics.median(r["rss_ranks"][i] for r in rs)
                                         for i in range(args.nproc)]
        best = min(ps, key=lambda v: ps[v]["epoch"])
        rows.append((cfg, summary(cfg, f_runs), ps, best))
        fl, wa, sentence = ddp_exactness(Path(config).stem, f_runs, p_runs)
        fails += fl
        notes["warnings"] += fl + wa
        notes["exact"].append(sentence)
    for config, (f_runs, p_runs) in zip(args.config, rows_runs):  # what ran, not what was asked
        ran = {(r.get("threads"), r.get("blas_threads")) for r in f_runs} | {
            t for rs in p_runs.values() for r in rs for t in r["rank_threads"]}
        if ran != {(1, 1)}:
            notes["warnings"].append(
                f"{Path(config).stem}: not every rank ran on 1 thread + OpenBLAS on 1 (intra-op, "
                f"OpenBLAS threads seen: {sorted(ran, key=str)})")
    weighted = sorted({r.get("weighted_batches", 0) for _, p_runs in rows_runs
                       for rs in p_runs.values() for r in rs})
    notes["weighted"] = ("no batch split unevenly in these runs" if weighted == [0] else
                         "batches weighted per epoch on rank 0: " + "/".join(map(str, weighted)))
    notes["blas"] = blas_note(args, rows_runs)
    notes["threads"] = ddp_threads_note(args, rows_runs)
    text = ddp_table(args, rows, machine, notes)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    for w in notes["warnings"]:
        print(f"side_by_side: warning: {w}", file=sys.stderr)
    if fails:
        sys.exit("side_by_side: an exactness check failed (the table says which)")


def describe(c):
    epochs = sum(c["stages"])
    if c["kind"] == "gpt":
        return (f"gpt {c['n_layer']} layers x {c['n_embd']} ({c['n_head']} heads), context "
                f"{c['context'] or c['block']}, batch {c['batch']}, {c['opt']} lr {c['lr']:g}, "
                f"{epochs} epoch(s) of {c['max_steps'] // epochs} steps")
    net = (f"mlp {'-'.join(map(str, [784] + [c['width']] * (c['depth'] + 1) + [10]))}"
           if c["arch"] == "mlp" else f"cnn width {c['width']}")
    return f"{net}, batch {c['batch']}, {c['opt']} lr {c['lr']:g}, {epochs} epoch(s)"


def summary(cfg, runs):
    """Medians over the rounds; the epoch's range (min-max) too."""
    epochs = [r["train_seconds"] / sum(cfg["stages"]) for r in runs]
    # frugal's auto may differ between rounds: ATen threads, and "+ BLAS" where reported
    threads = sorted({f"{r['threads']}" + (f" + BLAS {r['blas_threads']}" if r.get("blas_threads")
                                            else "") for r in runs}, key=str)
    return dict(runs[0], epoch=statistics.median(epochs), lo=min(epochs), hi=max(epochs),
                n=len(runs), threads="/".join(map(str, threads)),
                **{k: statistics.median(r[k] for r in runs) for k in ("step_seconds", "rss")})


def printed(r):
    """The numbers as the table prints them."""
    pct = lambda a: "-" if a is None else f"{100 * a:.2f}%"
    num = lambda a: "-" if a is None or (isinstance(a, float) and math.isnan(a)) else f"{a:.4f}"
    return dict(train_loss=num(r["final_loss"]), valid_loss=num(r.get("valid_loss")),
                valid_acc=pct(r.get("valid_accuracy")))


def close(f, p):
    """Equal to float rounding: losses within 1e-4 relative, accuracy within 0.1 point (one
    next-byte prediction in a thousand flipped by a last-digit difference)."""
    near = lambda a, b: a is None or b is None or abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12)
    acc = lambda a, b: a is None or b is None or abs(a - b) <= 1e-3
    return (near(f["final_loss"], p["final_loss"]) and near(f.get("valid_loss"), p.get("valid_loss"))
            and acc(f.get("valid_accuracy"), p.get("valid_accuracy")))


def exactness(name, f_runs, p_runs, kind="image"):
    """(problems that fail the run, warnings, a sentence for the footnote). The gpt's sides run
    different attention kernels (frugal's fused one sums in another order and computes exp its
    own way: attention.h), so they agree to rounding, not to every digit; the mlp and cnn run
    the same kernels and must agree to every printed digit."""
    keys = ("final_loss", "valid_loss", "valid_accuracy")
    exact = lambda rs: len({json.dumps([r.get(k) for k in keys]) for r in rs}) == 1
    fails, warns = [], []
    pt = [r for rs in p_runs.values() for r in rs]
    if not exact(pt):
        fails.append(f"{name}: the PyTorch runs differ among themselves: " + "; ".join(
            f"{v} round {i + 1}: train loss {r['final_loss']!r}, valid loss "
            f"{r.get('valid_loss')!r}, valid acc {r.get('valid_accuracy')!r}"
            for v, rs in p_runs.items() for i, r in enumerate(rs)))
    if not exact(f_runs):  # a failure unless run.threads = "auto" probed or chose differently
        (fails if len({(r["threads"], r.get("blas_threads"), r.get("probed")) for r in f_runs}) == 1
         else warns).append(
            f"{name}: frugal's rounds differ among themselves: train losses "
            + ", ".join(f"{r['final_loss']!r} ({r['threads']} thread(s), BLAS {r.get('blas_threads')}; "
                        f"first steps timed per setting {r.get('probed')})" for r in f_runs)
            + " (run.threads = \"auto\" times its settings on real steps and stops timing a slow "
              "one early: rounds whose first steps ran on other thread counts sum in another order)")
    f, p = f_runs[0], pt[0]
    diff = abs(f["final_loss"] - p["final_loss"])
    rounding = kind == "gpt" and close(f, p)
    if printed(f) != printed(p) and not rounding:
        a, b = printed(f), printed(p)
        warns.append(f"{name}: frugal and PyTorch differ in the printed digits (train loss "
                     f"{a['train_loss']} / {b['train_loss']}, valid loss {a['valid_loss']} / "
                     f"{b['valid_loss']}, valid acc {a['valid_acc']} / {b['valid_acc']}; frugal "
                     f"on {f['threads']} thread(s) (OpenBLAS on {f.get('blas_threads')}), PyTorch "
                     f"on {p['threads']} "
                     f"(OpenBLAS on {p.get('blas_threads')}); OpenBLAS kernels "
                     f"{(f['blas'] or {}).get('core', 'unknown')} / {p.get('blas_core')}: "
                     "OPENBLAS_NUM_THREADS=1 with --set run.threads=1 puts both on one thread)")
    same = lambda rs: "bitwise equal" if exact(rs) else "NOT all equal (see the warnings)"
    return fails, warns, (
        f"{name}: PyTorch's {len(pt)} runs (all allocators and rounds) {same(pt)}, frugal's "
        f"{len(f_runs)} round(s) {same(f_runs)}; frugal against PyTorch: "
        + ("equal to every printed digit" if printed(f) == printed(p) else
           "equal to rounding (frugal's fused attention kernel)" if rounding else "DIFFERENT")
        + f", train loss |difference| {diff:.2g}")


def cell(s):
    if s is None:
        return "skipped"
    return f"{s['epoch']:.2f}" + (f" ({s['lo']:.2f}-{s['hi']:.2f})" if s["n"] > 1 else "")


def table(args, rows, machine, notes):
    MiB, r = 1 << 20, lambda a, b: f"{a / b:.2f}" if b else "-"
    names = [n for n, _ in ALLOCATORS]
    lines = [f"`{shlex.join([sys.executable] + sys.argv)}`", "",
             "| model | epoch (s) frugal | "
             + " | ".join(f"epoch (s) PyTorch {n}" for n in names)
             + " | PyTorch at its best | frugal / best "
             "| step (ms) frugal | step (ms) PyTorch | frugal / PyTorch "
             "| peak RSS (MiB) frugal | peak RSS (MiB) PyTorch | frugal / PyTorch "
             "| train loss frugal | train loss PyTorch | valid loss frugal | valid loss PyTorch "
             "| valid acc frugal | valid acc PyTorch |",
             "|---|---:|" + "---:|" * len(names) + "---|" + "---:|" * 13]
    for cfg, f, ps, best in rows:
        p = ps[best]
        fp, pp = printed(f), printed(p)
        lines.append(
            f"| {describe(cfg)} | {cell(f)} | " + " | ".join(cell(ps.get(n)) for n in names)
            + f" | {best} | {r(f['epoch'], p['epoch'])} "
            f"| {1e3 * f['step_seconds']:.2f} | {1e3 * p['step_seconds']:.2f} "
            f"| {r(f['step_seconds'], p['step_seconds'])} "
            f"| {f['rss'] / MiB:.1f} | {p['rss'] / MiB:.1f} | {r(f['rss'], p['rss'])} "
            f"| {fp['train_loss']} | {pp['train_loss']} | {fp['valid_loss']} | {pp['valid_loss']} "
            f"| {fp['valid_acc']} | {pp['valid_acc']} |")
    lines += ["", "Each process's medians (epoch: median and range over the rounds):", "",
              "| config | process | epoch (s) | step (ms) | peak RSS (MiB) |",
              "|---|---|---:|---:|---:|"]
    for (cfg, f, ps, best), config in zip(rows, args.config):
        for who, s in [("frugal", f)] + [(f"PyTorch {n}" + (" (best)" if n == best else ""), ps[n])
                                         for n in names if n in ps]:
            lines.append(f"| {Path(config).stem} | {who} | {cell(s)} "
                         f"| {1e3 * s['step_seconds']:.2f} | {s['rss'] / MiB:.1f} |")
    threads = "; ".join(f"{Path(n).name}: frugal {f['threads']}, PyTorch {ps[best]['threads']} "
                        f"(its OpenBLAS {ps[best].get('blas_threads')})"
                        for n, (_, f, ps, best) in zip(args.config, rows))
    lb, la = (", ".join(f"{x:.2f}" for x in machine[k]) for k in ("load_before", "load_after"))
    lines += ["", f"{machine['cpu']}, {machine['cores']} cores; load average (1, 5, 15 min) "
              f"{lb} before the first round, {la} after the last"
              + (f". **The machine was not idle** (1-minute load {machine['load_before'][0]:.2f} "
                 "> 0.5 at the start): these times are not the README's"
                 if machine["load_before"][0] > 0.5 else "") + ".", ""]
    lines += [f"{args.rounds} round(s), each process on its own, the order (frugal, then PyTorch "
              f"with {', '.join(n for n, _ in args.variants)}) reversed every other round; "
              "each figure is the median over the rounds, the epoch's range (min-max) in "
              "brackets." + (" **Fewer than 3 rounds: no spread worth the name**; the README's "
                             "figures take 3 or more." if args.rounds < 3 else ""), ""]
    lines += ["PyTorch at its best: each round runs the PyTorch child with glibc's malloc (no "
              "preload) and with " + " and ".join(f"{n} (LD_PRELOAD={lib})"
                                                   for n, lib in args.variants if lib)
              + "; the variant with the lowest median epoch is its best, and the step, peak RSS "
              "and frugal / PyTorch columns are against it."
              + "".join(f" **{n} skipped**: {lib} is missing (`apt-get install "
                        f"{'libjemalloc2' if n == 'jemalloc' else 'libtcmalloc-minimal4'}`, or "
                        "`bash third_party/install-deps.sh --bench`)."
                        for n, lib in args.skipped), ""]
    lines += [notes["blas"], ""]
    lines += ["Exactness: " + "; ".join(notes["exact"]) + "." + "".join(
        f" **Warning: {w}.**" for w in notes["warnings"]), ""]
    gpt = any(cfg["kind"] == "gpt" for cfg, *_ in rows)
    lines += [f"On the CPU; torch {rows[0][2][rows[0][3]]['torch_version']}; intra-op threads "
              f"(+ OpenBLAS's own threads): {threads}. "
              "Epoch: the training epoch's wall time from its first batch to its last "
              "(gathering and normalizing the batches included; data loading, validation and "
              "start-up excluded; frugal's report.json fit.train_seconds / epochs). Step: the "
              "median time of one batch's forward, loss, backward and optimizer step after "
              "run.warmup batches (fit.step_seconds.median). Peak RSS: each child process's "
              "ru_maxrss (runtime, libraries and the data included). Train loss: the mean over "
              "the last epoch's batches; valid loss and acc: on the validation samples after "
              "training" + (" (the gpt's: nats per byte and next-byte accuracy)" if gpt else "")
              + ". Same initial weights, batches and optimizer on both sides."]
    return "\n".join(lines) + "\n"


def blas_note(args, rows_runs):
    """Both sides' BLAS kernels, as each process reported them, and the mode."""
    fr = [r["blas"] for f_runs, _ in rows_runs for r in f_runs]
    cores = sorted({r.get("blas_core") or "unknown" for _, p_runs in rows_runs
                    for rs in p_runs.values() for r in rs})
    passed = sorted({r["coretype"] for _, p_runs in rows_runs for rs in p_runs.values()
                     for r in rs if r.get("coretype")})
    if any(b is None for b in fr):
        f_text = "frugal's BLAS core unknown (its report.json has no \"blas\": an older binary)"
    else:
        f_text = "frugal: " + ", ".join(sorted({
            f"{b.get('library')} {b.get('core')}" + (f" (OpenBLAS chose {b.get('detected')}; "
                                                     "frugal switched it)"
                                                     if frugal_switched(b) else "")
            for b in fr}))
    p_text = "PyTorch: OpenBLAS " + "/".join(cores) if cores != ["unknown"] else \
        "PyTorch: BLAS core unknown (not OpenBLAS, or openblas_get_corename unavailable)"
    user = os.environ.get("OPENBLAS_CORETYPE")
    if user:
        mode = f"OPENBLAS_CORETYPE={user} set by the user for both sides"
    elif args.pytorch_blas_as_found:
        mode = ("--pytorch-blas-as-found: PyTorch on the kernels OpenBLAS chose by itself "
                "(what frugal's choice is worth)")
    elif passed:
        mode = (f"PyTorch started with OPENBLAS_CORETYPE={'/'.join(passed)}, the kernels frugal "
                "chose (the same BLAS kernels on both sides)")
    elif any(b is None for b in fr):
        mode = "frugal's core unknown, so PyTorch was given no OPENBLAS_CORETYPE"
    else:
        mode = "frugal kept OpenBLAS's own choice, so PyTorch was given no OPENBLAS_CORETYPE"
    return f"BLAS: {f_text}; {p_text}. Mode: {mode}."


def machine_info():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), load_before=os.getloadavg())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frugal", help="the frugal binary")
    ap.add_argument("--config", action="append", required=True, help="repeat for several")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key on both sides, as frugal's --set")
    ap.add_argument("--out", help="Markdown file for the table")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3; the spread needs 3)")
    ap.add_argument("--pytorch-blas-as-found", action="store_true",
                    help="do not start PyTorch on the OpenBLAS kernels frugal chose "
                         "(OPENBLAS_CORETYPE): measures what frugal's choice is worth")
    ap.add_argument("--workdir", help="folder for the runs (default: a new temporary folder)")
    ap.add_argument("--nproc", type=int, default=1, metavar="N",
                    help="data parallel: frugal train --nproc N against PyTorch DDP (Gloo) on N "
                         "processes, one thread each (default 1: the single-process comparison)")
    ap.add_argument("--bucket-view", choices=["both", "off", "on"], default="both",
                    help="with --nproc: DDP's gradient_as_bucket_view, both measured (default) "
                         "or only off (DDP's default) or on")
    ap.add_argument("--worker", choices=["pytorch", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfgs = [read_config(path, args.set) for path in args.config]
    if args.worker == "ddp":
        return pytorch_worker(dict(cfgs[0], bucket_view=args.bucket_view == "on"), args.result,
                              ddp=True)
    if args.worker:
        return pytorch_worker(cfgs[0], args.result)
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: at least 1 (3 or more for a spread)")
    if args.nproc < 1:
        sys.exit(f"--nproc {args.nproc}: at least 1")
    if not args.frugal or not (os.path.isfile(args.frugal) and os.access(args.frugal, os.X_OK)):
        sys.exit(f"--frugal: no executable at {args.frugal!r} (build it first)")
    args.set_argv = [a for s in args.set for a in ("--set", s)]
    args.variants = [(n, lib) for n, lib in ALLOCATORS if lib is None or os.path.isfile(lib)]
    args.skipped = [(n, lib) for n, lib in ALLOCATORS if (n, lib) not in args.variants]
    for n, lib in args.skipped:
        print(f"side_by_side: {lib} is missing: PyTorch with {n} skipped", file=sys.stderr)
    if args.nproc > 1:
        return main_ddp(args, cfgs)
    workdir = args.workdir or tempfile.mkdtemp(prefix="side_by_side_")
    machine = machine_info()
    if machine["load_before"][0] > 0.5:
        print(f"side_by_side: warning: the 1-minute load is {machine['load_before'][0]:.2f} "
              "(> 0.5): the machine is not idle, the times will say so", file=sys.stderr)
    rows_runs = []
    for n, (config, cfg) in enumerate(zip(args.config, cfgs)):
        wd = Path(workdir, f"{n}-{Path(config).stem}")
        wd.mkdir(parents=True, exist_ok=True)
        f_runs, p_runs = [], {v: [] for v, _ in args.variants}
        for k in range(args.rounds):  # the order reversed every other round
            order = [("frugal", None)] + args.variants
            for who, lib in order[::1 if k % 2 == 0 else -1]:
                if who == "frugal":
                    f_runs.append(run_frugal(args, config, wd))
                    continue
                blas = f_runs[-1]["blas"] if f_runs else None  # frugal went first in round 1
                p_runs[who].append(run_pytorch(args, config, wd, who, lib, blas))
            print(f"{config} round {k + 1}: final train loss frugal {f_runs[-1]['final_loss']:.6f}"
                  + "".join(f", PyTorch {v} {rs[-1]['final_loss']:.6f}" for v, rs in p_runs.items())
                  + f"; epoch {f_runs[-1]['train_seconds']:.2f} s" + "".join(
                      f" / {rs[-1]['train_seconds']:.2f} s" for rs in p_runs.values()),
                  file=sys.stderr)
        rows_runs.append((f_runs, p_runs))
    machine["load_after"] = os.getloadavg()
    rows, notes, fails = [], dict(exact=[], warnings=[]), []
    for config, cfg, (f_runs, p_runs) in zip(args.config, cfgs, rows_runs):
        ps = {v: summary(cfg, rs) for v, rs in p_runs.items()}
        best = min(ps, key=lambda v: ps[v]["epoch"])
        rows.append((cfg, summary(cfg, f_runs), ps, best))
        fl, wa, sentence = exactness(Path(config).stem, f_runs, p_runs, cfg.get("kind", "image"))
        fails += fl
        notes["warnings"] += fl + wa
        notes["exact"].append(sentence)
    notes["blas"] = blas_note(args, rows_runs)
    text = table(args, rows, machine, notes)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    for w in notes["warnings"]:
        print(f"side_by_side: warning: {w}", file=sys.stderr)
    if fails:
        sys.exit("side_by_side: an exactness check failed (the table says which)")


if __name__ == "__main__":
    main()
