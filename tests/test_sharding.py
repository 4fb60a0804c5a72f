"""Sharding, checked with 8 simulated CPU devices and with a one-device mesh on each backend.

The multi-device cases live in sharding_cases.py. XLA reads the number of host devices once, when
jax is first imported, and every other test module wants one device: so this module runs that file
in a pytest subprocess of its own (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
``JAX_PLATFORMS=cpu``), once per partitioner (Shardy and GSPMD, through
``JAX_USE_SHARDY_PARTITIONER``), and reports each of its test functions here, failing with the
subprocess's own messages. The run happens once per session, the first time a case asks for it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BWD_TARGET, FWD_TARGET, assert_close, count_custom_calls, np_attention
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_softmax

CASES_FILE = Path(__file__).with_name("sharding_cases.py")
N_HOST_DEVICES = 8
PARTITIONERS = {"shardy": "true", "gspmd": "false"}
RUN_TIMEOUT_S = 1800


def _case_names() -> list[str]:
    tree = ast.parse(CASES_FILE.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


class _Run:
    """One subprocess run of sharding_cases.py: its results by test function name."""

    def __init__(self, partitioner: str):
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_HOST_DEVICES}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_USE_SHARDY_PARTITIONER"] = PARTITIONERS[partitioner]
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.xml"
            # cwd outside the checkout: the installed package is the one imported (see conftest).
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junit-xml={report}",
                 str(CASES_FILE)],
                cwd=tmp, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
            )
            self.output = (proc.stdout + proc.stderr)[-6000:]
            self.returncode = proc.returncode
            self.results: dict[str, list[tuple[str, str, str]]] = {}
            if report.exists():
                for case in ET.parse(report).getroot().iter("testcase"):
                    name = case.get("name", "")
                    outcome, message = "passed", ""
                    for child in case:
                        if child.tag in ("failure", "error", "skipped"):
                            outcome = child.tag
                            message = (child.get("message") or "") + "\n" + (child.text or "")
                            break
                    self.results.setdefault(name.split("[")[0], []).append((name, outcome, message))


_RUNS: dict[str, _Run] = {}


@pytest.mark.parametrize("partitioner", list(PARTITIONERS))
@pytest.mark.parametrize("case", _case_names())
def test_on_8_cpu_devices(case, partitioner):
    if partitioner not in _RUNS:
        _RUNS[partitioner] = _Run(partitioner)
    run = _RUNS[partitioner]
    if run.returncode not in (0, 1) or not run.results:
        pytest.fail(f"the sharding_cases.py run exited with {run.returncode}:\n{run.output}")
    results = run.results.get(case)
    if not results:
        pytest.fail(f"{case} ran no test in the sharding_cases.py run:\n{run.output}")
    bad = [(name, outcome, message) for name, outcome, message in results if outcome in ("failure", "error")]
    if bad:
        pytest.fail("\n\n".join(f"{name}: {outcome}\n{message}" for name, outcome, message in bad))
    if all(outcome == "skipped" for _, outcome, _ in results):
        pytest.skip(results[0][2].strip().splitlines()[0] if results[0][2].strip() else "skipped")


# --- one device: the mesh changes nothing ----------------------------------------------------------
def test_one_device_mesh_takes_the_fused_kernels(backend, device):
    """A NamedSharding over a one-device mesh (the single-GPU case of a model written for a mesh):
    the forward and the backward are our custom calls, with no collective, and give the unsharded
    values."""
    mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "model"))
    rng = np.random.default_rng(85)
    x = rng.standard_normal((2, 4, 16, 24), dtype=np.float32)
    mask = rng.random((2, 1, 16, 24)) > 0.2
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model", None)))

    def loss(s):
        return jnp.sum(jax_softmax.attention_softmax(s, mask=mask, is_causal=True, scale=0.5) ** 2)

    fwd = jax.jit(lambda s: jax_softmax.attention_softmax(s, mask=mask, is_causal=True, scale=0.5))
    grad = jax.jit(jax.grad(loss))
    fwd_hlo = fwd.lower(xs).compile().as_text()
    grad_hlo = grad.lower(xs).compile().as_text()
    assert count_custom_calls(fwd_hlo, FWD_TARGET) == 1
    assert count_custom_calls(grad_hlo, FWD_TARGET) == 1 and count_custom_calls(grad_hlo, BWD_TARGET) == 1
    for hlo in (fwd_hlo, grad_hlo):
        assert not any(op in hlo for op in ("all-gather", "all-reduce", "all-to-all")), hlo
    assert_close(fwd(xs), np_attention(x, 0.5, None, mask, True), np.float32)
    expected = jax.jit(jax.grad(loss))(jax.device_put(x, device))  # unsharded
    assert_close(grad(xs), np.asarray(expected), np.float32)
