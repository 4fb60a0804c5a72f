"""Before/after comparison of two builds' benchmark sweeps (scripts/gpu_check.sh's absweep step).

    python scripts/compare_builds.py --base BASE.json [...] --this THIS.json [...] \
        [--out benchmarks/results/ab_nvidia_h200] [--limit 1.0]

Each JSON is a `python -m jax_softmax bench` result (softmax or attention). Points of the
jax_softmax provider are matched by (bench, dtype, mode, variant, N or S); each side's % of the
copy ceiling is the point's time against that run's own copy ceiling, so the two builds are
compared by ratios measured in their own runs. A point is flagged where this build is more than
--limit points of the copy slower than the base. Writes OUT.json and OUT.csv (one row per point)
and prints a table and the flagged points; exits 1 where any point is flagged.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

KEY_FIELDS = ("bench", "dtype", "mode", "variant", "N", "S")


def load_points(paths):
    """{key: record} of the jax_softmax provider's points in `paths` (a later file wins)."""
    points, metas = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append({k: data["meta"].get(k) for k in ("git", "date", "device", "ceilings")})
        for rec in data["records"]:
            if rec.get("provider") != "jax_softmax" or rec.get("pct_of_ceiling") is None:
                continue
            points[tuple(rec.get(k) for k in KEY_FIELDS)] = rec
    return points, metas


def compare(base, this, limit):
    rows = []
    for key in sorted(set(base) & set(this), key=lambda k: tuple(str(v) for v in k)):
        b, t = base[key], this[key]
        delta = t["pct_of_ceiling"] - b["pct_of_ceiling"]
        rows.append({
            **dict(zip(KEY_FIELDS, key)),
            "base_pct": round(b["pct_of_ceiling"], 2),
            "this_pct": round(t["pct_of_ceiling"], 2),
            "delta_pts": round(delta, 2),
            "base_us": round(b["time_us"], 2),
            "this_us": round(t["time_us"], 2),
            "flagged": delta < -limit,
        })
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", nargs="+", required=True, help="the base build's result JSONs")
    p.add_argument("--this", nargs="+", required=True, help="this build's result JSONs")
    p.add_argument("--out", default=None, help="path stem of the JSON and CSV written")
    p.add_argument("--limit", type=float, default=1.0,
                   help="points of the copy this build may be slower (default 1.0)")
    args = p.parse_args(argv)
    base, base_meta = load_points(args.base)
    this, this_meta = load_points(args.this)
    rows = compare(base, this, args.limit)
    if not rows:
        print("no common points", file=sys.stderr)
        return 2
    missing = sorted(set(base) ^ set(this), key=str)
    print(f"{'bench':9s} {'dtype':9s} {'mode':7s} {'variant':10s} {'N/S':>7s} "
          f"{'base %':>7s} {'this %':>7s} {'delta':>6s}")
    for r in rows:
        size = r["N"] if r["N"] is not None else r["S"]
        mark = "  <-- slower" if r["flagged"] else ""
        print(f"{r['bench']:9s} {r['dtype']:9s} {r['mode']:7s} {str(r['variant'] or '-'):10s} "
              f"{size:>7} {r['base_pct']:7.1f} {r['this_pct']:7.1f} {r['delta_pts']:+6.1f}{mark}")
    deltas = [r["delta_pts"] for r in rows]
    flagged = [r for r in rows if r["flagged"]]
    print(f"{len(rows)} points: delta (points of the copy) min {min(deltas):+.1f}, "
          f"median {sorted(deltas)[len(deltas) // 2]:+.1f}, max {max(deltas):+.1f}; "
          f"{len(flagged)} more than {args.limit} slower; {len(missing)} points on one side only")
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": {"base": base_meta, "this": this_meta, "limit_pts": args.limit},
                       "points": rows}, f, indent=1)
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
