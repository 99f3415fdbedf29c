#!/usr/bin/env python3
"""check_vectors.py: model.py against the test vectors of docs/model.md (docs/vectors/*.json).

Prints one line per vector and exits 1 when any disagrees beyond its file's tolerance: the
evidence that the docs alone are enough to compute what the C++ peers compute.
Usage: python3 examples/python_peer/check_vectors.py [docs/vectors]
"""
import json
import math
import os
import sys

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402

failures = []


def close(name, want, got, tol):
    want = np.asarray(want, np.float64).ravel()
    got = np.asarray(got, np.float64).ravel()
    if want.shape != got.shape:
        failures.append(f"{name}: {got.size} values, expected {want.size}")
        return
    if tol["abs"] == 0 and tol["rel"] == 0:
        bad = np.nonzero(want.astype(np.float32) != got.astype(np.float32))[0]
    else:
        bad = np.nonzero(np.abs(want - got) > tol["abs"] + tol["rel"] * np.abs(want))[0]
    if bad.size:
        i = bad[0]
        failures.append(f"{name}[{i}]: {got[i]!r}, expected {want[i]!r}")


def same(name, want, got):
    if want != got:
        failures.append(f"{name}: {got!r}, expected {want!r}")


def layers(spec):
    m, s = spec["model"], spec["partition"]["stages"]
    return spec["partition"].get("layers_per_stage") or [m["n_layer"] // s] * s


def check_init(v):
    for e in v["splitmix64"]:
        same(f"splitmix64({e['in']})", int(e["out"], 16), M.splitmix64(int(e["in"], 16)))
    spec = v["spec"]
    for p in v["params"]:
        vals = M.init_values(p["name"], tuple(p["shape"]), spec["seed"], spec["model"]["n_layer"])
        close(f"init {p['name']} first", p["first"], vals.ravel()[:len(p["first"])], v["tolerance"])
        same(f"init {p['name']} xxh3", int(p["xxh3"], 16), xxhash.xxh3_64_intdigest(vals.tobytes()))


def check_model(v):
    spec, tol = v["spec"], v["tolerance"]
    lps, S = layers(spec), spec["partition"]["stages"]
    st = [M.Stage(spec["model"], s, S, lps, spec["seed"]) for s in range(S)]
    x = torch.tensor(v["tokens"]).view(2, 8)
    y = torch.tensor(v["targets"]).view(2, 8)
    a1 = st[0].forward(x).detach()
    a2 = st[1].forward(a1).detach()
    close("a1", v["a1"], a1.numpy(), tol)
    close("a2", v["a2"], a2.numpy(), tol)
    in2 = a2.clone().requires_grad_(True)
    loss = M.Stage.loss(st[2].forward(in2), y)
    (loss * 2.0).backward()
    close("loss", [v["loss"]], [loss.item()], tol)
    close("g2", v["g2"], in2.grad.numpy(), tol)
    in1 = a1.clone().requires_grad_(True)
    st[1].forward(in1).backward(in2.grad)
    close("g1", v["g1"], in1.grad.numpy(), tol)
    st[0].forward(x).backward(in1.grad)
    grads = {(s, n): t.grad for s in range(S) for n, t in st[s].params}
    for g in v["grad_sums"]:
        t = grads[(g["stage"], g["name"])].double()
        close(f"grad sum {g['name']}", [g["sum"], g["norm"]], [t.sum().item(), t.norm().item()], tol)
    for a in v["after_step"]:
        s = a["stage"]
        defaults = {"name": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}  # the spec's defaults (docs/job-spec.md)
        opt = M.AdamW(st[s].params, {**defaults, **spec["optimizer"]}, spec["steps"])
        norm = opt.step(2)
        close(f"stage {s} grad norm", [a["grad_norm"]], [norm], tol)
        for p, (name, t) in zip(a["params"], st[s].params):
            close(f"stage {s} {name} after step", [p["sum"], p["norm"]], [t.double().sum().item(), t.double().norm().item()], tol)


def check_optim(v):
    tol = v["tolerance"]
    sch = v["schedule"]
    close("lr_at", v["lr_at"], [M.lr_at(sch, s, sch["total_steps"]) for s in range(len(v["lr_at"]))], tol)
    a = v["adamw"]
    w = torch.tensor(v["w0"], dtype=torch.float32).view(2, 2).requires_grad_(True)
    b = torch.tensor(v["b0"], dtype=torch.float32).requires_grad_(True)
    opt = M.AdamW([("w", w), ("b", b)], a, a["total_steps"])
    for i, s in enumerate(v["steps"]):
        w.grad = torch.tensor(s["grad_sum_w"], dtype=torch.float32).view(2, 2)
        b.grad = torch.tensor(s["grad_sum_b"], dtype=torch.float32)
        close(f"adamw step {i} lr", [s["lr"]], [M.lr_at(a, opt.t, a["total_steps"])], tol)
        norm = opt.step(a["samples"])
        close(f"adamw step {i} grad norm", [s["grad_norm"]], [norm], tol)
        close(f"adamw step {i} w", s["w"], w.detach().numpy(), tol)
        close(f"adamw step {i} b", s["b"], b.detach().numpy(), tol)


def check_rounds(v):
    for e in v["fragment_range"]:
        same(f"fragment_range P={e['P']} F={e['F']}", e["ranges"], [list(M.fragment_range(e["P"], e["F"], f)) for f in range(e["F"])])
    for e in v["fragment_due"]:  # the router's schedule, from docs/model.md's formula
        H, F_ = e["H"], e["F"]

        def due(steps):
            for f in range(F_):
                off = (f + 1) * H // F_
                if steps > 0 and off > 0 and steps >= off and (steps - off) % H == 0:
                    return f
            return -1
        same(f"fragment_due H={H} F={F_}", e["steps_0_to_20"], [due(s) for s in range(21)])
    r = v["reduce"]
    mean = M.reduce_delta([np.array(d, np.float32) for d in r["deltas"]], r["weights"])
    close("reduce", r["mean"], mean, v["tolerance"])
    o = v["outer_step"]
    tg, m = np.array(o["theta_g"], np.float32), np.array(o["m"], np.float32)
    M.outer_step(tg, m, np.array(o["d"], np.float32), o["lr"], o["momentum"], o["nesterov"])
    close("outer_step theta_g", o["theta_g_after"], tg, v["tolerance"])
    close("outer_step m", o["m_after"], m, v["tolerance"])
    same("state_hash", int(v["state_hash"]["hash"], 16), M.state_hash(tg, m))
    spec = v.get("stage_parameter_counts")
    if spec:
        import_spec = json.load(open(os.path.join(DIR, "model.json")))["spec"]
        lps, S = layers(import_spec), import_spec["partition"]["stages"]
        got = [sum(int(np.prod(s)) for _, s in M.stage_layout(import_spec["model"], k, S, lps)) for k in range(S)]
        same("stage_parameter_counts", spec, got)


DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "vectors")

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, fn in (("init", check_init), ("model", check_model), ("optim", check_optim), ("rounds", check_rounds)):
        before = len(failures)
        with open(os.path.join(DIR, name + ".json")) as f:
            fn(json.load(f))
        print(("ok   " if len(failures) == before else "FAIL ") + name)
    for f in failures[:30]:
        print("  " + f)
    sys.exit(1 if failures else 0)
