#!/usr/bin/env python3
"""plot_schedules.py: training loss against tokens, from `swarm bench quality`.

    build/swarm bench quality --json > docs/quality-bench.jsonl
    tools/plot_schedules.py docs/quality-bench.jsonl docs/schedules-loss-vs-tokens.svg

or, from runs made one by one (the same cases, e.g. on a machine too busy for the whole bench):

    tools/plot_schedules.py --runs reference=REF.jsonl sync1=A.jsonl async=B.jsonl ... OUT.svg

where each file is the `--json` output of `swarm reference JOB` or `swarm local JOB` (its
`{"event": "done", ...}` line is the one used) and each name is one of the bench's cases; a
number instead of a file (`reference=2.293`) is a final validation loss alone, drawn as a line.

Reads the bench's JSON lines (the summary line, {"bench": "quality", ..., "raw": {...}}, is the
one used) and writes an SVG with two panels: the whole run, and its last third magnified, where
the cases part. Each case is one line: its training loss per step averaged over a window of
WINDOW steps (x: training tokens, y: loss), with its validation losses as dots and its final
validation loss in the legend. Python's standard library only, so it runs wherever the bench does.
"""
import json
import sys
from xml.sax.saxutils import escape

PANEL_W, PANEL_H = 460, 320          # plot area of one panel, px
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 20, 50, 60
LEGEND_W = 380
WINDOW = 10                          # steps per point of the smoothed training curve
ORDER = ["reference", "sync1", "sync2", "async", "full_stack", "async_local"]
COLORS = {"reference": "#000000", "sync1": "#7f7f7f", "sync2": "#1f77b4", "async": "#2ca02c",
          "full_stack": "#d62728", "async_local": "#ff7f0e"}
LABELS = {"reference": "one process (swarm reference), final val loss", "sync1": "sync, 1 peer/stage", "sync2": "sync, 2 peers/stage",
          "async": "async (default), 2 peers/stage", "full_stack": "async, int8, chaos, 2 peers/stage",
          "async_local": "async_local (first async), 2 peers/stage"}


def summary_of(lines):
    for line in reversed(lines):
        line = line.strip()
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if j.get("bench") == "quality" and "raw" in j:
            return j
    sys.exit("no `swarm bench quality --json` summary line in the input")


def raw_of_runs(pairs):
    """The bench's "raw" from separate runs: NAME=FILE pairs of `swarm reference/local --json` output."""
    raw = {}
    for pair in pairs:
        name, path = pair.split("=", 1)
        if name not in LABELS:
            sys.exit("unknown case %r; one of: %s" % (name, ", ".join(ORDER)))
        try:
            raw[name] = {"val_loss": float(path), "curve": {"train": [], "val": []}, "level": True}
            continue
        except ValueError:
            pass
        done = None
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    j = json.loads(line)
                    if j.get("event") == "done":
                        done = j
        if done is None:
            sys.exit("%s: no {\"event\": \"done\"} line" % path)
        if "losses" in done:  # swarm reference: train losses per step, one final val loss
            train = [[i + 1, l] for i, l in enumerate(done["losses"])]
            val = [[len(done["losses"]), done["val_loss"]]]
        else:
            train = [[h["step"], h["train_loss"]] for h in done["history"] if h.get("train_loss") is not None]
            val = [[h["step"], h["val_loss"]] for h in done["history"] if h.get("val_loss") is not None]
        raw[name] = {"val_loss": done["val_loss"], "curve": {"train": train, "val": val}, "x_is_steps": True}
    return raw


def smooth(points):
    """Means of WINDOW consecutive (tokens, loss) points, at the window's last tokens."""
    out = []
    for i in range(0, len(points) - WINDOW + 1, WINDOW):
        chunk = points[i:i + WINDOW]
        out.append((chunk[-1][0], sum(p[1] for p in chunk) / len(chunk)))
    return out


def nice_step(span, ticks):
    raw = span / ticks
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 10 ** -len(str(int(1 / raw)))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def panel(out, x0, title, series, x_lo, x_hi):
    ys = [y for _, pts, val in series for x, y in pts + val if x_lo <= x <= x_hi]
    y_lo, y_hi = min(ys), max(ys)
    pad = max(0.01, 0.06 * (y_hi - y_lo))
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def px(x):
        return x0 + MARGIN_L + (x - x_lo) / (x_hi - x_lo) * PANEL_W

    def py(v):
        return MARGIN_T + (y_hi - v) / (y_hi - y_lo) * PANEL_H

    left, top = x0 + MARGIN_L, MARGIN_T
    out.append('<rect x="%g" y="%g" width="%g" height="%g" fill="none" stroke="#999"/>' % (left, top, PANEL_W, PANEL_H))
    out.append('<text x="%g" y="%g" font-size="15" text-anchor="middle" font-weight="bold">%s</text>'
               % (left + PANEL_W / 2, top - 20, escape(title)))
    step = nice_step((x_hi - x_lo) / 1e6, 5) * 1e6
    v = (int(x_lo / step) + (x_lo % step > 0)) * step
    while v <= x_hi:
        out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#eee"/>' % (px(v), top, px(v), top + PANEL_H))
        out.append('<text x="%g" y="%g" font-size="12" text-anchor="middle">%g</text>' % (px(v), top + PANEL_H + 18, v / 1e6))
        v += step
    step = nice_step(y_hi - y_lo, 5)
    v = (int(y_lo / step) + 1) * step
    while v <= y_hi:
        out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#eee"/>' % (left, py(v), left + PANEL_W, py(v)))
        out.append('<text x="%g" y="%g" font-size="12" text-anchor="end">%.2f</text>' % (left - 6, py(v) + 4, v))
        v += step
    out.append('<text x="%g" y="%g" font-size="13" text-anchor="middle">training tokens (millions)</text>'
               % (left + PANEL_W / 2, top + PANEL_H + 42))
    out.append('<text x="%g" y="%g" font-size="13" text-anchor="middle" transform="rotate(-90 %g %g)">loss (train: lines, %d-step means; validation: dots)</text>'
               % (x0 + 18, top + PANEL_H / 2, x0 + 18, top + PANEL_H / 2, WINDOW))
    for color, pts, val in series:
        pts = [(x, y) for x, y in pts if x_lo <= x <= x_hi]
        if len(pts) > 1:
            path = " ".join("%s%.1f,%.1f" % ("M" if i == 0 else "L", px(x), py(y)) for i, (x, y) in enumerate(pts))
            out.append('<path d="%s" fill="none" stroke="%s" stroke-width="1.6"/>' % (path, color))
        for x, y in val:
            if x_lo <= x <= x_hi:
                out.append('<circle cx="%.1f" cy="%.1f" r="4" fill="%s"/>' % (px(x), py(y), color))


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--runs":
        raw = raw_of_runs(sys.argv[2:-1])
    elif len(sys.argv) == 3:
        with open(sys.argv[1]) as f:
            raw = summary_of(f.readlines())["raw"]
    else:
        sys.exit("usage: plot_schedules.py BENCH.jsonl OUT.svg | plot_schedules.py --runs NAME=FILE... OUT.svg")
    names = [n for n in ORDER if n in raw]

    def tokens(case, pts):  # separate runs give steps: the bundled example's 32 x 64 tokens each
        return [(x * 32 * 64 if case.get("x_is_steps") else x, y) for x, y in pts]
    series = [(COLORS[n], smooth(tokens(raw[n], raw[n]["curve"]["train"])), tokens(raw[n], raw[n]["curve"]["val"]))
              for n in names if not raw[n].get("level")]
    x_max = max(x for _, pts, val in series for x, _ in pts + val)
    # A final validation loss alone: a dashed level across the run.
    levels = [(COLORS[n], raw[n]["val_loss"]) for n in names if raw[n].get("level")]
    series += [(c, [(0, v), (x_max * 2 / 3, v), (x_max, v)], []) for c, v in levels]
    width = 2 * (MARGIN_L + PANEL_W + MARGIN_R) + LEGEND_W
    height = MARGIN_T + PANEL_H + MARGIN_B
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif">' % (width, height),
           '<rect width="100%" height="100%" fill="white"/>']
    panel(out, 0, "the bundled example, 300 steps", series, 0, x_max)
    panel(out, MARGIN_L + PANEL_W + MARGIN_R, "the last third", series, x_max * 2 / 3, x_max)
    lx = 2 * (MARGIN_L + PANEL_W + MARGIN_R) + 10
    ref = raw.get("reference", {}).get("val_loss")
    for i, n in enumerate(names):
        y = MARGIN_T + 10 + 24 * i
        val = raw[n]["val_loss"]
        rel = " (%+.1f%%)" % (100 * (val / ref - 1)) if ref and n != "reference" else ""
        out.append('<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="%s" stroke-width="3"/>' % (lx, y - 4, lx + 22, y - 4, COLORS[n]))
        out.append('<text x="%g" y="%g" font-size="12">%s: %.3f%s</text>' % (lx + 28, y, escape(LABELS[n]), val, rel))
    out.append("</svg>")
    with open(sys.argv[-1], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
