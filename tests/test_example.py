"""examples/train_lm.py trains briefly, with and without the jax_softmax attention plug-in."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train_step.py"
TINY = dict(steps=5, seq_len=16, batch=8, d_model=32, layers=1, heads=2, vocab=16, lr=1e-2)


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plugin_run(train_lm):
    return train_lm.train(**TINY, use_plugin=True, verbose=False)


def test_loss_decreases(plugin_run):
    losses = plugin_run["losses"]
    assert len(losses) == TINY["steps"]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert plugin_run["attention"] == "jax_softmax"
    assert plugin_run["steps_per_sec"] > 0


def test_plugin_matches_flax_default(train_lm, plugin_run):
    ref = train_lm.train(**TINY, use_plugin=False, verbose=False)
    assert ref["attention"] == "flax default"
    # same init, same data: the first loss agrees to float32 rounding, later ones stay close
    assert plugin_run["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-5)
    assert plugin_run["losses"] == pytest.approx(ref["losses"], rel=1e-3)


def test_cli_bfloat16(train_lm, capsys):
    result = train_lm.main(
        ["--steps", "3", "--seq-len", "8", "--batch", "4", "--d-model", "16", "--layers", "1", "--heads", "2",
         "--vocab", "16", "--dtype", "bfloat16", "--dropout", "0.1"]
    )
    out = capsys.readouterr().out
    assert "attention=jax_softmax" in out and "steps/s" in out
    assert out.count("loss ") >= 3
    assert all(math.isfinite(v) for v in result["losses"])


def test_traced_steps(train_lm, tmp_path):
    """train(trace_dir=...) leaves a jax.profiler trace of the extra steps; on a GPU its timeline
    holds jax_softmax's kernels, elsewhere it has no GPU events."""
    from conftest import gpu_available

    from jax_softmax_bench.timeline import gpu_timeline, timeline_summary

    run = train_lm.train(**{**TINY, "steps": 3}, use_plugin=True, verbose=False,
                         trace_dir=str(tmp_path), trace_steps=2)
    assert len(run["losses"]) == 3
    assert list(tmp_path.glob("**/*.xplane.pb"))
    events = gpu_timeline(str(tmp_path))
    if gpu_available():
        assert timeline_summary(events, 2)["jax_softmax_us"] > 0
    else:
        assert events == []


def test_train_step_bench_profile(tmp_path):
    """bench_train_step.py --profile at a tiny size: both models, dropout on and off, every variant
    that applies timed twice (--repeats 2): each point holds every run, their median and best, the
    speedup over Flax and a timeline (empty without a GPU); cuDNN, where it does not apply (no
    CUDA GPU), is skipped with the reason."""
    import json

    from conftest import gpu_available

    spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path), "--tag", "t", "--seq-lens", "16", "--tokens", "32",
                 "--steps", "2", "--d-model", "16", "--layers", "1", "--heads", "2", "--profile",
                 "--trace-steps", "2", "--repeats", "2", "--dtype", "float32"])
    data = json.loads((tmp_path / "t.json").read_text())
    points = {(p["model"], p["dropout"]): p for p in data["points"]}
    assert sorted(points) == [("linen", 0.0), ("linen", 0.1), ("lm", 0.0), ("lm", 0.1)]
    for (model, dropout), point in points.items():
        assert point["seq_len"] == 16 and point["batch"] == 2
        variants = point["variants"]
        assert list(variants) == (["flax", "plugin", "jax_softmax", "flash"] if dropout
                                  else ["flax", "plugin", "jax_softmax", "cudnn"])
        for name, v in variants.items():
            if "skipped" in v:
                # cuDNN and the flash kernels refuse this float32 model: on a CPU for want of a
                # CUDA GPU, on a GPU for the dtype.
                reason = "dtype float32" if gpu_available() else "not a CUDA GPU"
                assert name in ("cudnn", "flash") and reason in v["skipped"], v["skipped"]
                continue
            assert len(v["runs"]) == 2 and min(v["runs"]) > 0
            assert v["steps_per_s"] == pytest.approx(sum(v["runs"]) / 2)  # the median of two
            assert v["best_steps_per_s"] == max(v["runs"])
            assert v["speedup"] == pytest.approx(v["steps_per_s"] / variants["flax"]["steps_per_s"])
            assert isinstance(v["timeline"], dict) and np.isfinite(v["final_loss"])
    assert isinstance(data["meta"]["jax_softmax_env"], dict)
    if importlib.util.find_spec("matplotlib") is not None:  # the plot needs it ([bench] extra)
        assert (tmp_path / "t.png").exists()
    # --merge: a run of one model keeps the other model's points from the earlier file.
    module.main(["--out", str(tmp_path), "--tag", "u", "--models", "lm", "--dropouts", "0",
                 "--variants", "flax", "jax_softmax", "--seq-lens", "16", "--tokens", "32",
                 "--steps", "1", "--d-model", "16", "--layers", "1", "--heads", "2",
                 "--repeats", "1", "--dtype", "float32", "--merge", str(tmp_path / "t.json")])
    merged = json.loads((tmp_path / "u.json").read_text())
    assert [(p["model"], p["dropout"]) for p in merged["points"]] == [
        ("linen", 0.1), ("linen", 0.0), ("lm", 0.0)]
    assert merged["points"][:2] == [points[("linen", 0.1)], points[("linen", 0.0)]]
    assert merged["meta"]["merged"]["models"] == ["linen"]
    assert list(merged["points"][2]["variants"]) == ["flax", "jax_softmax"]


def test_train_step_bench_ab_run(tmp_path):
    """bench_train_step.py as an A/B run between builds uses it (session 48): in its own process
    (XLA_FLAGS for --dump-hlo must be set before JAX starts), for the package first on
    PYTHONPATH, one run of each variant: the point holds both steps/s and their ratio, the meta
    the package that ran and the revision named, and each variant's optimized training-step HLO is
    kept (our custom call in the plug-in's only)."""
    import json
    import os
    import subprocess
    import sys

    import jax_softmax

    site = str(Path(jax_softmax.__file__).resolve().parents[1])  # the package these tests test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])),
           "JAX_SOFTMAX_GIT_REV": "abc1234"}
    hlo = tmp_path / "hlo"
    r = subprocess.run([sys.executable, str(BENCH), "--out", str(tmp_path), "--tag", "t", "--repeats", "1",
                        "--models", "lm", "--dropouts", "0", "--variants", "flax", "jax_softmax",
                        "--seq-lens", "16", "--tokens", "32", "--steps", "3", "--d-model", "16",
                        "--layers", "1", "--heads", "2", "--dtype", "float32", "--dump-hlo", str(hlo)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "t.json").read_text())
    (point,) = data["points"]
    assert point["seq_len"] == 16 and point["batch"] == 2
    assert os.path.samefile(data["meta"]["jax_softmax_path"], os.path.join(site, "jax_softmax"))
    assert data["meta"]["git"] == "abc1234"
    flax, ours = point["variants"]["flax"], point["variants"]["jax_softmax"]
    assert flax["runs"] == [flax["steps_per_s"]] and ours["steps_per_s"] > 0
    assert ours["speedup"] == pytest.approx(ours["steps_per_s"] / flax["steps_per_s"])
    for variant in ("flax", "jax_softmax"):
        (text,) = [f.read_text() for f in (hlo / f"t_lm_S16_p0_{variant}").glob("*train_step*after_optimizations.txt")]
        assert ('custom_call_target="jax_softmax' in text) == (variant == "jax_softmax")


def test_train_step_bench_dump_hlo_needs_own_process(tmp_path, monkeypatch):
    """In a process whose JAX backend already started, --dump-hlo gets no HLO from XLA and says
    why instead of leaving empty directories."""
    import os

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored for later subprocesses
    spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import jax

    jax.devices()  # the backend has started
    with pytest.raises(SystemExit, match="process of its own"):
        module.main(["--out", str(tmp_path), "--tag", "t", "--repeats", "1", "--seq-lens", "16",
                     "--tokens", "32", "--steps", "2", "--d-model", "16", "--layers", "1",
                     "--heads", "2", "--models", "lm", "--dropouts", "0", "--variants", "flax",
                     "--dump-hlo", str(tmp_path / "hlo")])
    assert not (tmp_path / "hlo").exists()
