#!/usr/bin/env python3
"""plot_compression.py: validation loss against wire bytes per sample, from `swarm bench compression`.

    build/swarm bench compression --json > docs/compression-bench.jsonl
    tools/plot_compression.py docs/compression-bench.jsonl docs/compression-loss-vs-bytes.svg

Reads the bench's JSON lines (the summary line, {"bench": "compression", ..., "raw": {...}},
is the one used) and writes an SVG with two panels: the bundled example (fp32, bf16, int8,
int4 and the subspace codec) and the wider model (fp32 and the subspace codec for k = 8, 16,
32). x: activation + gradient wire bytes per training sample, log scale; y: validation loss.
Python's standard library only, so it runs wherever the bench does.
"""
import json
import math
import sys
from xml.sax.saxutils import escape

PANEL_W, PANEL_H = 420, 300         # plot area of one panel, px
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 30, 50, 60
COLORS = {"fp32": "#444444", "bf16": "#1f77b4", "int8": "#2ca02c", "int4": "#ff7f0e", "subspace": "#d62728"}


def summary_of(lines):
    for line in reversed(lines):
        line = line.strip()
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if j.get("bench") == "compression" and "raw" in j:
            return j
    sys.exit("no `swarm bench compression --json` summary line in the input")


def label_of(name, case):
    if name in ("fp32", "bf16", "int8", "int4", "wide_fp32"):
        return name.replace("wide_", "")
    codec = case["codec"]  # e.g. "subspace:k=16,coef=int4,block=64"
    parts = dict(p.split("=") for p in codec.split(":", 1)[1].split(",") if "=" in p)
    return "subspace k=%s %s" % (parts.get("k", "?"), parts.get("coef", "fp32"))


def color_of(name):
    for key, c in COLORS.items():
        if key in name:
            return c
    return "#000000"


def panel(out, x0, title, points, target_loss=None):
    """points: [(label, bytes, loss, color)]. Draws one log-x panel at x0."""
    xs = [p[1] for p in points]
    ys = [p[2] for p in points] + ([target_loss] if target_loss else [])
    lx_min = math.floor(math.log10(min(xs)) - 0.15)
    lx_max = math.ceil(math.log10(max(xs)) + 0.15)
    y_lo, y_hi = min(ys), max(ys)
    pad = max(0.02, 0.12 * (y_hi - y_lo))
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def px(b):
        return x0 + MARGIN_L + (math.log10(b) - lx_min) / (lx_max - lx_min) * PANEL_W

    def py(v):
        return MARGIN_T + (y_hi - v) / (y_hi - y_lo) * PANEL_H

    left, top = x0 + MARGIN_L, MARGIN_T
    out.append('<rect x="%g" y="%g" width="%g" height="%g" fill="none" stroke="#999"/>' % (left, top, PANEL_W, PANEL_H))
    out.append('<text x="%g" y="%g" font-size="15" text-anchor="middle" font-weight="bold">%s</text>'
               % (left + PANEL_W / 2, top - 20, escape(title)))
    for e in range(lx_min, lx_max + 1):  # decades
        x = px(10 ** e)
        out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#ddd"/>' % (x, top, x, top + PANEL_H))
        out.append('<text x="%g" y="%g" font-size="12" text-anchor="middle">10<tspan dy="-6" font-size="9">%d</tspan></text>'
                   % (x, top + PANEL_H + 18, e))
    step = 10 ** math.floor(math.log10((y_hi - y_lo) / 4))
    step *= 5 if (y_hi - y_lo) / step > 20 else (2 if (y_hi - y_lo) / step > 8 else 1)
    v = math.ceil(y_lo / step) * step
    while v <= y_hi:
        y = py(v)
        out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#eee"/>' % (left, y, left + PANEL_W, y))
        out.append('<text x="%g" y="%g" font-size="12" text-anchor="end">%.2f</text>' % (left - 6, y + 4, v))
        v += step
    out.append('<text x="%g" y="%g" font-size="13" text-anchor="middle">wire bytes per sample (activations + gradients)</text>'
               % (left + PANEL_W / 2, top + PANEL_H + 42))
    out.append('<text x="%g" y="%g" font-size="13" text-anchor="middle" transform="rotate(-90 %g %g)">validation loss</text>'
               % (x0 + 18, top + PANEL_H / 2, x0 + 18, top + PANEL_H / 2))
    if target_loss:
        y = py(target_loss)
        out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#d62728" stroke-dasharray="5,4"/>' % (left, y, left + PANEL_W, y))
        out.append('<text x="%g" y="%g" font-size="11" fill="#d62728" text-anchor="end">fp32 + 3%% (target)</text>'
                   % (left + PANEL_W - 4, y - 5))
    placed = []  # label boxes so far: (x0, y0, x1, y1)
    for label, b, loss, color in points:
        x, y = px(b), py(loss)
        out.append('<circle cx="%g" cy="%g" r="5" fill="%s"/>' % (x, y, color))
        text = "%s (%.3f)" % (label, loss)
        w = 6.6 * len(text)  # about 12 px sans-serif
        anchor = "end" if x > left + PANEL_W * 0.6 else "start"
        tx = x - 9 if anchor == "end" else x + 9
        bx0 = tx - w if anchor == "end" else tx
        # The first vertical offset (above, below, further out) whose box meets no earlier label.
        for dy in (-7, 17, -22, 32, -37, 47, -52):
            box = (bx0, y + dy - 11, bx0 + w, y + dy + 2)
            if not any(box[0] < q[2] and q[0] < box[2] and box[1] < q[3] and q[1] < box[3] for q in placed):
                break
        placed.append(box)
        if abs(dy) > 17:
            out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="%s" stroke-width="0.7"/>' % (x, y, tx, y + dy - 4, color))
        out.append('<text x="%g" y="%g" font-size="12" text-anchor="%s" fill="%s">%s</text>'
                   % (tx, y + dy, anchor, color, escape(text)))


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_compression.py BENCH.jsonl OUT.svg")
    with open(sys.argv[1]) as f:
        raw = summary_of(f.readlines())["raw"]
    example = [n for n in ("fp32", "bf16", "int8", "int4", "subspace") if n in raw]
    wide = sorted((n for n in raw if n.startswith("wide_")), key=lambda n: (n != "wide_fp32", raw[n]["wire_bytes_per_sample"]))
    panels = []
    if example:
        c = raw[example[0]]
        panels.append(("bundled example: d_model %d, %d steps" % (c["d_model"], c["steps"]),
                       [(label_of(n, raw[n]), raw[n]["wire_bytes_per_sample"], raw[n]["val_loss"], color_of(n)) for n in example],
                       raw["fp32"]["val_loss"] * 1.03 if "fp32" in raw else None))
    if wide:
        c = raw[wide[0]]
        panels.append(("wider model: d_model %d, %d steps" % (c["d_model"], c["steps"]),
                       [(label_of(n, raw[n]), raw[n]["wire_bytes_per_sample"], raw[n]["val_loss"], color_of(n)) for n in wide],
                       None))
    width = len(panels) * (MARGIN_L + PANEL_W + MARGIN_R)
    height = MARGIN_T + PANEL_H + MARGIN_B
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif">' % (width, height),
           '<rect width="100%" height="100%" fill="white"/>']
    for i, (title, points, target) in enumerate(panels):
        panel(out, i * (MARGIN_L + PANEL_W + MARGIN_R), title, points, target)
    out.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
