#!/usr/bin/python3
"""check_export.py: the exported model's loss, computed in plain PyTorch.

    /usr/bin/python3 check_export.py MODEL.pt CONFIG.json BATCHES.bin

MODEL.pt and CONFIG.json are what `swarm export` writes. The forward below is written out
from the config alone, matching stages/model.cpp: learned token and position embeddings,
pre-LayerNorm blocks (eps from the config), causal multi-head attention scaled by
1/sqrt(head_dim), an MLP n_embd -> 4 n_embd -> n_embd with the GELU the config names (tanh
approximation), final LayerNorm and an untied LM head; no dropout; float32.

BATCHES.bin is little-endian int32: a header [n_batches, B, T], then per batch the inputs x
[B, T] and the targets y [B, T], row-major.

Prints one JSON object: {"loss": mean cross-entropy over every target token, "batches": ...,
"tokens": ..., "tensors": ..., "parameters": ...}. Exits 1 with a message when the state dict
does not have exactly the tensors the config implies.
"""
import array
import json
import math
import sys

import torch
import torch.nn.functional as F


def load_state_dict(path):
    try:
        # What PyTorch >= 2.6 does by default: only tensors and plain containers.
        return torch.load(path, map_location="cpu", weights_only=True)
    except TypeError:  # PyTorch < 1.13 has no weights_only
        return torch.load(path, map_location="cpu")


def expected_shapes(cfg):
    V, C, L = cfg["vocab_size"], cfg["n_embd"], cfg["n_layer"]
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg["block_size"], C)}
    for layer in range(L):
        h = f"transformer.h.{layer}."
        for name, w, b in [("ln_1", (C,), (C,)), ("attn.c_attn", (3 * C, C), (3 * C,)),
                           ("attn.c_proj", (C, C), (C,)), ("ln_2", (C,), (C,)),
                           ("mlp.c_fc", (4 * C, C), (4 * C,)), ("mlp.c_proj", (C, 4 * C), (C,))]:
            shapes[h + name + ".weight"] = w
            if cfg["bias"]:
                shapes[h + name + ".bias"] = b
    shapes["transformer.ln_f.weight"] = (C,)
    if cfg["bias"]:
        shapes["transformer.ln_f.bias"] = (C,)
    if not cfg.get("tied_embeddings", False):
        shapes["lm_head.weight"] = (V, C)
    return shapes


def check_state_dict(sd, cfg):
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    bad = sorted(k for k in want if k in sd and tuple(sd[k].shape) != want[k])
    if missing or extra or bad:
        sys.exit(f"check_export: state dict does not match the config: missing {missing}, unexpected {extra}, "
                 f"wrong shape {[(k, tuple(sd[k].shape), want[k]) for k in bad]}")
    for k, t in sd.items():
        if t.dtype != torch.float32:
            sys.exit(f"check_export: {k} is {t.dtype}, expected torch.float32")


def forward(sd, cfg, idx):
    """idx int64 [B, T] -> logits [B, T, V]."""
    B, T = idx.shape
    C, nh = cfg["n_embd"], cfg["n_head"]
    hd = C // nh
    eps = cfg["layer_norm_eps"]
    approximate = "tanh" if cfg.get("gelu", "tanh") == "tanh" else "none"
    get = sd.get  # None for the biases of a bias=false model

    x = F.embedding(idx, sd["transformer.wte.weight"]) + sd["transformer.wpe.weight"][:T]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # true where a query must not look
    for layer in range(cfg["n_layer"]):
        h = f"transformer.h.{layer}."
        a = F.layer_norm(x, (C,), sd[h + "ln_1.weight"], get(h + "ln_1.bias"), eps)
        q, k, v = F.linear(a, sd[h + "attn.c_attn.weight"], get(h + "attn.c_attn.bias")).split(C, dim=2)
        q = q.view(B, T, nh, hd).transpose(1, 2)
        k = k.view(B, T, nh, hd).transpose(1, 2)
        v = v.view(B, T, nh, hd).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, sd[h + "attn.c_proj.weight"], get(h + "attn.c_proj.bias"))
        m = F.layer_norm(x, (C,), sd[h + "ln_2.weight"], get(h + "ln_2.bias"), eps)
        m = F.gelu(F.linear(m, sd[h + "mlp.c_fc.weight"], get(h + "mlp.c_fc.bias")), approximate=approximate)
        x = x + F.linear(m, sd[h + "mlp.c_proj.weight"], get(h + "mlp.c_proj.bias"))
    x = F.layer_norm(x, (C,), sd["transformer.ln_f.weight"], get("transformer.ln_f.bias"), eps)
    head = sd["transformer.wte.weight"] if cfg.get("tied_embeddings", False) else sd["lm_head.weight"]
    return F.linear(x, head)


def read_batches(path):
    ints = array.array("i")
    with open(path, "rb") as f:
        ints.frombytes(f.read())
    if sys.byteorder == "big":
        ints.byteswap()
    if len(ints) < 3:
        sys.exit(f"check_export: {path}: no header")
    n, B, T = ints[0], ints[1], ints[2]
    if n < 0 or B <= 0 or T <= 0 or len(ints) != 3 + 2 * n * B * T:
        sys.exit(f"check_export: {path}: header [{n}, {B}, {T}] does not match {len(ints) - 3} ints of data")
    data = torch.tensor(ints[3:], dtype=torch.int64).view(n, 2, B, T)
    return [(data[i, 0], data[i, 1]) for i in range(n)]


def main(argv):
    if len(argv) != 4:
        sys.exit("usage: check_export.py MODEL.pt CONFIG.json BATCHES.bin")
    sd = load_state_dict(argv[1])
    if not isinstance(sd, dict):
        sys.exit(f"check_export: {argv[1]} holds a {type(sd).__name__}, not a dict of tensors")
    with open(argv[2]) as f:
        cfg = json.load(f)
    check_state_dict(sd, cfg)
    batches = read_batches(argv[3])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            if x.shape[1] > cfg["block_size"]:
                sys.exit(f"check_export: T={x.shape[1]} is over block_size {cfg['block_size']}")
            logits = forward(sd, cfg, x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            total += loss.item()
            tokens += y.numel()
    print(json.dumps({"loss": total / max(tokens, 1), "batches": len(batches), "tokens": tokens,
                      "tensors": len(sd), "parameters": sum(t.numel() for t in sd.values())}))


if __name__ == "__main__":
    main(sys.argv)
