"""``analyze --format perfetto``: the ranks' traces merged, fsdpdoctor's tracks beside them.

Every figure here is read back from the written file with the standard library (gzip + json),
and checked against the JSON report of the same run or against the raw input files read the same
way; HTA's trace parser (a real consumer) loads the merged file.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
from pathlib import Path

import pytest

import fsdpdoctor
from fsdpdoctor.api import Report
from fsdpdoctor.facts import RunFacts
from fsdpdoctor.report.perfetto import write

from conftest import PUBLIC_TRACES, cli_in_process

DLRM = "param-dlrm-v100-8ranks"
US = 1e-3  # ms: a slice's ts/dur are written in µs; epoch timestamps keep ~0.25 µs of precision


def _read(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def _tracks(doc: dict):
    """(process names by pid, thread names by (pid, tid), the fsdpdoctor X events)."""
    ev = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "thread_name"}
    mine = [e for e in ev if e.get("cat") == "fsdpdoctor" and e.get("ph") == "X"]
    return procs, threads, mine


def _rank_of(procs: dict, pid) -> int:
    return int(procs[pid].removeprefix("rank "))


def _raw_counts(path: Path) -> collections.Counter:
    with gzip.open(path, "rt") as fh:
        d = json.load(fh)
    ev = d["traceEvents"] if isinstance(d, dict) else d
    return collections.Counter((e.get("ph"), e.get("cat")) for e in ev if isinstance(e, dict) and e.get("ph") != "M")


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory):
    """(merged-file document, JSON report document, report, path) of the public 8-rank DLRM run."""
    if not (PUBLIC_TRACES / DLRM).is_dir():
        pytest.skip(f"../shared/traces/public/{DLRM} is absent")
    rep = fsdpdoctor.analyze(PUBLIC_TRACES / DLRM, spans=True)
    out = tmp_path_factory.mktemp("perfetto") / "dlrm.json.gz"
    write(rep, out)
    return _read(out), json.loads(rep.to_json()), rep, out


def test_one_process_per_rank_with_its_events_unchanged(dlrm):
    doc, js, _, _ = dlrm
    procs, threads, _ = _tracks(doc)
    assert sorted(procs.values()) == [f"rank {r}" for r in range(8)]
    by_rank = collections.defaultdict(collections.Counter)
    for e in doc["traceEvents"]:
        if e.get("ph") != "M" and e.get("cat") != "fsdpdoctor":
            by_rank[_rank_of(procs, e["pid"])][(e.get("ph"), e.get("cat"))] += 1
    for rf in js["rank_facts"]:  # every event of the input file, in its rank's process
        assert by_rank[rf["rank"]] == _raw_counts(Path(rf["path"]))
    # … with its name, times and args as they were
    r0 = next(rf for rf in js["rank_facts"] if rf["rank"] == 0)
    with gzip.open(r0["path"], "rt") as fh:
        raw = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    pid0 = next(p for p, n in procs.items() if n == "rank 0")
    got = [
        e for e in doc["traceEvents"] if e.get("pid") == pid0 and e.get("ph") == "X" and e.get("cat") != "fsdpdoctor"
    ]
    key = lambda e: (e["ts"], e["dur"], e["name"], json.dumps(e.get("args"), sort_keys=True))  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, raw))
    # valid Chrome trace events: integer processes and threads, no negative duration
    for e in doc["traceEvents"]:
        assert isinstance(e["pid"], int) and (e["ph"] == "M" or isinstance(e["tid"], int))
        assert e.get("dur", 0) >= 0
    # flows stay within one rank: each flow id starts once and ends once over the merged file
    starts = collections.Counter(e["id"] for e in doc["traceEvents"] if e.get("ph") == "s")
    assert starts and max(starts.values()) == 1
    names = set(threads.values())
    assert {"fsdpdoctor waterfall", "fsdpdoctor exposed comm", "fsdpdoctor GPU idle"} <= names


def test_waterfall_slices_add_up_to_the_report(dlrm):
    doc, js, _, _ = dlrm
    procs, threads, mine = _tracks(doc)
    parts, steps = collections.defaultdict(float), collections.Counter()
    for e in mine:
        if threads[(e["pid"], e["tid"])] != "fsdpdoctor waterfall":
            continue
        r = _rank_of(procs, e["pid"])
        if e["name"].startswith("step "):
            steps[r] += 1
        else:
            parts[(r, e["args"]["part"])] += e["dur"] / 1e3
    checked = 0
    for rf in js["rank_facts"]:
        r, want = rf["rank"], rf["efficiency"]["parts_ms"]
        assert steps[r] == len(rf["steps"])
        for part, ms in want.items():
            got = parts.get((r, part), 0.0) / steps[r]
            assert got == pytest.approx(ms, rel=0.01, abs=US), (r, part)
            checked += ms > 0
    assert checked >= 8 * 4
    # the run's waterfall is the mean of the ranks' (same step clock here)
    for part, ms in js["efficiency"]["parts_ms"].items():
        mean = sum(parts.get((r, part), 0.0) / steps[r] for r in steps) / len(steps)
        assert mean == pytest.approx(ms, rel=0.01, abs=US), part


def test_exposed_and_idle_spans_add_up_to_the_report(dlrm):
    doc, js, _, _ = dlrm
    procs, threads, mine = _tracks(doc)
    exposed, idle = collections.defaultdict(float), collections.defaultdict(float)
    for e in mine:
        th, r = threads[(e["pid"], e["tid"])], _rank_of(procs, e["pid"])
        if th == "fsdpdoctor exposed comm":
            exposed[r] += e["dur"] / 1e3
            assert e["args"]["kind"] and e["name"] == f"exposed {e['args']['kind']}"
        elif th == "fsdpdoctor GPU idle":
            idle[(r, e["args"]["cause"])] += e["dur"] / 1e3
    for rf in js["rank_facts"]:
        r, n = rf["rank"], len(rf["steps"])
        assert exposed[r] / n == pytest.approx(js["exposed_comm"]["per_rank"][str(r)], rel=0.01, abs=US)
        eff = rf["efficiency"]
        assert sum(v for (rk, _), v in idle.items() if rk == r) / n == pytest.approx(
            eff["parts_ms"]["gpu_idle"], rel=0.01
        )
        for cause, ms in eff["idle_ms"].items():
            assert idle[(r, cause)] / n == pytest.approx(ms, rel=0.01, abs=US), (r, cause)


def test_each_finding_is_a_slice_with_its_code_summary_and_saving(dlrm):
    doc, js, _, _ = dlrm
    procs, threads, mine = _tracks(doc)
    drawn = collections.defaultdict(set)
    for e in mine:
        a = e["args"]
        if "code" in a:
            drawn[a["code"]].add(_rank_of(procs, e["pid"]))
            f = next(x for x in js["findings"] if x["code"] == a["code"])
            assert a["summary"] == f["summary"]
            assert a.get("saving_ms_per_step") == f["est_saving_ms"]
            assert threads[(e["pid"], e["tid"])] == f"fsdpdoctor {f['code']} {f['slug']}"
    assert set(drawn) == {f["code"] for f in js["findings"]}
    for f in js["findings"]:
        rank = f["where"].get("rank")
        assert drawn[f["code"]] == ({rank} if isinstance(rank, int) else set(range(8))), f["code"]
    straggler = next(f for f in js["findings"] if f["code"] == "FSD009")
    assert drawn["FSD009"] == {straggler["where"]["rank"]} == {7}
    # the sync finding is drawn over the idle its call site drained, as much as the report says
    sync = next(f for f in js["findings"] if f["code"] == "FSD018")
    for rf in js["rank_facts"]:
        pid = next(p for p, n in procs.items() if n == f"rank {rf['rank']}")
        ms = sum(e["dur"] for e in mine if e["pid"] == pid and e["args"].get("code") == "FSD018") / 1e3
        want = next(x for x in rf["efficiency"]["syncs"] if x["site"] == sync["where"]["site"])
        assert ms / len(rf["steps"]) == pytest.approx(want["gpu_idle_ms_per_step"], rel=0.01, abs=US)


def test_h200_steps_and_the_hook_finding(tmp_path):
    """A real H200 GPT-2 FSDP2 recording (fixtures/recorded, 3 steps): the parts of every step
    add up to the report's, and the hook finding is drawn over the GPU idle that hook caused, as
    much of it as the report's hook table says."""
    run = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu-h200" / "gpt2-bf16-b96"
    rep = fsdpdoctor.analyze(run, spans=True)
    write(rep, tmp_path / "h200.json.gz")
    js = json.loads(rep.to_json())
    procs, threads, mine = _tracks(_read(tmp_path / "h200.json.gz"))
    (rf,) = js["rank_facts"]
    n = len(rf["steps"])
    assert n == 3
    parts = collections.defaultdict(float)
    steps = [e for e in mine if threads[(e["pid"], e["tid"])] == "fsdpdoctor waterfall" and "part" not in e["args"]]
    for e in mine:
        if "part" in e.get("args", {}):
            parts[e["args"]["part"]] += e["dur"] / 1e3
    assert len(steps) == n
    for st, e in zip(rf["steps"], sorted(steps, key=lambda e: e["ts"])):
        assert e["dur"] / 1e3 == pytest.approx(st["step_ms"], abs=US)
    for part, ms in rf["efficiency"]["parts_ms"].items():
        assert parts[part] / n == pytest.approx(ms, rel=0.01, abs=US), part
    hook = next(f for f in js["findings"] if f["code"] == "FSD016")
    unit, name = hook["where"]["unit"], hook["where"]["hook"]
    drawn = [e for e in mine if e["args"].get("code") == "FSD016"]
    assert drawn and all(e["args"]["over"] == f"GPU idle at {unit} {name}" for e in drawn)
    want = next(h for h in rf["efficiency"]["hooks"] if (h["unit"], h["hook"]) == (unit, name))
    assert sum(e["dur"] for e in drawn) / 1e3 / n == pytest.approx(want["gpu_wait_ms_per_step"], rel=0.01)


def test_a_unit_finding_covers_its_collectives(tmp_path):
    """A finding that names an FSDP unit (too-coarse: everything in the root unit, generated with
    the real schema) is drawn per step from the unit's first collective kernel to its last: every
    NCCL kernel of the rank's file lies in one of those slices, and each starts and ends on one."""
    from fixtures.scenarios.generator import PRESETS, generate

    cfg = dataclasses.replace(
        PRESETS["too-coarse"], world_size=2, num_layers=2, hidden_size=256, seq_len=256, vocab_size=512
    )
    d = generate(cfg, tmp_path / "run")
    rep = fsdpdoctor.analyze(d, spans=True)
    assert next(f for f in rep.findings if f.code == "FSD002").where == {"unit": ""}
    write(rep, tmp_path / "coarse.json.gz")
    procs, _, mine = _tracks(_read(tmp_path / "coarse.json.gz"))
    pid0 = next(p for p, n in procs.items() if n == "rank 0")
    slices = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in mine if e["pid"] == pid0 and e["args"].get("code") == "FSD002"
    )
    assert len(slices) == 3  # one per step
    with gzip.open(d / "rank0.json.gz", "rt") as fh:
        nccl = [
            (e["ts"], e["ts"] + e["dur"])
            for e in json.load(fh)["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel")
        ]
    assert nccl
    for a, b in nccl:
        assert any(lo - 1e-3 <= a and b <= hi + 1e-3 for lo, hi in slices)
    for lo, hi in slices:
        assert min(abs(lo - a) for a, _ in nccl) < 1e-3 and min(abs(hi - b) for _, b in nccl) < 1e-3


def test_slices_nest_on_each_thread(dlrm):
    """chrome://tracing draws complete events of one thread as a stack: they must nest."""
    doc, _, _, _ = dlrm
    _, _, mine = _tracks(doc)
    by_thread = collections.defaultdict(list)
    for e in mine:
        by_thread[(e["pid"], e["tid"])].append((e["ts"], -e["dur"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        stack: list[float] = []
        for ts, _, end in sorted(spans):
            while stack and stack[-1] <= ts + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3
            stack.append(end)


def test_hta_reads_the_merged_file(dlrm):
    """Holistic Trace Analysis's trace parser (a real consumer) loads the merged file: every rank's
    process, every fsdpdoctor slice and every GPU kernel of the inputs."""
    from hta.common.trace_parser import ParserBackend, ParserConfig, parse_trace_dataframe

    doc, js, _, out = dlrm
    procs, _, mine = _tracks(doc)
    cfg = ParserConfig()
    cfg.parser_backend = ParserBackend.JSON
    _, df, sym = parse_trace_dataframe(str(out), cfg)
    cats = df["cat"].map(lambda i: sym.sym_table[int(i)])
    assert sorted(procs[p] for p in df["pid"].unique()) == [f"rank {r}" for r in range(8)]
    assert int((cats == "fsdpdoctor").sum()) == len(mine)
    kernels = sum(_raw_counts(Path(rf["path"]))[("X", "kernel")] for rf in js["rank_facts"])
    assert int((cats == "kernel").sum()) == kernels > 0


def test_ranks_merged_follow_the_rank_detail(tmp_path):
    """An 18-rank run (generated, real schema): ``auto`` merges the ranks that matter only, every
    rank keeps its fsdpdoctor track; a report cut to those ranks (a saved JSON read back) draws
    the same steps and parts for the others from their summaries."""
    from fixtures.scenarios.generator import PRESETS, generate

    cfg = dataclasses.replace(
        PRESETS["healthy-fsdp2"], world_size=18, num_layers=1, steps=3, hidden_size=256, seq_len=256, vocab_size=512
    )
    d = generate(cfg, tmp_path / "run")
    rep = fsdpdoctor.analyze(d, spans=True)
    chosen = {s.rank for s in rep.facts.rank_summaries if s.detail_reasons}
    assert 0 < len(chosen) < 18
    got = write(rep, tmp_path / "auto.json.gz")
    doc = _read(tmp_path / "auto.json.gz")
    procs, threads, mine = _tracks(doc)
    assert len(procs) == 18 and set(got["merged"]) == chosen
    with_raw = {
        _rank_of(procs, e["pid"]) for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"
    }
    assert with_raw == chosen
    assert {_rank_of(procs, p) for (p, _), n in threads.items() if n == "fsdpdoctor waterfall"} == set(range(18))
    # none: no raw events at all, still 18 tracks
    write(rep, tmp_path / "none.json.gz", rank_detail="none")
    none = _read(tmp_path / "none.json.gz")
    assert not any(e.get("cat") == "kernel" for e in none["traceEvents"])
    assert sum(e.get("name") == "process_name" for e in none["traceEvents"]) == 18
    # a report cut to the chosen ranks: the others' steps and waterfall from their summaries
    facts = RunFacts.from_dict(json.loads(rep.to_json()))
    assert {r.rank for r in facts.rank_facts} == chosen
    cut = Report(facts=facts, findings=rep.findings, rank_detail="auto")
    write(cut, tmp_path / "cut.json.gz")

    def wf(doc: dict) -> list:
        procs, threads, mine = _tracks(doc)
        rows = [e for e in mine if threads[(e["pid"], e["tid"])] == "fsdpdoctor waterfall"]
        return sorted((e["pid"], e["name"], round(e["ts"]), round(e["dur"])) for e in rows)

    assert wf(_read(tmp_path / "cut.json.gz")) == wf(doc)
    steps = sum(1 for e in mine if e["name"].startswith("step ") and "part" not in e.get("args", {}))
    assert steps == 18 * 3
    # against the generator's truth (computed from its own integer-ns events): each merged rank's
    # exposed communication per step, and every rank's waterfall parts
    from fixtures.scenarios.generator import read_truth

    truth = read_truth(d)
    exposed, parts = collections.defaultdict(float), collections.defaultdict(float)
    for e in mine:
        r, a = _rank_of(procs, e["pid"]), e.get("args", {})
        if threads[(e["pid"], e["tid"])] == "fsdpdoctor exposed comm":
            exposed[(r, a["step"])] += e["dur"] / 1e3
        elif "part" in a:
            parts[(r, a["part"])] += e["dur"] / 1e3 / 3
    for r in chosen:
        for k, st in enumerate(truth["ranks"][str(r)]["steps"]):
            assert exposed[(r, k)] == pytest.approx(st["exposed_comm_ms"], rel=0.01, abs=US), (r, k)
    for r in range(18):
        for part, ms in truth["waterfall"]["ranks"][str(r)]["parts_ms"].items():
            assert parts[(r, part)] == pytest.approx(ms, rel=0.01, abs=US), (r, part)


def test_cpu_fsdp_recording(recorded_run, tmp_path):
    """A real CPU FSDP run (gloo, 2 processes) through the CLI: both ranks merged, each step a
    slice of its measured time (no GPU: no waterfall parts, said in the slice)."""
    run = recorded_run("per-block")
    out = tmp_path / "cpu.json.gz"
    code, err = cli_in_process(["analyze", str(run), "--format", "perfetto", "-o", str(out)])
    assert code == 0, err
    assert "2 ranks, 2 with their trace's events" in err
    doc = _read(out)
    procs, threads, mine = _tracks(doc)
    assert sorted(procs.values()) == ["rank 0", "rank 1"]
    for r in (0, 1):
        raw = _raw_counts(run / f"rank{r}.json.gz")
        pid = next(p for p, n in procs.items() if n == f"rank {r}")
        merged = collections.Counter(
            (e.get("ph"), e.get("cat"))
            for e in doc["traceEvents"]
            if e.get("pid") == pid and e.get("ph") != "M" and e.get("cat") != "fsdpdoctor"
        )
        assert merged == raw
        # each step slice's length is the CPU step clock of the raw trace: the ProfilerStep spans end
        # to end (the first step its span; a later one from the previous span's end to its own, the
        # gap between the spans included: 3.1 ms in one CI recording)
        with gzip.open(run / f"rank{r}.json.gz", "rt") as fh:
            spans = sorted(
                (e["ts"], e["ts"] + e["dur"])
                for e in json.load(fh)["traceEvents"]
                if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
            )
        clock = [spans[0][1] - spans[0][0]] + [b - prev_end for (_, prev_end), (_, b) in zip(spans, spans[1:])]
        got = sorted(
            (e["ts"], e["dur"]) for e in mine if e["pid"] == pid and threads[(pid, e["tid"])] == "fsdpdoctor waterfall"
        )
        assert len(got) == len(spans) >= 2
        for (_, d0), d1 in zip(got, clock):
            assert d0 == pytest.approx(d1, rel=0.01)
        assert all(
            "none" in e["args"].get("waterfall", "") for e in mine if e["pid"] == pid and e["name"].startswith("step ")
        )


def test_cli_refuses_bad_outputs(tmp_path, shared_traces):
    code, err = cli_in_process(["analyze", str(shared_traces / DLRM), "--format", "perfetto"])
    assert code == 2 and "needs -o FILE" in err and "Traceback" not in err
    inside = shared_traces / DLRM / "merged.json.gz"
    code, err = cli_in_process(["analyze", str(shared_traces / DLRM), "--format", "perfetto", "-o", str(inside)])
    assert code == 2 and "inside the input folder" in err and str(inside) in err
    assert not inside.exists()
    one = next((shared_traces / DLRM).glob("*.json.gz"))
    code, err = cli_in_process(["analyze", str(one), "--format", "perfetto", "-o", str(one.parent / "x.json.gz")])
    assert code == 2 and "inside the input folder" in err


def test_flight_recorder_dumps_alone_have_nothing_to_draw(hang_recording, tmp_path):
    dumps = hang_recording("leave-early") / "dumps"
    code, err = cli_in_process(["analyze", str(dumps), "--format", "perfetto", "-o", str(tmp_path / "x.json.gz")])
    assert code == 2 and "no profiler trace among the inputs" in err and "Traceback" not in err
