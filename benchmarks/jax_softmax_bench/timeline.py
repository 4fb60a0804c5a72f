"""GPU timelines from jax.profiler traces: what ran on the GPU's streams, and a per-step summary
(span, busy and idle time, jax_softmax's kernels, the top kernels). Used by
benchmarks/bench_train_step.py --profile and scripts/profile_cases.py `trace`."""

from __future__ import annotations

import glob
import os


def gpu_timeline(trace_dir: str) -> list:
    """(start ns, duration ns, name) of every event on the GPU's streams in the newest
    jax.profiler trace under trace_dir, in start order; empty where the trace has no GPU (CPU)."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return []
    events = []
    for plane in ProfileData.from_file(files[-1]).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    events.sort()
    return events


def kernel_medians(events: list) -> dict:
    """{kernel name: (launches, median us)} of a GPU timeline (gpu_timeline's events); the median
    is the middle duration (the upper one of an even count)."""
    durations = {}
    for _, duration_ns, name in events:
        durations.setdefault(name, []).append(duration_ns / 1e3)
    return {n: (len(v), sorted(v)[len(v) // 2]) for n, v in durations.items()}


def timeline_summary(events: list, units: int, top: int = 12) -> dict:
    """A GPU timeline of `units` repetitions (training steps, chained calls), per repetition: the
    span from the first event's start to the last one's end, the time some kernel runs (busy: the
    union of the events) and the rest (idle), the time in jax_softmax's own kernels (names that
    contain "jax_softmax", as the mangled ones do), and the `top` kernels by time (launches and
    us). Empty for an empty timeline."""
    if not events or units < 1:
        return {}
    ends = [s + d for s, d, _ in events]
    busy, start, end = 0, events[0][0], ends[0]
    for (s, _, _), e in zip(events[1:], ends[1:]):
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    span = max(ends) - events[0][0]
    per_name = {}
    for _, d, name in events:
        c = per_name.setdefault(name, [0, 0])
        c[0] += 1
        c[1] += d
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"units": units, "span_us": span / 1e3 / units, "busy_us": busy / 1e3 / units,
            "idle_us": (span - busy) / 1e3 / units,
            "jax_softmax_us": sum(t for n, (_, t) in per_name.items() if "jax_softmax" in n) / 1e3 / units,
            "kernels": [{"name": n, "launches": c / units, "us": t / 1e3 / units}
                        for n, (c, t) in ranked]}

