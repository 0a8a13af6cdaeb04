"""torchtitan's dump folder read as it lies (issue 34): real recorded traces and snapshots, copied
at test time into torchtitan's layout (torchtitan/tools/profiling.py: ``iteration_<N>`` folders,
``rank<r>_trace.json``, ``rank<r>_memory_snapshot.pickle``, ``iteration_<N>_exit`` on an OOM),
analysed with no path beyond the dump folder."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpdoctor
from fsdpdoctor.api import analyze_memory_only
from fsdpdoctor.errors import InputError

GPU = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu"


def _gunzip(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(src) as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo)


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    """Iteration 10: the fsdp2 recording; iteration 20: fsdp2-ac; an OOM after step 20: the oom
    recording's snapshot in iteration_20_exit. Non-default folder names, as a config may set
    them, a leaf folder under iteration 20, and folders torchtitan also writes."""
    root = tmp_path_factory.mktemp("outputs")
    _gunzip(GPU / "fsdp2" / "rank0.json.gz", root / "traces" / "iteration_10" / "rank0_trace.json")
    _gunzip(GPU / "fsdp2-ac" / "rank0.json.gz", root / "traces" / "iteration_20" / "replica_0" / "rank0_trace.json")
    _gunzip(
        GPU / "fsdp2" / "rank0.memory.pickle.gz", root / "snapshots" / "iteration_10" / "rank0_memory_snapshot.pickle"
    )
    _gunzip(
        GPU / "fsdp2-ac" / "rank0.memory.pickle.gz",
        root / "snapshots" / "iteration_20" / "replica_0" / "rank0_memory_snapshot.pickle",
    )
    _gunzip(
        GPU / "oom" / "rank0.memory.pickle.gz",
        root / "snapshots" / "iteration_20_exit" / "rank0_memory_snapshot.pickle",
    )
    (root / "checkpoint" / "step-20").mkdir(parents=True)
    (root / "comm_traces").mkdir()
    (root / "tb").mkdir()
    return root


def test_analyze_reads_the_latest_iteration_and_its_snapshot(dump):
    rep = fsdpdoctor.analyze(dump)
    f = rep.facts
    assert [Path(i.path).parts[-3:] for i in f.inputs] == [("iteration_20", "replica_0", "rank0_trace.json")]
    assert Path(f.memory.path).parts[-3:] == ("iteration_20", "replica_0", "rank0_memory_snapshot.pickle")
    assert f.memory.activation_checkpointing == "full"  # the fsdp2-ac recording: checkpoint_wrapper on every block
    assert f.fsdp.activation_checkpointing is True
    note = next(n for n in f.notes if "not analysed" in n)
    assert (
        "iteration_10 (iteration 10;" in note
        and "iteration_20_exit (the memory snapshot of an out-of-memory exit" in note
    )


def test_analyze_chosen_iteration(dump):
    f = fsdpdoctor.analyze(dump, iteration=10).facts
    assert Path(f.inputs[0].path).parent.name == "iteration_10"
    assert Path(f.memory.path).parent.name == "iteration_10"
    assert f.memory.activation_checkpointing == "none"
    with pytest.raises(InputError, match=r"iterations \[10, 20\], not 7"):
        fsdpdoctor.analyze(dump, iteration=7)


def test_memory_reads_the_latest_snapshot_an_oom_exit(dump):
    m = analyze_memory_only(dump).facts.memory
    assert Path(m.path).parent.name == "iteration_20_exit"
    assert m.oom is not None and m.oom.statement.op == "gelu"
    assert Path(analyze_memory_only(dump, iteration=10).facts.memory.path).parent.name == "iteration_10"


def test_cli_on_the_dump_folder(dump):
    out = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(dump), "--iteration", "10", "--format", "json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert Path(json.loads(out.stdout)["memory"]["path"]).parent.name == "iteration_10"
    bad = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(dump), "--iteration", "3"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_iteration_without_a_dump_folder_is_refused():
    with pytest.raises(InputError, match="--iteration"):
        fsdpdoctor.analyze(GPU / "fsdp2", iteration=3)


def test_dump_folder_with_snapshots_only(tmp_path):
    _gunzip(
        GPU / "oom" / "rank0.memory.pickle.gz",
        tmp_path / "memory_snapshot" / "iteration_0_exit" / "rank0_memory_snapshot.pickle",
    )
    # analyze reads a framework's folder by content (issue #41 item 4): its latest snapshots
    rep = fsdpdoctor.analyze(tmp_path)
    assert rep.facts.memory.oom is not None and "iteration_0_exit" in rep.facts.memory.path
    assert analyze_memory_only(tmp_path).facts.memory.oom is not None


def test_plain_trace_folders_are_not_dump_folders():
    """A folder of rank traces (and one of variant folders) is read as before."""
    from fsdpdoctor.ingest.layouts import dump_folder

    assert dump_folder(GPU / "fsdp2") is None and dump_folder(GPU) is None


def test_traces_in_the_folder_snapshots_in_iteration_folders(tmp_path):
    """A run that keeps its traces in the folder itself and torchtitan-style snapshot folders below."""
    _gunzip(GPU / "fsdp2" / "rank0.json.gz", tmp_path / "rank0.json")
    _gunzip(
        GPU / "fsdp2" / "rank0.memory.pickle.gz",
        tmp_path / "memory_snapshot" / "iteration_4" / "rank0_memory_snapshot.pickle",
    )
    f = fsdpdoctor.analyze(tmp_path).facts
    assert Path(f.inputs[0].path).name == "rank0.json"
    assert Path(f.memory.path).parent.name == "iteration_4"


def test_the_dump_folder_brings_its_flight_recorder_dumps_too(tmp_path):
    """A torchtitan run that hung after profiling: its dump folder holds the profile traces of an
    iteration and the Flight Recorder dumps of every rank (comm_traces/rank_<r>); analyze reads
    both from the dump folder alone, the traces' steps and the hang's culprit."""
    from fixtures.flight_recorder import gen

    root = tmp_path / "outputs"
    _gunzip(GPU / "fsdp2" / "rank0.json.gz", root / "profile_traces" / "iteration_10" / "rank0_trace.json")
    truth = gen.write(gen.PRESETS["missing"], root / "comm_traces")
    for p in (root / "comm_traces").iterdir():
        p.rename(p.with_name(p.name.replace(gen.PREFIX, "rank_")))
    f = fsdpdoctor.analyze(root).facts
    assert f.steps.count == 2 and f.gpu_present
    assert f.hang is not None and f.hang.culprit_ranks == truth.culprits and f.hang.dumps == 4
