"""Flight Recorder dumps: the format (real gloo dumps and the NCCL generator field for field), every
version and form, finding dumps wherever they lie, and bad dumps (one line each, no code run)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpdoctor
from _suiteweb_fr_server import run_fr_trace  # _fr_peer.run_fr_trace, torch imported once per process
from fixtures.flight_recorder import gen
from fsdpdoctor.ingest.flight_recorder import FrError, load_dump

REPO = Path(__file__).resolve().parents[1]
PER_BLOCK = REPO / "fixtures" / "recorded" / "per-block"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdpdoctor", *args], capture_output=True, text=True, timeout=120)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- the format


def _shape(v):
    """A value's type, recursively (lists by their first item), for comparing layouts."""
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, _shape(v[0]) if v else None]
    return type(v).__name__


def test_generator_writes_the_real_2_10_layout_field_for_field(hang_recording, tmp_path):
    real = pickle.loads((hang_recording("leave-early") / "dumps" / "nccl_trace_rank_0").read_bytes())
    spec = dataclasses.replace(gen.PRESETS["missing"], timing=False)  # gloo records no timing
    gen.write(spec, tmp_path)
    ours = pickle.loads((tmp_path / "nccl_trace_rank_0").read_bytes())
    assert list(ours) == list(real)  # top-level keys, in order
    # the last entry of each: an all-gather the rank waits in (scheduled, as NCCL without timing has it)
    a, b = ours["entries"][-1], real["entries"][-1]
    assert a["state"] == b["state"] == "scheduled" and a["profiling_name"].endswith("all_gather_base")
    assert b["profiling_name"] == "gloo:all_gather"
    assert list(a) == list(b)  # entry keys, in order
    assert _shape(a) == _shape(b)
    assert list(a["frames"][0]) == list(b["frames"][0])
    assert list(next(iter(ours["pg_config"].values()))) == list(next(iter(real["pg_config"].values())))
    assert list(next(iter(ours["pg_status"].values()))) == list(next(iter(real["pg_status"].values())))
    assert real["version"] == ours["version"] == "2.10"
    assert isinstance(real["entries"][0]["process_group"], tuple)  # the JIT pickler writes a tuple


def test_generator_writes_the_real_json_layout(hang_recording, tmp_path):
    real = json.loads((hang_recording("leave-early") / "json" / "nccl_trace_rank_0.json").read_text())
    gen.write(dataclasses.replace(gen.PRESETS["missing"], timing=False), tmp_path, json_form=True)
    ours = json.loads((tmp_path / "nccl_trace_rank_0.json").read_text())
    assert list(ours) == list(real)
    a, b = ours["entries"][-1], real["entries"][-1]
    assert list(a) == list(b) and _shape(a) == _shape(b)
    assert b["time_discovered_started_ns"] == 0 and isinstance(b["process_group"], list)
    assert all(isinstance(v, str) for v in next(iter(real["pg_status"].values())).values())


def test_real_gloo_dump_reads_with_stacks(hang_recording):
    d = load_dump(hang_recording("leave-early") / "dumps" / "nccl_trace_rank_0")
    assert d.version == "2.10" and d.backend == "gloo" and d.form == "pickle" and d.rank == 0
    assert {e.state for e in d.entries} == {"scheduled"}  # gloo tracks no start or completion
    assert {e.op for e in d.entries} >= {"all_gather", "all_reduce", "barrier"}
    assert all(0 <= e.stack < len(d.stacks) for e in d.entries) and d.stacks
    assert d.pg_config and all(not c.ranks or c.name == "" for c in d.pg_config.values())  # gloo: keyed ''


def test_the_json_form_gives_the_same_verdict_without_stacks(hang_recording):
    for scenario in ("leave-early", "rank0-metric"):
        d = hang_recording(scenario)
        a, b = fsdpdoctor.analyze(d / "dumps").facts.hang, fsdpdoctor.analyze(d / "json").facts.hang
        assert (b.kind, b.culprit_ranks, b.seq_id, b.op) == (a.kind, a.culprit_ranks, a.seq_id, a.op)
        assert b.forms == ["json"] and not any(c.stack for c in b.culprits)


CASES = [
    (name, v, form)
    for name in gen.PRESETS
    for v in gen.VERSIONS
    for form in ("pickle", "json")
    if not (name == "mismatch-dtype" and v == "1.5")  # 1.x records no dtypes
    and not (name == "coalesced" and gen.version_tuple(v) < (2, 7))
]


@pytest.mark.parametrize("name,version,form", CASES, ids=[f"{n}-{v}-{f}" for n, v, f in CASES])
def test_generated_nccl_dumps_are_diagnosed_as_generated(tmp_path, name, version, form):
    spec = dataclasses.replace(gen.PRESETS[name], version=version)
    truth = gen.write(spec, tmp_path, json_form=form == "json")
    h = fsdpdoctor.analyze(tmp_path).facts.hang
    assert h.kind == truth.kind, h.summary
    assert h.culprit_ranks == truth.culprits and h.seq_id == truth.seq_id
    assert h.ranks_without_dump == truth.ranks_without_dump
    assert h.versions == [version] and h.backend == "nccl"
    if truth.kind != "none":
        assert h.process_group.ranks == truth.group_ranks
    if truth.late_s is not None:
        assert abs(h.late_ranks[0].late_s - truth.late_s) < 0.01
    if truth.step is not None and form == "pickle":
        assert any(o.step == truth.step for o in h.ops if o.status == "entered"), h.ops
    if name == "wrapped":
        assert not h.steps_from_start
    if truth.kind == "in_collective":
        assert {o.state for o in h.ops} == {"started"}


@pytest.mark.parametrize("name", ["missing", "hsdp", "mismatch-op", "p2p"])
def test_torch_fr_trace_on_nccl_dumps_beside_ours(tmp_path, name):
    """fr_trace reads the generator's NCCL dumps (it fails on gloo's): its verdict beside ours."""
    truth = gen.write(gen.PRESETS[name], tmp_path)
    ours = fsdpdoctor.analyze(tmp_path).facts.hang
    peer = run_fr_trace(tmp_path)
    print(
        f"\n{name}: truth ranks {truth.culprits} #{truth.seq_id} | fsdpdoctor {ours.culprit_ranks} #{ours.seq_id} | "
        f"fr_trace: {peer.text()}"
    )
    assert ours.culprit_ranks == truth.culprits
    if name in ("missing", "hsdp"):  # where fr_trace gives a verdict it agrees on these: a check of the generator too
        assert peer.rc == 0 and peer.missing == truth.culprits and peer.seq == truth.seq_id


# --------------------------------------------------------------------------- finding dumps


def test_dumps_beside_traces_and_a_snapshot(tmp_path):
    for f in PER_BLOCK.glob("rank*.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    gen.write(gen.PRESETS["late"], tmp_path)
    from fixtures.snapshots import gen_snapshot

    snap, _ = gen_snapshot.write("fsdp2", tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    rep = fsdpdoctor.analyze(tmp_path)
    assert rep.facts.rank_facts and rep.facts.hang.kind == "late" and rep.facts.memory is not None
    assert not any("nccl_trace_rank" in n and "not analysed" in n for n in rep.facts.notes)
    assert rep.findings[0].slug == "collective-hang"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("sub", ["comm_trace", "comm_traces"])
def test_torchtitan_dump_folder(tmp_path, sub):
    out = tmp_path / "outputs"
    (out / "checkpoint").mkdir(parents=True)
    truth = gen.write(gen.PRESETS["missing"], out / sub)
    for p in (out / sub).iterdir():  # torchtitan's prefix: <dump_folder>/comm_trace(s)/rank_<r>
        p.rename(p.with_name(p.name.replace(gen.PREFIX, "rank_")))
    for target in (out, out / sub):
        h = fsdpdoctor.analyze(target).facts.hang
        assert h.culprit_ranks == truth.culprits and h.dumps == 4


def test_gzipped_dumps_glob_and_single_file(tmp_path):
    d = tmp_path / "d"
    truth = gen.write(gen.PRESETS["mismatch-op"], d)
    for p in d.iterdir():
        p.with_name(p.name + ".gz").write_bytes(gzip.compress(p.read_bytes()))
        p.unlink()
    assert fsdpdoctor.analyze(d).facts.hang.culprit_ranks == truth.culprits
    assert fsdpdoctor.analyze(str(d / "nccl_trace_rank_*")).facts.hang.culprit_ranks == truth.culprits
    one = fsdpdoctor.analyze(d / "nccl_trace_rank_0.gz").facts.hang  # one rank alone: nothing to match
    assert one.dumps == 1 and one.ranks_without_dump == [1, 2, 3]


def test_folder_with_neither_traces_nor_dumps_still_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    one_line_error(cli("analyze", str(tmp_path)), "no trace files", "no Flight Recorder dumps")


# --------------------------------------------------------------------------- bad dumps


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _good(tmp_path: Path) -> bytes:
    gen.write(gen.PRESETS["missing"], tmp_path / "src")
    return (tmp_path / "src" / "nccl_trace_rank_0").read_bytes()


def test_truncated_dump(tmp_path):
    data = _good(tmp_path)
    bad = tmp_path / "dumps" / "nccl_trace_rank_0"
    bad.parent.mkdir()
    bad.write_bytes(data[: len(data) // 2])
    one_line_error(cli("analyze", str(bad.parent)), str(bad), "truncated pickle")


def test_wrong_version(tmp_path):
    d = pickle.loads(_good(tmp_path))
    for version, needle in (
        ("3.0", "version 3.0 is not one this fsdpdoctor reads"),
        ("two", "unknown Flight Recorder dump version"),
    ):
        p = tmp_path / "v" / "nccl_trace_rank_1"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(pickle.dumps(dict(d, version=version), protocol=2))
        one_line_error(cli("analyze", str(p)), str(p), needle)


def test_pickle_with_globals_is_refused_and_nothing_runs(tmp_path):
    d = pickle.loads(_good(tmp_path))
    marker = tmp_path / "pwned"
    d["entries"][3]["frames"] = [_Evil(marker)]
    p = tmp_path / "evil" / "nccl_trace_rank_2"
    p.parent.mkdir()
    p.write_bytes(pickle.dumps(d, protocol=2))
    one_line_error(
        cli("analyze", str(p.parent)), str(p), "refused to load", "system (a Flight Recorder dump holds only plain data"
    )
    assert not marker.exists()


def test_too_large_and_memo_bomb(tmp_path):
    p = tmp_path / "big" / "nccl_trace_rank_0"
    p.parent.mkdir()
    p.write_bytes(_good(tmp_path))
    one_line_error(cli("analyze", "--max-input-bytes", "1000", str(p)), str(p), "--max-input-bytes limit")
    frames = [{"name": "f", "filename": "x.py", "line": i} for i in range(1000)]
    entry = {"record_id": 0, "profiling_name": "nccl:all_reduce", "frames": frames}
    bomb = tmp_path / "bomb" / "nccl_trace_rank_0"
    bomb.parent.mkdir()
    bomb.write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": [entry] * 20000}, protocol=2))
    one_line_error(cli("analyze", str(bomb)), str(bomb), "shared references")


def test_structure_name_and_json_problems(tmp_path):
    d = pickle.loads(_good(tmp_path))
    d["entries"][3]["input_sizes"] = "abc"
    p = tmp_path / "s" / "nccl_trace_rank_0"
    p.parent.mkdir()
    p.write_bytes(pickle.dumps(d, protocol=2))
    one_line_error(cli("analyze", str(p)), str(p), "wrong structure: entries[3].input_sizes")
    noname = tmp_path / "n" / "final_dump"
    noname.parent.mkdir()
    noname.write_bytes(_good(tmp_path))
    one_line_error(cli("analyze", str(noname)), str(noname), "cannot tell which rank")
    gen.write(gen.PRESETS["missing"], tmp_path / "j", json_form=True)
    j = tmp_path / "j" / "nccl_trace_rank_1.json"
    j.write_text(j.read_text()[:-300])
    one_line_error(cli("analyze", str(tmp_path / "j")), str(j), "truncated JSON")


def test_a_memory_snapshot_named_directly_is_read_as_one(tmp_path):
    """By content: a snapshot pickle is a snapshot, not a dump (issue #41 item 4)."""
    from fixtures.snapshots import gen_snapshot

    snap, _ = gen_snapshot.write("fsdp2", tmp_path)
    proc = cli("analyze", str(snap))
    assert proc.returncode == 0, proc.stderr
    assert "Memory" in proc.stdout and "Flight Recorder" not in proc.stderr


def test_load_dump_error_type(tmp_path):
    p = tmp_path / "nccl_trace_rank_0"
    p.write_bytes(b"\x80\x02}q\x00.")  # an empty dict
    with pytest.raises(FrError, match="no 'version' and 'entries'"):
        load_dump(p)
