"""Bad input: one clear line on stderr naming the file and the problem, exit code 2, no traceback."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REAL_EVENT = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 2.0, "args": {"stream": 7}}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", *args], capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0]
    assert proc.stdout == ""


def _make(tmp_path: Path, name: str, content: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content)
    return p


CASES = {
    "empty.json": (b"", "empty file"),
    "truncated.json.gz": (gzip.compress(json.dumps({"traceEvents": [REAL_EVENT] * 50}).encode())[:60], "gzip"),
    "truncated.json": (json.dumps({"traceEvents": [REAL_EVENT] * 5}).encode()[:-20], "truncated JSON"),
    "garbage.json": (b"this is not json {", "not valid JSON"),
    "not_a_trace.json": (json.dumps({"hello": "world"}).encode(), "not a Chrome/Kineto trace"),
    "scalar.json": (b"42", "not a Chrome/Kineto trace"),
    "zero_events.json": (json.dumps({"traceEvents": []}).encode(), "no events"),
    "only_metadata.json": (
        json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "x"}}]}).encode(),
        "no complete",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_trace_files(tmp_path, name):
    content, needle = CASES[name]
    p = _make(tmp_path, name, content)
    _assert_one_line_error(run_cli("analyze", str(p)), str(p), needle)


def test_directory_without_traces(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    _assert_one_line_error(run_cli("analyze", str(tmp_path)), str(tmp_path), "no trace files")


def test_missing_path_and_empty_glob(tmp_path):
    _assert_one_line_error(run_cli("analyze", str(tmp_path / "nope.json")), "nope.json", "no such file")
    _assert_one_line_error(run_cli("analyze", str(tmp_path / "*.json.gz")), "pattern matches no files")


def test_one_bad_rank_among_good_ones_names_the_bad_file(tmp_path):
    good = {"traceEvents": [REAL_EVENT], "distributedInfo": {"rank": 0, "world_size": 2}}
    _make(tmp_path, "rank0.json", json.dumps(good).encode())
    bad = _make(tmp_path, "rank1.json", b"{\"traceEvents\": [")
    # --strict: fail on the bad file (the behaviour before partial runs)
    _assert_one_line_error(run_cli("analyze", "--strict", str(tmp_path)), str(bad))
    # default: the bad rank is left out, named in one warning line, exit 0
    proc = run_cli("analyze", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "warning: 1 of 2 ranks analysed" in lines[0] and str(bad) in lines[0]


def test_no_write_into_input_folder(tmp_path):
    good = {"traceEvents": [REAL_EVENT], "distributedInfo": {"rank": 0, "world_size": 1}}
    _make(tmp_path, "rank0.json", json.dumps(good).encode())
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_cli("analyze", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert json.loads(proc.stdout)["ranks"] == [0]
