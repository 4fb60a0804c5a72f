"""Correctness of every timed point: float64 NumPy references, the first and last rows of each
output copied to the host, the relative Frobenius error, and the verdict against a tolerance
that catches wrong indexing, not ulps. A FAIL is reported, and the point still timed."""

from __future__ import annotations

import numpy as np

from .environment import import_jax, torch_cuda

# Relative Frobenius error accepted by the sanity check (catches wrong indexing, not ulps).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-2}


def np_softmax(x64, log=False):
    """The float64 reference: softmax (or log-softmax) over the last axis."""
    m = np.max(x64, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    z = x64 - m
    e = np.exp(z)
    s = np.sum(e, axis=-1, keepdims=True)
    return z - np.log(s) if log else e / s


def np_softmax_bwd(y64, dy64, log=False):
    """The float64 reference backward: dx from the forward's output y and the cotangent dy."""
    if log:  # y = log_softmax: dx = dy - exp(y) * sum(dy)
        return dy64 - np.exp(y64) * np.sum(dy64, axis=-1, keepdims=True)
    return y64 * (dy64 - np.sum(y64 * dy64, axis=-1, keepdims=True))


def rel_err(out, ref) -> float:
    """Relative Frobenius error; inf for a wrong shape, nan where out is not finite."""
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
    _, jnp = import_jax()
    a2 = a.reshape(-1, a.shape[-1])
    if a2.shape[0] <= 2 * r:
        sel = a2
    else:
        sel = jnp.concatenate([a2[:r], a2[-r:]])
    return np.asarray(sel.astype(jnp.float32)).astype(np.float64)


def torch_rows_host(t, r):
    """First r and last r rows of a (.., N) torch tensor as float64 NumPy."""
    torch = torch_cuda()
    t2 = t.reshape(-1, t.shape[-1])
    sel = t2 if t2.shape[0] <= 2 * r else torch.cat([t2[:r], t2[-r:]])
    return sel.float().cpu().numpy().astype(np.float64)


def output_errors(mode: str, got, y64, dx64=None) -> dict:
    """rel_err (of y) and rel_err_dx (of dx) of a point's outputs against the references;
    ``got`` holds the outputs' host rows: y (mode fwd), dx (bwd) or (y, dx) (fwdbwd)."""
    if mode == "fwd":
        return {"rel_err": rel_err(got, y64)}
    if mode == "bwd":
        return {"rel_err_dx": rel_err(got, dx64)}
    return {"rel_err": rel_err(got[0], y64), "rel_err_dx": rel_err(got[1], dx64)}


def judge(rec, dtype):
    """Sets rec["check"]: ok, FAIL (an error above the dtype's tolerance, or not finite) or
    skip (nothing was compared)."""
    errs = [rec.get(k) for k in ("rel_err", "rel_err_dx") if k in rec]
    if not errs:
        rec["check"] = "skip"
        return
    tol = TOLERANCE[dtype]
    rec["check"] = "ok" if all(e is not None and e == e and e <= tol for e in errs) else "FAIL"
