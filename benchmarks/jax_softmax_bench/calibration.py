"""What every sweep measures before its points: the copy ceiling (the bandwidth of a large
device-to-device copy, the most a memory-bound kernel can reach) and the dispatch check (how
much of each execution's fixed cost is left in the per-call figures)."""

from __future__ import annotations

import math
import statistics

from .environment import MIB, free_memory, import_jax, torch_cuda
from .timing import chain_record, summarize, time_cuda, time_jax


def measure_ceilings(copy_mib: int, providers, k: int, reps: int, warmup: int, log=print,
                     pipeline: int = 20) -> dict:
    """The copy ceiling: copy_jax (a jitted ``a + s``, s a traced scalar, so XLA can neither drop
    it nor alias the output to the input) and copy_torch (``dst.copy_(src)``), each timed as the
    providers are; bytes = read + write; ``ceiling_gbps`` is the larger of the two."""
    jax, jnp = import_jax()
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
    jax, jnp = import_jax()
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
