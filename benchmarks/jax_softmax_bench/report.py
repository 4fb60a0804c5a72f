"""A sweep's results: the JSON and CSV files, the per-point derived figures (% of the copy
ceiling, speedup over the baseline), the text table, the plots, and the `bench plot` command
that re-plots and merges saved JSON files."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
from typing import NamedTuple


class Layout(NamedTuple):
    """How one bench's records are compared, tabulated and plotted (by its sweep and by
    `bench plot`)."""

    baseline: str        # the provider that speedups are over
    point_keys: tuple    # the fields that make two providers' records one point
    xkey: str            # the x axis: row length N or sequence length S
    table_groups: tuple  # one table block per value of these
    plot_rows: tuple     # one row of subplots per value of these
    plot_cols: tuple     # one column of subplots per value of these
    title: str           # {op}: the operation


LAYOUTS = {
    "softmax": Layout("jax_nn", ("op", "dtype", "mode", "N", "size_mib"), "N",
                      ("op", "size_mib", "dtype", "mode"), ("dtype",), ("mode",),
                      "{op}: GB/s vs row length N"),
    "attention": Layout("xla", ("dtype", "mode", "variant", "S", "size_mib"), "S",
                        ("size_mib", "dtype", "mode", "variant"), ("variant",), ("dtype", "mode"),
                        "attention_softmax: GB/s vs S"),
}


def slug(s: str) -> str:
    """s as a file-name stem: lower case, runs of other characters as one underscore."""
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_") or "device"


CSV_FIELDS = ["bench", "op", "provider", "dtype", "mode", "variant", "N", "S", "shape",
              "size_mib", "bytes", "time_us", "time_us_min", "time_us_p10", "time_us_p90",
              "time_us_host", "timing", "gpu_gap_us",
              "spread_pct", "reps", "gbps", "pct_of_ceiling", "speedup_vs_baseline", "baseline",
              "chain_k", "arg_sets", "dispatch_residual_us", "dispatch_residual_pct",
              "compile_s", "rel_err", "rel_err_dx", "check", "error"]


def write_outputs(path_base: str, meta: dict, records: list) -> None:
    """<path_base>.json (meta and records; replaced in one step, so a reader never sees half a
    file) and <path_base>.csv (the records' CSV_FIELDS)."""
    os.makedirs(os.path.dirname(path_base) or ".", exist_ok=True)
    tmp = path_base + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1, default=str)
    os.replace(tmp, path_base + ".json")
    with open(path_base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})


def finalize_records(records: list, ceiling: float | None, baseline: str, keys) -> None:
    """Fills gbps-derived columns: % of ceiling and speedup over the baseline provider."""
    base = {}
    for r in records:
        if r["provider"] == baseline and r.get("time_us"):
            base[tuple(r.get(k) for k in keys)] = r["time_us"]
    for r in records:
        r["baseline"] = baseline
        if r.get("gbps") and ceiling:
            r["pct_of_ceiling"] = 100.0 * r["gbps"] / ceiling
        b = base.get(tuple(r.get(k) for k in keys))
        r["speedup_vs_baseline"] = (b / r["time_us"]) if (b and r.get("time_us")) else None


def _fmt_cell(r):
    """A table cell: GB/s, % of the ceiling, speedup over the baseline, and !WRONG where the
    check failed."""
    if r is None:
        return "-"
    if r.get("error"):
        return "ERR"
    g = r["gbps"]
    s = f"{g:.0f}" if g >= 100 else (f"{g:.1f}" if g >= 10 else f"{g:.2f}")
    if r.get("pct_of_ceiling") is not None:
        s += f" {r['pct_of_ceiling']:.0f}%"
    if r.get("speedup_vs_baseline") is not None:
        s += f" {r['speedup_vs_baseline']:.2f}x"
    if r.get("check") == "FAIL":
        s += " !WRONG"
    return s


def format_table(records: list, xkey: str, group_keys, title: str) -> str:
    """Compact table: one block per group, one row per x, one column per provider."""
    providers, labels = [], {}
    for r in records:
        pid = r.get("provider_id", r["provider"])
        if pid not in providers:
            providers.append(pid)
        if r["provider"] != pid:
            labels[pid] = r["provider"]
    groups = {}
    for r in records:
        groups.setdefault(tuple(r.get(k) for k in group_keys), []).append(r)
    lines = [title, "cells: GB/s over must-move bytes, % of copy ceiling, speedup over "
             f"{records[0].get('baseline') if records else '?'}"]
    lines += [f"note: {pid} is {lab}" for pid, lab in labels.items()]
    width = max([len(p) for p in providers] + [18]) + 1
    for g, rs in groups.items():
        lines.append("")
        lines.append("== " + ", ".join(f"{k}={v}" for k, v in zip(group_keys, g) if v is not None))
        lines.append(f"{xkey:>7} " + "".join(f"{p:>{width}}" for p in providers))
        by = {(r[xkey], r.get("provider_id", r["provider"])): r for r in rs}
        for x in sorted({r[xkey] for r in rs}):
            lines.append(f"{x:>7} " + "".join(f"{_fmt_cell(by.get((x, p))):>{width}}"
                                              for p in providers))
    return "\n".join(lines)


def plot_results(records: list, meta: dict, png: str, xkey: str, row_keys, col_keys, title: str,
                 line_key: str = "provider") -> str | None:
    """One subplot per (row_keys values) x (col_keys values); one line per provider; GB/s vs x
    on a log2 axis; the copy ceiling as a horizontal line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"matplotlib unavailable ({e}); no plot written", file=sys.stderr)
        return None
    ok = [r for r in records if r.get("gbps") and not r.get("error")]
    if not ok:
        print("nothing to plot", file=sys.stderr)
        return None
    row_vals, col_vals = [], []
    for r in ok:
        rv, cv = tuple(r.get(k) for k in row_keys), tuple(r.get(k) for k in col_keys)
        if rv not in row_vals:
            row_vals.append(rv)
        if cv not in col_vals:
            col_vals.append(cv)
    nr, nc = len(row_vals), len(col_vals)
    fig, axes = plt.subplots(nr, nc, figsize=(4.6 * nc, 3.4 * nr), squeeze=False, sharex=True)
    lines_seen = []
    for r in ok:
        if r[line_key] not in lines_seen:
            lines_seen.append(r[line_key])
    cmap = plt.get_cmap("tab10")
    colors = {name: cmap(i % 10) for i, name in enumerate(lines_seen)}
    ceil = (meta.get("ceilings") or {})
    for i, rv in enumerate(row_vals):
        for j, cv in enumerate(col_vals):
            ax = axes[i][j]
            key = rv + cv
            rs = [r for r in ok if tuple(r.get(k) for k in row_keys) == rv
                  and tuple(r.get(k) for k in col_keys) == cv]
            for name in lines_seen:
                pts = sorted((r[xkey], r["gbps"]) for r in rs if r[line_key] == name)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                            lw=1.4, color=colors[name], label=name)
            if ceil.get("ceiling_gbps"):
                ax.axhline(ceil["ceiling_gbps"], color="k", ls="--", lw=1,
                           label=f"copy ceiling {ceil['ceiling_gbps']:.0f} GB/s")
                for ck, ls in (("copy_jax_gbps", ":"), ("copy_torch_gbps", "-.")):
                    if ceil.get(ck) and ceil[ck] != ceil["ceiling_gbps"]:
                        ax.axhline(ceil[ck], color="grey", ls=ls, lw=0.8,
                                   label=f"{ck[:-5]} {ceil[ck]:.0f} GB/s")
            ax.set_xscale("log", base=2)
            ax.set_title(", ".join(str(v) for v in key if v is not None), fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("GB/s (must-move bytes)")
            if i == nr - 1:
                ax.set_xlabel(xkey)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in handles:
                handles[l] = h
                labels.append(l)
    fig.legend([handles[l] for l in labels], labels, loc="lower center", ncol=min(len(labels), 6),
               fontsize=8, bbox_to_anchor=(0.5, 0.0))
    sub = (f"{meta.get('device')} | jax {meta.get('jax')} | torch {meta.get('torch')} | "
           f"triton {meta.get('triton')} | driver {meta.get('driver_version')} | "
           f"{meta.get('date')}")
    if meta.get("standin"):
        sub += " | jax_softmax = STAND-IN"
    fig.suptitle(f"{title}\n{sub}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05 + 0.02 * (len(labels) > 6), 1, 0.95))
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    # bbox_inches="tight": a one-column figure is narrower than its subtitle and legend.
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def plot_by_size(records: list, meta: dict, png: str, layout: Layout, plot_rows,
                 title: str) -> list:
    """One plot per tensor size of the records: `png` where they have one size, else png's stem
    + _<size>MiB.png. Returns the paths written."""
    sizes = sorted({r.get("size_mib") for r in records})
    written = []
    for size in sizes:
        rs = [r for r in records if r.get("size_mib") == size]
        out = png if len(sizes) == 1 else os.path.splitext(png)[0] + f"_{size}MiB.png"
        if plot_results(rs, meta, out, layout.xkey, plot_rows, layout.plot_cols,
                        f"{title}, {size} MiB tensors"):
            written.append(out)
    return written


def run_plot(argv=None) -> int:
    """`bench plot`: re-plots (and merges) result JSON files of one bench."""
    p = argparse.ArgumentParser(
        prog="python -m jax_softmax bench plot",
        description="Re-plot (and merge) JSON results written by the softmax/attention benches.")
    p.add_argument("json", nargs="+",
                   help="result JSON files (same bench kind) to merge; a point that a later file "
                        "measured again replaces the earlier one")
    p.add_argument("--out", default=None, help="PNG path (default: first JSON with .png)")
    p.add_argument("--table", action="store_true", help="also print the table")
    args = p.parse_args(argv)
    metas, records = [], []
    for path in args.json:
        with open(path) as f:
            d = json.load(f)
        metas.append(d["meta"])
        records.extend(d["records"])
    # One record per provider and point: the last file's, so that a re-run of some points can be
    # merged over the sweep it updates.
    point = ("provider", "op", "dtype", "mode", "variant", "N", "S", "size_mib")
    records = list({tuple(r.get(k) for k in point): r for r in records}.values())
    meta = dict(metas[0])
    ceils = {}
    for m in metas:
        for k, v in (m.get("ceilings") or {}).items():
            if k.endswith("_gbps") and v:
                ceils[k] = max(v, ceils.get(k, 0))
    meta["ceilings"] = ceils
    layout = LAYOUTS["attention" if meta.get("bench") == "attention" else "softmax"]
    finalize_records(records, ceils.get("ceiling_gbps"), layout.baseline, layout.point_keys)
    # The title names "softmax" also for log_softmax files, and for both merged.
    title = layout.title.format(op="softmax")
    plot_rows = layout.plot_rows
    if len({r.get("op") for r in records}) > 1:  # e.g. softmax and log_softmax files merged
        plot_rows = ("op",) + plot_rows
    png = args.out or os.path.splitext(args.json[0])[0] + ".png"
    if args.table:
        print(format_table(records, layout.xkey, layout.table_groups, title))
    for out in plot_by_size(records, meta, png, layout, plot_rows, title):
        print("wrote", out)
    return 0
