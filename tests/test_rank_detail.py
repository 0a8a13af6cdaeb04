"""A report of many ranks stays small: every rank's summary, full detail for the ranks that matter.

Ground truth: the generated run's config (world size, steps, which rank is slow) and the per-step
figures of the same run's ``--rank-detail all`` document, read as plain JSON.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import statistics
from pathlib import Path

import pytest

from fixtures.scenarios.generator import PRESETS, generate
from fsdpdoctor.analysis.compare import compare
from fsdpdoctor.api import analyze
from fsdpdoctor.facts import AUTO_FULL_RANKS, RunFacts
from fsdpdoctor.schema import validate

from conftest import cli_in_process

WORLD = AUTO_FULL_RANKS + 4  # beyond the size whose ranks are all kept in full


def _cfg(**kw):
    kw = {"slow_factor": 3.0, **kw}
    return dataclasses.replace(
        PRESETS["slow-rank"],
        world_size=WORLD,
        num_layers=2,
        steps=3,
        hidden_size=1024,
        seq_len=512,
        vocab_size=1024,
        slow_rank=13,
        **kw,
    )


def _raw_waits(d: Path) -> dict[int, float]:
    """rank → µs it waited at collectives for the last arrival (NCCL kernel starts matched by
    collective name and occurrence), read from the raw trace files."""
    arrivals: dict[int, dict[tuple[str, int], float]] = {}
    for p in d.glob("rank*.json.gz"):
        doc = json.loads(gzip.decompress(p.read_bytes()))
        seen: dict[str, int] = {}
        arr = arrivals.setdefault(doc["distributedInfo"]["rank"], {})
        for e in sorted(
            (e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "Collective name" in e.get("args", {})),
            key=lambda e: e["ts"],
        ):
            name = e["args"]["Collective name"]
            arr[(name, seen.get(name, 0))] = float(e["ts"])
            seen[name] = seen.get(name, 0) + 1
    keys = set.intersection(*(set(a) for a in arrivals.values()))
    return {r: sum(max(arrivals[q][k] for q in arrivals) - a[k] for k in keys) for r, a in arrivals.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, generated_run) -> dict:
    base = tmp_path_factory.mktemp("detail")
    cfg_a, cfg_b = _cfg(), _cfg(slow_factor=1.0)
    a, b = generated_run(cfg_a), generated_run(cfg_b)  # shared by the session: read only
    rep_a, rep_b = analyze([a]), analyze([b])
    out = {"cfg": cfg_a, "dir": a, "waits": _raw_waits(a), "report": rep_a}
    for name, rep in (("a", rep_a), ("b", rep_b)):
        for pol in ("all", "auto", "none"):
            p = base / f"{name}-{pol}.json"
            p.write_text(rep.to_json(rank_detail=pol))
            out[name, pol] = p
    return out


def _doc(p: Path) -> dict:
    return json.loads(p.read_text())


def test_every_policy_validates_and_summarises_every_rank(runs):
    cfg = runs["cfg"]
    for pol in ("all", "auto", "none"):
        d = _doc(runs["a", pol])
        validate(d)
        assert d["rank_detail"] == pol
        assert [s["rank"] for s in d["rank_summaries"]] == list(range(cfg.world_size))
        assert all(s["steps"] == cfg.steps for s in d["rank_summaries"])
        assert d == json.loads(json.dumps(runs["report"].to_dict(pol)))  # to_json encodes what to_dict holds
        full = {r["rank"] for r in d["rank_facts"]}
        assert {s["rank"] for s in d["rank_summaries"] if s["detail"] == "full"} == full
    assert len(_doc(runs["a", "all"])["rank_facts"]) == cfg.world_size
    assert _doc(runs["a", "none"])["rank_facts"] == []


def test_auto_keeps_the_ranks_that_matter(runs):
    cfg = runs["cfg"]
    d = _doc(runs["a", "auto"])
    reasons = {s["rank"]: s["detail_reasons"] for s in d["rank_summaries"] if s["detail_reasons"]}
    waits = runs["waits"]
    straggler = min(waits, key=lambda r: (waits[r], r))  # the others wait for it
    assert straggler == cfg.slow_rank  # (the config's slow rank)
    assert "straggler" in reasons[straggler]
    assert "first" in reasons[0]
    assert {r["rank"] for r in d["rank_facts"]} == set(reasons)
    assert len(reasons) <= 6
    # the lowest overlap, read from the full document's per-rank overlap
    full = _doc(runs["a", "all"])
    low = min(full["rank_facts"], key=lambda r: (r["overlap_pct"], r["rank"]))["rank"]
    assert "lowest-overlap" in reasons[low]


def test_summaries_agree_with_the_per_step_detail(runs):
    full = _doc(runs["a", "all"])
    sums = {s["rank"]: s for s in _doc(runs["a", "none"])["rank_summaries"]}
    for r in full["rank_facts"]:
        s = sums[r["rank"]]
        ms = [st["step_ms"] for st in r["steps"]]
        assert s["step_ms"] == pytest.approx(statistics.fmean(ms), rel=1e-12)
        assert (s["step_min_ms"], s["step_max_ms"]) == (min(ms), max(ms))
        assert s["step_numbers"] == [st["number"] for st in r["steps"]]
        for key in ("compute_ms", "exposed_comm_ms", "idle_ms", "gpu_busy_ms", "cpu_span_ms"):
            assert s["mean_step"][key] == pytest.approx(
                statistics.fmean(st[key] for st in r["steps"]), rel=1e-9, abs=1e-12
            )
        n = len(r["steps"])
        by = {}
        for c in r["collectives"]:
            if 0 <= c["step"] < n and c["exposed_us"] > 0:
                by[(c["phase"], c["kind"])] = by.get((c["phase"], c["kind"]), 0.0) + c["exposed_us"] / 1e3 / n
        got = {(p, k): v for p, ks in s["exposed_ms_by_phase_kind"].items() for k, v in ks.items()}
        assert got == pytest.approx(by)
        assert s["collectives"] == len(r["collectives"])


def _table(c) -> tuple[list, list[float]]:
    """(labels, numbers) of a comparison: its components, per-rank rows and step times."""
    labels = [(x.name, x.phase) for x in c.components] + [r.rank for r in c.ranks]
    nums = [v for x in c.components for v in (x.before_ms, x.after_ms)]
    nums += [
        v or 0.0 for r in c.ranks for v in (r.step_before_ms, r.step_after_ms, r.exposed_before_ms, r.exposed_after_ms)
    ]
    return labels, nums + [c.step_before_ms, c.step_after_ms]


def test_compare_reads_summarised_ranks_as_it_reads_full_ones(runs):
    ref = compare(RunFacts.load(runs["a", "all"]), RunFacts.load(runs["b", "all"]))
    labels, nums = _table(ref)
    assert ref.step_after_ms != ref.step_before_ms  # the two runs differ
    for pa, pb in (("auto", "auto"), ("none", "none"), ("none", "all")):
        c = compare(RunFacts.load(runs["a", pa]), RunFacts.load(runs["b", pb]))
        got_labels, got = _table(c)
        assert got_labels == labels
        assert got == pytest.approx(nums, rel=1e-9, abs=1e-12)
        assert c.alignment["steps"] == ref.alignment["steps"]


def test_auto_report_grows_by_the_summary_only(runs):
    all_b, auto_b, none_b = (runs["a", p].stat().st_size for p in ("all", "auto", "none"))
    d = _doc(runs["a", "auto"])
    per_rank = (
        none_b - len(json.dumps({k: v for k, v in d.items() if k not in ("rank_summaries", "rank_facts")}, indent=2))
    ) / WORLD
    # bytes of one summary line (its RankFacts is several times that); 3,127 since its mean step
    # carries the step-clock split (StepFacts.clock_parts_ms) and the op-number coverage, 3,702
    # since it also carries compare's instant-by-instant split (StepFacts.clock_split_ms)
    assert per_rank < 4000
    assert auto_b < all_b / 2


def test_small_runs_keep_every_rank_under_auto(tmp_path):
    cfg = dataclasses.replace(_cfg(), world_size=4, slow_rank=1)
    d = json.loads(analyze([generate(cfg, tmp_path / "small")]).to_json())
    assert d["rank_detail"] == "auto"
    assert [r["rank"] for r in d["rank_facts"]] == [0, 1, 2, 3]


def test_cli_rank_detail_option(runs, tmp_path):
    out = tmp_path / "r.json"
    code, text = cli_in_process(
        ["analyze", str(runs["dir"]), "--format", "json", "--rank-detail", "none", "-o", str(out)]
    )
    assert code == 0, text
    d = json.loads(out.read_text())
    assert d["rank_facts"] == [] and len(d["rank_summaries"]) == WORLD
    code, text = cli_in_process(["analyze", str(runs["dir"]), "--rank-detail", "some"])
    assert code == 2 and "some" in text


def test_the_client_keeps_one_copy_of_each_string():
    """Each rank's result is unpickled with its own copies of the same dict keys and labels: the
    client shares them (share_strings), leaving every value equal."""
    import pickle

    from fsdpdoctor.analysis.ranks import analyze_one, share_strings

    recorded = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu" / "fsdp2" / "rank0.json.gz"
    rf, _ = analyze_one(str(recorded), 0)
    blob = pickle.dumps(rf)
    a, b = pickle.loads(blob), pickle.loads(blob)
    ka, kb = next(iter(a.steps[0].phase_ms)), next(iter(b.steps[0].phase_ms))
    assert ka == kb and ka is not kb  # what unpickling gives
    pool: dict[str, str] = {}
    share_strings(a, pool)
    share_strings(b, pool)
    assert a == rf and b == rf
    ka, kb = next(iter(a.steps[0].phase_ms)), next(iter(b.steps[0].phase_ms))
    assert ka is kb
    assert a.fsdp.units[1].fqn is b.fsdp.units[1].fqn and a.phase_method is b.phase_method


@pytest.fixture(scope="module")
def lean_load(runs):
    """The run read twice: every rank whole, and with only the first 4 in detail, so that the
    client makes most of the others lean as they arrive."""
    from fsdpdoctor.analysis.ranks import load_ranks
    from fsdpdoctor.ingest.discover import discover

    files = discover([runs["dir"]])
    full = load_ranks(files, detail_ranks=None)
    first = {r.rank for r in full.ranks if r.path in {str(f) for f in files[:4]}}  # the 4 sent with their collectives
    return full, load_ranks(files, detail_ranks=4), first


def test_lean_ranks_change_no_run_figure(runs, lean_load):
    """Ranks the client keeps lean (one mean step, no FSDP units) give the run the same figures,
    summaries and findings as every rank kept whole; the whole ones are the ranks the report's
    detail names."""
    from fsdpdoctor.analysis.ranks import fold
    from fsdpdoctor.engine import run_rules

    full, lean, first = lean_load
    assert not full.arrived.lean and len(lean.arrived.lean) >= WORLD - 4 - 6
    assert len(first) == 4 and not first & lean.arrived.lean
    a = fold(full.ranks, full.excluded, full.cross_rank, arrived=full.arrived)
    b = fold(lean.ranks, lean.excluded, lean.cross_rank, arrived=lean.arrived)
    for attr in (
        "steps",
        "overlap",
        "exposed_comm",
        "timeline",
        "collectives",
        "whatif",
        "compute",
        "fsdp",
        "cross_rank",
        "world_size",
        "workload",
        "ranks",
        "inputs",
    ):
        assert getattr(b, attr) == getattr(a, attr), attr
    assert b.rank_summaries == a.rank_summaries
    # facts that hold the ranks that matter cannot write every rank: "all" is written as "auto"
    assert (a.rank_detail, b.rank_detail) == ("all", "auto")
    ranks, sums, policy = b.ranks_to_write("all")
    assert policy == "auto" and len(sums) == WORLD and {r.rank for r in ranks} < {r.rank for r in b.rank_facts}
    kept = {r.rank for r in b.rank_facts}
    assert kept == set(range(WORLD)) - lean.arrived.lean
    named = {s.rank for s in a.rank_summaries if s.detail_reasons}
    assert named <= kept and runs["cfg"].slow_rank not in first  # the straggler: read again if it was lean
    assert [f.code for f in run_rules(b)] == [f.code for f in run_rules(a)]
    # the step figures over every step, from the --rank-detail all document read as plain JSON
    times = [st["step_ms"] for r in _doc(runs["a", "all"])["rank_facts"] for st in r["steps"]]
    assert b.steps.median_ms == pytest.approx(statistics.median(times), rel=1e-12)
    assert (b.steps.min_ms, b.steps.max_ms) == (min(times), max(times))
    assert b.step_times() == {
        r["rank"]: [st["step_ms"] for st in r["steps"]] for r in _doc(runs["a", "all"])["rank_facts"]
    }


def test_a_lean_rank_holds_a_fraction_of_a_whole_one(lean_load):
    import pickle

    full, lean, _ = lean_load
    r = next(iter(sorted(lean.arrived.lean)))
    whole, cut = next(x for x in full.ranks if x.rank == r), next(x for x in lean.ranks if x.rank == r)
    assert len(cut.steps) == 1 and not cut.fsdp.units and not cut.collectives
    assert cut.fsdp.version == whole.fsdp.version and whole.compute is not None and whole.whatif is not None
    assert (cut.compute, cut.whatif, cut.collective_stats) == (None, None, [])  # folded as it arrived
    assert (cut.rank, cut.path, cut.world_size, cut.backlog_ms) == (
        whole.rank,
        whole.path,
        whole.world_size,
        whole.backlog_ms,
    )
    summary = lean.arrived.summaries[r]  # kept for every rank: what the lean rank adds to it
    assert cut.steps[0] is summary.mean_step
    assert len(pickle.dumps((summary, cut))) - len(pickle.dumps(summary)) < len(pickle.dumps(whole)) / 5


def test_step_times_of_summarised_ranks(runs):
    """RunFacts.step_times(): every rank's step times, from the summary line of a rank written
    without its RankFacts."""
    want = {r["rank"]: [st["step_ms"] for st in r["steps"]] for r in _doc(runs["a", "all"])["rank_facts"]}
    for pol in ("auto", "none"):
        assert RunFacts.load(runs["a", pol]).step_times() == want


def test_a_lean_straggler_is_read_again(runs, monkeypatch):
    """The straggler is known only when every rank is in: kept lean until then (here no other
    reason keeps it), its file is read again so that the report's detail holds it whole."""
    from fsdpdoctor.analysis import ranks as R
    from fsdpdoctor.ingest.discover import discover

    monkeypatch.setattr(R, "_CANDIDATE_KEYS", {k: v for k, v in R._CANDIDATE_KEYS.items() if k in ("first", "fsdp")})
    files = discover([runs["dir"]])
    slow = runs["cfg"].slow_rank
    assert str(runs["dir"] / f"rank{slow}.json.gz") not in {str(f) for f in files[:4]}
    load = R.load_ranks(files, detail_ranks=4)
    assert load.cross_rank.ranks[0].rank == slow
    assert slow not in load.arrived.lean
    r = next(x for x in load.ranks if x.rank == slow)
    whole = _doc(runs["a", "all"])["rank_facts"][slow]
    assert [s.step_ms for s in r.steps] == [st["step_ms"] for st in whole["steps"]]
    assert len(r.fsdp.units) == len(whole["fsdp"]["units"]) and r.compute is not None
    assert load.arrived.lean == set(range(WORLD)) - first_four(files, load) - {slow}  # "first" and "fsdp": rank 0


def first_four(files, load) -> set[int]:
    paths = {str(f) for f in files[:4]}
    return {r.rank for r in load.ranks if r.path in paths}
