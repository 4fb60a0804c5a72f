"""One training step of two Flax models, with and without the jax_softmax attention plug-in and
with cuDNN's flash attention, at attention dropout 0.1 and 0, for sequence lengths 512 ... 4096.

    python benchmarks/bench_train_step.py [--out DIR] [--models lm linen] [--dropouts 0.1 0]
        [--seq-lens 512 1024 2048 4096] [--steps 30] [--repeats 3] [--profile] [--tag NAME]
        [--dump-hlo DIR] [--merge FILE]

Models (bfloat16, 4 layers, d_model 512, 8 heads, 16K tokens a step: batch = tokens // seq_len):
  lm     examples/train_lm.py: an NNX causal LM (nnx.MultiHeadAttention, is_causal=True).
  linen  benchmarks/linen_decoder.py: a Linen decoder stack in the shape of Flax's lm1b example
         (padding + causal (batch, 1, q, kv) mask, the loss over non-padding tokens).
Attention variants:
  flax         Flax's own attention function (its dropout: jax.random.bernoulli and a multiply).
  plugin       jax_softmax.flax.dot_product_attention as a user gets it (its default path:
               cuDNN where that applies, i.e. without dropout; with dropout jax_softmax's flash
               kernels for causal or masked attention, its fused softmax elsewhere).
  jax_softmax  the plug-in forced onto jax_softmax's fused softmax (implementation="jax_softmax").
  cudnn        the plug-in forced onto cuDNN (jax.nn.dot_product_attention(implementation="cudnn")).
  flash        the plug-in forced onto jax_softmax's flash kernels (implementation="flash").
With dropout cudnn does not run (cuDNN's path has no dropout), without it flash does not (its
kernels are for dropout: without it the plug-in takes cuDNN); --variants narrows them.

Timing: every variant of a point is compiled first (its first step), then timed in --repeats
rounds of --steps steps, the variants alternating within each round, each round one device sync
at its end (dispatch overlaps the previous step). A point holds each variant's runs (steps/s),
their median and best, and the speedup over flax (medians). Why rounds: on the H200 (session 48)
the steps/s of short steps changed from run to run of one program (the plug-in at S = 1024 ran
96-133 steps/s); alternating keeps a slow stretch from landing on one variant only.
Writes train_step_<device>.{json,png} (or <tag>.{json,png}) and prints a table. --merge FILE
keeps the points of the models this run leaves out from an earlier result (its meta under
"merged"): one file and plot for both models where each model's run fits a device call of its
own (every ratio still comes from one run: a point's variants always share theirs).

--profile: after the timed rounds, a few more steps of each variant under jax.profiler; the
point then also holds each variant's GPU timeline per step (`timeline`: span, busy and idle time,
time in jax_softmax's kernels, the kernels that took the most time), and a second table shows it.
--dump-hlo DIR keeps each variant's optimized training-step HLO (DIR/<tag>_<model>_S<seq_len>_
p<dropout>_<variant>/); it sets XLA_FLAGS, which JAX reads when its backend starts, so it needs a
process of its own. The benchmark's helpers come from this source tree's benchmarks/
jax_softmax_bench/, and the package needs nothing but jax_softmax.flax, so another build can be
timed as well: `PYTHONPATH=<its site> JAX_SOFTMAX_GIT_REV=<its revision> python
benchmarks/bench_train_step.py --tag NAME`.
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
# common.py and linen_decoder.py: sys.path[0] already when run as a script, not when a test loads
# this file.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import import_source_bench  # noqa: E402

VARIANTS = ("flax", "plugin", "jax_softmax", "cudnn", "flash")
DROPOUT_VARIANTS = ("flax", "plugin", "jax_softmax", "flash")  # cuDNN's path has no dropout
NO_DROPOUT_VARIANTS = ("flax", "plugin", "jax_softmax", "cudnn")


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


def make_trainer(model: str, variant: str, args, seq_len: int, batch: int, dropout: float):
    """(train_step, state) of one model and attention variant."""
    common = dict(seq_len=seq_len, batch=batch, d_model=args.d_model, layers=args.layers,
                  heads=args.heads, vocab=512, dtype=args.dtype, dropout=dropout)
    if model == "lm":
        from train_lm import make_trainer as lm_trainer  # examples/train_lm.py

        impl = {"flax": None, "plugin": None, "jax_softmax": "jax_softmax", "cudnn": "cudnn",
                "flash": "flash"}[variant]
        return lm_trainer(use_plugin=variant != "flax", implementation=impl, **common)
    from linen_decoder import make_trainer as linen_trainer

    return linen_trainer(attention=variant, **common)


class Runner:
    """One variant's compiled step and state, run `steps` steps at a time."""

    def __init__(self, step, state):
        import jax

        self.step, self.state = step, state
        self.key = jax.random.key(1)
        self.i = 0
        self.loss = None

    def run(self, steps: int) -> float:
        """Runs `steps` steps; returns their steps/s (one sync at the end)."""
        import jax

        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, self.loss = self.step(self.state, jax.random.fold_in(self.key, self.i))
            self.i += 1
        jax.block_until_ready((self.state, self.loss))
        return steps / (time.perf_counter() - t0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--models", nargs="+", choices=["lm", "linen"], default=["lm", "linen"])
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.1, 0.0])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch * seq_len)")
    p.add_argument("--steps", type=int, default=30, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, the variants alternating")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true",
                   help="also record each variant's GPU timeline per step (jax.profiler)")
    p.add_argument("--trace-steps", type=int, default=5, help="steps traced with --profile")
    p.add_argument("--tag", default=None, help="file name stem (default train_step_<device>)")
    p.add_argument("--dump-hlo", default=None,
                   help="keep each variant's optimized training-step HLO under this directory")
    p.add_argument("--merge", default=None,
                   help="an earlier result JSON whose points of other models this file keeps")
    args = p.parse_args(argv)

    raw_hlo = None
    if args.dump_hlo:
        raw_hlo = tempfile.mkdtemp(prefix="train_step_hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={raw_hlo} --xla_dump_hlo_as_text").strip()

    import jax

    import_source_bench()  # the helpers below: this checkout's (see the docstring)
    from jax_softmax_bench.environment import collect_meta, device_kind
    from jax_softmax_bench.report import slug
    from jax_softmax_bench.timeline import gpu_timeline, timeline_summary

    device = device_kind()
    stem = args.tag or f"train_step_{slug(device)}"
    rows = []
    for model in args.models:
        for dropout in args.dropouts:
            names = [v for v in args.variants if v in (NO_DROPOUT_VARIANTS if dropout == 0.0 else DROPOUT_VARIANTS)]
            for s in args.seq_lens:
                batch = max(1, args.tokens // s)
                point = {"model": model, "dropout": dropout, "seq_len": s, "batch": batch,
                         "variants": {}}
                runners = {}
                for name in names:
                    try:
                        step, state = make_trainer(model, name, args, s, batch, dropout)
                        runner = Runner(step, state)
                        t0 = time.perf_counter()
                        runner.run(1)  # compiles
                        point["variants"][name] = {"compile_s": time.perf_counter() - t0, "runs": []}
                        runners[name] = runner
                    except ValueError as e:  # e.g. cudnn where it does not apply
                        point["variants"][name] = {"skipped": str(e)}
                    if raw_hlo is not None:
                        _take_hlo(raw_hlo, os.path.join(
                            args.dump_hlo, f"{stem}_{model}_S{s}_p{dropout:g}_{name}") if name in runners else None)
                for _ in range(args.repeats):
                    for name, runner in runners.items():
                        point["variants"][name]["runs"].append(runner.run(args.steps))
                for name, runner in runners.items():
                    v = point["variants"][name]
                    v["steps_per_s"] = statistics.median(v["runs"])
                    v["best_steps_per_s"] = max(v["runs"])
                    v["final_loss"] = float(runner.loss)
                    if args.profile:
                        trace_dir = tempfile.mkdtemp(prefix="train_step_trace_")
                        jax.profiler.start_trace(trace_dir)
                        runner.run(args.trace_steps)
                        jax.profiler.stop_trace()
                        v["timeline"] = timeline_summary(gpu_timeline(trace_dir), args.trace_steps)
                        shutil.rmtree(trace_dir, ignore_errors=True)
                flax = point["variants"].get("flax", {}).get("steps_per_s")
                for name, v in point["variants"].items():
                    if flax and "steps_per_s" in v:
                        v["speedup"] = v["steps_per_s"] / flax
                rows.append(point)
                line = "  ".join(f"{n} {v['steps_per_s']:.2f}" + (f" x{v['speedup']:.2f}" if "speedup" in v else "")
                                 for n, v in point["variants"].items() if "steps_per_s" in v)
                print(f"{model:5s} p={dropout:<4g} S={s:5d} B={batch:3d}  {line}  (steps/s, x over flax)",
                      flush=True)
                del runners

    if raw_hlo is not None:
        shutil.rmtree(raw_hlo)
    os.makedirs(args.out, exist_ok=True)
    meta = collect_meta("jax_softmax", standin=False)
    meta["settings"] = vars(args)
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        kept = [r for r in earlier["points"] if r["model"] not in args.models]
        meta["merged"] = {"models": sorted({r["model"] for r in kept}), "meta": earlier["meta"]}
        rows = kept + rows
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
    _plot(rows, args, device, os.path.join(args.out, stem + ".png"))
    _table(rows, args.profile)


def _plot(rows, args, device, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(r["model"], r["dropout"]) for r in rows}, key=lambda k: (k[0], -k[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, dropout) in zip(axes[0], panels):
        pts = [r for r in rows if r["model"] == model and r["dropout"] == dropout]
        names = [n for n in VARIANTS if n != "flax" and any("speedup" in r["variants"].get(n, {}) for r in pts)]
        width = 0.8 / max(1, len(names))
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(pts))]
            ax.bar(xs, [r["variants"].get(n, {}).get("speedup", 0) for r in pts], width, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(pts)), [f"S={r['seq_len']}" for r in pts])
        ax.set_title(f"{model}, attention dropout {dropout:g}")
        ax.set_ylabel("step speedup over Flax's default")
        ax.legend(fontsize=8)
    fig.suptitle(f"training step ({args.dtype}, {args.layers} layers, d={args.d_model}, "
                 f"{args.tokens} tokens) on {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(rows, profile: bool):
    # Steps/s: the median of the runs; x: over flax.
    print(f"\n{'model':5} {'drop':>4} {'S':>5} {'flax steps/s':>12}  " +
          "  ".join(f"{n:>12}" for n in VARIANTS[1:]))
    for r in rows:
        v = r["variants"]
        flax = v.get("flax", {}).get("steps_per_s")
        cells = [f"x{v[n]['speedup']:.2f}" if "speedup" in v.get(n, {}) else "-" for n in VARIANTS[1:]]
        print(f"{r['model']:5} {r['dropout']:>4g} {r['seq_len']:>5} {flax or 0:>12.2f}  " +
              "  ".join(f"{c:>12}" for c in cells))
    if profile:
        # us per step on the GPU's timeline; "softmax": the time in jax_softmax's kernels.
        print(f"\n{'model':5} {'drop':>4} {'S':>5} {'variant':>12} {'span':>9} {'busy':>9} {'idle':>8} "
              f"{'softmax':>8}  top kernels (us)")
        for r in rows:
            for n, v in r["variants"].items():
                t = v.get("timeline") or {}
                if not t:
                    continue
                top = ", ".join(f"{k['name'][:40]} {k['us']:.0f}" for k in t["kernels"][:3])
                print(f"{r['model']:5} {r['dropout']:>4g} {r['seq_len']:>5} {n:>12} {t['span_us']:>9.0f} "
                      f"{t['busy_us']:>9.0f} {t['idle_us']:>8.0f} {t['jax_softmax_us']:>8.0f}  {top}")


if __name__ == "__main__":
    main()
