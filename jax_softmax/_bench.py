"""Benchmark core for jax_softmax (softmax row-length sweep and attention softmax).

Everything reusable lives here so that ``python -m jax_softmax bench ...`` works from an
installed wheel; ``benchmarks/*.py`` in the source tree are thin scripts that call this module
(through :mod:`jax_softmax._bench_cli`).

What is measured
----------------
*Row sweep* (``run_softmax``): a ``(rows, N)`` tensor of fixed size (default 256 MiB of input,
``rows = size // (N * itemsize)``), softmax over the last axis, for N = 32 ... 262144 (powers of
two) plus 1000, 3000 and 50257, in float32 / bfloat16 / float16, in three modes:

* ``fwd``    : x -> y.                               must move: read x, write y       (2 passes)
* ``bwd``    : (y, dy) -> dx.                        must move: read y, dy, write dx  (3 passes)
* ``fwdbwd`` : (x, dy) -> (y, dx), both returned.    must move: read x, write y, read y, read dy,
  write dx (5 passes; a kernel that keeps y on chip between the two halves can beat this count,
  so "% of copy ceiling" may then exceed what a 5-pass kernel could reach).

In ``bwd`` the JAX providers' input is the function returned by ``jax.vjp`` (its residuals:
y for jax_softmax; exp(x - max) and row sums for jax.nn.softmax, the same byte count), applied
to dy inside ``jax.jit``; in ``fwdbwd`` the whole ``jax.vjp`` runs inside ``jax.jit``.

*Attention* (``run_attention``): scores ``(B, H, S, S)`` with S = 128 ... 8192, B and H chosen
so one scores tensor is about ``--sizes-mib``; ``jax_softmax.attention_softmax`` against the
jitted XLA expression it replaces (``scale*scores + bias``, ``where(mask)``, ``jax.nn.softmax``
in float32, cast back), with a padding mask ``(B,1,1,S)``, a full mask ``(1,1,S,S)``, causal,
and a ``(1,H,S,S)`` bias; modes ``fwd`` and ``fwdbwd``. Must-move bytes are the softmax passes
above plus one read of the bias and of the mask (1 byte per bool).

Providers: ``jax_softmax`` (the package), ``jax_nn`` (``jax.jit(jax.nn.softmax)``; backward is
the function returned by ``jax.vjp`` applied inside ``jax.jit``), ``torch`` (``torch.softmax``
and ``torch._softmax_backward_data``) and ``triton`` (a classic one-row-per-program fused
softmax written here, with an online-softmax loop variant for rows too long for one tile). torch
and triton run only when the JAX backend is a GPU and ``torch.cuda.is_available()``; a missing
import just skips them. The ceiling is a large device-to-device copy, measured twice:
``copy_jax`` (a jitted ``a + s`` with ``s`` a traced scalar, so XLA can neither simplify it
away nor alias the output to the input; a pure streaming read+write) and ``copy_torch``
(``dst.copy_(src)``); bytes = read + write; the ceiling is the max and both are recorded.

How every provider is timed, and how dispatch overhead is kept out
------------------------------------------------------------------
Every provider is timed the same way: a chain of K (``--chain``, default 8) calls back to back on
K distinct input sets, timed on the GPU from before the first call's kernel to after the last
one's, divided by K.

* JAX providers (``jax_softmax``, ``jax_nn``, ``copy_jax``): ONE jitted function makes the K
  calls. Distinct inputs are essential: XLA's CSE merged identical calls on shared inputs even
  across ``lax.optimization_barrier`` (seen on CPU). Consecutive calls are sequenced with
  ``lax.optimization_barrier((args_k, out_{k-1}))`` so fusion cannot reach across calls (on the
  GPU the compiled program runs the K kernels one after another). All K outputs are returned, so
  nothing is dead-code eliminated, and they are written into donated buffers (the previous
  execution's outputs), so nothing is allocated while timing. Around the chain the function reads
  the GPU's own clock (``jax_softmax_gpu_clock``, an FFI call of the package's CUDA extension: a
  one-thread kernel reading the nanosecond global timer on XLA's stream), ordered by the same
  barriers: before the first call and after every output of the last. One sample = R
  (``--pipeline``, default 20) executions enqueued back to back, then one ``block_until_ready``;
  the sample's per-call time is the executions' GPU spans summed over R*K calls. The median over
  ``--reps`` samples is reported as ``time_us``.
* torch and triton: the same K calls launched from Python between two CUDA events (the method of
  ``triton.testing.do_bench``, over a chain): before every sample a scratch buffer of 2 x L2 is
  zeroed, which flushes L2 and keeps the GPU busy while the host enqueues the timed launches, so
  host launch cost is not in the events' interval. Median over max(``--reps``, 50) samples.

Both measure the GPU from the start of the first kernel's launch to the end of the last, gaps
between the K kernels included, and leave out the host's dispatch. The JAX providers are also
timed from the host as before this clock existed (R executions pipelined, sample time /
(R*K)); that figure is stored beside every point as ``time_us_host``, with ``gpu_gap_us``, the
GPU's median idle time between one execution's last call and the next one's first (TUNING.md,
session 18, compares the two). Where the clock is missing (CPU, or no CUDA extension), the host
figure is the reported one and each record's ``timing`` says so.

This is CHECKED at the start of every run (``dispatch_check``): at a small shape (1 MiB) and at
the sweep's size, chains of K = 1, 2, 4, 8 calls are timed the same way and fitted to
T_exec = D + K*t, for the reported figure and for the host one. D (what each execution costs
beyond its calls) and the share D/K left in each per-call figure are printed and stored in the
JSON meta; every point records ``dispatch_residual_us`` = max(D)/K of the reported figure and
``dispatch_residual_pct`` (its share of the point's time). (H200, host-timed, 256 MiB softmax,
fit over K = 1..16: the fixed part per execution was 13-18 us with R = 20 and 35-90 us with
R = 5; timing each execution with its own ``block_until_ready`` carried 250-600 us.)

Every point is also checked for correctness against a float64 NumPy reference on the first and
last rows of the tensor (relative Frobenius error; ``check`` = ok / FAIL); a FAIL is reported but
still timed.

Outputs (``--out``, default ``benchmarks/results/``): ``<name>.json`` (meta: device, driver,
versions, date, ceilings, dispatch check, config; and one record per point), ``<name>.csv``,
``<name>.png``. Both files are rewritten after every point, so an interrupted run keeps what it
measured. ``<name>`` is ``softmax_<device>`` / ``attention_<device>`` unless ``--tag`` is given.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

MIB = 1 << 20

SOFTMAX_NS = sorted([2**k for k in range(5, 19)] + [1000, 3000, 50257])
QUICK_NS = [32, 1000, 4096, 65536]
ATTN_SEQS = [128, 256, 512, 1024, 2048, 4096, 8192]
QUICK_SEQS = [128, 1024]
DTYPES = ("float32", "bfloat16", "float16")
SOFTMAX_MODES = ("fwd", "bwd", "fwdbwd")
ATTN_MODES = ("fwd", "fwdbwd")
SOFTMAX_PROVIDERS = ("jax_softmax", "jax_nn", "torch", "triton")
ATTN_PROVIDERS = ("jax_softmax", "xla")
COPY_PROVIDERS = ("copy_jax", "copy_torch")
ATTN_VARIANTS = {
    # name: (bias, mask kind, causal)
    "none": (False, None, False),
    "pad_mask": (False, "pad", False),      # mask (B,1,1,S)
    "full_mask": (False, "full", False),    # mask (1,1,S,S)
    "causal": (False, None, True),
    "bias": (True, None, False),            # bias (1,H,S,S)
    "bias_pad_mask": (True, "pad", False),
    "bias_causal": (True, None, True),
    "bias_full_mask": (True, "full", False),
}
DEFAULT_ATTN_VARIANTS = ("none", "pad_mask", "full_mask", "causal", "bias")
MODE_ALIASES = {
    "forward": "fwd", "fwd": "fwd",
    "backward": "bwd", "bwd": "bwd",
    "forward+backward": "fwdbwd", "fwd+bwd": "fwdbwd", "fwdbwd": "fwdbwd", "both": "fwdbwd",
}
DTYPE_ALIASES = {"float32": "float32", "f32": "float32", "fp32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16"}
# Relative Frobenius error accepted by the sanity check (catches wrong indexing, not ulps).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-2}
STANDIN_LABEL = "jax_softmax[STAND-IN=jax.nn]"
NO_KERNEL_LABEL = "jax_softmax[NO KERNEL: jnp fallback]"


# ----------------------------------------------------------------------------------------------
# Environment: must run before JAX creates its GPU client.
# ----------------------------------------------------------------------------------------------

def prepare_environment() -> None:
    """Stop JAX from grabbing 75% of GPU memory, so torch/triton providers fit beside it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        from jax._src import xla_bridge  # private; only used for a warning
        if getattr(xla_bridge, "_backends", None):
            if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false":
                print("warning: JAX backend already initialised with preallocation; torch/triton "
                      "providers may run out of GPU memory", file=sys.stderr)
    except Exception:
        pass


def _jax():
    import jax
    import jax.numpy as jnp
    return jax, jnp


def jax_platform() -> str:
    jax, _ = _jax()
    return jax.default_backend()


def on_gpu() -> bool:
    return jax_platform() in ("gpu", "cuda", "rocm")


# ----------------------------------------------------------------------------------------------
# The API under test (real package, or a clearly labelled stand-in for development).
# ----------------------------------------------------------------------------------------------

class _StandIn:
    """jax.nn in place of jax_softmax; only for developing the benchmark while the API is absent."""

    is_standin = True

    @staticmethod
    def softmax(x, axis=-1, where=None):
        import jax
        return jax.nn.softmax(x, axis=axis, where=where)

    @staticmethod
    def log_softmax(x, axis=-1, where=None):
        import jax
        return jax.nn.log_softmax(x, axis=axis, where=where)

    @staticmethod
    def attention_softmax(scores, *, scale=1.0, bias=None, mask=None, is_causal=False):
        return xla_attention_softmax(scores, scale=scale, bias=bias, mask=mask, is_causal=is_causal)


def resolve_api(standin: bool):
    """Returns (object with softmax/log_softmax/attention_softmax, label, is_standin)."""
    try:
        import jax_softmax as api
        for name in ("softmax", "log_softmax", "attention_softmax"):
            getattr(api, name)
        # Smoke call: the package may import but have no kernels for this platform.
        _, jnp = _jax()
        np.asarray(api.softmax(jnp.arange(16, dtype=jnp.float32).reshape(2, 8)))
    except Exception as e:
        if not standin:
            raise SystemExit(
                f"jax_softmax's API cannot be imported ({type(e).__name__}: {e}).\n"
                "Build/install the package first (pip install -e . or pip install .), or pass "
                "--standin to benchmark jax.nn in its place (development of the benchmark only).")
        print(f"*** WARNING: jax_softmax API unavailable ({e}); provider 'jax_softmax' is a "
              f"STAND-IN (jax.nn) and is labelled {STANDIN_LABEL!r} ***", file=sys.stderr)
        return _StandIn, STANDIN_LABEL, True
    # Without a compiled kernel for this platform the package lowers its jnp reference formula:
    # runnable, but these are then not the kernel's numbers. The sweep stops unless --standin
    # asks for it (then the label says so). Session 48 lost a device call to this: run from the
    # source tree, `python -m jax_softmax` imported the checkout (no kernels next to it) instead
    # of the installed package, and the sweep timed the fallback against jax.nn.
    plat = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(jax_platform(), jax_platform())
    try:
        built = tuple(api.available_platforms())
    except Exception:
        built = None
    if built is not None and plat not in built:
        where = os.path.dirname(os.path.abspath(api.__file__))
        if not standin:
            raise SystemExit(
                f"jax_softmax imported from {where} has no compiled kernel for platform {plat!r} "
                f"(built: {built}): every call would time its jnp fallback.\n"
                "Run from outside the source tree so the installed package is imported, or build "
                "it (pip install .); --standin times the fallback anyway, labelled "
                f"{NO_KERNEL_LABEL!r}.")
        print(f"*** WARNING: jax_softmax has no compiled kernel for platform {plat!r} (built: "
              f"{built}); it falls back to its jnp formula, labelled {NO_KERNEL_LABEL!r} ***",
              file=sys.stderr)
        return api, NO_KERNEL_LABEL, False
    return api, "jax_softmax", False


def xla_attention_softmax(scores, *, scale=1.0, bias=None, mask=None, is_causal=False):
    """The plain XLA expression that jax_softmax.attention_softmax replaces."""
    jax, jnp = _jax()
    from jax import lax
    s = scores.astype(jnp.float32) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    big_neg = jnp.finfo(jnp.float32).min
    if mask is not None:
        s = jnp.where(mask, s, big_neg)
    if is_causal:
        S_q, S_k = s.shape[-2], s.shape[-1]
        q = lax.broadcasted_iota(jnp.int32, (S_q, S_k), 0)
        k = lax.broadcasted_iota(jnp.int32, (S_q, S_k), 1)
        s = jnp.where(k <= q, s, big_neg)
    return jax.nn.softmax(s, axis=-1).astype(scores.dtype)


# ----------------------------------------------------------------------------------------------
# Meta data
# ----------------------------------------------------------------------------------------------

def _run(cmd) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:
        return None


def _dist_version(name: str) -> str | None:
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:
        return None


def torch_cuda():
    """torch if it is importable, CUDA is available and JAX runs on a GPU too; else None."""
    if not on_gpu():
        return None
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def triton_mod():
    if torch_cuda() is None:
        return None
    try:
        import triton
        return triton
    except Exception:
        return None


def l2_bytes() -> int:
    torch = torch_cuda()
    if torch is not None:
        try:
            return int(torch.cuda.get_device_properties(0).L2_cache_size)
        except Exception:
            pass
    if on_gpu():
        kind = device_kind().lower()
        if "h200" in kind:
            return 60 * MIB
        if "h100" in kind:
            return 50 * MIB
        if "a100" in kind:
            return 40 * MIB
        return 64 * MIB
    return 32 * MIB  # CPU: roughly an L3; only used for the small-tensor warning


def device_kind() -> str:
    jax, _ = _jax()
    d = jax.devices()[0]
    return str(getattr(d, "device_kind", d.platform))


def _built_platforms():
    try:
        import jax_softmax
        return list(jax_softmax.available_platforms())
    except Exception:
        return None


def _package_path():
    try:
        import jax_softmax
        return os.path.dirname(os.path.abspath(jax_softmax.__file__))
    except Exception:
        return None


def collect_meta(api_label: str, standin: bool) -> dict:
    jax, _ = _jax()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": jax_platform(),
        "device": device_kind(),
        "device_count": jax.device_count(),
        "host": platform.node(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _dist_version("jaxlib"),
        "jax_cuda_plugin": _dist_version("jax-cuda13-plugin") or _dist_version("jax-cuda12-plugin"),
        "numpy": np.__version__,
        "jax_softmax": _dist_version("jax-softmax"),
        "jax_softmax_provider": api_label,
        "standin": standin,
        "jax_softmax_kernels": _built_platforms(),
        "jax_softmax_path": _package_path(),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "xla_python_client_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        # The tuning knobs set for this run (A/B runs differ only here).
        "jax_softmax_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("JAX_SOFTMAX_")},
        "l2_bytes": l2_bytes(),
    }
    try:
        import jaxlib
        meta["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                "clocks.max.mem", "--format=csv,noheader"])
    if smi:
        first = smi.splitlines()[0].split(",")
        meta["nvidia_smi"] = smi
        meta["gpu_name"] = first[0].strip()
        meta["driver_version"] = first[1].strip() if len(first) > 1 else None
    else:
        meta["nvidia_smi"] = None
        meta["driver_version"] = None
    try:
        import torch
        meta["torch"] = torch.__version__
        meta["torch_cuda"] = torch.version.cuda
    except Exception:
        meta["torch"] = None
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    # The caller may name the revision: the GPU machine's copy of the tree is not the checkout
    # it came from (its .git, where present, is not the built commit's).
    rev = os.environ.get("JAX_SOFTMAX_GIT_REV")
    if not rev:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = _run(["git", "-C", here, "rev-parse", "--short", "HEAD"])
        if rev and _run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"]):
            rev += "-dirty"
    meta["git"] = rev or None
    meta["timing"] = ("gpu_clock: JAX chains between two reads of the GPU's global timer, torch "
                      "and triton chains between CUDA events" if gpu_clock_available() else
                      "host: JAX chains timed from the host (no GPU clock here)")
    return meta


# ----------------------------------------------------------------------------------------------
# JAX timing: K chained calls in one jit (see module docstring).
# ----------------------------------------------------------------------------------------------

GPU_CLOCK_TARGET = "jax_softmax_gpu_clock"


def gpu_clock_available() -> bool:
    """True when the GPU's own clock can be read inside a jitted chain: JAX runs on a CUDA GPU
    and the package's CUDA extension (which holds the clock's FFI target) is built."""
    if not on_gpu():
        return False
    try:
        from jax_softmax import _ffi
        return _ffi.has_platform("cuda")
    except Exception:
        return False


def gpu_clock(after):
    """u32[2]: the GPU's nanosecond global timer (low, high word) when this call runs on XLA's
    stream, after the op that produced ``after`` (which is not read). See ffi/gpu_clock.cu."""
    jax, jnp = _jax()
    return jax.ffi.ffi_call(GPU_CLOCK_TARGET, jax.ShapeDtypeStruct((2,), jnp.uint32),
                            has_side_effect=True)(after)


def make_chain(fn, k: int, clock=None):
    """chain(arg_sets) -> (list of K outputs, stamps); call i uses arg_sets[i] (K distinct input
    sets). With ``clock`` (gpu_clock), stamps is u32[2, 2]: the GPU clock read just before the
    first call and just after the last one; otherwise None.

    Distinct inputs are what keep the K calls from collapsing: XLA's CSE merges identical calls
    on the same buffers even across lax.optimization_barrier (its expander turns barriers into
    control dependencies, and CSE then merged the calls; seen with jaxlib 0.10 on CPU). The
    barriers order the calls and keep fusion from reaching across them (on the GPU they survive
    into the compiled program: one kernel after the other); they also put the first clock read
    before the first call and the second after every output of the last."""
    _, jnp = _jax()
    from jax import lax

    def chain(arg_sets):
        assert len(arg_sets) == k, (len(arg_sets), k)
        outs = []
        prev = None
        start = None
        for i in range(k):
            args = arg_sets[i]
            if i == 0 and clock is not None:
                start = clock(jnp.zeros((), jnp.uint32))
                args, start = lax.optimization_barrier((args, start))
            if prev is not None:
                args, _ = lax.optimization_barrier((args, prev))
            out = fn(*args)
            outs.append(out)
            prev = out
        if clock is None:
            return outs, None
        _, after_last = lax.optimization_barrier((prev, jnp.zeros((), jnp.uint32)))
        return outs, jnp.stack([start, clock(after_last)])

    return chain


# ----------------------------------------------------------------------------------------------
# GPU timelines (jax.profiler traces): scripts/profile_cases.py `trace`, bench_train_step --profile
# ----------------------------------------------------------------------------------------------

def gpu_timeline(trace_dir: str) -> list:
    """(start ns, duration ns, name) of every event on the GPU's streams in the newest
    jax.profiler trace under trace_dir, in start order; empty where the trace has no GPU (CPU)."""
    import glob

    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return []
    events = []
    for plane in ProfileData.from_file(files[-1]).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    events.sort()
    return events


def timeline_summary(events: list, units: int, top: int = 12) -> dict:
    """A GPU timeline of `units` repetitions (training steps, chained calls), per repetition: the
    span from the first event's start to the last one's end, the time some kernel runs (busy: the
    union of the events) and the rest (idle), the time in jax_softmax's own kernels (names that
    contain "jax_softmax", as the mangled ones do), and the `top` kernels by time (launches and
    us). Empty for an empty timeline."""
    if not events or units < 1:
        return {}
    ends = [s + d for s, d, _ in events]
    busy, start, end = 0, events[0][0], ends[0]
    for (s, _, _), e in zip(events[1:], ends[1:]):
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    span = max(ends) - events[0][0]
    per_name = {}
    for _, d, name in events:
        c = per_name.setdefault(name, [0, 0])
        c[0] += 1
        c[1] += d
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"units": units, "span_us": span / 1e3 / units, "busy_us": busy / 1e3 / units,
            "idle_us": (span - busy) / 1e3 / units,
            "jax_softmax_us": sum(t for n, (_, t) in per_name.items() if "jax_softmax" in n) / 1e3 / units,
            "kernels": [{"name": n, "launches": c / units, "us": t / 1e3 / units}
                        for n, (c, t) in ranked]}


_DUMP_COUNT = 0


def lower_chain(fn, arg_sets, k: int, donate: bool = True, clock=None):
    """(lowered, bufs): the jitted chain of K calls (make_chain), lowered for arg_sets; the
    executable returns (outputs, stamps). With donate, it takes (arg_sets, bufs) and writes its
    outputs into bufs (zeros of the outputs' shapes to start with; afterwards, the previous
    execution's outputs); without, it takes arg_sets alone and bufs is None. The stamps are never
    donated, so every execution's stay readable."""
    jax, _ = _jax()
    chain = make_chain(fn, k, clock)
    if not donate:
        return jax.jit(chain).lower(arg_sets), None
    bufs = jax.tree.map(lambda sd: jax.numpy.zeros(sd.shape, sd.dtype),
                        jax.eval_shape(chain, arg_sets)[0])
    jitted = jax.jit(lambda sets, out_bufs: chain(sets), donate_argnums=1, keep_unused=True)
    return jitted.lower(arg_sets, bufs), bufs


def _stamp_ns(stamps) -> tuple[int, int]:
    a = np.asarray(stamps).astype(np.uint64)
    t = a[:, 0] | (a[:, 1] << np.uint64(32))
    return int(t[0]), int(t[1])


class ChainTiming:
    """What time_jax measured, per call, in us. ``host``: host-timed samples; ``span``: GPU-clock
    samples or None; ``gap``: median idle time on the GPU between one execution's last call and
    the next execution's first, per sample (None without the clock); ``times``: the samples the
    benchmark reports (the GPU span where the clock is used, else the host figure)."""

    def __init__(self, host, span, gap, first, compile_s):
        self.host, self.span, self.gap = host, span, gap
        self.first, self.compile_s = first, compile_s

    @property
    def times(self):
        return self.span if self.span is not None else self.host

    @property
    def method(self) -> str:
        return "gpu_clock" if self.span is not None else "host"

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def time_jax(fn, arg_sets, k: int, reps: int, warmup: int, on_first=None, pipeline: int = 20,
             donate=None, clock=None) -> ChainTiming:
    """Times K chained calls of fn per execution (the module docstring says why this way).

    One sample = ``pipeline`` (R) executions enqueued back to back, then one
    ``block_until_ready``; host per-call time = sample / (R*K). With the GPU clock
    (``clock=None`` means: where gpu_clock_available()), every execution also reads the GPU's
    timer before its first call and after its last (make_chain); the spans over R*K calls are
    the GPU-side per-call time, the figure reported. Both are returned. The outputs are written
    into donated buffers (the previous execution's outputs, passed back in with donate_argnums
    and keep_unused=True, so XLA aliases them to the results), so memory stays at one
    execution's worth and no output is allocated while timing.
    ``JAX_SOFTMAX_BENCH_NO_DONATE=1`` turns donation off for comparison."""
    jax, _ = _jax()
    if donate is None:
        donate = not os.environ.get("JAX_SOFTMAX_BENCH_NO_DONATE")
    if clock is None:
        clock = gpu_clock_available()
    lowered, bufs = lower_chain(fn, arg_sets, k, donate, gpu_clock if clock else None)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    dump = os.environ.get("JAX_SOFTMAX_BENCH_DUMP_HLO")
    if dump:  # for inspecting what XLA made of the chain (fusions, copies, CSE)
        os.makedirs(dump, exist_ok=True)
        global _DUMP_COUNT
        _DUMP_COUNT += 1
        with open(os.path.join(dump, f"chain_{_DUMP_COUNT:04d}.txt"), "w") as f:
            f.write(compiled.as_text())

    def run(bufs):
        return compiled(arg_sets, bufs) if donate else compiled(arg_sets)

    outs, _ = run(bufs)
    jax.block_until_ready(outs)
    first = on_first(outs[0]) if on_first is not None else None
    if not donate:
        del outs
        outs = None
    for _ in range(warmup):
        outs, _ = run(outs)
    jax.block_until_ready(outs)
    r = max(1, int(pipeline))
    host, span, gap = [], [], []
    for _ in range(reps):
        stamps = []
        t0 = time.perf_counter()
        for _ in range(r):
            outs, st = run(outs)
            stamps.append(st)
        jax.block_until_ready(outs)
        host.append((time.perf_counter() - t0) * 1e6 / (r * k))
        if clock:
            ns = [_stamp_ns(st) for st in stamps]
            span.append(sum(b - a for a, b in ns) / 1e3 / (r * k))
            gaps = [c - b for (_, b), (c, _) in zip(ns, ns[1:])]
            gap.append(statistics.median(gaps) / 1e3 if gaps else float("nan"))
    del outs, bufs
    return ChainTiming(host, span if clock else None, gap if clock else None, first, compile_s)


# ----------------------------------------------------------------------------------------------
# CUDA-event timing for torch / triton (the method of triton.testing.do_bench, over a chain).
# ----------------------------------------------------------------------------------------------

def time_cuda(fn, reps: int, warmup: int, k: int = 1):
    """Per-call us samples of ``fn``, which makes K calls back to back (on K distinct input
    sets, as the JAX chains do): CUDA events around fn(), divided by K. Before every sample a
    scratch buffer of 2 x L2 is zeroed, which flushes L2 and keeps the GPU busy while the host
    enqueues the timed launches, so host launch cost is not in the events' interval."""
    torch = torch_cuda()
    flush = torch.empty(2 * l2_bytes(), dtype=torch.int8, device="cuda")
    out = fn()
    torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 / k for s, e in zip(starts, ends)]
    del flush
    return times, out


# ----------------------------------------------------------------------------------------------
# Triton: classic fused softmax, one row per program (own code).
# ----------------------------------------------------------------------------------------------

TRITON_TILE_MAX = 16384   # rows up to this length live in registers in one tile
TRITON_LOOP_BLOCK = 4096  # longer rows: online-softmax loop over tiles of this size
_TRITON_KERNELS = None


def _triton_kernels():
    global _TRITON_KERNELS
    if _TRITON_KERNELS is not None:
        return _TRITON_KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def fwd_tile(X, Y, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        msk = cols < N
        x = tl.load(X + row * stride + cols, mask=msk, other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        y = e / tl.sum(e, axis=0)
        tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=msk)

    @triton.jit
    def fwd_loop(X, Y, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        xrow = X + row * stride
        yrow = Y + row * stride
        cols = tl.arange(0, BLOCK)
        m_i = tl.full([BLOCK], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            offs = start + cols
            x = tl.load(xrow + offs, mask=offs < N, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m_i, x)
            l_i = l_i * tl.exp(m_i - m_new) + tl.exp(x - m_new)
            m_i = m_new
        m = tl.max(m_i, axis=0)
        l = tl.sum(l_i * tl.exp(m_i - m), axis=0)
        inv = 1.0 / l
        for start in range(0, N, BLOCK):
            offs = start + cols
            msk = offs < N
            x = tl.load(xrow + offs, mask=msk, other=-float("inf")).to(tl.float32)
            tl.store(yrow + offs, (tl.exp(x - m) * inv).to(Y.dtype.element_ty), mask=msk)

    @triton.jit
    def bwd_tile(Y, DY, DX, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        msk = cols < N
        y = tl.load(Y + row * stride + cols, mask=msk, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride + cols, mask=msk, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=0)
        tl.store(DX + row * stride + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=msk)

    @triton.jit
    def bwd_loop(Y, DY, DX, stride, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            offs = start + cols
            msk = offs < N
            y = tl.load(Y + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=0)
        for start in range(0, N, BLOCK):
            offs = start + cols
            msk = offs < N
            y = tl.load(Y + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride + offs, mask=msk, other=0.0).to(tl.float32)
            tl.store(DX + row * stride + offs, (y * (dy - dot)).to(DX.dtype.element_ty), mask=msk)

    _TRITON_KERNELS = {"fwd_tile": fwd_tile, "fwd_loop": fwd_loop,
                       "bwd_tile": bwd_tile, "bwd_loop": bwd_loop}
    return _TRITON_KERNELS


def _triton_config(n: int):
    import triton
    block = triton.next_power_of_2(n)
    if block <= TRITON_TILE_MAX:
        return "tile", block, max(1, min(16, block // 256))
    return "loop", TRITON_LOOP_BLOCK, 8


def triton_softmax_fwd(x):
    torch = torch_cuda()
    rows, n = x.shape
    y = torch.empty_like(x)
    kind, block, warps = _triton_config(n)
    _triton_kernels()["fwd_" + kind][(rows,)](x, y, x.stride(0), n, BLOCK=block, num_warps=warps)
    return y


def triton_softmax_bwd(y, dy):
    torch = torch_cuda()
    rows, n = y.shape
    dx = torch.empty_like(y)
    kind, block, warps = _triton_config(n)
    _triton_kernels()["bwd_" + kind][(rows,)](y, dy, dx, y.stride(0), n, BLOCK=block,
                                              num_warps=warps)
    return dx


# ----------------------------------------------------------------------------------------------
# References and checks
# ----------------------------------------------------------------------------------------------

def np_softmax(x64, log=False):
    m = np.max(x64, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    z = x64 - m
    e = np.exp(z)
    s = np.sum(e, axis=-1, keepdims=True)
    return z - np.log(s) if log else e / s


def np_softmax_bwd(y64, dy64, log=False):
    if log:  # y = log_softmax: dx = dy - exp(y) * sum(dy)
        return dy64 - np.exp(y64) * np.sum(dy64, axis=-1, keepdims=True)
    return y64 * (dy64 - np.sum(y64 * dy64, axis=-1, keepdims=True))


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("nan")
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def check_rows(rows: int, n: int) -> int:
    """Rows sampled at each end of the tensor for the correctness check."""
    return max(1, min(max(rows // 2, 1), (1 << 18) // max(n, 1)))


def jax_rows_host(a, r):
    """First r and last r rows of a (.., N) JAX array as float64 NumPy."""
    _, jnp = _jax()
    a2 = a.reshape(-1, a.shape[-1])
    if a2.shape[0] <= 2 * r:
        sel = a2
    else:
        sel = jnp.concatenate([a2[:r], a2[-r:]])
    return np.asarray(sel.astype(jnp.float32)).astype(np.float64)


def torch_rows_host(t, r):
    torch = torch_cuda()
    t2 = t.reshape(-1, t.shape[-1])
    sel = t2 if t2.shape[0] <= 2 * r else torch.cat([t2[:r], t2[-r:]])
    return sel.float().cpu().numpy().astype(np.float64)


# ----------------------------------------------------------------------------------------------
# Small utilities
# ----------------------------------------------------------------------------------------------

def jnp_dtype(name):
    _, jnp = _jax()
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def itemsize(name) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


def torch_dtype(name):
    torch = torch_cuda()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def free_memory():
    gc.collect()
    torch = torch_cuda()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def summarize(times):
    times = sorted(times)
    med = statistics.median(times)
    p10 = times[int(0.1 * (len(times) - 1))]
    p90 = times[int(math.ceil(0.9 * (len(times) - 1)))]
    return {"time_us": med, "time_us_min": times[0], "time_us_p10": p10, "time_us_p90": p90,
            "spread_pct": 100.0 * (p90 - p10) / med if med > 0 else None, "reps": len(times)}


def chain_record(t) -> dict:
    """A record's timing fields from a ChainTiming: summarize(t.times) (the reported figure),
    the host-timed median beside it, the GPU's median idle time between executions, and the
    method ("gpu_clock" or "host")."""
    rec = summarize(t.times)
    rec.update(time_us_host=statistics.median(t.host), timing=t.method, compile_s=t.compile_s,
               gpu_gap_us=statistics.median(t.gap) if t.gap else None)
    return rec


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


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_") or "device"


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


# ----------------------------------------------------------------------------------------------
# Ceilings and the dispatch check
# ----------------------------------------------------------------------------------------------

def measure_ceilings(copy_mib: int, providers, k: int, reps: int, warmup: int, log=print,
                     pipeline: int = 20) -> dict:
    jax, jnp = _jax()
    res = {"copy_mib": copy_mib}
    nbytes = copy_mib * MIB
    n = nbytes // 4
    if "copy_jax" in providers:
        try:
            a = jax.random.normal(jax.random.key(7), (n,), jnp.float32)
            s = jnp.zeros((), jnp.float32)
            sets = tuple((a if i == 0 else a + float(i), s) for i in range(k))
            t = time_jax(lambda v, c: v + c, sets, k, reps, warmup, pipeline=pipeline)
            st = chain_record(t)
            res["copy_jax_gbps"] = 2 * nbytes / (st["time_us"] * 1e-6) / 1e9
            res["copy_jax_time_us"] = st["time_us"]
            res["copy_jax_time_us_host"] = st["time_us_host"]
            res["copy_jax_method"] = (f"jit(a + s), s a traced scalar; chain K={k}, "
                                      f"{pipeline} executions pipelined per sample; timed by "
                                      f"{t.method}")
            del a, sets, t
        except Exception as e:
            res["copy_jax_error"] = f"{type(e).__name__}: {e}"
        free_memory()
    torch = torch_cuda()
    if "copy_torch" in providers and torch is not None:
        try:
            srcs = [torch.randn(n, device="cuda", dtype=torch.float32) for _ in range(k)]
            dsts = [torch.empty_like(a) for a in srcs]

            def copies():
                for d, a in zip(dsts, srcs):
                    d.copy_(a)

            times, _ = time_cuda(copies, max(reps, 50), warmup, k)
            st = summarize(times)
            res["copy_torch_gbps"] = 2 * nbytes / (st["time_us"] * 1e-6) / 1e9
            res["copy_torch_time_us"] = st["time_us"]
            res["copy_torch_method"] = f"dst.copy_(src), K={k} pairs back to back, CUDA events"
            del srcs, dsts
        except Exception as e:
            res["copy_torch_error"] = f"{type(e).__name__}: {e}"
        free_memory()
    vals = [v for key, v in res.items() if key.endswith("_gbps")]
    res["ceiling_gbps"] = max(vals) if vals else None
    log("copy ceiling: " + ", ".join(f"{key[:-5]} {v:.0f} GB/s" for key, v in res.items()
                                      if key.endswith("_gbps") and key != "ceiling_gbps")
        + (f"  -> ceiling {res['ceiling_gbps']:.0f} GB/s" if vals else "  (none measured)"))
    return res


CHECK_KS = (1, 2, 4, 8)


def _fit_chain(tk: dict) -> tuple[float, float]:
    """Least-squares fit of {K: T_K} to T_K = D + K*t; returns (t, D)."""
    ks = list(tk)
    mk = sum(ks) / len(ks)
    mt = sum(tk.values()) / len(ks)
    t = sum((kk - mk) * (tk[kk] - mt) for kk in ks) / sum((kk - mk) ** 2 for kk in ks)
    return t, mt - t * mk


def dispatch_check(fns: dict, k: int, reps: int, warmup: int, log=print, shapes=None,
                   pipeline: int = 20) -> dict:
    """Fixed cost per jitted execution (D) vs per-call time (t), at a small and a large shape.

    For K in CHECK_KS a chain of K calls (K distinct float32 inputs) is timed; the medians are
    fitted by least squares to T_K = D + K*t, once for the reported figure (the GPU clock's span
    where it is used) and once for the host-timed figure. D is what each execution adds beyond
    its calls: for the host figure, dispatch, synchronisation and the GPU's idle time between
    executions; for the GPU span, the clock reads and the first call's launch after the first
    read. In the sweep it is spread over K calls, so each per-call figure carries D/K; the
    residual stored with every point is max(D of the reported figure over the shapes)/K."""
    jax, jnp = _jax()
    shapes = shapes or {"small_1MiB": (256, 1024)}
    res = {"chain_ks": list(CHECK_KS), "sweep_chain_k": k, "dtype": "float32", "shapes": {}}
    for tag, shape in shapes.items():
        res["shapes"][tag] = list(shape)
        xs = [jax.random.normal(jax.random.key(3 + i), shape, jnp.float32)
              for i in range(max(CHECK_KS))]
        nbytes = 2 * math.prod(shape) * 4
        for name, fn in fns.items():
            entry = res.setdefault(name, {})
            try:
                runs = {kk: time_jax(fn, tuple((x,) for x in xs[:kk]), kk, max(reps, 10), warmup,
                                     pipeline=pipeline) for kk in CHECK_KS}
                tk = {kk: r.median * kk for kk, r in runs.items()}
                hk = {kk: statistics.median(r.host) * kk for kk, r in runs.items()}
                t, d = _fit_chain(tk)
                th, dh = _fit_chain(hk)
                method = runs[CHECK_KS[0]].method
                entry[tag] = {"timing": method, "chain_us": {str(kk): v for kk, v in tk.items()},
                              "per_call_us": t, "overhead_us": d,
                              "host_chain_us": {str(kk): v for kk, v in hk.items()},
                              "host_per_call_us": th, "host_overhead_us": dh,
                              "fwd_gbps_from_slope": nbytes / (t * 1e-6) / 1e9 if t > 0 else None}
                log(f"dispatch check [{name}] {tag} {tuple(shape)} f32, {method}: chain of K "
                    "calls " + ", ".join(f"K={kk}: {v:.0f}" for kk, v in tk.items())
                    + f" us -> per call {t:.1f} us, fixed per execution D = {d:.1f} us "
                    f"(~{max(d, 0) / k:.2f} us per call at K={k})"
                    + ("" if method == "host" else
                       f"; host-timed: per call {th:.1f} us, D = {dh:.1f} us"))
            except Exception as e:
                entry[tag] = {"error": f"{type(e).__name__}: {e}"}
                log(f"dispatch check [{name}] {tag} failed: {e}")
        del xs
        free_memory()
    for name in fns:
        ds = [v["overhead_us"] for v in res.get(name, {}).values()
              if isinstance(v, dict) and "overhead_us" in v]
        if ds:
            res[name]["overhead_us"] = max(ds)
            res[name]["residual_us_in_sweep"] = max(max(ds), 0.0) / k
    return res


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------

CSV_FIELDS = ["bench", "op", "provider", "dtype", "mode", "variant", "N", "S", "shape",
              "size_mib", "bytes", "time_us", "time_us_min", "time_us_p10", "time_us_p90",
              "time_us_host", "timing", "gpu_gap_us",
              "spread_pct", "reps", "gbps", "pct_of_ceiling", "speedup_vs_baseline", "baseline",
              "chain_k", "arg_sets", "dispatch_residual_us", "dispatch_residual_pct",
              "compile_s", "rel_err", "rel_err_dx", "check", "error"]


def write_outputs(path_base: str, meta: dict, records: list) -> None:
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


# ----------------------------------------------------------------------------------------------
# Common argument handling
# ----------------------------------------------------------------------------------------------

def default_out_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    if os.path.isdir(os.path.join(repo, "benchmarks")):
        return os.path.join(repo, "benchmarks", "results")
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
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the copy-ceiling buffer (default 1024; quick 256 GPU / 16 CPU)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--standin", action="store_true",
                   help="if jax_softmax's API does not import, time jax.nn in its place, labelled "
                        "as a stand-in; if it has no compiled kernel for this platform, time its "
                        "jnp fallback, labelled so (developing the benchmark only)")


def resolve_common(args, providers, modes, quick_sizes_gpu=64, quick_sizes_cpu=4):
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
    cfg["copy_mib"] = args.copy_mib or ((256 if gpu else 16) if args.quick else 1024)
    cfg["check"] = not args.no_check
    cfg["quick"] = bool(args.quick)
    cfg["out"] = args.out or default_out_dir()
    if cfg["chain"] < 1 or cfg["reps"] < 1:
        raise SystemExit("--chain and --reps must be >= 1")
    return cfg


def available_providers(requested, log) -> list:
    out = []
    for p in requested:
        if p in ("torch", "copy_torch") and torch_cuda() is None:
            log(f"skipping provider {p}: needs torch with CUDA and JAX on a GPU")
            continue
        if p == "triton" and triton_mod() is None:
            log("skipping provider triton: needs triton, torch with CUDA and JAX on a GPU")
            continue
        out.append(p)
    return out


def _warn_l2(size_mib, log):
    if on_gpu() and size_mib * MIB < 2 * l2_bytes():
        log(f"note: {size_mib} MiB tensors are under 2x L2 ({l2_bytes() / MIB:.0f} MiB); JAX "
            "gives each chained call its own inputs, but GB/s at this size partly measures the "
            "cache")


# ----------------------------------------------------------------------------------------------
# Row-length sweep
# ----------------------------------------------------------------------------------------------

def softmax_bytes(mode: str, nbytes: int) -> int:
    return {"fwd": 2, "bwd": 3, "fwdbwd": 5}[mode] * nbytes


def _jax_softmax_point(fn, op, dtype, mode, rows, n, cfg, key_seed):
    """Times one JAX provider at one point; returns a partial record."""
    jax, jnp = _jax()
    dt = jnp_dtype(dtype)
    nbytes = rows * n * itemsize(dtype)
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

    def host_rows(out):  # copied before the output buffers are donated to the next execution
        return jax.tree.map(lambda a: jax_rows_host(a, r), out) if cfg["check"] else None

    t = time_jax(call, tuple(sets), cfg["chain"], cfg["reps"], cfg["warmup"],
                 on_first=host_rows, pipeline=cfg["pipeline"])
    first = t.first
    rec = chain_record(t)
    rec.update(arg_sets=m, chain_k=cfg["chain"])
    if cfg["check"]:
        log = op == "log_softmax"
        x64 = jax_rows_host(xs[0], r)
        y64 = np_softmax(x64, log=log)
        if mode == "fwd":
            rec["rel_err"] = rel_err(first, y64)
        else:
            dy64 = jax_rows_host(dys[0], r)
            dx64 = np_softmax_bwd(y64, dy64, log=log)
            if mode == "bwd":
                rec["rel_err_dx"] = rel_err(first, dx64)
            else:
                rec["rel_err"] = rel_err(first[0], y64)
                rec["rel_err_dx"] = rel_err(first[1], dx64)
    del sets, xs, dys, first
    return rec


def _torch_softmax_point(provider, op, dtype, mode, rows, n, cfg, seed):
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
    log = op == "log_softmax"
    if provider == "torch":
        fwd = (lambda a: torch.log_softmax(a, -1)) if log else (lambda a: torch.softmax(a, -1))
        if log:
            def bwd(y, d):
                return torch._log_softmax_backward_data(d, y, -1, y.dtype)
        else:
            def bwd(y, d):
                return torch._softmax_backward_data(d, y, -1, y.dtype)
    else:  # triton
        if log:
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
        x64 = torch_rows_host(xs[0], r)
        y64 = np_softmax(x64, log=log)
        if mode == "fwd":
            rec["rel_err"] = rel_err(torch_rows_host(out, r), y64)
        else:
            dx64 = np_softmax_bwd(y64, torch_rows_host(dys[0], r), log=log)
            if mode == "bwd":
                rec["rel_err_dx"] = rel_err(torch_rows_host(out, r), dx64)
            else:
                rec["rel_err"] = rel_err(torch_rows_host(out[0], r), y64)
                rec["rel_err_dx"] = rel_err(torch_rows_host(out[1], r), dx64)
    del xs, dys, y0s, out, outs
    return rec


def _judge(rec, dtype):
    errs = [rec.get(k) for k in ("rel_err", "rel_err_dx") if k in rec]
    if not errs:
        rec["check"] = "skip"
        return
    tol = TOLERANCE[dtype]
    rec["check"] = "ok" if all(e is not None and e == e and e <= tol for e in errs) else "FAIL"


def run_softmax(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jax_softmax bench softmax",
        description="Softmax row-length sweep at fixed tensor size (see module docstring of "
                    "jax_softmax._bench for the method).")
    add_common_args(p, SOFTMAX_PROVIDERS, SOFTMAX_MODES)
    p.add_argument("--ns", nargs="+", default=None,
                   help="row lengths N (default 32..262144 powers of two + 1000, 3000, 50257)")
    p.add_argument("--op", choices=("softmax", "log_softmax"), default="softmax")
    args = p.parse_args(argv)
    prepare_environment()
    cfg = resolve_common(args, SOFTMAX_PROVIDERS, SOFTMAX_MODES)
    cfg["ns"] = parse_ints(args.ns) or (QUICK_NS if args.quick else SOFTMAX_NS)
    cfg["op"] = args.op
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    api, api_label, standin = (None, None, False)
    if "jax_softmax" in cfg["providers"]:
        api, api_label, standin = resolve_api(args.standin)
    providers = available_providers(cfg["providers"], log)
    if "triton" in providers and cfg["op"] != "softmax":
        log("skipping provider triton: it implements softmax only")
        providers.remove("triton")
    meta = collect_meta(api_label or "jax_softmax (not run)", standin)
    meta["bench"] = "softmax"
    meta["config"] = {k: v for k, v in cfg.items()}
    meta["providers_run"] = providers
    meta["bytes_model"] = {"fwd": "read x + write y", "bwd": "read y + read dy + write dx",
                           "fwdbwd": "read x + write y + read y + read dy + write dx"}
    name = args.tag or f"softmax_{slug(meta['device'])}"
    base = os.path.join(cfg["out"], name)
    log(f"device: {meta['device']} ({meta['platform']}), jax {meta['jax']}, torch "
        f"{meta.get('torch')}, triton {meta.get('triton')}; writing {base}.{{json,csv,png}}")

    jax_fns = {}
    if "jax_softmax" in providers:
        jax_fns["jax_softmax"] = api.log_softmax if cfg["op"] == "log_softmax" else api.softmax
    if "jax_nn" in providers:
        import jax
        jax_fns["jax_nn"] = jax.nn.log_softmax if cfg["op"] == "log_softmax" else jax.nn.softmax
    label = {"jax_softmax": api_label or "jax_softmax"}

    meta["ceilings"] = measure_ceilings(cfg["copy_mib"], providers, cfg["chain"], cfg["reps"],
                                        cfg["warmup"], log, pipeline=cfg["pipeline"])
    big_rows = max(1, cfg["sizes_mib"][0] * MIB // (1024 * 4))
    meta["dispatch_check"] = dispatch_check(
        jax_fns, cfg["chain"], cfg["reps"], cfg["warmup"], log, pipeline=cfg["pipeline"],
        shapes={"small_1MiB": (256, 1024), f"large_{cfg['sizes_mib'][0]}MiB": (big_rows, 1024)})
    records = []
    write_outputs(base, meta, records)

    point_providers = [q for q in providers if q not in COPY_PROVIDERS]
    total = (len(cfg["sizes_mib"]) * len(cfg["dtypes"]) * len(cfg["modes"]) * len(cfg["ns"])
             * len(point_providers))
    meta["points_planned"] = total
    bar = Progress(total, "softmax")
    t_start = time.time()
    seed = 0
    for size_mib in cfg["sizes_mib"]:
        _warn_l2(size_mib, bar.write)
        for dtype in cfg["dtypes"]:
            for mode in cfg["modes"]:
                for n in cfg["ns"]:
                    rows = max(1, (size_mib * MIB) // (n * itemsize(dtype)))
                    nbytes = rows * n * itemsize(dtype)
                    seed += 1
                    for prov in point_providers:
                        bar.set(f"{size_mib}MiB {dtype} {mode} N={n} {prov}")
                        rec = {"bench": "softmax", "op": cfg["op"],
                               "provider": label.get(prov, prov), "provider_id": prov,
                               "dtype": dtype, "mode": mode, "variant": None, "N": n, "S": None,
                               "shape": f"{rows}x{n}", "rows": rows, "size_mib": size_mib,
                               "bytes": softmax_bytes(mode, nbytes)}
                        if prov in jax_fns:
                            measure = functools.partial(_jax_softmax_point, jax_fns[prov],
                                                        cfg["op"], dtype, mode, rows, n, cfg, seed)
                        else:
                            measure = functools.partial(_torch_softmax_point, prov, cfg["op"],
                                                        dtype, mode, rows, n, cfg, seed)
                        _run_point(rec, measure, f"{prov} {dtype} {mode} N={n}", meta, bar,
                                   records, base, "jax_nn",
                                   ("op", "dtype", "mode", "N", "size_mib"), t_start)
    bar.close()
    return _finish(base, meta, records, "N", ("op", "size_mib", "dtype", "mode"),
                   ("dtype",), ("mode",), f"{cfg['op']}: GB/s vs row length N", args.no_plot)


def _run_point(rec, measure, what, meta, bar, records, base, baseline, group_keys, t_start):
    """Measures one point of a sweep into `rec` and records it; never raises.

    `measure()` returns the timing fields. Adds the dispatch residual (JAX providers only: the
    dispatch check holds nothing for the others), GB/s and the correctness verdict, or the error;
    then appends the record, recomputes ceiling/baseline figures and rewrites JSON/CSV so an
    interrupted sweep keeps what it measured; while records are fewer than the planned points,
    the meta's `partial` says how far the sweep got (a killed run's file keeps it)."""
    try:
        rec.update(measure())
        dc = meta["dispatch_check"].get(rec["provider_id"], {})
        if "residual_us_in_sweep" in dc:
            rec["dispatch_residual_us"] = dc["residual_us_in_sweep"]
            rec["dispatch_residual_pct"] = 100.0 * dc["residual_us_in_sweep"] / rec["time_us"]
        rec["gbps"] = rec["bytes"] / (rec["time_us"] * 1e-6) / 1e9
        _judge(rec, rec["dtype"])
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
    finalize_records(records, meta["ceilings"].get("ceiling_gbps"), baseline, group_keys)
    meta["elapsed_s"] = time.time() - t_start
    if len(records) < meta["points_planned"]:
        meta["partial"] = (f"{len(records)} of {meta['points_planned']} points: "
                           "the sweep had not finished when this file was written")
    else:
        meta.pop("partial", None)
    write_outputs(base, meta, records)
    bar.update()


def _finish(base, meta, records, xkey, group_keys, row_keys, col_keys, title, no_plot) -> int:
    print(format_table(records, xkey, group_keys, f"{title}  [{meta['device']}]"))
    ceil = meta.get("ceilings") or {}
    print(f"\ncopy ceiling: {ceil.get('ceiling_gbps') and round(ceil['ceiling_gbps'])} GB/s "
          f"(copy_jax {ceil.get('copy_jax_gbps') and round(ceil['copy_jax_gbps'])}, copy_torch "
          f"{ceil.get('copy_torch_gbps') and round(ceil['copy_torch_gbps'])})")
    for k, v in (meta.get("dispatch_check") or {}).items():
        if isinstance(v, dict) and "overhead_us" in v:
            per = ", ".join(f"{tag}: D {e['overhead_us']:.1f} us, per call "
                            f"{e['per_call_us']:.1f} us"
                            for tag, e in v.items() if isinstance(e, dict) and "overhead_us" in e)
            print(f"dispatch check [{k}]: {per}; residual left in each timed call <= "
                  f"{v['residual_us_in_sweep']:.2f} us")
    if meta.get("standin"):
        print("*** jax_softmax provider was a STAND-IN (jax.nn); these are not jax_softmax "
              "numbers ***")
    elif meta.get("jax_softmax_provider") == NO_KERNEL_LABEL:
        print("*** jax_softmax had no compiled kernel here: its numbers are the jnp fallback ***")
    n_err = sum(1 for r in records if r.get("error"))
    n_fail = sum(1 for r in records if r.get("check") == "FAIL")
    outs = [base + ".json", base + ".csv"]
    if not no_plot:
        sizes = sorted({r.get("size_mib") for r in records})
        for size in sizes:
            rs = [r for r in records if r.get("size_mib") == size]
            png = base + (f"_{size}MiB" if len(sizes) > 1 else "") + ".png"
            if plot_results(rs, meta, png, xkey, row_keys, col_keys,
                            f"{title}, {size} MiB tensors"):
                outs.append(png)
    print(f"\n{len(records)} points, {n_err} errors, {n_fail} failed checks; wrote: "
          + ", ".join(outs))
    return 1 if (n_fail or (records and n_err == len(records))) else 0


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

def attention_shape(s: int, size_mib: int, dtype: str, heads: int):
    per_head = s * s * itemsize(dtype)
    target = size_mib * MIB
    b = target // (heads * per_head)
    if b >= 1:
        return int(b), heads
    return 1, int(max(1, target // per_head))


def run_attention(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jax_softmax bench attention",
        description="attention_softmax on (B,H,S,S) scores vs the XLA expression it replaces.")
    add_common_args(p, ATTN_PROVIDERS, ATTN_MODES)
    p.add_argument("--seqs", nargs="+", default=None,
                   help="sequence lengths S (default 128..8192 powers of two)")
    p.add_argument("--variants", nargs="+", default=None,
                   help=f"from {list(ATTN_VARIANTS)} (default {list(DEFAULT_ATTN_VARIANTS)})")
    p.add_argument("--heads", type=int, default=16, help="H when the size allows (default 16)")
    p.add_argument("--scale", type=float, default=0.125)
    args = p.parse_args(argv)
    prepare_environment()
    cfg = resolve_common(args, ATTN_PROVIDERS, ATTN_MODES)
    cfg["seqs"] = parse_ints(args.seqs) or (QUICK_SEQS if args.quick else ATTN_SEQS)
    cfg["variants"] = (parse_list(args.variants, allowed=tuple(ATTN_VARIANTS), what="variant")
                       or list(DEFAULT_ATTN_VARIANTS))
    cfg["heads"], cfg["scale"] = args.heads, args.scale
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    api, api_label, standin = (None, None, False)
    if "jax_softmax" in cfg["providers"]:
        api, api_label, standin = resolve_api(args.standin)
    providers = available_providers(cfg["providers"], log)
    meta = collect_meta(api_label or "jax_softmax (not run)", standin)
    meta["bench"] = "attention"
    meta["config"] = dict(cfg)
    meta["providers_run"] = providers
    meta["bytes_model"] = {"fwd": "read scores + write y + read bias + read mask",
                           "fwdbwd": "fwd + read y + read dy + write dscores"}
    name = args.tag or f"attention_{slug(meta['device'])}"
    base = os.path.join(cfg["out"], name)
    log(f"device: {meta['device']} ({meta['platform']}), jax {meta['jax']}; writing "
        f"{base}.{{json,csv,png}}")

    jax, jnp = _jax()
    fns = {}
    if "jax_softmax" in providers:
        fns["jax_softmax"] = api.attention_softmax
    if "xla" in providers:
        fns["xla"] = xla_attention_softmax
    label = {"jax_softmax": api_label or "jax_softmax"}
    meta["ceilings"] = measure_ceilings(cfg["copy_mib"], providers, cfg["chain"], cfg["reps"],
                                        cfg["warmup"], log, pipeline=cfg["pipeline"])
    meta["dispatch_check"] = dispatch_check(
        {k: functools.partial(f, scale=cfg["scale"]) for k, f in fns.items()},
        cfg["chain"], cfg["reps"], cfg["warmup"], log, pipeline=cfg["pipeline"],
        shapes={"small_1MiB": (1, 4, 256, 256),
                f"large_{cfg['sizes_mib'][0]}MiB": (max(1, cfg["sizes_mib"][0]), 16, 128, 128)})
    records = []
    write_outputs(base, meta, records)
    total = (len(cfg["sizes_mib"]) * len(cfg["dtypes"]) * len(cfg["modes"]) * len(cfg["variants"])
             * len(cfg["seqs"]) * len(fns))
    meta["points_planned"] = total
    bar = Progress(total, "attention")
    t_start = time.time()
    seed = 100
    for size_mib in cfg["sizes_mib"]:
        _warn_l2(size_mib, bar.write)
        for dtype in cfg["dtypes"]:
            for mode in cfg["modes"]:
                for variant in cfg["variants"]:
                    for s in cfg["seqs"]:
                        seed += 1
                        b, h = attention_shape(s, size_mib, dtype, cfg["heads"])
                        for prov, fn in fns.items():
                            bar.set(f"{dtype} {mode} {variant} S={s} {prov}")
                            rec = {"bench": "attention", "op": "attention_softmax",
                                   "provider": label.get(prov, prov), "provider_id": prov,
                                   "dtype": dtype, "mode": mode, "variant": variant, "N": s,
                                   "S": s, "shape": f"{b}x{h}x{s}x{s}", "size_mib": size_mib}
                            measure = functools.partial(_attention_point, fn, dtype, mode,
                                                        variant, b, h, s, cfg, seed)
                            _run_point(rec, measure, f"{prov} {dtype} {mode} {variant} S={s}",
                                       meta, bar, records, base, "xla",
                                       ("dtype", "mode", "variant", "S", "size_mib"), t_start)
    bar.close()
    return _finish(base, meta, records, "S", ("size_mib", "dtype", "mode", "variant"),
                   ("variant",), ("dtype", "mode"), "attention_softmax: GB/s vs S", args.no_plot)


def _attention_inputs(dtype, variant, b, h, s, seed):
    jax, jnp = _jax()
    dt = jnp_dtype(dtype)
    use_bias, mask_kind, causal = ATTN_VARIANTS[variant]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    scores = (4.0 * jax.random.normal(k1, (b, h, s, s), jnp.float32)).astype(dt)
    bias = jax.random.normal(k2, (1, h, s, s), jnp.float32).astype(dt) if use_bias else None
    mask = None
    if mask_kind == "pad":   # keep the first len_b keys of each batch element, len_b in [S/2, S]
        lens = jax.random.randint(k3, (b,), s // 2, s + 1)
        mask = (jnp.arange(s)[None, :] < lens[:, None])[:, None, None, :]
    elif mask_kind == "full":  # random 90% keep; the diagonal is always kept (no empty rows)
        mask = jax.random.bernoulli(k3, 0.9, (s, s)) | jnp.eye(s, dtype=bool)
        mask = mask[None, None]
    dy = jax.random.normal(k4, (b, h, s, s), jnp.float32).astype(dt)
    return scores, bias, mask, causal, dy


def _attention_ref_rows(scores, bias, mask, causal, scale, r):
    """float64 reference for the first r and last r rows of the flattened (B*H*S, S) view."""
    b, h, s, _ = scores.shape
    total = b * h * s
    idx = np.arange(total) if total <= 2 * r else np.concatenate(
        [np.arange(r), np.arange(total - r, total)])
    x = jax_rows_host(scores, r) * scale
    bi, hi, qi = idx // (h * s), (idx // s) % h, idx % s
    if bias is not None:
        bias_np = np.asarray(bias.astype(np.float32)).astype(np.float64)
        x = x + bias_np[0, hi, qi, :]
    keep = np.ones_like(x, dtype=bool)
    if mask is not None:
        m = np.asarray(mask)
        mb = np.minimum(bi, m.shape[0] - 1)
        mq = np.minimum(qi, m.shape[2] - 1)
        keep &= m[mb, 0, mq, :]
    if causal:
        keep &= np.arange(s)[None, :] <= qi[:, None]
    x = np.where(keep, x, -np.inf)
    return np_softmax(x), idx


def _attention_point(fn, dtype, mode, variant, b, h, s, cfg, seed):
    jax, jnp = _jax()
    scale = cfg["scale"]
    scores, bias, mask, causal, dy = _attention_inputs(dtype, variant, b, h, s, seed)
    nbytes = scores.size * itemsize(dtype)
    extra = (bias.size * itemsize(dtype) if bias is not None else 0) + \
            (mask.size if mask is not None else 0)
    byts = {"fwd": 2, "fwdbwd": 5}[mode] * nbytes + extra

    def fwd(sc, bi, ma):
        return fn(sc, scale=scale, bias=bi, mask=ma, is_causal=causal)

    m = cfg["chain"]  # one distinct input set per chained call (bias, mask and dy copied too)
    sets = []
    for i in range(m):
        if i == 0:
            sc, bi, ma, d = scores, bias, mask, dy
        else:
            sc = (scores * (1 + i / 64)).astype(scores.dtype)
            bi, ma, d = (None if a is None else jnp.array(a, copy=True) for a in (bias, mask, dy))
        sets.append((sc, bi, ma) if mode == "fwd" else (sc, bi, ma, d))
    if mode == "fwd":
        call = fwd
    else:
        def call(sc, bi, ma, d):
            y, vjp_fn = jax.vjp(lambda t: fwd(t, bi, ma), sc)
            return y, vjp_fn(d)[0]
    r = check_rows(b * h * s, s)

    def host_rows(out):  # copied before the output buffers are donated to the next execution
        return jax.tree.map(lambda a: jax_rows_host(a, r), out) if cfg["check"] else None

    t = time_jax(call, tuple(sets), cfg["chain"], cfg["reps"], cfg["warmup"],
                 on_first=host_rows, pipeline=cfg["pipeline"])
    first = t.first
    rec = chain_record(t)
    rec.update(bytes=byts, arg_sets=m, chain_k=cfg["chain"])
    if cfg["check"]:
        y64, _ = _attention_ref_rows(scores, bias, mask, causal, scale, r)
        if mode == "fwd":
            rec["rel_err"] = rel_err(first, y64)
        else:
            dy64 = jax_rows_host(dy, r)
            dx64 = scale * np_softmax_bwd(y64, dy64)
            rec["rel_err"] = rel_err(first[0], y64)
            rec["rel_err_dx"] = rel_err(first[1], dx64)
    del sets, first, scores, bias, mask, dy
    return rec


# ----------------------------------------------------------------------------------------------
# Re-plotting / merging saved results
# ----------------------------------------------------------------------------------------------

def run_plot(argv=None) -> int:
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
    bench = meta.get("bench", "softmax")
    if bench == "attention":
        finalize_records(records, ceils.get("ceiling_gbps"), "xla",
                         ("dtype", "mode", "variant", "S", "size_mib"))
        xkey, rows, cols, groups, title = ("S", ("variant",), ("dtype", "mode"),
                                           ("size_mib", "dtype", "mode", "variant"),
                                           "attention_softmax: GB/s vs S")
    else:
        finalize_records(records, ceils.get("ceiling_gbps"), "jax_nn",
                         ("op", "dtype", "mode", "N", "size_mib"))
        xkey, rows, cols, groups, title = ("N", ("dtype",), ("mode",),
                                           ("op", "size_mib", "dtype", "mode"),
                                           "softmax: GB/s vs row length N")
    if len({r.get("op") for r in records}) > 1:  # e.g. softmax and log_softmax files merged
        rows = ("op",) + rows
    png = args.out or os.path.splitext(args.json[0])[0] + ".png"
    if args.table:
        print(format_table(records, xkey, groups, title))
    sizes = sorted({r.get("size_mib") for r in records})
    for size in sizes:
        rs = [r for r in records if r.get("size_mib") == size]
        out = png if len(sizes) == 1 else os.path.splitext(png)[0] + f"_{size}MiB.png"
        if plot_results(rs, meta, out, xkey, rows, cols, f"{title}, {size} MiB tensors"):
            print("wrote", out)
    return 0
