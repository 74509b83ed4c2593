"""Use a frugal run's trained model from plain PyTorch, and check it scores as frugal does.

A run folder holds config.toml (the resolved config), data.json (what the data were: the
images' mean and std) and model.safetensors (the weights, float32, under the names of the
model's modules). For model.arch "mlp" and "cnn" this script builds the same model out of
torch.nn modules (nn.Sequential numbers children as frugal's blocks do, so the names match),
loads the weights with strict=True, reads the first data.valid_samples Fashion-MNIST test
images, prepares them as frugal does ((pixel / 255 - mean) / std in float32) and prints the
accuracy as `frugal evaluate RUN_DIR` does, to the same count of correct predictions:

    /usr/bin/python3 examples/pytorch/load_run.py runs/quickstart
    build/bin/frugal evaluate runs/quickstart

Every architecture (resnet, vit, gpt, plugins' models) loads without a Python definition:
model.pt is a TorchScript module with a forward, `m = torch.jit.load("RUN_DIR/model.pt")`
(its `prepare` method turns raw images into what forward takes: m(m.prepare(images))).
Needs torch (Debian's python3-torch: /usr/bin/python3) and Python 3.11 (tomllib); the
safetensors package is used when installed, else the file is read by its format alone.
"""
import argparse, ctypes, gzip, json, os, struct, sys, tomllib
from collections import OrderedDict

import torch
from torch import nn


def read_safetensors(path):
    """{name: tensor} and the metadata: an 8-byte little-endian header length, a JSON header
    (dtype, shape, byte offsets of each tensor), then the raw little-endian bytes."""
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "F16": torch.float16}
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        raw = bytearray(blob[8 + n + begin:8 + n + end])
        tensors[name] = torch.frombuffer(raw, dtype=dtypes[t["dtype"]]).reshape(t["shape"])
    return tensors, meta


def make_mlp(m, channels, size, classes):
    """frugal's make_mlp: stem, block1..block<depth>, head (models.cpp)."""
    layers = [("stem", nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, m["width"]), nn.ReLU()))]
    for i in range(1, m["depth"] + 1):
        block = [nn.Linear(m["width"], m["width"]), nn.ReLU()]
        if m["dropout"] > 0:
            block.append(nn.Dropout(m["dropout"]))
        layers.append((f"block{i}", nn.Sequential(*block)))
    layers.append(("head", nn.Sequential(nn.Linear(m["width"], classes))))
    return nn.Sequential(OrderedDict(layers))


def make_cnn(m, channels, size, classes):
    """frugal's make_cnn: three conv + batch-norm blocks, pooled to 7 x 7, and a linear head.
    LibTorch's BatchNorm2d defaults are PyTorch's (eps 1e-5, momentum 0.1)."""
    def block(c_in, c_out, pool):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), pool]
    w = m["width"]
    head = [nn.Dropout(m["dropout"])] if m["dropout"] > 0 else []
    return nn.Sequential(OrderedDict(
        features1=nn.Sequential(*block(channels, w, nn.MaxPool2d(2))),
        features2=nn.Sequential(*block(w, 2 * w, nn.MaxPool2d(2))),
        features3=nn.Sequential(*block(2 * w, 4 * w, nn.AdaptiveAvgPool2d(7)), nn.Flatten()),
        head=nn.Sequential(*head, nn.Linear(4 * w * 7 * 7, classes))))


def same_blas_kernels_as_frugal():
    """frugal switches OpenBLAS to the CPU's own kernels when OpenBLAS did not recognise the CPU
    and fell back to Prescott's (base/blas.cpp; report.json "blas"): other kernels sum in
    another order, so the loss would differ in its last bits. Do the same here."""
    try:
        blas = ctypes.CDLL("libblas.so.3")  # the one torch loaded
        blas.openblas_get_corename.restype = ctypes.c_char_p
        if os.environ.get("OPENBLAS_CORETYPE") or blas.openblas_get_corename() != b"Prescott":
            return
    except (OSError, AttributeError):  # not OpenBLAS
        return
    flags = set(open("/proc/cpuinfo").read().split())
    for core, needs in (("SkylakeX", {"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
                        ("Haswell", {"avx2", "fma"}), ("Sandybridge", {"avx"})):
        if needs <= flags:
            os.environ["OPENBLAS_CORETYPE"] = core  # read by gotoblas_dynamic_init
            blas.gotoblas_dynamic_quit()
            blas.gotoblas_dynamic_init()
            return


def read_idx(path):
    """An IDX file (gzip): magic 0 0 8 ndims, big-endian int32 sizes, then uint8 data."""
    with gzip.open(path, "rb") as f:
        blob = f.read()
    ndims = blob[3]
    shape = struct.unpack(">" + "i" * ndims, blob[4:4 + 4 * ndims])
    return torch.frombuffer(bytearray(blob[4 + 4 * ndims:]), dtype=torch.uint8).reshape(shape)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--data", help="the Fashion-MNIST folder (default: the config's data.path)")
    p.add_argument("--limit", type=int, default=0, help="the first N test images, as frugal evaluate --samples N (default: data.valid_samples)")
    a = p.parse_args()

    config = tomllib.load(open(os.path.join(a.run_dir, "config.toml"), "rb"))
    data = json.load(open(os.path.join(a.run_dir, "data.json")))
    arch, makers = config["model"]["arch"], {"mlp": make_mlp, "cnn": make_cnn}
    if arch not in makers or config["data"]["dataset"] != "fashion-mnist":
        sys.exit(f"{a.run_dir}: model.arch '{arch}' on '{config['data']['dataset']}': this example "
                 f"defines {' and '.join(makers)} on fashion-mnist. Every arch loads as TorchScript: "
                 f"m = torch.jit.load('{os.path.join(a.run_dir, 'model.pt')}')")
    shape = data["input"]  # what frugal built the model for
    model = makers[arch](config["model"], shape["channels"], shape["image_size"], shape["num_classes"])

    try:
        from safetensors.torch import load_file
        weights = load_file(os.path.join(a.run_dir, "model.safetensors"))
    except ImportError:
        weights, meta = read_safetensors(os.path.join(a.run_dir, "model.safetensors"))
        assert meta.get("frugal.model.arch", arch) == arch, meta
    model.load_state_dict(weights, strict=True)  # every name and shape, nothing left over
    model.eval()  # batch norm on its running statistics, no dropout
    same_blas_kernels_as_frugal()

    # The validation split: the first valid_samples test images, in order (0 or -1: all).
    folder = a.data or config["data"]["path"]
    images = read_idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz")).unsqueeze(1)  # N, 1, H, W
    labels = read_idx(os.path.join(folder, "t10k-labels-idx1-ubyte.gz")).long()
    n = a.limit if a.limit > 0 else config["data"]["valid_samples"]
    if n > 0:
        images, labels = images[:n], labels[:n]

    # Batches of data.valid_batch_size, prepared as frugal's DataLoader does: float32
    # pixel * (1 / (255 std)) - mean / std, the two constants rounded to float32 once.
    mean, std = data["images"]["mean"], data["images"]["std"]
    batch = config["data"]["valid_batch_size"]
    correct, loss_sum = 0, torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(labels), batch):
            x = images[i:i + batch].float().mul_(1.0 / (255.0 * std)).sub_(mean / std)
            y = labels[i:i + batch]
            logits = model(x)
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum")
            correct += int((logits.argmax(1) == y).sum())
    count = len(labels)
    print(f"{a.run_dir}: {arch} on fashion-mnist, {count} validation sample(s), "
          f"{correct} correct (torch.nn from model.safetensors)")
    print(f"  accuracy: {100.0 * correct / count:.2f}%")
    print(f"  valid_loss: {loss_sum.item() / count:g} nats/sample")


if __name__ == "__main__":
    main()
