#!/usr/bin/python3
"""An independent reference of Hugging Face GPT-2 (GPT2LMHeadModel), for frugal's C++ tests.

Used by tests/framework/test_hf_gpt2.cpp (frugal's `gpt2` model loads Hugging Face checkpoints and
computes the same logits, loss and training steps) and plugins/lora/test_lora.cpp (a LoRA adapter
saved in PEFT's format gives what a PEFT user gets). GPT-2 is written here from the paper and the
semantics of transformers' modeling_gpt2.py (Conv1D weights stored [in, out], gelu_new, pre-LN
blocks, tied head), with plain torch ops and nothing from frugal. It needs only Debian's
python3-torch (and the numpy it brings): no transformers, no safetensors; safetensors files are
read and written by hand (8-byte little-endian header length, JSON header, raw row-major bytes).

  hf_gpt2_reference.py make OUT [--n_layer 2 --n_head 2 --n_embd 32 --vocab 61 --n_positions 24
                                 --seed 0 --std 0.2 --shards K --no_prefix --mask_buffers --dtype F32|BF16|F16]
      random weights (LayerNorms non-trivial) as OUT/config.json + OUT/model.safetensors, or K
      shards model-0000i-of-0000K.safetensors + model.safetensors.index.json.
  hf_gpt2_reference.py forward DIR BATCH_JSON OUT_JSON
      float64 eval forward of DIR on BATCH_JSON {"x": [[tok..]..], "y": [[next tok..]..]};
      writes {"logits": [B][T][V], "loss": mean cross-entropy}.
  hf_gpt2_reference.py train DIR BATCH_JSON OUT_DIR --steps 3 --lr 0.01 --optimizer sgd|adamw
                             [--weight_decay 0.0]
      float32 training (no dropout, wte one tied parameter); writes OUT_DIR/losses.json
      {"losses": [before step 1, ..., after the last step]}, OUT_DIR/model.safetensors (F32,
      "transformer."-prefixed names) and a copy of config.json.
  hf_gpt2_reference.py peft BASE_DIR ADAPTER_DIR BATCH_JSON OUT_JSON
      merges ADAPTER_DIR (adapter_config.json + adapter_model.safetensors, PEFT's LoRA format)
      into BASE_DIR's Conv1D weights and writes what `forward` writes.

Errors print a message on stderr and exit with status 1.
"""
import argparse
import json
import math
import os
import re
import shutil
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

PREFIX = "transformer."
BUFFERS = (".attn.bias", ".attn.masked_bias")  # with the dot: c_attn.bias is a parameter
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# safetensors dtype -> numpy dtype of its little-endian bytes (BF16 read as raw uint16)
ST_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}


class RefError(Exception):
    pass


def check(condition, message):
    if not condition:
        raise RefError(message)


# ---------------------------------------------------------------- safetensors by hand

def tensor_bytes(t, dtype):
    t = t.detach().contiguous()
    if dtype == "BF16":
        return t.float().to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    check(dtype in ("F32", "F16", "F64"), f"cannot write dtype {dtype}")
    return t.double().numpy().astype(ST_DTYPES[dtype]).tobytes()


def write_safetensors(path, tensors, dtype):
    """tensors: ordered {name: tensor}; all stored as `dtype`, data in the given order."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        raw = tensor_bytes(t, dtype)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in chunks:
            f.write(raw)
    return offset


def decode_tensor(data, info, name):
    check(isinstance(info, dict), f"{name}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    check(dtype in ST_DTYPES, f"{name}: unsupported dtype {dtype!r}")
    check(isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape), f"{name}: bad shape")
    check(isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets),
          f"{name}: bad data_offsets")
    begin, end = offsets
    np_dtype = np.dtype(ST_DTYPES[dtype])
    count = math.prod(shape)
    check(0 <= begin <= end <= len(data) and end - begin == count * np_dtype.itemsize,
          f"{name}: data_offsets {offsets} do not fit shape {shape} / dtype {dtype} / {len(data)} data bytes")
    if count == 0:
        return torch.zeros(shape, dtype=torch.float32)
    array = np.frombuffer(data, dtype=np_dtype, count=count, offset=begin)
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return torch.from_numpy((array.astype(np.uint32) << 16).view(np.float32)).reshape(shape)
    return torch.from_numpy(array.astype(np_dtype.newbyteorder("="))).reshape(shape)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    check(len(blob) >= 8, f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    check(n <= len(blob) - 8, f"{path}: header length {n} exceeds the file")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RefError(f"{path}: bad header JSON: {e}")
    check(isinstance(header, dict), f"{path}: header is not a JSON object")
    data = blob[8 + n:]
    return {name: decode_tensor(data, info, f"{path}: {name}")
            for name, info in header.items() if name != "__metadata__"}


# ---------------------------------------------------------------- checkpoints

def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise RefError(f"{path}: bad JSON: {e}")


def load_config(folder):
    raw = read_json(os.path.join(folder, "config.json"))
    cfg = {k: raw.get(k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")}
    for key, value in cfg.items():
        check(isinstance(value, int) and value > 0, f"config.json: {key} must be a positive integer")
    check(cfg["n_embd"] % cfg["n_head"] == 0, "config.json: n_embd must be a multiple of n_head")
    cfg["eps"] = float(raw.get("layer_norm_epsilon", 1e-5))
    cfg["n_inner"] = raw.get("n_inner") or 4 * cfg["n_embd"]
    cfg["act"] = raw.get("activation_function", "gelu_new")
    check(cfg["act"] in ("gelu_new", "gelu_pytorch_tanh", "gelu"), f"unsupported activation {cfg['act']}")
    check(raw.get("tie_word_embeddings", True), "only tie_word_embeddings=true is supported")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        check(not raw.get(flag, False), f"config.json: {flag} is not supported")
    return cfg


def expected_shapes(cfg):
    """The Hugging Face names and shapes of GPT2LMHeadModel's parameters, in state_dict order."""
    C, I, shapes = cfg["n_embd"], cfg["n_inner"], {}
    shapes["transformer.wte.weight"] = [cfg["vocab_size"], C]
    shapes["transformer.wpe.weight"] = [cfg["n_positions"], C]
    for i in range(cfg["n_layer"]):
        h = f"transformer.h.{i}."
        for name, shape in (("ln_1.weight", [C]), ("ln_1.bias", [C]),
                            ("attn.c_attn.weight", [C, 3 * C]), ("attn.c_attn.bias", [3 * C]),
                            ("attn.c_proj.weight", [C, C]), ("attn.c_proj.bias", [C]),
                            ("ln_2.weight", [C]), ("ln_2.bias", [C]),
                            ("mlp.c_fc.weight", [C, I]), ("mlp.c_fc.bias", [I]),
                            ("mlp.c_proj.weight", [I, C]), ("mlp.c_proj.bias", [C])):
            shapes[h + name] = shape
    shapes["transformer.ln_f.weight"] = [C]
    shapes["transformer.ln_f.bias"] = [C]
    return shapes


def read_checkpoint_files(folder):
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    check(os.path.exists(index_path), f"{folder}: no model.safetensors nor model.safetensors.index.json")
    weight_map = read_json(index_path).get("weight_map")
    check(isinstance(weight_map, dict) and weight_map, f"{index_path}: no weight_map")
    shards = {file: read_safetensors(os.path.join(folder, file)) for file in sorted(set(weight_map.values()))}
    tensors = {}
    for name, file in weight_map.items():
        check(name in shards[file], f"{index_path}: {name} is not in {file}")
        tensors[name] = shards[file][name]
    return tensors


def normalize(tensors, cfg):
    """File tensors -> {prefixed HF name: tensor}; buffers dropped, lm_head checked against wte."""
    out, lm_head = {}, None
    for name, t in tensors.items():
        if name == "lm_head.weight":
            lm_head = t
            continue
        full = name if name.startswith(PREFIX) else PREFIX + name
        if not full.endswith(BUFFERS):
            out[full] = t
    shapes = expected_shapes(cfg)
    missing, unexpected = sorted(set(shapes) - set(out)), sorted(set(out) - set(shapes))
    check(not missing, f"missing tensors: {missing}")
    check(not unexpected, f"unexpected tensors: {unexpected}")
    for name, shape in shapes.items():
        check(list(out[name].shape) == shape, f"{name}: shape {list(out[name].shape)}, expected {shape}")
    if lm_head is not None:
        check(torch.equal(lm_head.double(), out["transformer.wte.weight"].double()),
              "lm_head.weight is present but differs from transformer.wte.weight (untied head unsupported)")
    return {name: out[name] for name in shapes}


def load_model(folder, dtype):
    cfg = load_config(folder)
    weights = normalize(read_checkpoint_files(folder), cfg)
    return cfg, {name: t.to(dtype) for name, t in weights.items()}


# ---------------------------------------------------------------- GPT-2

def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def activation(x, name):
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def attention(x, w, h, n_head):
    B, T, C = x.shape
    qkv = x @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]
    q, k, v = (t.reshape(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=-1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // n_head)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    merged = (probs @ v).transpose(1, 2).reshape(B, T, C)
    return merged @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]


def mlp(x, w, h, act):
    hidden = activation(x @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"], act)
    return hidden @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]


def gpt2_logits(w, cfg, x):
    """x: [B, T] long -> logits [B, T, V] in the dtype of the weights."""
    h = w["transformer.wte.weight"][x] + w["transformer.wpe.weight"][torch.arange(x.shape[1])]
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        a = h + attention(layer_norm(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"], cfg["eps"]), w, p, cfg["n_head"])
        h = a + mlp(layer_norm(a, w[p + "ln_2.weight"], w[p + "ln_2.bias"], cfg["eps"]), w, p, cfg["act"])
    h = layer_norm(h, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], cfg["eps"])
    return h @ w["transformer.wte.weight"].t()


def mean_ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def load_batch(path, cfg):
    batch = read_json(path)
    check(isinstance(batch, dict) and "x" in batch and "y" in batch, f"{path}: needs keys x and y")
    try:
        x, y = torch.tensor(batch["x"], dtype=torch.long), torch.tensor(batch["y"], dtype=torch.long)
    except (TypeError, ValueError) as e:
        raise RefError(f"{path}: x and y must be rectangular lists of integers ({e})")
    check(x.dim() == 2 and x.shape == y.shape and x.numel() > 0, f"{path}: x and y must both be B x T")
    check(x.shape[1] <= cfg["n_positions"], f"{path}: T = {x.shape[1]} exceeds n_positions")
    for t in (x, y):
        check(int(t.min()) >= 0 and int(t.max()) < cfg["vocab_size"], f"{path}: token outside [0, vocab_size)")
    return x, y


def write_forward(w, cfg, batch_path, out_path):
    x, y = load_batch(batch_path, cfg)
    with torch.no_grad():
        logits = gpt2_logits(w, cfg, x)
        loss = mean_ce(logits, y)
    with open(out_path, "w") as f:
        json.dump({"logits": logits.tolist(), "loss": loss.item()}, f)


# ---------------------------------------------------------------- make

def random_weights(cfg, seed, std=0.2):
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        if re.search(r"(ln_\d|ln_f)\.weight$", name):
            weights[name] = 1.0 + 0.1 * noise
        elif re.search(r"(ln_\d|ln_f)\.bias$", name):
            weights[name] = 0.1 * noise
        else:
            weights[name] = std * noise
    return weights


def with_buffers(weights, cfg):
    """HF state_dict order, with the old attn.bias / attn.masked_bias buffers after ln_1."""
    P, out = cfg["n_positions"], {}
    for name, t in weights.items():
        out[name] = t
        m = re.match(r"(transformer\.h\.\d+\.)ln_1\.bias$", name)
        if m:
            out[m.group(1) + "attn.bias"] = torch.tril(torch.ones(P, P)).reshape(1, 1, P, P)
            out[m.group(1) + "attn.masked_bias"] = torch.tensor(-1e4)
    return out


def write_shards(folder, tensors, shards, dtype):
    names = list(tensors)
    check(1 <= shards <= len(names), f"--shards must be in [1, {len(names)}]")
    weight_map, total = {}, 0
    for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {names[i]: tensors[names[i]] for i in part}
        total += write_safetensors(os.path.join(folder, file), chunk, dtype)
        weight_map.update({name: file for name in chunk})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


def write_config(folder, a):
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": a.n_layer,
              "n_head": a.n_head, "n_embd": a.n_embd, "vocab_size": a.vocab, "n_positions": a.n_positions,
              "n_ctx": a.n_positions, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
              "tie_word_embeddings": True, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def cmd_make(a):
    os.makedirs(a.out, exist_ok=True)
    write_config(a.out, a)
    cfg = load_config(a.out)
    tensors = random_weights(cfg, a.seed, a.std)
    if a.mask_buffers:
        tensors = with_buffers(tensors, cfg)
    if a.no_prefix:
        tensors = {name[len(PREFIX):]: t for name, t in tensors.items()}
    if a.shards:
        write_shards(a.out, tensors, a.shards, a.dtype)
    else:
        write_safetensors(os.path.join(a.out, "model.safetensors"), tensors, a.dtype)


def cmd_forward(a):
    cfg, w = load_model(a.dir, torch.float64)
    write_forward(w, cfg, a.batch, a.out)


# ---------------------------------------------------------------- train

def make_optimizer(params, a):
    if a.optimizer == "sgd":
        return torch.optim.SGD(params, lr=a.lr, momentum=0.0, weight_decay=a.weight_decay)
    return torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)


def cmd_train(a):
    check(a.steps >= 0, "--steps must be >= 0")
    cfg, w = load_model(a.dir, torch.float32)
    x, y = load_batch(a.batch, cfg)
    params = {name: t.clone().requires_grad_(True) for name, t in w.items()}
    optimizer = make_optimizer(list(params.values()), a)
    losses = []
    for _ in range(a.steps):
        optimizer.zero_grad()
        loss = mean_ce(gpt2_logits(params, cfg, x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses.append(mean_ce(gpt2_logits(params, cfg, x), y).item())
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "losses.json"), "w") as f:
        json.dump({"losses": losses}, f)
    write_safetensors(os.path.join(a.out_dir, "model.safetensors"), params, "F32")
    if os.path.abspath(a.dir) != os.path.abspath(a.out_dir):
        shutil.copyfile(os.path.join(a.dir, "config.json"), os.path.join(a.out_dir, "config.json"))


# ---------------------------------------------------------------- peft

def lora_config(adapter_dir):
    raw = read_json(os.path.join(adapter_dir, "adapter_config.json"))
    check(raw.get("peft_type") == "LORA", "adapter_config.json: peft_type must be LORA")
    r, alpha, targets = raw.get("r"), raw.get("lora_alpha"), raw.get("target_modules")
    check(isinstance(r, int) and r > 0, "adapter_config.json: r must be a positive integer")
    check(isinstance(alpha, (int, float)), "adapter_config.json: lora_alpha must be a number")
    check(isinstance(targets, (list, str)) and targets, "adapter_config.json: target_modules missing")
    check(raw.get("bias", "none") == "none", "adapter_config.json: only bias = none is supported")
    check(not raw.get("modules_to_save"), "adapter_config.json: modules_to_save is not supported")
    check(not raw.get("rank_pattern") and not raw.get("alpha_pattern"), "rank/alpha_pattern not supported")
    scale = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    return r, scale, targets


def targeted(module, targets):
    """PEFT's rule: a regex string must fullmatch; a list entry must equal or be a '.'-suffix."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def lora_pairs(adapter_dir, modules):
    """{module: {"A": tensor, "B": tensor}} from adapter_model.safetensors, names checked."""
    pairs = {}
    for name, t in read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors")).items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", name)
        check(m is not None, f"adapter tensor {name}: not a base_model.model.*.lora_A/B.weight name")
        module = m.group(1) if m.group(1).startswith(PREFIX) else PREFIX + m.group(1)
        check(module in modules, f"adapter tensor {name}: {module} is not a Conv1D module of the base model")
        pairs.setdefault(module, {})[m.group(2)] = t.double()
    return pairs


def merge_lora(w, adapter_dir, cfg):
    modules = {f"transformer.h.{i}.{m}" for i in range(cfg["n_layer"]) for m in CONV1D}
    r, scale, targets = lora_config(adapter_dir)
    pairs = lora_pairs(adapter_dir, modules)
    for module in sorted(m for m in modules if targeted(m, targets)):
        check(set(pairs.get(module, {})) == {"A", "B"}, f"adapter: {module} needs both lora_A and lora_B")
        pair = pairs.pop(module)
        A, B = pair["A"], pair["B"]
        fan_in, fan_out = w[module + ".weight"].shape
        check(list(A.shape) == [r, fan_in], f"{module}.lora_A: shape {list(A.shape)}, expected {[r, fan_in]}")
        check(list(B.shape) == [fan_out, r], f"{module}.lora_B: shape {list(B.shape)}, expected {[fan_out, r]}")
        w[module + ".weight"] = w[module + ".weight"] + scale * (B @ A).t()
    check(not pairs, f"adapter has tensors for modules not in target_modules: {sorted(pairs)}")


def cmd_peft(a):
    cfg, w = load_model(a.base_dir, torch.float64)
    merge_lora(w, a.adapter_dir, cfg)
    write_forward(w, cfg, a.batch, a.out)


# ---------------------------------------------------------------- CLI

def parser():
    p = argparse.ArgumentParser(description="Independent Hugging Face GPT-2 reference for frugal's tests.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="random GPT-2 checkpoint in Hugging Face's layout")
    m.add_argument("out")
    for name, default in (("n_layer", 2), ("n_head", 2), ("n_embd", 32), ("vocab", 61), ("n_positions", 24),
                          ("seed", 0), ("shards", 0)):
        m.add_argument("--" + name, type=int, default=default)
    m.add_argument("--std", type=float, default=0.2,
                   help="of the weights and biases (0.2: large, so a test that ignores one fails; "
                        "0.02: GPT-2's initialisation, for a model to fine-tune)")
    m.add_argument("--no_prefix", action="store_true")
    m.add_argument("--mask_buffers", action="store_true")
    m.add_argument("--dtype", choices=("F32", "BF16", "F16"), default="F32")
    f = sub.add_parser("forward", help="float64 logits and loss")
    f.add_argument("dir"), f.add_argument("batch"), f.add_argument("out")
    t = sub.add_parser("train", help="float32 training steps")
    t.add_argument("dir"), t.add_argument("batch"), t.add_argument("out_dir")
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--lr", type=float, default=0.01)
    t.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    t.add_argument("--weight_decay", type=float, default=0.0)
    e = sub.add_parser("peft", help="forward with a PEFT LoRA adapter merged")
    e.add_argument("base_dir"), e.add_argument("adapter_dir"), e.add_argument("batch"), e.add_argument("out")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    command = {"make": cmd_make, "forward": cmd_forward, "train": cmd_train, "peft": cmd_peft}[a.command]
    try:
        command(a)
    except (RefError, OSError, KeyError, ValueError, RuntimeError) as e:
        print(f"hf_gpt2_reference.py {a.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
