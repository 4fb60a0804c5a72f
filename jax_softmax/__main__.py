"""``python -m jax_softmax``: self-check and a quick timing table on JAX's default backend.

``python -m jax_softmax bench [...]`` runs the benchmark suite instead (see benchmarks/).

The benchmark suite is a package of its own, jax_softmax_bench (benchmarks/jax_softmax_bench/ of
the source tree; the wheel installs it beside jax_softmax), imported here only when a command
needs it, so that ``import jax_softmax`` never loads benchmark code. The self-check is the
library's; the timing table borrows the suite's chain timing (jax_softmax_bench.timing), so that
its figures are the benchmark's, and is left out with a note where the suite is not installed.
"""

from __future__ import annotations

import sys

BENCH_PACKAGE = "jax_softmax_bench"
BENCH_MISSING = (f"the benchmark package {BENCH_PACKAGE} is not installed: the jax-softmax wheel "
                 "carries it (pip install .); in a source checkout it is "
                 f"benchmarks/{BENCH_PACKAGE}/ (python benchmarks/bench_softmax.py runs it)")


def _import_bench(module: str):
    """jax_softmax_bench.<module>, or None where the package is not installed (an error inside
    it is raised as it is)."""
    import importlib

    try:
        return importlib.import_module(f"{BENCH_PACKAGE}.{module}")
    except ModuleNotFoundError as e:
        if e.name != BENCH_PACKAGE:
            raise
        return None


def _progress(iterable, total, desc):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False)
    except ImportError:  # a plain counter keeps the output readable without tqdm
        def gen():
            for i, item in enumerate(iterable):
                print(f"\r{desc}: {i + 1}/{total}", end="", file=sys.stderr, flush=True)
                yield item
            print(file=sys.stderr)

        return gen()


def _time_per_call(timing, fn, xs):
    """Median microseconds per call of fn, the benchmark's way (jax_softmax_bench.timing, passed
    as `timing`): the calls chained in one jit on the distinct inputs xs, timed on the GPU's
    clock where there is one (from the host otherwise), so dispatch stays out of the figure."""
    t = timing.time_jax(fn, tuple((x,) for x in xs), len(xs), reps=5, warmup=1, pipeline=5)
    return t.median, t.method


def self_check() -> bool:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_softmax

    backend = jax.default_backend()
    print(f"jax_softmax {jax_softmax.__version__} | jax {jax.__version__} | backend {backend} "
          f"({jax.devices()[0].device_kind}) | kernels built for {jax_softmax.available_platforms()}")
    rng = np.random.default_rng(0)
    cases = [((64, 1000), -1, jnp.float32), ((8, 33, 257), 1, jnp.float32),
             ((16, 4096), -1, jnp.bfloat16), ((4, 8, 128, 128), -1, jnp.float16),
             ((32, 3000), -1, jnp.float64)]
    tol = {jnp.float32: 1e-5, jnp.float64: 1e-12, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
    ok = True
    for shape, axis, dtype in _progress(cases, len(cases), "self-check"):
        if dtype == jnp.float64 and not jax.config.jax_enable_x64:
            continue
        x = jnp.asarray(rng.standard_normal(shape) * 4, dtype)
        where = jnp.asarray(rng.random(shape) > 0.2)
        for name, ours, ref in [("softmax", jax_softmax.softmax, jax.nn.softmax),
                                ("log_softmax", jax_softmax.log_softmax, jax.nn.log_softmax)]:
            for w in (None, where):
                got = np.asarray(jax.jit(lambda a, w=w: ours(a, axis=axis, where=w))(x), np.float64)
                want = np.asarray(ref(x.astype(jnp.float32 if dtype != jnp.float64 else dtype),
                                      axis=axis, where=w), np.float64)
                fin = np.isfinite(want)
                err = np.max(np.abs(got[fin] - want[fin]) / (1 + np.abs(want[fin])), initial=0)
                good = err <= tol[dtype] and np.array_equal(np.isfinite(got), fin)
                ok &= bool(good)
                if not good:
                    print(f"  MISMATCH {name} {shape} axis={axis} {np.dtype(dtype).name} "
                          f"where={w is not None}: max rel err {err:.2e}")
    print("self-check:", "PASS" if ok else "FAIL")
    return ok


def timing_table() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_softmax

    timing = _import_bench("timing")
    if timing is None:
        print(f"\nno timing table: {BENCH_MISSING}")
        return
    gpu = jax.default_backend() == "gpu"
    mib = 256 if gpu else 8
    rows = []
    cols_list = [128, 1024, 4096, 32768]
    chain = 4  # calls per jitted chain, each on its own input
    method = "host"
    for cols in _progress(cols_list, len(cols_list), "timing"):
        n = mib * 2**20 // 4
        rng = np.random.default_rng(1)
        xs = [jnp.asarray(rng.standard_normal((n // cols, cols)), jnp.float32) for _ in range(chain)]
        t_ours, method = _time_per_call(timing, jax_softmax.softmax, xs)
        t_xla, _ = _time_per_call(timing, jax.nn.softmax, xs)
        gbs = 2 * xs[0].nbytes / (t_ours * 1e-6) / 1e9
        rows.append((cols, xs[0].shape[0], t_ours, t_xla, t_xla / t_ours, gbs))
        del xs
    how = ("on the GPU's clock" if method == "gpu_clock" else "from the host")
    print(f"\nfloat32 softmax, {mib} MiB input, per call of {chain} chained in one jit, timed {how}")
    print(f"{'cols':>7} {'rows':>8} {'ours us':>10} {'jax.nn us':>10} {'speedup':>8} {'GB/s':>8}")
    for r in rows:
        print(f"{r[0]:>7} {r[1]:>8} {r[2]:>10.1f} {r[3]:>10.1f} {r[4]:>8.2f} {r[5]:>8.1f}")
    print("(the full sweep against a copy, torch and Triton: python -m jax_softmax bench)")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "bench":
        cli = _import_bench("cli")
        if cli is None:
            print(f"python -m jax_softmax bench: {BENCH_MISSING}", file=sys.stderr)
            return 1
        return cli.main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    ok = self_check()
    timing_table()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
