#!/usr/bin/env python3
"""pytorch_eager.py: the PyTorch eager baseline of `swarm bench gpu` (figure vs_pytorch).

Trains the model a swarm stage trains, written the way a PyTorch user would write it: a nanoGPT
decoder (pre-LayerNorm blocks, causal attention through F.scaled_dot_product_attention, MLP with
tanh GELU, untied LM head, biases), torch.autocast in bf16 (fp16 with a GradScaler), AdamW
(betas 0.9/0.95, decay on matrices only, PyTorch's default implementation), clipping to
--grad-clip, gradient accumulation over microbatches. Random tokens: the speed does not depend on
the data. One step runs untimed first (the stage server times one forward and backward when it
loads a stage), then --steps steps are timed with the GPU synchronised at both ends.

Prints one JSON line: {"tokens_per_s", "steps", "seconds", "params", "torch", "device", ...}.
Needs only PyTorch 2.x with CUDA.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq_len):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--microbatch", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("pytorch_eager.py: needs a CUDA device", file=sys.stderr)
        return 2
    if a.batch % a.microbatch:
        print("pytorch_eager.py: --batch must be a multiple of --microbatch", file=sys.stderr)
        return 2
    dev = torch.device("cuda:0")
    torch.manual_seed(1)
    model = GPT(a.vocab, a.d_model, a.n_head, a.n_layer, a.seq_len).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.precision]
    scaler = torch.cuda.amp.GradScaler(enabled=a.precision == "fp16")
    micro = a.batch // a.microbatch
    data = torch.randint(0, a.vocab, (micro, a.microbatch, a.seq_len + 1), device=dev)

    def step():
        for m in range(micro):
            x, y = data[m, :, :-1], data[m, :, 1:]
            with torch.autocast(device_type="cuda", dtype=dtype, enabled=a.precision != "fp32"):
                loss = model(x, y)
            scaler.scale(loss / micro).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    step()  # untimed: kernels chosen, memory allocated
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out = {"tokens_per_s": a.steps * a.batch * a.seq_len / seconds, "steps": a.steps, "seconds": seconds,
           "params": sum(p.numel() for p in model.parameters()), "last_loss": float(loss), "precision": a.precision,
           "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
