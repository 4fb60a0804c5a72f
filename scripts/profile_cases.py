"""Kernel cases for quick A/B timing and for Nsight Compute: a fixed set (CASES), and rows of
any length named {f32,bf16,f16}_{fwd,bwd,bwdmask}_N (e.g. bf16_fwd_53001).

    python3 scripts/profile_cases.py time [CASE ...]   # one line per case: % of copy, x XLA
    python3 scripts/profile_cases.py ncu  [CASE ...]   # each case once, for `ncu -k regex:softmax`
    python3 scripts/profile_cases.py trace [CASE ...]  # GPU timeline: kernel time vs the gaps

`time` times 256 MiB tensors the benchmark's way (K = 4 calls chained in one jit, executions
pipelined, the chain's span read from the GPU's clock; Triton's K launches between CUDA events),
so per-call dispatch stays out of the figure; it is a quick
probe for comparing kernel variants in one session (the run-time settings JAX_SOFTMAX_STAGED and
JAX_SOFTMAX_PDL are read once per process, so run one process per variant; scripts/gpu_check.sh's
ab step does). The committed figures come from `python -m jax_softmax bench`, which also checks
the dispatch residual.

`trace` runs each case's chain as `time` does while jax.profiler records the GPU timeline (CUPTI),
and prints, for ours and XLA, each kernel's median duration, the median idle gap between
consecutive kernels and the time per call on the timeline: what separates the per-call figure
from the kernel's own time. (A kernel launched with programmatic dependent launch starts while the
one ahead still runs, so its duration then includes that wait and the gap reads negative.)

`ncu` builds inputs on the host and runs each case once (compiling launches none of our
kernels), so `ncu -k regex:softmax_rows` sees one launch per case; with PROFILE_XLA=1 the XLA
function runs once after ours (profile it without the kernel filter).
"""

import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (Triton cases) shares the GPU

import numpy as np

import jax
import jax.numpy as jnp

import jax_softmax
from jax_softmax.primitives import softmax_bwd_p

# The benchmark suite's timing, providers and timelines: this checkout's jax_softmax_bench
# (benchmarks/jax_softmax_bench/, which the wheel also installs), ahead of any installed copy, as
# benchmarks/common.py does; the kernels are whatever `import jax_softmax` found.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "benchmarks"))
from jax_softmax_bench import attention_sweep, environment, providers, timeline, timing  # noqa

MIB = 2**20
TENSOR_BYTES = int(os.environ.get("PROFILE_MIB", "256")) * MIB
_NO_MASK = jnp.ones((1, 1), bool)


def _rows(n, dtype):
    return max(1, TENSOR_BYTES // (n * jnp.dtype(dtype).itemsize))


def _bwd(y, g, mask=None):
    return softmax_bwd_p.bind(y, g, _NO_MASK if mask is None else mask, log=False, scale=1.0,
                              has_mask=mask is not None, causal=False)


def _xla_bwd(y, g, mask=None):
    if mask is None:
        return (y * (g - jnp.sum(y * g, -1, keepdims=True))).astype(y.dtype)
    g = jnp.where(mask, g, 0)
    return jnp.where(mask, y * (g - jnp.sum(y * g, -1, keepdims=True)), 0).astype(y.dtype)


def _attention_case(kind, s, dtype=jnp.bfloat16, dropout=0.0):
    """(B, H, s, s) scores of the benchmark's shape (jax_softmax_bench's attention_shape: 16
    heads, fewer where one head's scores pass the tensor size) in bfloat16 (float32 for the
    attn32_, attnbwd32_ and attndrop32_ cases) with a padding mask (B, 1, 1, s) that drops a random
    10% of the keys ("pad"; "padcausal": with the causal rule too) or, as the benchmark's, all
    keys past a length drawn per batch element from [s/2, s] ("padlen"), a full mask (1, 1, s, s),
    a per-head bias, the causal rule or none of them (scale only); the XLA side is the benchmark's
    own expression (jax_softmax_bench.providers.xla_attention_softmax). With `dropout`, attention
    dropout at that rate on both sides (the attndrop_ cases: fused Philox bits against Flax's
    bernoulli draw)."""
    b, h = attention_sweep.attention_shape(s, TENSOR_BYTES // MIB, jnp.dtype(dtype).name, 16)
    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.standard_normal((b, h, s, s)).astype(np.float32), dtype)
    lens = rng.integers(s // 2, s + 1, size=(b, 1, 1, 1))
    pad = lambda: jnp.asarray(rng.random((b, 1, 1, s)) > 0.1)  # noqa: E731
    operand = {"pad": ("mask", pad), "padcausal": ("mask", pad),
               "padlen": ("mask", lambda: jnp.asarray(np.arange(s) < lens)),
               "full": ("mask", lambda: jnp.asarray(rng.random((1, 1, s, s)) > 0.1)),
               "bias": ("bias", lambda: jnp.asarray(rng.standard_normal((1, h, s, s)), dtype)),
               "causal": (None, None), "none": (None, None)}[kind]
    name, make = operand
    args = [scores] + ([make()] if make else [])

    drop = dict(dropout_rate=dropout, dropout_rng=jax.random.key(0)) if dropout else {}

    def bind(fn):
        def call(x, *extra):
            kw = {name: extra[0]} if name else {}
            kw["is_causal"] = kind in ("causal", "padcausal")
            return fn(x, scale=0.125, **kw, **drop)
        return call

    return (bind(jax_softmax.attention_softmax), bind(providers.xla_attention_softmax), args,
            2 * scores.nbytes)


def _attention_bwd_case(kind, s, dtype=jnp.bfloat16, dropout=0.0):
    """The backward of an _attention_case (no bias: its backward rows are plain ones), alone:
    jax.vjp's function for the scores (its residuals, y and the mask, are inputs) applied to dy,
    as the benchmark's bwd mode does; must move: read y and dy, write dscores (with dropout ours
    reads the scores instead of y)."""
    ours, xla, args, nbytes = _attention_case(kind, s, dtype, dropout)
    dy = jnp.asarray(np.random.default_rng(2).standard_normal(args[0].shape).astype(np.float32),
                     dtype)

    def residuals(fn):
        return [jax.vjp(lambda t: fn(t, *args[1:]), args[0])[1], dy]

    def pull(vjp_fn, d):
        return vjp_fn(d)[0]

    # The XLA side's residuals differ (its vjp saves what XLA's expression needs), so each side
    # gets its own: the case's args are ours; main() passes XLA's through the xla_args hook.
    return pull, pull, residuals(ours), 3 * nbytes // 2, residuals(xla)


def _row_case(dtype, n, bwd=False, masked=False):
    """Rows of n columns; the backward ones read y and dy (and a (rows, n) mask: its bytes
    counted too)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((_rows(n, dtype), n)).astype(np.float32), dtype)
    if not bwd:
        return jax_softmax.softmax, jax.nn.softmax, [x], 2 * x.nbytes
    if masked:
        mask = jnp.asarray(rng.random(x.shape) > 0.1)
        y = jax_softmax.softmax(x, where=mask)
        return _bwd, _xla_bwd, [y, x, mask], 3 * x.nbytes + mask.nbytes
    y = jax_softmax.softmax(x)
    return _bwd, _xla_bwd, [y, x], 3 * x.nbytes


def _triton_case(dtype, n, bwd=False):
    """The benchmark's Triton tutorial-style kernels (jax_softmax_bench.providers) on torch
    tensors, for comparing their counters and timing with ours in one process: the forward, or the
    backward from y and dy. Its case has no XLA function (None): main() times it as launched from
    Python."""
    torch = environment.torch_cuda()
    x = torch.randn(_rows(n, jnp.dtype(dtype)), n, device="cuda").to(getattr(torch, dtype))
    nbytes = x.numel() * x.element_size()
    if not bwd:
        return providers.triton_softmax_fwd, None, [x], 2 * nbytes
    y = torch.softmax(x.float(), -1).to(x.dtype)
    return providers.triton_softmax_bwd, None, [y, torch.randn_like(x)], 3 * nbytes


# Row cases' dtypes by name: the fixed set below and the rows of any length (_ROW_CASE).
_ROW_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

CASES = {}
for _name in ("f32", "bf16"):
    _dt = _ROW_DTYPES[_name]
    for _n in (32, 128, 256, 512, 1000, 1024, 2048, 3000, 4096, 8192, 16384, 32768, 50257, 65536, 131072,
               262144, 1000001, 1048576):  # the last two: past the clusters, the two-pass kernel
        CASES[f"{_name}_fwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n))
    # Odd rows (read through 16-byte windows), one per tier: a warp, blocks, clusters.
    for _n in (255, 1001, 2047, 4095, 4097, 4609, 5121, 6143, 8191, 8193, 16383, 32769, 100003,
               262143):
        CASES[f"{_name}_fwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n))
    for _n in (32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 50257, 65536, 131072,
               262144, 524288):
        CASES[f"{_name}_bwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n, bwd=True))
        CASES[f"{_name}_bwdmask_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n, True, True))
    for _n in (6000, 12000):  # rows that fill three quarters of a block tier or less
        CASES[f"{_name}_fwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n))
    # Rows just past a cluster tier's power of two, launched with fewer CTAs than the tier's
    # (FitCluster in ffi/launch_device.cuh), and a vocabulary's length (151936).
    for _n in (16385, 65537, 151936):
        CASES[f"{_name}_fwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n))
    # Rows of 9-16 chunks of a 512-thread CTA (forward: staged clusters of 16 x 512 threads, or
    # for 16-bit rows up to 8 x 1024, kForwardTiers).
    for _n in (140000, 170000, 200000, 230000):
        CASES[f"{_name}_fwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n))
    for _n in (32769, 65537, 81920, 100003, 114688, 151936):
        CASES[f"{_name}_bwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n, bwd=True))
    # Odd rows, read through 16-byte windows; and rows that fill a block tier partly (3000).
    for _n in (255, 3000, 4095, 4097, 8193, 16383, 32767, 65535, 262143):
        CASES[f"{_name}_bwd_{_n}"] = (lambda dt=_dt, n=_n: _row_case(dt, n, bwd=True))
# float16 forward where its staged tiers keep x as loaded (and a register-tier control, 4096).
for _n in (256, 1000, 1001, 4096, 6143, 8191, 8193, 16383):
    CASES[f"f16_fwd_{_n}"] = (lambda n=_n: _row_case(_ROW_DTYPES["f16"], n))
for _n in (256, 1024, 4096, 8192, 16384, 32768):
    for _dt, _name in (("float32", "f32"), ("bfloat16", "bf16")):
        CASES[f"triton_{_name}_fwd_{_n}"] = (lambda dt=_dt, n=_n: _triton_case(dt, n))
        CASES[f"triton_{_name}_bwd_{_n}"] = (lambda dt=_dt, n=_n: _triton_case(dt, n, True))
for _kind in ("none", "pad", "padlen", "full", "bias", "causal", "padcausal"):
    for _s in (128, 256, 512, 1024, 2048, 4096, 8192):
        CASES[f"attn_{_kind}_{_s}"] = (lambda k=_kind, s=_s: _attention_case(k, s))
        CASES[f"attn32_{_kind}_{_s}"] = (lambda k=_kind, s=_s: _attention_case(k, s, jnp.float32))
        CASES[f"attndrop_{_kind}_{_s}"] = (lambda k=_kind, s=_s: _attention_case(k, s, dropout=0.1))
        CASES[f"attndrop32_{_kind}_{_s}"] = (
            lambda k=_kind, s=_s: _attention_case(k, s, jnp.float32, dropout=0.1))
        CASES[f"attndropbwd_{_kind}_{_s}"] = (
            lambda k=_kind, s=_s: _attention_bwd_case(k, s, dropout=0.1))
        if _kind != "bias":
            CASES[f"attnbwd_{_kind}_{_s}"] = (lambda k=_kind, s=_s: _attention_bwd_case(k, s))
            CASES[f"attnbwd32_{_kind}_{_s}"] = (
                lambda k=_kind, s=_s: _attention_bwd_case(k, s, jnp.float32))

NCU_DEFAULT = ["bf16_fwd_32", "bf16_fwd_256", "f32_fwd_4096", "f32_fwd_16384", "f32_fwd_50257",
               "f32_fwd_65536", "f32_fwd_262144", "attn_pad_1024", "attn_causal_1024"]


def _sync(r):
    if hasattr(r, "block_until_ready"):
        r.block_until_ready()
    else:  # a torch tensor
        import torch
        torch.cuda.synchronize()


def _arg_sets(args, k):
    """K distinct input sets for a chain of K calls (the first set is args itself; an argument
    may be a pytree, such as jax.vjp's function with its residuals)."""
    return tuple(tuple(a if i == 0 else jax.tree.map(jnp.copy, a) for a in args)
                 for i in range(k))


def timeit(fn, args, k=4, reps=5, jit=True):
    """Seconds per call, the benchmark's way: K calls on the GPU clock. JAX: chained in one jit
    on K distinct input copies, executions pipelined (jax_softmax_bench.timing.time_jax; the GPU
    span where the clock is built). Not jitted (Triton, launched from Python): K launches back to
    back between CUDA events (timing.time_cuda)."""
    if jit:
        return timing.time_jax(fn, _arg_sets(args, k), k, reps, warmup=2, pipeline=10).median * 1e-6
    times, _ = timing.time_cuda(lambda: [fn(*args) for _ in range(k)], max(reps, 20), 2, k)
    return sorted(times)[len(times) // 2] * 1e-6


def trace_case(fn, args, k=4, pipeline=10):
    """The GPU timeline of `pipeline` executions of K chained calls (the benchmark's chain, with
    donated outputs): ({kernel name: (launches, median us)}, median idle gap in us between
    consecutive kernels (negative where a kernel starts before the one ahead ends), us per call
    from the first kernel's start to the last one's end). Compilation and warm-up run before the
    trace starts."""
    import tempfile

    sets = _arg_sets(args, k)
    lowered, outs = timing.lower_chain(fn, sets, k)
    run = lowered.compile()
    for _ in range(3):
        outs, _ = run(sets, outs)
    jax.block_until_ready(outs)
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(pipeline):
        outs, _ = run(sets, outs)
    jax.block_until_ready(outs)
    jax.profiler.stop_trace()
    events = timeline.gpu_timeline(d)
    kernels = timeline.kernel_medians(events)
    gaps = sorted(b[0] - (a[0] + a[1]) for a, b in zip(events, events[1:]))
    per_call = timeline.timeline_summary(events, pipeline * k).get("span_us", float("nan"))
    return kernels, (gaps[len(gaps) // 2] / 1e3 if gaps else float("nan")), per_call


def copy_bandwidth():
    x = jnp.ones((TENSOR_BYTES // 4,), jnp.float32)
    return 2 * x.nbytes / timeit(lambda a, s: a + s, [x, jnp.float32(1)])


# Row cases of any length beyond the list above: {f32,bf16,f16}_{fwd,bwd,bwdmask}_N.
_ROW_CASE = re.compile(r"(%s)_(fwd|bwd|bwdmask)_([1-9][0-9]*)" % "|".join(_ROW_DTYPES))


def _known(name):
    return name in CASES or _ROW_CASE.fullmatch(name) is not None


def _case(name):
    """(ours, xla, args, nbytes, xla_args): a case's functions, our inputs, the bytes it must
    move, and XLA's inputs (the same as ours except for the backward cases' residuals)."""
    if name in CASES:
        case = CASES[name]()
    else:
        dt, mode, n = _ROW_CASE.fullmatch(name).groups()
        case = _row_case(_ROW_DTYPES[dt], int(n), bwd=mode != "fwd", masked=mode == "bwdmask")
    return (*case, case[2]) if len(case) == 4 else case


def main(argv):
    mode = argv[0] if argv else "time"
    names = argv[1:] or (NCU_DEFAULT if mode == "ncu" else list(CASES))
    unknown = [n for n in names if not _known(n)]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {list(CASES)} and rows of any length, "
                         "{f32,bf16,f16}_{fwd,bwd,bwdmask}_N")
    if mode == "ncu":
        for name in names:
            ours, xla, args, _, xla_args = _case(name)
            _sync((jax.jit(ours) if xla else ours)(*args))
            if xla is not None and os.environ.get("PROFILE_XLA"):  # XLA's kernels after ours
                _sync(jax.jit(xla)(*xla_args))
            print(f"profiled {name}", flush=True)
        return
    if mode == "trace":
        for name in names:
            ours, xla, args, nbytes, xla_args = _case(name)
            for who, fn, a in (("ours", ours, args), ("xla", xla, xla_args)):
                kernels, gap, per_call = trace_case(fn, a)
                for kname, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
                    print(f"{name:20s} {who:4s} {count:4d} x {us:7.1f} us  {kname[:90]}", flush=True)
                print(f"{name:20s} {who:4s} median gap between kernels {gap:.2f} us, "
                      f"{per_call:.1f} us per call on the timeline", flush=True)
            del args, xla_args
        return
    bw = copy_bandwidth()
    # The JAX_SOFTMAX_* settings of the environment (JAX_SOFTMAX_STAGED, JAX_SOFTMAX_PDL).
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("JAX_SOFTMAX_"))
    print(f"copy {bw / 1e9:.0f} GB/s  ({settings or 'default settings'})", flush=True)
    for name in names:
        ours, xla, args, nbytes, xla_args = _case(name)
        if xla is None:  # Triton: launched from Python, timed with CUDA events
            t_o = timeit(ours, args, jit=False)
            print(f"{name:22s} ours {100 * nbytes / t_o / bw:5.1f}%  ({t_o * 1e6:.0f} us)", flush=True)
            del args
            continue
        t_o = timeit(ours, args)
        t_x = timeit(xla, xla_args)
        print(f"{name:22s} ours {100 * nbytes / t_o / bw:5.1f}%  xla {100 * nbytes / t_x / bw:5.1f}%"
              f"  x{t_x / t_o:4.2f}  ({t_o * 1e6:.0f} us)", flush=True)
        del args, xla_args


if __name__ == "__main__":
    main(sys.argv[1:])
