"""Collective wait skew and the straggler ranking across ranks, against the raw trace events.

Ground truth is read straight from the generated files (every NCCL kernel's start, matched
across ranks by its occurrence) and from the scenario's config (which rank is slow).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from collections import defaultdict
from pathlib import Path

import pytest

from fixtures.scenarios.generator import PRESETS
from fsdpdoctor.analysis.ranks.crossrank import CrossRankFold
from fsdpdoctor.api import analyze

WORLD = 4


@pytest.fixture(scope="module")
def slow_run(generated_run) -> tuple[Path, object]:
    cfg = dataclasses.replace(
        PRESETS["slow-rank"], world_size=WORLD, num_layers=2, steps=3, hidden_size=512, seq_len=512, vocab_size=1024
    )
    return generated_run(cfg), cfg


def _raw_arrivals(d: Path) -> dict[int, dict[tuple[str, int], float]]:
    """rank → (collective name, occurrence) → kernel start (µs), from the raw JSON."""
    out = {}
    for p in sorted(d.glob("rank*.json.gz")):
        doc = json.loads(gzip.decompress(p.read_bytes()))
        rank = doc["distributedInfo"]["rank"]
        ks = sorted(
            (e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "Collective name" in e.get("args", {})),
            key=lambda e: e["ts"],
        )
        seen: dict[str, int] = defaultdict(int)
        arr = {}
        for k in ks:
            name = k["args"]["Collective name"]
            arr[(name, seen[name])] = float(k["ts"])
            seen[name] += 1
        out[rank] = arr
    return out


def test_wait_skew_matches_raw_kernel_starts(slow_run):
    d, cfg = slow_run
    raw = _raw_arrivals(d)
    keys = set.intersection(*(set(a) for a in raw.values()))
    assert keys and all(set(a) == keys for a in raw.values())
    last = defaultdict(int)
    wait = defaultdict(float)
    skews = []
    for k in keys:
        arr = {r: raw[r][k] for r in raw}
        m = max(arr.values())
        last[min(r for r, a in arr.items() if a == m)] += 1
        for r, a in arr.items():
            wait[r] += m - a
        skews.append(m - min(arr.values()))
    cr = analyze([d]).facts.cross_rank
    assert cr is not None and cr.arrival == "gpu kernel start"
    assert cr.collectives_matched == len(keys)
    got = {w.rank: w for w in cr.ranks}
    assert sorted(got) == list(range(WORLD))
    for r in range(WORLD):
        assert got[r].last_arrivals == last[r]
        assert got[r].wait_ms_per_step == pytest.approx(wait[r] / 1e3 / cfg.steps, abs=1e-6)
    # the config's slow rank arrives last everywhere and heads the ranking (it never waits)
    assert cr.ranks[0].rank == cfg.slow_rank
    assert last[cfg.slow_rank] == len(keys)
    assert cr.top_skew[0].skew_ms == pytest.approx(max(skews) / 1e3, abs=1e-6)
    assert all(s.last_rank == cfg.slow_rank for s in cr.top_skew)


def test_fold_is_order_independent(slow_run):
    d, _ = slow_run
    rf = analyze([d]).facts
    ranks = list(rf.rank_facts)
    random.Random(0).shuffle(ranks)
    fold = CrossRankFold()
    for r in ranks:
        fold.add(r)
    assert fold.result() == rf.cross_rank


def test_two_rank_cpu_run_waits_add_up(recorded_run):
    """Gloo (no kernels): arrivals are CPU issue times; with two ranks the one that is not last
    waits the whole skew, so the ranks' waits sum to the total skew."""
    rf = analyze([recorded_run("per-block")]).facts
    cr = rf.cross_rank
    assert cr is not None and cr.arrival == "cpu issue"
    assert sum(w.last_arrivals for w in cr.ranks) == cr.collectives_matched
    for s in cr.top_skew:
        assert s.ranks == 2 and s.mean_wait_ms == pytest.approx(s.skew_ms, abs=1e-6)
    assert cr.ranks[0].wait_ms_per_step <= cr.ranks[1].wait_ms_per_step


def test_single_rank_has_no_cross_rank(slow_run):
    d, _ = slow_run
    assert analyze([d / "rank0.json.gz"]).facts.cross_rank is None


def test_fold_keeps_the_lowest_ranks_placement_on_a_real_run(shared_traces):
    """HTA's sampled 128-rank trace: its two ranks place some collectives in different phases;
    the fold reports the lowest rank's placement whichever rank arrives first (it used to keep
    the first arrival's, so the same files gave forward or backward by scheduling)."""
    rf = analyze([shared_traces / "hta-sampled-128ranks"]).facts
    ranks = list(rf.rank_facts)
    assert len(ranks) == 2
    results = []
    for order in (ranks, ranks[::-1]):
        fold = CrossRankFold()
        for r in order:
            fold.add(r)
        results.append(fold.result())
    assert results[0] == results[1] == rf.cross_rank
