"""What the softmax and attention sweeps share: the dtype and mode names, the common options and
their defaults, the start of a run (the API under test, the meta, the copy ceiling and the
dispatch check), and `Sweep`, which measures each point into a record, keeps the result files
current after every point and prints the table at the end."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

from .calibration import dispatch_check, measure_ceilings
from .checks import jax_rows_host, judge
from .environment import MIB, collect_meta, free_memory, import_jax, l2_bytes, on_gpu, torch_cuda
from .providers import COPY_PROVIDERS, NO_KERNEL_LABEL, resolve_api
from .report import finalize_records, format_table, plot_by_size, slug, write_outputs
from .timing import chain_record, time_jax

DTYPES = ("float32", "bfloat16", "float16")
MODE_ALIASES = {
    "forward": "fwd", "fwd": "fwd",
    "backward": "bwd", "bwd": "bwd",
    "forward+backward": "fwdbwd", "fwd+bwd": "fwdbwd", "fwdbwd": "fwdbwd", "both": "fwdbwd",
}
DTYPE_ALIASES = {"float32": "float32", "f32": "float32", "fp32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16"}


def jnp_dtype(name):
    _, jnp = import_jax()
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def itemsize(name) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


def torch_dtype(name):
    torch = torch_cuda()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def parse_list(values, aliases=None, allowed=None, what="value"):
    out = []
    for v in values or []:
        for item in str(v).split(","):
            item = item.strip()
            if not item:
                continue
            if aliases is not None:
                if item.lower() not in aliases:
                    raise SystemExit(f"unknown {what} {item!r}; choose from {sorted(set(aliases))}")
                item = aliases[item.lower()]
            elif allowed is not None and item not in allowed:
                raise SystemExit(f"unknown {what} {item!r}; choose from {list(allowed)}")
            if item not in out:
                out.append(item)
    return out


def parse_ints(values):
    out = []
    for v in values or []:
        for item in str(v).split(","):
            if item.strip():
                out.append(int(float(item)))
    return out


class Progress:
    def __init__(self, total, desc):
        try:
            from tqdm import tqdm
            tty = sys.stderr.isatty()
            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr,
                            mininterval=0.5 if tty else 30.0, maxinterval=60.0)
            self.tty = tty
        except Exception:
            self.bar = None
            self.n, self.total, self.desc = 0, total, desc

    def set(self, text):
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=self.tty)

    def update(self):
        if self.bar is not None:
            self.bar.update(1)
        else:
            self.n += 1
            print(f"[{self.desc} {self.n}/{self.total}]", file=sys.stderr, flush=True)

    def write(self, msg):
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def log_to_stderr(msg: str) -> None:
    """The sweeps' log: stderr, so that stdout holds the results."""
    print(msg, file=sys.stderr, flush=True)


def default_out_dir() -> str:
    """benchmarks/results/ of the source tree when this package runs from one (a checkout or an
    editable install); else, installed from a wheel, benchmarks/results/ under the current
    directory."""
    benchmarks = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.basename(benchmarks) == "benchmarks":
        return os.path.join(benchmarks, "results")
    return os.path.join(os.getcwd(), "benchmarks", "results")


def add_common_args(p: argparse.ArgumentParser, providers, modes):
    p.add_argument("--out", default=None,
                   help="output directory (default: benchmarks/results/ of the source tree)")
    p.add_argument("--tag", default=None, help="file name stem (default <bench>_<device>)")
    p.add_argument("--quick", action="store_true",
                   help="small sweep (few sizes, small tensors, few repeats) for smoke tests")
    p.add_argument("--dtypes", nargs="+", default=None,
                   help=f"comma/space separated, from {list(DTYPES)} (default all)")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"from {list(modes)} (aliases forward, backward, forward+backward)")
    p.add_argument("--sizes-mib", nargs="+", default=None,
                   help="input tensor size(s) in MiB (default 256; --quick: 64 on GPU, 4 on CPU)")
    p.add_argument("--providers", nargs="+", default=None,
                   help=f"subset of {list(providers) + list(COPY_PROVIDERS)} (default all; copy_* "
                        "are the ceiling; unavailable ones are skipped)")
    p.add_argument("--chain", type=int, default=None,
                   help="K: calls chained in one jit per JAX measurement (default 8; quick 4)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed samples; the median is reported (default 10; quick 5)")
    p.add_argument("--pipeline", type=int, default=None,
                   help="R: JAX executions enqueued back to back per sample (default 20; quick 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed executions (default 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="each point's providers measured this many times in turn, the order "
                        "rotated each round; a provider's record is its median round (default 1; "
                        "for machines whose speed drifts between two providers' measurements)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the copy-ceiling buffer (default 1024; quick 256 GPU / 16 CPU)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--standin", action="store_true",
                   help="if jax_softmax's API does not import, time jax.nn in its place, labelled "
                        "as a stand-in; if it has no compiled kernel for this platform, time its "
                        "jnp fallback, labelled so (developing the benchmark only)")


def resolve_common(args, providers, modes, quick_sizes_gpu=64, quick_sizes_cpu=4):
    """The sweep's configuration from the common options, with the defaults (and --quick's)."""
    gpu = on_gpu()
    cfg = {}
    cfg["dtypes"] = parse_list(args.dtypes, DTYPE_ALIASES, what="dtype") or list(DTYPES)
    mode_aliases = {k: v for k, v in MODE_ALIASES.items() if v in modes}
    cfg["modes"] = parse_list(args.modes, mode_aliases, what="mode") or list(modes)
    if args.sizes_mib:
        cfg["sizes_mib"] = parse_ints(args.sizes_mib)
    elif args.quick:
        cfg["sizes_mib"] = [quick_sizes_gpu if gpu else quick_sizes_cpu]
    else:
        cfg["sizes_mib"] = [256]
    cfg["providers"] = parse_list(args.providers, allowed=tuple(providers) + COPY_PROVIDERS,
                                  what="provider") or list(providers) + list(COPY_PROVIDERS)
    cfg["chain"] = args.chain or (4 if args.quick else 8)
    cfg["reps"] = args.reps or (5 if args.quick else 10)
    cfg["pipeline"] = args.pipeline or (4 if args.quick else 20)
    cfg["warmup"] = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    cfg["rounds"] = args.rounds or 1
    cfg["copy_mib"] = args.copy_mib or ((256 if gpu else 16) if args.quick else 1024)
    cfg["check"] = not args.no_check
    cfg["quick"] = bool(args.quick)
    cfg["out"] = args.out or default_out_dir()
    if cfg["chain"] < 1 or cfg["reps"] < 1 or cfg["rounds"] < 1:
        raise SystemExit("--chain, --reps and --rounds must be >= 1")
    return cfg


def warn_l2(size_mib, log):
    """Says so where the tensors are small enough for L2 to hold part of them."""
    if on_gpu() and size_mib * MIB < 2 * l2_bytes():
        log(f"note: {size_mib} MiB tensors are under 2x L2 ({l2_bytes() / MIB:.0f} MiB); JAX "
            "gives each chained call its own inputs, but GB/s at this size partly measures the "
            "cache")


# ----------------------------------------------------------------------------------------------
# A run: its start, one point, its end.
# ----------------------------------------------------------------------------------------------

def api_under_test(providers, standin: bool):
    """resolve_api's (api, label, is_standin) where the run times jax_softmax; else (None,
    None, False), and the package is not touched."""
    if "jax_softmax" not in providers:
        return None, None, False
    return resolve_api(standin)


def start_results(bench: str, cfg: dict, tag, api_label, standin: bool, providers, bytes_model,
                  log, log_versions=()) -> tuple[dict, str]:
    """(meta, base): the result file's meta (the machine, see collect_meta; the bench, its
    configuration, the providers that run and what their must-move bytes count) and the result
    files' path without extension, <out>/<tag> or <out>/<bench>_<device>. Logs the device, the
    versions of `log_versions` (meta keys) and that path."""
    meta = collect_meta(api_label or "jax_softmax (not run)", standin)
    meta.update(bench=bench, config=dict(cfg), providers_run=providers, bytes_model=bytes_model)
    base = os.path.join(cfg["out"], tag or f"{bench}_{slug(meta['device'])}")
    versions = "".join(f", {name} {meta.get(name)}" for name in log_versions)
    log(f"device: {meta['device']} ({meta['platform']}), jax {meta['jax']}{versions}; writing "
        f"{base}.{{json,csv,png}}")
    return meta, base


def calibrate(meta: dict, cfg: dict, providers, jax_fns: dict, shapes: dict, log) -> None:
    """Measures the copy ceiling and the dispatch check of `jax_fns` at `shapes` into meta."""
    meta["ceilings"] = measure_ceilings(cfg["copy_mib"], providers, cfg["chain"], cfg["reps"],
                                        cfg["warmup"], log, pipeline=cfg["pipeline"])
    meta["dispatch_check"] = dispatch_check(jax_fns, cfg["chain"], cfg["reps"], cfg["warmup"],
                                            log, pipeline=cfg["pipeline"], shapes=shapes)


def measure_in_rounds(measures: dict, rounds: int) -> dict:
    """The providers of one point measured `rounds` times each, in turn, the order rotated by one
    each round, so that a drift of the machine's speed falls on every provider alike. Returns,
    per provider, a callable giving its median round's timing fields (by time_us; that round's
    samples and check together), or raising the error of its first failed round (for
    Sweep.run_point). One round calls each measure once, as without rounds."""
    names = list(measures)
    results = {name: [] for name in names}
    errors = {}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in errors:
                continue
            try:
                results[name].append(measures[name]())
            except Exception as e:  # recorded by run_point, as a measure's own error
                errors[name] = e

    def median_round(name):
        if name in errors:
            raise errors[name]
        runs = sorted(results[name], key=lambda f: f["time_us"])
        fields = dict(runs[(len(runs) - 1) // 2])
        if len(runs) > 1:
            fields["rounds_us"] = [f["time_us"] for f in results[name]]
        return fields

    return {name: functools.partial(median_round, name) for name in names}


def time_jax_point(call, arg_sets, cfg: dict, check_rows: int):
    """Times a JAX provider at one point: K chained calls of `call`, one input set of arg_sets
    each. Returns (the record's timing fields, the first execution's outputs as float64 host
    rows, `check_rows` at each end, for the correctness check; None with --no-check)."""
    jax, _ = import_jax()

    def host_rows(out):  # copied before the output buffers are donated to the next execution
        return jax.tree.map(lambda a: jax_rows_host(a, check_rows), out) if cfg["check"] else None

    t = time_jax(call, tuple(arg_sets), cfg["chain"], cfg["reps"], cfg["warmup"],
                 on_first=host_rows, pipeline=cfg["pipeline"])
    return chain_record(t), t.first


class Sweep:
    """The records of one run, as they are measured. Every point is written to the JSON and CSV
    files at once (an interrupted run keeps what it measured, and its meta's `partial` says how
    far it got); `finish` prints the table and draws the plots."""

    def __init__(self, base: str, meta: dict, layout, total: int, desc: str):
        self.base, self.meta, self.layout = base, meta, layout
        self.records = []
        write_outputs(base, meta, self.records)
        meta["points_planned"] = total
        self.bar = Progress(total, desc)
        self.t_start = time.time()
        self.sizes_seen = set()

    def run_point(self, rec: dict, measure, what: str) -> None:
        """Measures one point into `rec` and records it; an exception of the measurement is
        recorded as the point's error, not raised.

        `measure()` returns the timing fields. Adds the dispatch residual (JAX providers only:
        the dispatch check holds nothing for the others), GB/s and the correctness verdict, or
        the error; then appends the record, recomputes ceiling/baseline figures and rewrites
        JSON/CSV."""
        meta, bar, records = self.meta, self.bar, self.records
        if rec["size_mib"] not in self.sizes_seen:  # the first point of this tensor size
            self.sizes_seen.add(rec["size_mib"])
            warn_l2(rec["size_mib"], bar.write)
        try:
            rec.update(measure())
            dc = meta["dispatch_check"].get(rec["provider_id"], {})
            if "residual_us_in_sweep" in dc:
                rec["dispatch_residual_us"] = dc["residual_us_in_sweep"]
                rec["dispatch_residual_pct"] = 100.0 * dc["residual_us_in_sweep"] / rec["time_us"]
            rec["gbps"] = rec["bytes"] / (rec["time_us"] * 1e-6) / 1e9
            judge(rec, rec["dtype"])
            if rec["check"] == "FAIL":
                bar.write(f"CHECK FAILED: {what}: rel_err={rec.get('rel_err')} "
                          f"rel_err_dx={rec.get('rel_err_dx')}")
        except Exception as e:  # record and go on
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            rec["check"] = "error"
            bar.write(f"ERROR {what}: {rec['error']}")
            if os.environ.get("JAX_SOFTMAX_BENCH_TRACEBACK"):
                bar.write(traceback.format_exc())
        free_memory()
        records.append(rec)
        finalize_records(records, meta["ceilings"].get("ceiling_gbps"), self.layout.baseline,
                         self.layout.point_keys)
        meta["elapsed_s"] = time.time() - self.t_start
        if len(records) < meta["points_planned"]:
            meta["partial"] = (f"{len(records)} of {meta['points_planned']} points: "
                               "the sweep had not finished when this file was written")
        else:
            meta.pop("partial", None)
        write_outputs(self.base, meta, records)
        bar.update()

    def finish(self, title: str, no_plot: bool) -> int:
        """Prints the table, the ceiling and the dispatch check, writes the plots (one per
        tensor size) unless no_plot; the exit status: 1 where a check failed or every point
        failed, else 0."""
        self.bar.close()
        base, meta, records, layout = self.base, self.meta, self.records, self.layout
        print(format_table(records, layout.xkey, layout.table_groups,
                           f"{title}  [{meta['device']}]"))
        ceil = meta.get("ceilings") or {}
        print(f"\ncopy ceiling: {ceil.get('ceiling_gbps') and round(ceil['ceiling_gbps'])} GB/s "
              f"(copy_jax {ceil.get('copy_jax_gbps') and round(ceil['copy_jax_gbps'])}, "
              f"copy_torch {ceil.get('copy_torch_gbps') and round(ceil['copy_torch_gbps'])})")
        for k, v in (meta.get("dispatch_check") or {}).items():
            if isinstance(v, dict) and "overhead_us" in v:
                per = ", ".join(f"{tag}: D {e['overhead_us']:.1f} us, per call "
                                f"{e['per_call_us']:.1f} us" for tag, e in v.items()
                                if isinstance(e, dict) and "overhead_us" in e)
                print(f"dispatch check [{k}]: {per}; residual left in each timed call <= "
                      f"{v['residual_us_in_sweep']:.2f} us")
        if meta.get("standin"):
            print("*** jax_softmax provider was a STAND-IN (jax.nn); these are not jax_softmax "
                  "numbers ***")
        elif meta.get("jax_softmax_provider") == NO_KERNEL_LABEL:
            print("*** jax_softmax had no compiled kernel here: its numbers are the jnp "
                  "fallback ***")
        n_err = sum(1 for r in records if r.get("error"))
        n_fail = sum(1 for r in records if r.get("check") == "FAIL")
        outs = [base + ".json", base + ".csv"]
        if not no_plot:
            outs += plot_by_size(records, meta, base + ".png", layout, layout.plot_rows, title)
        print(f"\n{len(records)} points, {n_err} errors, {n_fail} failed checks; wrote: "
              + ", ".join(outs))
        return 1 if (n_fail or (records and n_err == len(records))) else 0
