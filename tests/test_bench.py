"""The benchmark suite (jax_softmax_bench): the chain's records on any backend, and on a GPU the
clock reads that bracket a chain of calls (they must not run together, nor outside it); the
sweep's files; `python -m jax_softmax` and its `bench` command; and that `import jax_softmax`
loads none of it."""

from __future__ import annotations

import json
import os
import statistics

import jax
import jax.numpy as jnp
import pytest

from conftest import gpu_available

from jax_softmax_bench import environment, providers, softmax_sweep, sweep, timeline, timing


def test_cpu_chain_is_host_timed():
    """Without the GPU clock the reported figure is the host one, and the record says so."""
    xs = tuple((jnp.full((8, 128), float(i), jnp.float32),) for i in range(3))
    t = timing.time_jax(jax.nn.softmax, xs, 3, reps=2, warmup=1, pipeline=2, clock=False)
    assert t.method == "host" and t.span is None and t.gap is None
    assert t.times == t.host and len(t.host) == 2 and all(v > 0 for v in t.host)
    rec = timing.chain_record(t)
    assert rec["timing"] == "host" and rec["time_us"] == rec["time_us_host"]


def test_sweep_writes_timing_fields(tmp_path):
    """A tiny sweep on the default backend: every JAX record carries its timing method and the
    host-timed figure, and the meta says how the run was timed."""
    rc = softmax_sweep.run_softmax(["--quick", "--ns", "32", "--dtypes", "float32", "--modes", "fwd",
                             "--sizes-mib", "1", "--copy-mib", "1", "--reps", "2",
                             "--providers", "jax_softmax", "jax_nn", "--no-plot",
                             "--out", str(tmp_path), "--tag", "t"])
    assert rc == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["meta"]["timing"].split(":")[0] == (
        "gpu_clock" if environment.gpu_clock_available() else "host")
    recs = [r for r in data["records"] if r["provider"] in ("jax_softmax", "jax_nn")]
    assert recs and all(r["timing"] in ("gpu_clock", "host") and r["time_us_host"] > 0
                        and r["check"] == "ok" for r in recs)
    # A finished sweep's file holds every planned point and does not call itself partial.
    assert data["meta"]["points_planned"] == len(data["records"]) == 2
    assert "partial" not in data["meta"]


def test_rounds_rotate_and_keep_the_median_round():
    """--rounds: each provider measured once a round, the order rotated by one each round; its
    record is its median round's fields; a failing provider raises its error for run_point and
    is not measured again."""
    calls = []
    times = {"a": iter([30.0, 10.0, 20.0]), "b": iter([5.0, 7.0, 6.0])}

    def measure(name):
        calls.append(name)
        if name == "c":
            raise RuntimeError("no kernel")
        return {"time_us": next(times[name]), "round": len(calls)}

    measures = {name: (lambda name=name: measure(name)) for name in ("a", "b", "c")}
    rounds = sweep.measure_in_rounds(measures, 3)
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]
    assert rounds["a"]() == {"time_us": 20.0, "round": 6, "rounds_us": [30.0, 10.0, 20.0]}
    assert rounds["b"]()["time_us"] == 6.0
    with pytest.raises(RuntimeError, match="no kernel"):
        rounds["c"]()


def test_sweep_in_rounds(tmp_path):
    """A tiny sweep with --rounds 3: every record holds its three rounds' times and reports the
    median one."""
    rc = softmax_sweep.run_softmax(["--quick", "--ns", "32", "--dtypes", "float32", "--modes", "fwd",
                                    "--sizes-mib", "1", "--copy-mib", "1", "--reps", "2",
                                    "--rounds", "3", "--providers", "jax_softmax", "jax_nn",
                                    "--no-plot", "--out", str(tmp_path), "--tag", "t"])
    assert rc == 0
    recs = [r for r in json.loads((tmp_path / "t.json").read_text())["records"]
            if r["provider"] in ("jax_softmax", "jax_nn")]
    assert len(recs) == 2
    for r in recs:
        assert len(r["rounds_us"]) == 3 and r["check"] == "ok"
        assert r["time_us"] == sorted(r["rounds_us"])[1]


def test_interrupted_sweep_says_partial(tmp_path, monkeypatch):
    """A sweep stopped before it finishes (here: interrupted while measuring its second point)
    leaves a file whose meta says how many of the planned points it holds."""
    measure = softmax_sweep.measure_jax_point
    calls = []

    def interrupt_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a killed run: not recorded as the point's error
        return measure(*args, **kwargs)

    monkeypatch.setattr(softmax_sweep, "measure_jax_point", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        softmax_sweep.run_softmax(["--quick", "--ns", "32", "64", "--dtypes", "float32", "--modes",
                            "fwd", "--sizes-mib", "1", "--copy-mib", "1", "--reps", "2",
                            "--providers", "jax_softmax", "--no-plot",
                            "--out", str(tmp_path), "--tag", "t"])
    data = json.loads((tmp_path / "t.json").read_text())
    meta = data["meta"]
    assert meta["points_planned"] == 2 and len(data["records"]) == 1
    assert meta["partial"].startswith("1 of 2 points")


def test_timeline_summary():
    """Per repetition: the span, the union of the kernels' intervals (busy) and the gaps (idle),
    jax_softmax's kernels by name, and the kernels ranked by their time."""
    events = [(0, 10_000, "fusion_a"), (5_000, 10_000, "_ZN11jax_softmax19softmax_rows_kernel"),
              (30_000, 5_000, "fusion_a"), (40_000, 10_000, "gemm_b")]
    t = timeline.timeline_summary(events, units=2)
    assert t["span_us"] == 25 and t["busy_us"] == 15 and t["idle_us"] == 10
    assert t["jax_softmax_us"] == 5
    assert t["kernels"][0] == {"name": "fusion_a", "launches": 1, "us": 7.5}
    assert {k["name"] for k in t["kernels"][1:]} == {"gemm_b", "_ZN11jax_softmax19softmax_rows_kernel"}
    assert timeline.timeline_summary([], units=2) == {}


@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA device")
def test_gpu_clock_brackets_the_chain():
    """Four 64 MiB copies between the two clock reads: the span per call cannot be shorter than
    moving 128 MiB at 10 TB/s (more than any GPU here), which fails if XLA ran both reads next
    to each other; nor longer than the host-timed figure, which also carries the dispatch."""
    if not environment.gpu_clock_available():
        pytest.fail("a GPU is present but the CUDA extension (and its clock) is not built")
    n = 16 * 2**20  # 64 MiB of float32
    sets = tuple((jnp.full((n,), float(i), jnp.float32), jnp.float32(1)) for i in range(4))
    t = timing.time_jax(lambda a, s: a + s, sets, 4, reps=5, warmup=2, pipeline=10)
    assert t.method == "gpu_clock" and len(t.span) == 5
    span, host = statistics.median(t.span), statistics.median(t.host)
    floor_us = 2 * n * 4 / 10e12 * 1e6
    assert floor_us < span <= 1.02 * host, (span, host)
    assert all(g >= 0 for g in t.gap), t.gap


def test_main_job_runs(tmp_path):
    """`python -m jax_softmax`: the self-check passes and the quick table is printed, timed the
    benchmark's way (run from outside the checkout, so the installed package is imported)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "jax_softmax"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "self-check: PASS" in r.stdout
    how = "on the GPU's clock" if environment.gpu_clock_available() else "from the host"
    assert f"chained in one jit, timed {how}" in r.stdout, r.stdout
    assert len([ln for ln in r.stdout.splitlines() if ln.split()[:1] in (["128"], ["32768"])]) == 2


def test_library_import_loads_no_bench_code(tmp_path):
    """The suite is a package of its own: `import jax_softmax` loads none of it, and
    `python -m jax_softmax bench` finds it (run from outside the checkout, as above)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import jax_softmax, sys; "
                        "print([m for m in sys.modules if 'bench' in m])"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "jax_softmax", "bench", "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "python -m jax_softmax bench attention" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "jax_softmax", "bench", "nonsense"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown bench command 'nonsense'" in r.stderr, r.stderr


def test_sweep_refuses_a_package_without_kernels(monkeypatch, tmp_path):
    """A jax_softmax with no compiled kernel for the backend (e.g. the source tree imported in
    place of the installed package) stops the sweep with a message naming where it came from;
    --standin times its fallback anyway, under a label that says so."""
    import jax_softmax

    monkeypatch.setattr(jax_softmax, "available_platforms", lambda: ())
    with pytest.raises(SystemExit, match="no compiled kernel for platform") as info:
        providers.resolve_api(standin=False)
    assert os.path.dirname(os.path.abspath(jax_softmax.__file__)) in str(info.value)
    api, label, is_standin = providers.resolve_api(standin=True)
    assert api is jax_softmax and label == providers.NO_KERNEL_LABEL and not is_standin
    with pytest.raises(SystemExit, match="no compiled kernel for platform"):
        softmax_sweep.run_softmax(["--quick", "--ns", "32", "--dtypes", "float32", "--modes", "fwd",
                            "--no-plot", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # stopped before writing anything
