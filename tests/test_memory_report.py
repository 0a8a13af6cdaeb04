"""Memory through the whole pipeline: --memory on analyze, the memory command, report sections."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpdoctor
from fsdpdoctor.analysis.memory import analyze_memory
from fsdpdoctor.facts import MEMORY_CATEGORIES

from fixtures.snapshots import gen_snapshot as gen

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    out = tmp_path_factory.mktemp("snap")
    path, truth = gen.write("fsdp2", out)
    return path, json.loads(Path(truth).read_text()) if isinstance(truth, (str, Path)) else truth


def test_analyze_with_memory_reports_the_json_contract(snap):
    path, _ = snap
    rep = fsdpdoctor.analyze(REPO / "fixtures" / "recorded" / "per-block", memory=[path])
    d = json.loads(rep.to_json())
    want = analyze_memory(path)
    assert d["memory"]["peak_allocated_bytes"] == want.peak_allocated_bytes > 0
    assert d["memory"]["reserved_at_peak_bytes"] == want.reserved_at_peak_bytes
    assert set(d["memory"]["categories"]) == set(MEMORY_CATEGORIES)
    assert sum(d["memory"]["categories"].values()) == want.peak_allocated_bytes
    assert "peak_time_us" in d["memory"]
    md = rep.to_markdown()
    assert "Memory at the peak" in md and "Reserved memory at the peak" in md


def test_memory_directory_picks_the_highest_peak(snap, tmp_path):
    path, _ = snap
    other, _ = gen.write("fsdp1", tmp_path)
    rep = fsdpdoctor.api.analyze_memory_only([path.parent, tmp_path])
    peaks = rep.facts.memory_per_input
    assert len(peaks) == 2
    assert rep.facts.memory.peak_allocated_bytes == max(peaks.values())


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_memory_command_rejects_a_malicious_pickle_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps(_Evil(marker)))
    out = subprocess.run([sys.executable, "-m", "fsdpdoctor", "memory", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert str(bad) in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_memory_command_on_generated_oom(tmp_path):
    path, _ = gen.write("fsdp2_oom", tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "memory", str(path), "--format", "json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    slugs = [f["slug"] for f in d["findings"]]
    assert "oom" in slugs and d["memory"]["oom"]["requested_bytes"] > 0


def test_trace_memory_events_give_the_curve_without_a_snapshot(snap):
    """A real trace recorded with profile_memory=True: peak and reserved from its [memory]
    events, checked against an independent read of the JSON."""
    import gzip

    from conftest import PUBLIC_TRACES

    trace = PUBLIC_TRACES / "hta-df-index-v100" / "rank-1.json.gz"
    if not trace.exists():
        pytest.skip("../shared/traces/public is absent")
    events = [
        e["args"]
        for e in json.load(gzip.open(trace))["traceEvents"]
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 1
    ]
    peak = max(a["Total Allocated"] for a in events)
    at_peak = next(a for a in events if a["Total Allocated"] == peak)
    m = fsdpdoctor.analyze(trace).facts.memory
    assert m.source == "trace [memory] events"
    assert m.peak_allocated_bytes == peak == 6629508096
    assert m.reserved_at_peak_bytes == at_peak["Total Reserved"]
    assert m.n_events == len(events) and len(m.curve.x) <= 501
    # a snapshot, when given, is the better source and wins
    path, _ = snap
    assert fsdpdoctor.analyze(trace, memory=[path]).facts.memory.source == "snapshot"


def test_report_names_the_instant_and_both_peaks(tmp_path):
    """FSDP2 frees its all-gather buffers on the all-gather stream, so memory_viz's active peak
    (the generator's truth) is above max_memory_allocated; the report shows both and says which
    instant the category table describes."""
    path, truth = gen.write("fsdp2", tmp_path)
    truth = json.loads(Path(truth).read_text())
    rep = fsdpdoctor.api.analyze_memory_only(path)
    d = json.loads(rep.to_json())["memory"]
    assert d["categories_instant"] == "peak_allocated"
    assert (
        d["peak_active_bytes"]
        == truth["peak_active_bytes"]
        > d["peak_allocated_bytes"]
        == truth["peak_allocated_bytes"]
    )
    assert sum(d["categories_at_active_peak"].values()) == truth["peak_active_bytes"]
    md = rep.to_markdown()
    assert "Active peak" in md and "at active peak" in md
    assert f"event {truth['peak_event_index']}, during backward" in md


def test_trace_memory_curve_keeps_every_steps_peak():
    """Drift fixed in the split (#37): the curve from a trace's [memory] events sampled 500
    evenly spaced events plus the global peak (501 points, above the 500 MemoryFacts promises),
    so the peaks of the other steps fell between samples. It now shares the snapshot's
    downsampling: each bucket's highest point. Ten steps of 1,000 events each, every step with
    a one-event spike of its own height at an odd offset: each spike is in the curve."""
    import numpy as np

    from fsdpdoctor.analysis.memory.curve import CURVE_POINTS
    from fsdpdoctor.analysis.memory.trace_events import memory_from_events

    n_steps, per = 10, 1000
    ts = np.arange(n_steps * per, dtype=np.float64) * 10.0
    allocated = np.full(ts.size, 1 << 30, dtype=np.float64)
    spikes = {}
    for s in range(n_steps):
        i = s * per + 101 + 37 * s  # where the step's largest tensor lives, one event long
        allocated[i] = (2 << 30) + s * (64 << 20)
        spikes[s] = (ts[i], int(allocated[i]))
    events = np.column_stack([ts, np.ones_like(ts), np.zeros_like(ts), allocated, allocated + (1 << 29)])
    m = memory_from_events("synthetic", events)
    curve = m.curve
    assert len(curve.x) <= CURVE_POINTS
    assert m.peak_allocated_bytes == spikes[n_steps - 1][1]
    points = dict(zip(curve.x, curve.allocated, strict=True))
    for s, (t, height) in spikes.items():
        assert points.get(t) == height, f"step {s}'s peak ({height} bytes at {t} us) is not in the curve"
