"""How a provider is timed (the package docstring says why this way).

JAX providers: K calls chained in one jit on K distinct input sets (make_chain), R executions
enqueued back to back per sample, timed on the GPU's own clock where it can be read and from
the host in any case (time_jax). torch and Triton: the same K calls launched from Python between
two CUDA events (time_cuda). summarize and chain_record turn the samples into a record's fields.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np

from .environment import gpu_clock_available, import_jax, l2_bytes, torch_cuda

GPU_CLOCK_TARGET = "jax_softmax_gpu_clock"


def gpu_clock(after):
    """u32[2]: the GPU's nanosecond global timer (low, high word) when this call runs on XLA's
    stream, after the op that produced ``after`` (which is not read). See ffi/gpu_clock.cu."""
    jax, jnp = import_jax()
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
    _, jnp = import_jax()
    from jax import lax

    def chain(arg_sets):
        if len(arg_sets) != k:
            raise ValueError(f"a chain of {k} calls needs {k} input sets, got {len(arg_sets)}")
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


_DUMP_COUNT = 0


def lower_chain(fn, arg_sets, k: int, donate: bool = True, clock=None):
    """(lowered, bufs): the jitted chain of K calls (make_chain), lowered for arg_sets; the
    executable returns (outputs, stamps). With donate, it takes (arg_sets, bufs) and writes its
    outputs into bufs (zeros of the outputs' shapes to start with; afterwards, the previous
    execution's outputs); without, it takes arg_sets alone and bufs is None. The stamps are never
    donated, so every execution's stay readable."""
    jax, _ = import_jax()
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
    """Times K chained calls of fn per execution (the package docstring says why this way).

    One sample = ``pipeline`` (R) executions enqueued back to back, then one
    ``block_until_ready``; host per-call time = sample / (R*K). With the GPU clock
    (``clock=None`` means: where gpu_clock_available()), every execution also reads the GPU's
    timer before its first call and after its last (make_chain); the spans over R*K calls are
    the GPU-side per-call time, the figure reported. Both are returned. The outputs are written
    into donated buffers (the previous execution's outputs, passed back in with donate_argnums
    and keep_unused=True, so XLA aliases them to the results), so memory stays at one
    execution's worth and no output is allocated while timing.
    ``JAX_SOFTMAX_BENCH_NO_DONATE=1`` turns donation off for comparison."""
    jax, _ = import_jax()
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


def summarize(times):
    """A record's timing fields from per-call samples (us): median, min, p10/p90 and spread."""
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
