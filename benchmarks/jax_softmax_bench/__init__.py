"""jax_softmax's benchmark suite: the softmax row-length sweep and the attention softmax sweep.

A package of its own beside the library, never imported by ``import jax_softmax``: it lives in
benchmarks/jax_softmax_bench/ of the source tree and the wheel carries it as a top-level package,
so that ``python -m jax_softmax bench ...`` works from a checkout and from an installed wheel
alike (jax_softmax/__main__.py imports it for that command only). benchmarks/*.py are thin
scripts over it.

Where things are
----------------
=====================  =========================================================================
``cli``                ``python -m jax_softmax bench [softmax|attention|plot]``: picks the command
``softmax_sweep``      ``bench softmax``: the row-length sweep
``attention_sweep``    ``bench attention``: the (B, H, S, S) attention softmax sweep
``report``             result files (JSON, CSV), the table, the plots, ``bench plot``
``sweep``              what both sweeps share: options, the start of a run, ``Sweep`` (one point)
``calibration``        the copy ceiling and the dispatch check, measured before every sweep
``timing``             how a call is timed: JAX chains on the GPU clock, CUDA events for torch
``providers``          what is timed: jax_softmax or its stand-in, XLA's expression, Triton
``checks``             float64 references and the correctness verdict of every point
``environment``        the machine: backend, device, torch/triton, L2, the meta of a result file
``timeline``           GPU timelines of jax.profiler traces (bench_train_step.py --profile)
=====================  =========================================================================

What is measured
----------------
*Row sweep* (``softmax_sweep.run_softmax``): a ``(rows, N)`` tensor of fixed size (default
256 MiB of input, ``rows = size // (N * itemsize)``), softmax over the last axis, for
N = 32 ... 262144 (powers of two) plus 1000, 3000 and 50257, in float32 / bfloat16 / float16, in
three modes:

* ``fwd``    : x -> y.                               must move: read x, write y       (2 passes)
* ``bwd``    : (y, dy) -> dx.                        must move: read y, dy, write dx  (3 passes)
* ``fwdbwd`` : (x, dy) -> (y, dx), both returned.    must move: read x, write y, read y, read dy,
  write dx (5 passes; a kernel that keeps y on chip between the two halves can beat this count,
  so "% of copy ceiling" may then exceed what a 5-pass kernel could reach).

In ``bwd`` the JAX providers' input is the function returned by ``jax.vjp`` (its residuals:
y for jax_softmax; exp(x - max) and row sums for jax.nn.softmax, the same byte count), applied
to dy inside ``jax.jit``; in ``fwdbwd`` the whole ``jax.vjp`` runs inside ``jax.jit``.

*Attention* (``attention_sweep.run_attention``): scores ``(B, H, S, S)`` with S = 128 ... 8192,
B and H chosen so one scores tensor is about ``--sizes-mib``; ``jax_softmax.attention_softmax``
against the jitted XLA expression it replaces (``scale*scores + bias``, ``where(mask)``,
``jax.nn.softmax`` in float32, cast back), with a padding mask ``(B,1,1,S)``, a full mask
``(1,1,S,S)``, causal, and a ``(1,H,S,S)`` bias; modes ``fwd`` and ``fwdbwd``. Must-move bytes
are the softmax passes above plus one read of the bias and of the mask (1 byte per bool).

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

This is CHECKED at the start of every run (``calibration.dispatch_check``): at a small shape
(1 MiB) and at the sweep's size, chains of K = 1, 2, 4, 8 calls are timed the same way and fitted to
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
