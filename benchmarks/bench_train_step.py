"""One training step of examples/train_lm.py (a Flax NNX causal transformer LM, bfloat16) with
and without the jax_softmax attention plug-in, for sequence lengths 512 ... 4096.

    python benchmarks/bench_train_step.py [--out DIR] [--seq-lens 512 1024 2048 4096] [--steps 60]
        [--repeats 3] [--profile] [--tag NAME] [--dump-hlo DIR]

Tokens per step are held constant (batch = tokens // seq_len) so every point moves a similar
amount of non-attention work; the attention scores grow with the sequence length. A run is the
steady-state steps/s of `train()` (first, compiling step excluded; one device sync at the end,
so dispatch overlaps the previous step). Each variant runs --repeats times, the two alternating;
a point holds every run (`<variant>_runs`), their median (`<variant>_steps_per_s`, and
`speedup` from the medians) and their best (`<variant>_best_steps_per_s`, `speedup_best`).
Why repeats: on the H200 (session 48) the steps/s of short steps change from run to run of the
same program: the plug-in at S = 1024 ran 96-133 steps/s, Flax's default at S = 512 83-114,
while the GPU's busy time per step (the traced timeline) is 7.3 and 8.7 ms. The slow runs take
10-12 ms a step; what sets them was not identified (the host's launches are the suspect). Flax's
default from S = 1024 on, with 13 ms and more of GPU work a step, varied by 0.2%. One run of
each, as before session 48, reads whichever rate came.
Writes train_step_<device>.{json,png} (or <tag>.{json,png}) and prints a table.

--profile: after each timed run, a few more steps under jax.profiler; the point then also holds
the GPU timeline per step (`<variant>_timeline`: span, busy and idle time, time in jax_softmax's
kernels, the kernels that took the most time), and a second table shows it. That is the way to
see where a step's time goes when the steps/s move but the softmax benchmarks do not. The meta's
`jax_softmax_env` records the JAX_SOFTMAX_* knobs of the run (e.g. JAX_SOFTMAX_PDL=0).

A/B between builds: the benchmark's helpers (meta, timeline) come from this source tree's
benchmarks/jax_softmax_bench/, not from the package on the path, and the package needs nothing but
`jax_softmax.flax.dot_product_attention`; so any build, an old revision's too, can be timed:
`PYTHONPATH=<its site> JAX_SOFTMAX_GIT_REV=<its revision> python benchmarks/bench_train_step.py
--repeats 1 --tag NAME`, alternating builds one process each (session 48 timed session 9's build
so). The meta's `jax_softmax_path` says which package ran, its `git` the revision named.
--dump-hlo DIR keeps each variant's optimized training-step HLO (DIR/<tag>_S<seq_len>_<variant>/),
to diff the programs two builds give XLA; it sets XLA_FLAGS, which JAX reads when its backend
starts, so it needs a process of its own (as from the command line).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
# common.py: sys.path[0] already when run as a script, not when a test loads this file.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import import_source_bench  # noqa: E402


def _take_hlo(raw: str, dest: str | None) -> None:
    """Empties XLA's dump directory `raw` for the next compile, first copying the training step's
    optimized HLO to `dest` (None: nothing kept)."""
    if dest is not None:
        kept = glob.glob(os.path.join(raw, "*train_step*after_optimizations.txt"))
        if not kept:
            shutil.rmtree(raw)
            raise SystemExit(f"--dump-hlo: XLA wrote no training-step HLO to {raw}; XLA_FLAGS is "
                             "read when JAX's backend starts, so run the benchmark in a process of "
                             "its own")
        os.makedirs(dest, exist_ok=True)
        for path in kept:
            shutil.copy(path, dest)
    shutil.rmtree(raw)
    os.makedirs(raw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch * seq_len)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true",
                   help="also record each run's GPU timeline per step (jax.profiler)")
    p.add_argument("--trace-steps", type=int, default=5, help="steps traced with --profile")
    p.add_argument("--tag", default=None, help="file name stem (default train_step_<device>)")
    p.add_argument("--dump-hlo", default=None,
                   help="keep each variant's optimized training-step HLO under this directory")
    args = p.parse_args(argv)

    raw_hlo = None
    if args.dump_hlo:
        raw_hlo = tempfile.mkdtemp(prefix="train_step_hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={raw_hlo} --xla_dump_hlo_as_text").strip()

    from train_lm import train  # examples/train_lm.py

    import_source_bench()  # the helpers below: this checkout's (see the docstring: A/B)
    from jax_softmax_bench.environment import collect_meta, device_kind
    from jax_softmax_bench.report import slug
    from jax_softmax_bench.timeline import gpu_timeline, timeline_summary

    device = device_kind()
    stem = args.tag or f"train_step_{slug(device)}"
    rows = []
    for s in args.seq_lens:
        batch = max(1, args.tokens // s)
        point = {"seq_len": s, "batch": batch}
        keys = {False: "flax_default", True: "jax_softmax"}
        for repeat in range(args.repeats):
            last = repeat == args.repeats - 1
            for plugin in (False, True):
                key = keys[plugin]
                # The trace (--profile) follows the last run's timed steps only.
                trace_dir = tempfile.mkdtemp(prefix="train_step_trace_") if args.profile and last else None
                r = train(steps=args.steps, seq_len=s, batch=batch, d_model=args.d_model,
                          layers=args.layers, heads=args.heads, vocab=512, use_plugin=plugin,
                          dtype=args.dtype, log_every=10**9, verbose=False, trace_dir=trace_dir,
                          trace_steps=args.trace_steps)
                point.setdefault(key + "_runs", []).append(r["steps_per_sec"])
                point[key + "_final_loss"] = r["losses"][-1]
                if trace_dir is not None:
                    point[key + "_timeline"] = timeline_summary(gpu_timeline(trace_dir),
                                                                args.trace_steps)
                    shutil.rmtree(trace_dir, ignore_errors=True)
                if raw_hlo is not None:  # every repeat compiles the same program: keep the first
                    _take_hlo(raw_hlo, os.path.join(args.dump_hlo, f"{stem}_S{s}_{key}") if repeat == 0 else None)
        for key in keys.values():
            point[key + "_steps_per_s"] = statistics.median(point[key + "_runs"])
            point[key + "_best_steps_per_s"] = max(point[key + "_runs"])
        point["speedup"] = point["jax_softmax_steps_per_s"] / point["flax_default_steps_per_s"]
        point["speedup_best"] = point["jax_softmax_best_steps_per_s"] / point["flax_default_best_steps_per_s"]
        rows.append(point)
        runs = {k: " ".join(f"{v:.1f}" for v in point[k + "_runs"]) for k in keys.values()}
        print(f"S={s:5d} batch={batch:3d}  flax {runs['flax_default']} steps/s  "
              f"jax_softmax {runs['jax_softmax']} steps/s  x{point['speedup']:.2f} (median) "
              f"x{point['speedup_best']:.2f} (best)", flush=True)

    os.makedirs(args.out, exist_ok=True)
    # The softmax benches' record of the machine: device, driver, versions, git revision.
    if raw_hlo is not None:
        shutil.rmtree(raw_hlo)
    meta = collect_meta("jax_softmax", standin=False)
    meta["settings"] = vars(args)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["flax_default_steps_per_s"] for r in rows], 0.4, label="Flax default")
        ax.bar([x + 0.2 for x in xs], [r["jax_softmax_steps_per_s"] for r in rows], 0.4, label="jax_softmax plug-in")
        ax.set_xticks(list(xs), [f"S={r['seq_len']}\nB={r['batch']}" for r in rows])
        ax.set_ylabel("training steps / s")
        ax.set_title(f"train_lm step ({args.dtype}, {args.layers} layers, d={args.d_model}) on {device}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, stem + ".png"), dpi=110)
    except ImportError:
        pass
    # Steps/s: the median of the runs, the best in brackets.
    print(f"{'S':>6} {'flax steps/s':>17} {'ours steps/s':>17} {'speedup':>8} {'best':>6}")
    for r in rows:
        flax = f"{r['flax_default_steps_per_s']:.2f} ({r['flax_default_best_steps_per_s']:.1f})"
        ours = f"{r['jax_softmax_steps_per_s']:.2f} ({r['jax_softmax_best_steps_per_s']:.1f})"
        print(f"{r['seq_len']:>6} {flax:>17} {ours:>17} {r['speedup']:>8.2f} {r['speedup_best']:>6.2f}")
    if args.profile:
        # us per step on the GPU's timeline; "softmax" is the time in jax_softmax's kernels.
        print(f"\n{'S':>6} {'attention':>12} {'span':>9} {'busy':>9} {'idle':>8} {'softmax':>8}  top kernels (us)")
        for r in rows:
            for key in ("flax_default", "jax_softmax"):
                t = r.get(key + "_timeline") or {}
                if not t:
                    print(f"{r['seq_len']:>6} {key:>12}  no GPU timeline")
                    continue
                top = ", ".join(f"{k['name'][:40]} {k['us']:.0f}" for k in t["kernels"][:3])
                print(f"{r['seq_len']:>6} {key:>12} {t['span_us']:>9.0f} {t['busy_us']:>9.0f} "
                      f"{t['idle_us']:>8.0f} {t['jax_softmax_us']:>8.0f}  {top}")


if __name__ == "__main__":
    main()
