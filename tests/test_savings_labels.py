"""Labels from measurements (issue #42 item 4): "CPU-bound" / "GPU-bound" from the replay's
sensitivity to each side, and compare / check significance from the runs' own step-to-step spread.

Truth: the generator's regime (a preset built GPU-bound or host-bound), and the recordings' step
times read from the raw traces with plain ``json`` (never fsdpdoctor's step reader).
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import pytest

import fsdpdoctor
from fixtures.scenarios import generator as gen

REC = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
STEP = re.compile(r"ProfilerStep#(\d+)$")


def _raw_steps(run: Path) -> list[float]:
    """Per step index, the mean over the run's ranks of the ProfilerStep span (ms)."""
    per_rank = []
    for path in sorted(run.glob("rank*.json.gz")):
        with gzip.open(path, "rt") as fh:
            events = json.load(fh)["traceEvents"]
        spans = {}
        for e in events:
            m = STEP.match(e.get("name", ""))
            if m and e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op"):
                spans[int(m.group(1))] = max(spans.get(int(m.group(1)), 0.0), float(e["dur"]) / 1e3)
        per_rank.append([spans[k] for k in sorted(spans)])
    n = min(len(x) for x in per_rank)
    return [sum(x[i] for x in per_rank) / len(per_rank) for i in range(n)]


def _two_se(a: list[float], b: list[float]) -> float:
    def var(x):
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / (len(x) - 1)

    return 2 * math.sqrt(var(a) / len(a) + var(b) / len(b))


@pytest.fixture(scope="module")
def runs():
    cache: dict[str, fsdpdoctor.Report] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = fsdpdoctor.analyze(REC / name)
        return cache[name]

    return get


def test_compare_names_no_cause_for_a_change_within_the_runs_spread(runs):
    """per-block -> no-backward-prefetch: +2.08 ms (+3.6%) while each run's own steps span 5.6 and
    16.3 ms: within noise, said so with the spread; no primary cause."""
    from fsdpdoctor.analysis.compare import compare
    from fsdpdoctor.report.comparison import primary_sentence

    a, b = runs("per-block"), runs("no-backward-prefetch")
    c = compare(a.facts, b.facts, a.findings, b.findings)
    xa, xb = _raw_steps(REC / "per-block"), _raw_steps(REC / "no-backward-prefetch")
    assert c.noise_ms == pytest.approx(_two_se(xa, xb), rel=0.02)
    assert abs(c.step_time_delta_ms) < c.noise_ms
    assert not c.significant and c.primary is None
    text = primary_sentence(c)
    assert text.startswith("Within noise") and f"{min(xb):.1f}" in text and f"{max(xb):.1f}" in text


def test_compare_names_a_cause_for_a_change_out_of_the_spread(runs):
    """root-only -> per-block: +36.6 ms, far outside the steps' spread: significant, a cause named."""
    from fsdpdoctor.analysis.compare import compare

    a, b = runs("root-only"), runs("per-block")
    c = compare(a.facts, b.facts, a.findings, b.findings)
    assert c.noise_ms is not None and abs(c.step_time_delta_ms) > c.noise_ms
    assert c.significant and c.primary is not None


def test_check_step_gate_passes_a_rise_within_noise(runs):
    """The step gate fails only on a rise over its limit that also stands out of the spread."""
    from fsdpdoctor.api import LoadedRun
    from fsdpdoctor.check import check_defaults, run_check

    a, b = runs("per-block"), runs("no-backward-prefetch")
    s = check_defaults() | {"max_step_regression_pct": 1.0}
    res = run_check(
        LoadedRun(b.facts, b.findings, "cur", "traces"), LoadedRun(a.facts, a.findings, "base", "traces"), s
    )
    gate = next(g for g in res.gates if g.name == "step-time-regression")
    assert gate.status == "pass" and "within noise" in gate.detail


@pytest.mark.parametrize("preset,side", [("gpu-bound", "gpu"), ("host-bound", "cpu")])
def test_bound_label_is_the_side_whose_speed_up_shortens_the_step(preset, side, analyzed_run):
    """The generator builds the regime: a slow GPU with a full launch queue (GPU-bound), 150 µs of
    Python per op on a small model (host-bound). The label is the side whose 25% speed-up in the
    replay shortens the step more, the other side's by less than half of it."""
    rep = analyzed_run(gen.PRESETS[preset])[0]
    w = rep.facts.whatif
    g, c = w.saving_ms["compute×0.75"], w.saving_ms["cpu×0.75"]
    assert rep.facts.timeline.bound == side, (g, c)
    mine, other = (g, c) if side == "gpu" else (c, g)
    assert other < 0.5 * mine
    assert any(n.startswith(f"{side}-bound from the replay") for n in rep.facts.notes)


def test_gpt2_b96_label_comes_from_the_replay_not_a_busy_cut(runs):
    """The H200 GPT-2 batch-96 run's GPU is busy 86% of the step (under the old 90% cut): its label
    is what the replay measures, the CPU's speed-up shortening the step several times more than
    the GPU's (the GPU waits at FSDP's hooks)."""
    rep = runs("gpu-h200/gpt2-bf16-b96")
    w = rep.facts.whatif
    assert w.saving_ms["cpu×0.75"] > 2 * w.saving_ms["compute×0.75"]
    assert rep.facts.timeline.bound == "cpu"
