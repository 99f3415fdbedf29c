"""model.py: the stage math of docs/model.md in PyTorch and NumPy, written from the docs.

Defines splitmix64, fnv1a64, init_values (the seeded initial weights), stage_layout (which
parameters a stage holds, in flattening order), Stage (forward, loss), AdamW and lr_at (the
inner optimizer), fragment_range, reduce_delta, outer_step and state_hash (the round's
arithmetic). Everything is fp32 on the CPU. `broken` names one rule to get wrong on purpose
("gelu": the exact erf GELU instead of the tanh approximation), for the conformance kit's test
that it notices.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
import xxhash

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x):
    """splitmix64 of a Python int or a NumPy uint64 array (wrapping arithmetic)."""
    if isinstance(x, np.ndarray):
        with np.errstate(over="ignore"):
            x = x + np.uint64(GOLDEN)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return x ^ (x >> np.uint64(31))
    x = (x + GOLDEN) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def fnv1a64(name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & MASK64
    return h


def init_values(name, shape, seed, n_layer):
    """The initial float32 values of parameter `name` (docs/model.md#initialisation)."""
    n = int(np.prod(shape))
    if name.endswith(".bias"):
        return np.zeros(shape, np.float32)
    if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
        return np.ones(shape, np.float32)
    std = 0.02 / math.sqrt(2.0 * n_layer) if name.endswith("c_proj.weight") else 0.02
    key = splitmix64(seed ^ splitmix64(fnv1a64(name)))
    even = np.arange(0, n, 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        c = np.uint64(key) + even
        b1, b2 = splitmix64(c), splitmix64(c + np.uint64(1))
    u1 = ((b1 >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    u2 = ((b2 >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    r = np.sqrt(-2.0 * np.log(u1))
    a = 6.283185307179586476925 * u2
    out = np.empty(len(even) * 2, np.float64)
    out[0::2] = std * r * np.cos(a)
    out[1::2] = std * r * np.sin(a)
    return out[:n].astype(np.float32).reshape(shape)


def stage_layout(model, stage, stages, layers_per_stage):
    """[(name, shape)] of a stage, in flattening order."""
    C, V, bias = model["d_model"], model["vocab_size"], model.get("bias", True)
    T = model.get("max_seq_len") or model["seq_len"]
    out = []
    if stage == 0:
        out += [("transformer.wte.weight", (V, C)), ("transformer.wpe.weight", (T, C))]
    first = sum(layers_per_stage[:stage])
    for l in range(first, first + layers_per_stage[stage]):
        h = f"transformer.h.{l}."
        for part, shape in (("ln_1", (C,)), ("attn.c_attn", (3 * C, C)), ("attn.c_proj", (C, C)), ("ln_2", (C,)),
                            ("mlp.c_fc", (4 * C, C)), ("mlp.c_proj", (C, 4 * C))):
            wshape = shape
            out.append((h + part + ".weight", wshape))
            if bias:
                out.append((h + part + ".bias", (shape[0],)))
    if stage == stages - 1:
        out.append(("transformer.ln_f.weight", (C,)))
        if bias:
            out.append(("transformer.ln_f.bias", (C,)))
        out.append(("lm_head.weight", (V, C)))
    return out


class Stage:
    """One stage of the GPT: parameters as fp32 leaf tensors, in stage_layout's order."""

    def __init__(self, model, stage, stages, layers_per_stage, seed, broken=None):
        self.model, self.stage, self.stages, self.broken = model, stage, stages, broken
        self.first = stage == 0
        self.last = stage == stages - 1
        self.params = []
        for name, shape in stage_layout(model, stage, stages, layers_per_stage):
            t = torch.from_numpy(init_values(name, shape, seed, model["n_layer"])).requires_grad_(True)
            self.params.append((name, t))
        self.p = dict(self.params)
        first = sum(layers_per_stage[:stage])
        self.layers = list(range(first, first + layers_per_stage[stage]))

    def numel(self):
        return sum(t.numel() for _, t in self.params)

    def _ln(self, x, prefix):
        C = self.model["d_model"]
        return F.layer_norm(x, (C,), self.p[prefix + ".weight"], self.p.get(prefix + ".bias"), 1e-5)

    def _linear(self, x, prefix, bias=True):
        return F.linear(x, self.p[prefix + ".weight"], self.p.get(prefix + ".bias") if bias else None)

    def _gelu(self, x):
        if self.broken == "gelu":
            return F.gelu(x)  # exact erf: the rule broken on purpose
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))

    def _block(self, l, x):
        B, T, C = x.shape
        nh = self.model["n_head"]
        hd = C // nh
        h = f"transformer.h.{l}."
        qkv = self._linear(self._ln(x, h + "ln_1"), h + "attn.c_attn")
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, nh, hd).transpose(1, 2)
        k = k.view(B, T, nh, hd).transpose(1, 2)
        v = v.view(B, T, nh, hd).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self._linear(y, h + "attn.c_proj")
        m = self._gelu(self._linear(self._ln(x, h + "ln_2"), h + "mlp.c_fc"))
        return x + self._linear(m, h + "mlp.c_proj")

    def forward(self, inp):
        """tokens int64 [B, T] at stage 0, activations [B, T, C] elsewhere -> output or logits."""
        if self.first:
            T = inp.shape[1]
            x = F.embedding(inp, self.p["transformer.wte.weight"]) + self.p["transformer.wpe.weight"][:T]
        else:
            x = inp
        for l in self.layers:
            x = self._block(l, x)
        if self.last:
            x = self._linear(self._ln(x, "transformer.ln_f"), "lm_head", bias=False)
        return x

    @staticmethod
    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def flat(self):
        return np.concatenate([t.detach().numpy().ravel() for _, t in self.params]).astype(np.float32)

    def load_flat(self, flat):
        off = 0
        with torch.no_grad():
            for _, t in self.params:
                n = t.numel()
                t.copy_(torch.from_numpy(np.ascontiguousarray(flat[off:off + n])).view_as(t))
                off += n

    def flat_grads(self):
        return np.concatenate([(t.grad if t.grad is not None else torch.zeros_like(t)).detach().numpy().ravel()
                               for _, t in self.params]).astype(np.float32)

    def set_grads(self, flat):
        off = 0
        for _, t in self.params:
            n = t.numel()
            t.grad = torch.from_numpy(np.array(flat[off:off + n], np.float32)).view_as(t).clone()
            off += n


def lr_at(opt, step, total):
    """docs/model.md#the-inner-optimizer: warm-up, then a cosine from lr to min_lr."""
    warmup = max(0, opt["warmup_steps"])
    if step < warmup:
        return opt["lr"] * (step + 1) / warmup
    if step <= warmup:
        return opt["lr"]
    last = total - 1
    if step >= last:
        return opt["min_lr"]
    ratio = (step - warmup) / (last - warmup)
    return opt["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (opt["lr"] - opt["min_lr"])


class AdamW:
    """The inner optimizer (docs/model.md): mean gradient, stage-wide clipping, torch's AdamW."""

    def __init__(self, params, opt, total_steps):
        self.params, self.opt, self.total = params, opt, total_steps
        self.m = [torch.zeros_like(t) for _, t in params]
        self.v = [torch.zeros_like(t) for _, t in params]
        self.t = 0

    def step(self, samples):
        o = self.opt
        lr = lr_at(o, self.t, self.total)
        with torch.no_grad():
            live = [i for i, (_, p) in enumerate(self.params) if p.grad is not None]
            norms = []
            for i in live:
                g = self.params[i][1].grad
                g.div_(float(samples))
                norms.append(g.norm())
            norm = torch.stack(norms).norm().item() if norms else 0.0
            if o["grad_clip"] > 0:
                coef = o["grad_clip"] / (norm + 1e-6)
                if coef < 1.0:
                    for i in live:
                        self.params[i][1].grad.mul_(coef)
            self.t += 1
            if o.get("name", "adamw") == "sgd":
                for i in live:
                    p = self.params[i][1]
                    if p.dim() >= 2 and o["weight_decay"] != 0:
                        p.mul_(1.0 - lr * o["weight_decay"])
                    p.add_(p.grad, alpha=-lr)
            else:
                bc1 = 1.0 - o["beta1"] ** self.t
                bc2_sqrt = math.sqrt(1.0 - o["beta2"] ** self.t)
                step_size = lr / bc1
                for i in live:
                    p = self.params[i][1]
                    g = p.grad
                    if p.dim() >= 2 and o["weight_decay"] != 0:
                        p.mul_(1.0 - lr * o["weight_decay"])
                    self.m[i].mul_(o["beta1"]).add_(g, alpha=1.0 - o["beta1"])
                    self.v[i].mul_(o["beta2"]).addcmul_(g, g, value=1.0 - o["beta2"])
                    denom = (self.v[i].sqrt() / bc2_sqrt).add_(o["eps"])
                    p.addcdiv_(self.m[i], denom, value=-step_size)
        self.zero_grad()
        return norm

    def zero_grad(self):
        for _, p in self.params:
            p.grad = None

    def flat_moments(self):
        return (np.concatenate([m.numpy().ravel() for m in self.m]).astype(np.float32),
                np.concatenate([v.numpy().ravel() for v in self.v]).astype(np.float32))

    def load_moments(self, m, v, step):
        off = 0
        with torch.no_grad():
            for i, (_, p) in enumerate(self.params):
                n = p.numel()
                self.m[i].copy_(torch.from_numpy(np.ascontiguousarray(m[off:off + n])).view_as(p))
                self.v[i].copy_(torch.from_numpy(np.ascontiguousarray(v[off:off + n])).view_as(p))
                off += n
        self.t = step


def fragment_range(P, F_, f):
    return (P * f) // F_, (P * (f + 1)) // F_


OUTLIER_FACTOR = 4.0
BLAME_FACTOR = 1000.0


def outliers(deltas, weights, grad_sums=False, factor=OUTLIER_FACTOR):
    """ROUND_REDUCE, before the sum (docs/model.md, "Outliers"): with two or more contributions,
    the indices of any whose score is not finite and of those whose score exceeds `factor` (4;
    BLAME_FACTOR for ROUND_REDUCED.far) x the lower median score of the yardstick: the counted contributions with a positive score and at least
    half the largest counted weight. A Δ's score ("delta") is its L2 norm and counts only at
    positive weight; a gradient sum's ("grad", weights the router-counted samples) is its norm /
    sqrt(max(w, 1)) at any weight. Norms in float64, summed in order."""
    norms = [math.sqrt(float(np.cumsum(np.asarray(d, np.float64) ** 2)[-1])) if len(d) else 0.0 for d in deltas]
    if len(deltas) < 2:
        return []
    scores = [n / math.sqrt(max(w, 1.0)) if grad_sums else n for n, w in zip(norms, weights)]
    counted = [(grad_sums or w > 0) and math.isfinite(x) for x, w in zip(scores, weights)]
    max_w = max([w for w, c in zip(weights, counted) if c], default=0.0)
    ref = sorted(x for x, w, c in zip(scores, weights, counted) if c and x > 0 and w >= 0.5 * max_w)
    bound = factor * ref[(len(ref) - 1) // 2] if sum(counted) >= 2 and ref else math.inf
    return [k for k, (x, c) in enumerate(zip(scores, counted)) if not math.isfinite(x) or (c and x > bound)]


def reduce_delta(deltas, weights, mean=True, left_out=()):
    """ROUND_REDUCE: sum(w_i d_i) in fp32 in order, times float32(1 / sum w) ("delta"), over the
    contributions not in left_out."""
    s = np.zeros_like(deltas[0], dtype=np.float32)
    total = 0.0
    for k, (d, w) in enumerate(zip(deltas, weights)):
        if k in left_out:
            continue
        s += (np.float32(w) if mean else np.float32(1.0)) * d
        total += w
    if mean:
        s *= np.float32(1.0 / total)
    return s


def outer_step(theta_g, m, d, lr, mu, nesterov):
    """ROUND_APPLY "delta", in place, element by element in fp32."""
    lr, mu = np.float32(lr), np.float32(mu)
    m[:] = mu * m + d
    upd = d + mu * m if nesterov else m
    theta_g[:] = theta_g - lr * upd


def state_hash(theta_g, m):
    a = xxhash.xxh3_64_intdigest(np.ascontiguousarray(theta_g, np.float32).tobytes())
    b = xxhash.xxh3_64_intdigest(np.ascontiguousarray(m, np.float32).tobytes())
    return a ^ ((b * GOLDEN) & MASK64)
