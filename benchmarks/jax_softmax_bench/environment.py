"""The machine and software a benchmark runs on: JAX's backend and device, torch and Triton where
the GPU has them, the L2 size, the GPU clock, and the meta data stored with every result file."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import subprocess
import sys

import numpy as np

MIB = 1 << 20


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


def import_jax():
    """(jax, jax.numpy), imported on first use, so that `bench plot` and `--help` need no JAX."""
    import jax
    import jax.numpy as jnp
    return jax, jnp


def jax_platform() -> str:
    jax, _ = import_jax()
    return jax.default_backend()


def on_gpu() -> bool:
    return jax_platform() in ("gpu", "cuda", "rocm")


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
    jax, _ = import_jax()
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
    jax, _ = import_jax()
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
    # The training step's baselines depend on Flax's own attention path (NNX's takes
    # jax.nn.dot_product_attention without dropout): its version, read without importing it.
    from importlib import metadata
    for dist in ("flax", "optax"):
        try:
            meta[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            meta[dist] = None
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


def free_memory():
    """Drops what the last point left: Python's garbage and torch's cached GPU blocks."""
    gc.collect()
    torch = torch_cuda()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
