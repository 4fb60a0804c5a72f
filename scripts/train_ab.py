"""A/B of the example's training step between builds of the package or knob settings.

    PYTHONPATH=<site of a build> python3 scripts/train_ab.py --label NAME [--seq-lens 512 1024]
        [--steps 60] [--profile] [--dump-hlo DIR]

Runs examples/train_lm.py's `train()` (the model and tokens per step of
benchmarks/bench_train_step.py, its STEP_DEFAULTS) with Flax's default attention and with
the plug-in, in this process, for the jax_softmax that comes first on the path, and prints one
JSON line per sequence length (label, steps/s of both, their ratio, the package's location and
revision). Flax's default is the control: it shares the process, so a machine that runs slower
moves both. Run it once per build or setting, alternating (base / this / base / this), and
compare the plug-in's steps/s where the controls agree.

It needs nothing of the package but `jax_softmax.flax.dot_product_attention`, so a build of an
old revision runs it as well; --profile reads the GPU timeline with this repository's
`jax_softmax/_bench.py`, loaded from its file for the same reason. --dump-hlo DIR keeps the
training step's optimized HLO of each variant (XLA_FLAGS is read when the backend starts, so it
is set here before JAX is imported), to diff the programs two builds give XLA.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _load(name: str, path: str):
    """A module of this repository loaded from its file (not from the package on the path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default bench_train_step's)")
    p.add_argument("--profile", action="store_true", help="also print each run's GPU timeline per step")
    p.add_argument("--trace-steps", type=int, default=5)
    p.add_argument("--dump-hlo", default=None, help="keep the optimized HLO of the training steps here")
    args = p.parse_args(argv)
    step = _load("bench_train_step", os.path.join("benchmarks", "bench_train_step.py")).STEP_DEFAULTS

    if args.dump_hlo:
        raw = tempfile.mkdtemp(prefix="train_ab_hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={raw} --xla_dump_hlo_as_text").strip()
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from train_lm import train  # noqa: E402  (examples/train_lm.py)

    import jax_softmax

    bench = _load("_repo_bench", os.path.join("jax_softmax", "_bench.py")) if args.profile else None
    revision = os.environ.get("JAX_SOFTMAX_GIT_REV", "")
    site = os.path.dirname(os.path.dirname(os.path.abspath(jax_softmax.__file__)))
    rev_file = os.path.join(os.path.dirname(site), "REVISION")
    if os.path.exists(rev_file):
        with open(rev_file) as f:
            revision = f.read().strip()
    knobs = {k: v for k, v in os.environ.items() if k.startswith("JAX_SOFTMAX_")}
    for s in args.seq_lens:
        batch = max(1, (args.tokens or step["tokens"]) // s)
        line = {"label": args.label, "revision": revision, "package": site, "knobs": knobs, "seq_len": s,
                "batch": batch}
        rate = {}
        for plugin in (False, True):
            key = "jax_softmax" if plugin else "flax_default"
            trace_dir = tempfile.mkdtemp(prefix="train_ab_trace_") if args.profile else None
            r = train(steps=args.steps, seq_len=s, batch=batch, d_model=step["d_model"],
                      layers=step["layers"], heads=step["heads"], vocab=step["vocab"],
                      use_plugin=plugin, dtype=step["dtype"], log_every=10**9, verbose=False,
                      trace_dir=trace_dir, trace_steps=args.trace_steps)
            rate[key] = r["steps_per_sec"]
            line[key + "_steps_per_s"] = round(rate[key], 2)
            line[key + "_compile_s"] = round(r["compile_s"], 1)
            if trace_dir is not None:
                summary = bench.timeline_summary(bench.gpu_timeline(trace_dir), args.trace_steps, top=8)
                line[key + "_timeline"] = summary
                shutil.rmtree(trace_dir, ignore_errors=True)
            if args.dump_hlo:
                dest = os.path.join(args.dump_hlo, f"{args.label}_S{s}_{key}")
                os.makedirs(dest, exist_ok=True)
                for path in glob.glob(os.path.join(raw, "*train_step*after_optimizations.txt")):
                    shutil.copy(path, dest)
                for path in glob.glob(os.path.join(raw, "*")):  # the next run's dump starts empty
                    if os.path.isfile(path):
                        os.remove(path)
                    else:
                        shutil.rmtree(path, ignore_errors=True)
        line["ratio"] = round(rate["jax_softmax"] / rate["flax_default"], 3)
        print(json.dumps(line), flush=True)
    if args.dump_hlo:
        shutil.rmtree(raw, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
