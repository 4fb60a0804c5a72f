"""`bench softmax`: the row-length sweep. A (rows, N) tensor of fixed size, softmax (or
log-softmax) over the last axis, forward, backward and both, for every provider; the package
docstring says what is measured and how."""

from __future__ import annotations

import argparse
import functools
import itertools

from .checks import (check_rows, jax_rows_host, np_softmax, np_softmax_bwd, output_errors,
                     torch_rows_host)
from .environment import MIB, import_jax, prepare_environment, torch_cuda
from .providers import COPY_PROVIDERS, available_providers, triton_softmax_bwd, triton_softmax_fwd
from .report import LAYOUTS
from .sweep import (Sweep, add_common_args, api_under_test, calibrate, itemsize, jnp_dtype,
                    log_to_stderr, measure_in_rounds, parse_ints, resolve_common, start_results,
                    time_jax_point, torch_dtype)
from .timing import summarize, time_cuda

SOFTMAX_NS = sorted([2**k for k in range(5, 19)] + [1000, 3000, 50257])
QUICK_NS = [32, 1000, 4096, 65536]
SOFTMAX_MODES = ("fwd", "bwd", "fwdbwd")
SOFTMAX_PROVIDERS = ("jax_softmax", "jax_nn", "torch", "triton")


# What each mode must move (the meta's bytes_model), and how many passes over the tensor that is.
BYTES_MODEL = {"fwd": "read x + write y", "bwd": "read y + read dy + write dx",
               "fwdbwd": "read x + write y + read y + read dy + write dx"}
PASSES = {"fwd": 2, "bwd": 3, "fwdbwd": 5}


def softmax_bytes(mode: str, nbytes: int) -> int:
    """The bytes a mode must move for a tensor of nbytes."""
    return PASSES[mode] * nbytes


def softmax_errors(op: str, mode: str, got, x64, dy64) -> dict:
    """output_errors of a point against the float64 reference computed from its input rows x64
    (and cotangent rows dy64, None in mode fwd)."""
    is_log = op == "log_softmax"
    y64 = np_softmax(x64, log=is_log)
    dx64 = None if mode == "fwd" else np_softmax_bwd(y64, dy64, log=is_log)
    return output_errors(mode, got, y64, dx64)


def measure_jax_point(fn, op, dtype, mode, rows, n, cfg, key_seed):
    """Times one JAX provider at one point; returns a partial record."""
    jax, jnp = import_jax()
    dt = jnp_dtype(dtype)
    m = cfg["chain"]  # one distinct input set per chained call
    key = jax.random.key(key_seed)
    sets, xs, dys = [], [], []
    for i in range(m):
        k1, k2, key = jax.random.split(key, 3)
        x = (2.0 * jax.random.normal(k1, (rows, n), jnp.float32)).astype(dt)
        dy = None if mode == "fwd" else jax.random.normal(k2, (rows, n), jnp.float32).astype(dt)
        xs.append(x)
        dys.append(dy)
        if mode == "fwd":
            sets.append((x,))
        elif mode == "bwd":
            _, vjp_fn = jax.vjp(fn, x)   # residuals (y, or what the provider saves) are inputs
            sets.append((vjp_fn, dy))
        else:
            sets.append((x, dy))
    if mode == "fwd":
        call = fn
    elif mode == "bwd":
        def call(vjp_fn, dy):
            return vjp_fn(dy)[0]
    else:
        def call(x, dy):
            y, vjp_fn = jax.vjp(fn, x)
            return y, vjp_fn(dy)[0]
    r = check_rows(rows, n)
    rec, first = time_jax_point(call, sets, cfg, r)
    rec.update(arg_sets=m, chain_k=cfg["chain"])
    if cfg["check"]:
        dy64 = None if mode == "fwd" else jax_rows_host(dys[0], r)
        rec.update(softmax_errors(op, mode, first, jax_rows_host(xs[0], r), dy64))
    del sets, xs, dys, first
    return rec


def measure_torch_point(provider, op, dtype, mode, rows, n, cfg, seed):
    """Times torch or Triton at one point: a chain of K calls on K distinct input sets (as the
    JAX chains), CUDA events around the chain (time_cuda); returns a partial record."""
    torch = torch_cuda()
    tdt = torch_dtype(dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = cfg["chain"]
    xs = [(2.0 * torch.randn(rows, n, device="cuda", generator=g, dtype=torch.float32)).to(tdt)
          for _ in range(k)]
    dys = [None if mode == "fwd" else
           torch.randn(rows, n, device="cuda", generator=g, dtype=torch.float32).to(tdt)
           for _ in range(k)]
    is_log = op == "log_softmax"
    if provider == "torch":
        fwd = (lambda a: torch.log_softmax(a, -1)) if is_log else (lambda a: torch.softmax(a, -1))
        if is_log:
            def bwd(y, d):
                return torch._log_softmax_backward_data(d, y, -1, y.dtype)
        else:
            def bwd(y, d):
                return torch._softmax_backward_data(d, y, -1, y.dtype)
    else:  # triton
        if is_log:
            raise NotImplementedError("triton provider implements softmax only")
        fwd, bwd = triton_softmax_fwd, triton_softmax_bwd
    y0s = [fwd(x) for x in xs] if mode == "bwd" else None
    if mode == "fwd":
        def run():
            return [fwd(x) for x in xs]
    elif mode == "bwd":
        def run():
            return [bwd(y, d) for y, d in zip(y0s, dys)]
    else:
        def run():
            outs = []
            for x, d in zip(xs, dys):
                y = fwd(x)
                outs.append((y, bwd(y, d)))
            return outs
    times, outs = time_cuda(run, max(cfg["reps"], 50), cfg["warmup"], k)
    out = outs[0]
    rec = summarize(times)
    rec.update(chain_k=k, arg_sets=k, dispatch_residual_us=None, timing="cuda_events")
    if cfg["check"]:
        r = check_rows(rows, n)
        got = (tuple(torch_rows_host(o, r) for o in out) if mode == "fwdbwd"
               else torch_rows_host(out, r))
        dy64 = None if mode == "fwd" else torch_rows_host(dys[0], r)
        rec.update(softmax_errors(op, mode, got, torch_rows_host(xs[0], r), dy64))
    del xs, dys, y0s, out, outs
    return rec


def run_softmax(argv=None) -> int:
    """`bench softmax`: the row-length sweep; returns the exit status (Sweep.finish)."""
    p = argparse.ArgumentParser(
        prog="python -m jax_softmax bench softmax",
        description="Softmax row-length sweep at fixed tensor size (the docstring of the "
                    "jax_softmax_bench package, benchmarks/jax_softmax_bench/__init__.py, says "
                    "how it measures).")
    add_common_args(p, SOFTMAX_PROVIDERS, SOFTMAX_MODES)
    p.add_argument("--ns", nargs="+", default=None,
                   help="row lengths N (default 32..262144 powers of two + 1000, 3000, 50257)")
    p.add_argument("--op", choices=("softmax", "log_softmax"), default="softmax")
    args = p.parse_args(argv)
    prepare_environment()
    cfg = resolve_common(args, SOFTMAX_PROVIDERS, SOFTMAX_MODES)
    cfg["ns"] = parse_ints(args.ns) or (QUICK_NS if args.quick else SOFTMAX_NS)
    cfg["op"] = args.op
    log = log_to_stderr

    api, api_label, standin = api_under_test(cfg["providers"], args.standin)
    providers = available_providers(cfg["providers"], log)
    if "triton" in providers and cfg["op"] != "softmax":
        log("skipping provider triton: it implements softmax only")
        providers.remove("triton")
    meta, base = start_results("softmax", cfg, args.tag, api_label, standin, providers,
                               BYTES_MODEL, log, log_versions=("torch", "triton"))

    jax_fns = {}
    if "jax_softmax" in providers:
        jax_fns["jax_softmax"] = api.log_softmax if cfg["op"] == "log_softmax" else api.softmax
    if "jax_nn" in providers:
        jax, _ = import_jax()
        jax_fns["jax_nn"] = jax.nn.log_softmax if cfg["op"] == "log_softmax" else jax.nn.softmax
    label = {"jax_softmax": api_label or "jax_softmax"}

    big_rows = max(1, cfg["sizes_mib"][0] * MIB // (1024 * 4))
    calibrate(meta, cfg, providers, jax_fns, log=log,
              shapes={"small_1MiB": (256, 1024),
                      f"large_{cfg['sizes_mib'][0]}MiB": (big_rows, 1024)})

    point_providers = [q for q in providers if q not in COPY_PROVIDERS]
    grid = list(itertools.product(cfg["sizes_mib"], cfg["dtypes"], cfg["modes"], cfg["ns"]))
    layout = LAYOUTS["softmax"]
    sweep = Sweep(base, meta, layout, len(grid) * len(point_providers), "softmax")
    # Every provider of a grid point draws its inputs from the point's seed.
    for seed, (size_mib, dtype, mode, n) in enumerate(grid, start=1):
        rows = max(1, (size_mib * MIB) // (n * itemsize(dtype)))
        nbytes = rows * n * itemsize(dtype)
        measures = {}
        for prov in point_providers:
            if prov in jax_fns:
                measures[prov] = functools.partial(measure_jax_point, jax_fns[prov], cfg["op"],
                                                   dtype, mode, rows, n, cfg, seed)
            else:
                measures[prov] = functools.partial(measure_torch_point, prov, cfg["op"], dtype,
                                                   mode, rows, n, cfg, seed)
        if cfg["rounds"] > 1:
            sweep.bar.set(f"{size_mib}MiB {dtype} {mode} N={n}: {cfg['rounds']} rounds")
            measures = measure_in_rounds(measures, cfg["rounds"])
        for prov in point_providers:
            sweep.bar.set(f"{size_mib}MiB {dtype} {mode} N={n} {prov}")
            rec = {"bench": "softmax", "op": cfg["op"], "provider": label.get(prov, prov),
                   "provider_id": prov, "dtype": dtype, "mode": mode, "variant": None, "N": n,
                   "S": None, "shape": f"{rows}x{n}", "rows": rows, "size_mib": size_mib,
                   "bytes": softmax_bytes(mode, nbytes)}
            sweep.run_point(rec, measures[prov], f"{prov} {dtype} {mode} N={n}")
    return sweep.finish(layout.title.format(op=cfg["op"]), args.no_plot)
