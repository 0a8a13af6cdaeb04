"""Bad input: one clear line on stderr naming the file and the problem, exit code 2, no traceback.

Each family of cases runs at least once as ``python -m fsdpdoctor`` in its own process
(:func:`run_cli`: the exit status and everything the process wrote on stderr, interpreter start
and exit included); the other cases of the family run the same CLI in this process
(:func:`run_here`: its exit code and what it wrote on ``sys.stdout`` / ``sys.stderr``), which
spares a Python start (~0.4 s of CPU) per case.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REAL_EVENT = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 2.0, "args": {"stream": 7}}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdpdoctor", *args], capture_output=True, text=True, timeout=120)


class _Hung(Exception):
    pass


def run_here(*args: str) -> subprocess.CompletedProcess:
    """``fsdpdoctor ARGS`` in this process, as :func:`run_cli` reports it; a run past 120 s (a
    FIFO waited on) fails the test instead of hanging it. Not for ``--max-input-bytes``, which
    sets an environment variable for the rest of the process (see its test)."""
    from fsdpdoctor.cli import main

    def hung(signum, frame):
        raise _Hung(f"fsdpdoctor {' '.join(args)} still running after 120 s")

    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main.main(args=list(args), prog_name="fsdpdoctor", standalone_mode=True)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return subprocess.CompletedProcess(["fsdpdoctor", *args], code, out.getvalue(), err.getvalue())


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
        json.dumps(
            {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "x"}}]}
        ).encode(),
        "no complete",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_trace_files(tmp_path, name):
    content, needle = CASES[name]
    p = _make(tmp_path, name, content)
    run = run_cli if name == "truncated.json.gz" else run_here  # one in its own process
    _assert_one_line_error(run("analyze", str(p)), str(p), needle)


def test_directory_without_traces(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    _assert_one_line_error(run_here("analyze", str(tmp_path)), str(tmp_path), "no trace files")


def test_missing_path_and_empty_glob(tmp_path):
    _assert_one_line_error(run_cli("analyze", str(tmp_path / "nope.json")), "nope.json", "no such file")
    _assert_one_line_error(run_here("analyze", str(tmp_path / "*.json.gz")), "pattern matches no files")


def test_one_bad_rank_among_good_ones_names_the_bad_file(tmp_path):
    good = {"traceEvents": [REAL_EVENT], "distributedInfo": {"rank": 0, "world_size": 2}}
    _make(tmp_path, "rank0.json", json.dumps(good).encode())
    bad = _make(tmp_path, "rank1.json", b'{"traceEvents": [')
    # --strict: fail on the bad file (the behaviour before partial runs)
    _assert_one_line_error(run_here("analyze", "--strict", str(tmp_path)), str(bad))
    # default: the bad rank is left out, named in one warning line, exit 0
    proc = run_cli("analyze", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "warning: 1 of 2 ranks analysed" in lines[0] and str(bad) in lines[0]


def test_no_write_into_input_folder(tmp_path):
    good = {"traceEvents": [REAL_EVENT], "distributedInfo": {"rank": 0, "world_size": 1}}
    _make(tmp_path, "rank0.json", json.dumps(good).encode())
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_here("analyze", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert json.loads(proc.stdout)["ranks"] == [0]


# -- special files, permissions, limits (issue 15) ------------------------------------------------

RECORDED_RANK0 = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "per-block" / "rank0.json.gz"


def test_fifo_is_refused_by_stat_not_waited_on(tmp_path):
    fifo = tmp_path / "rank0.json"
    os.mkfifo(fifo)
    for run, args in (
        (run_cli, ["analyze", str(fifo)]),
        (run_here, ["memory", str(fifo)]),
        (run_here, ["check", str(RECORDED_RANK0), "-j", "1", "--baseline", str(fifo)]),
    ):
        _assert_one_line_error(run(*args), str(fifo), "named pipe (FIFO), not a regular file")


def test_unreadable_directory_and_file_say_permission_denied(tmp_path, monkeypatch):
    from fsdpdoctor.errors import InputError
    from fsdpdoctor.ingest import _io
    from fsdpdoctor.ingest.discover import discover

    (tmp_path / "rank0.json").write_text("{}")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)  # root reads every directory: simulate chmod 000
    with pytest.raises(InputError, match="permission denied") as err:
        discover([tmp_path])
    assert err.value.path == str(tmp_path)
    monkeypatch.undo()

    real_stat = os.stat

    def stat_denied(p, *a, **kw):
        if str(p).endswith("rank0.json"):
            raise PermissionError(13, "Permission denied")
        return real_stat(p, *a, **kw)

    monkeypatch.setattr(_io.os, "stat", stat_denied)
    with pytest.raises(InputError, match="permission denied"):
        _io.read_input(tmp_path / "rank0.json")


def test_max_input_bytes_refuses_then_admits(tmp_path, monkeypatch):
    from fsdpdoctor.ingest._io import MAX_INPUT_ENV

    raw = gzip.decompress(RECORDED_RANK0.read_bytes())
    p = _make(tmp_path, "rank0.json", raw)
    _assert_one_line_error(
        run_cli("analyze", str(p), "-j", "1", "--max-input-bytes", "64K"),
        str(p),
        "more than the --max-input-bytes limit of 64.0 KiB",
    )
    # in this process the option sets MAX_INPUT_ENV for good: monkeypatch puts back what was
    # there before (nothing, or the caller's own cap; "" reads as no cap)
    monkeypatch.setenv(MAX_INPUT_ENV, os.environ.get(MAX_INPUT_ENV, ""))
    ok = run_here("analyze", str(p), "-j", "1", "--format", "json", "--max-input-bytes", f"{len(raw)}")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["rank_facts"][0]["event_count"] == len(json.loads(raw)["traceEvents"])
    bad = run_here("analyze", str(p), "--max-input-bytes", "lots")
    assert bad.returncode == 2 and "is not a size" in bad.stderr


def test_gzip_ratio_cap_and_its_override(tmp_path, monkeypatch):
    """A genuine trace padded so that it gzips > 100x is refused as a likely bomb (with the
    floor lowered so a small file shows it), and read in full once the cap is raised."""
    from fsdpdoctor.errors import InputError
    from fsdpdoctor.ingest import _io
    from fsdpdoctor.ingest.kineto import load_trace

    doc = json.loads(gzip.decompress(RECORDED_RANK0.read_bytes()))
    text = json.dumps(doc).encode()
    head, tail = text.split(b'"traceEvents": [', 1)
    padded = head + b'"traceEvents": [' + b" " * (8 << 20) + tail + b" " * (8 << 20)
    p = _make(tmp_path, "rank0.json.gz", gzip.compress(padded, 9))
    assert len(padded) > _io.MAX_RATIO * p.stat().st_size
    monkeypatch.setattr(_io, "RATIO_FLOOR", 1 << 20)
    with pytest.raises(InputError, match="likely a gzip bomb"):
        load_trace(p, workers=0)
    with _io.input_limit(1 << 30):
        rt = load_trace(p, workers=0)
    assert rt.event_count == len(doc["traceEvents"])


def test_baseline_from_another_schema_says_how_to_regenerate(tmp_path):
    from fsdpdoctor.errors import InputError
    from fsdpdoctor.facts import OLDEST_SCHEMA_VERSION, SCHEMA_VERSION, RunFacts

    for version, needle in (
        (SCHEMA_VERSION + 1, "newer fsdpdoctor"),
        (OLDEST_SCHEMA_VERSION - 1, "older"),
        ("1", "not an integer"),
    ):
        p = _make(tmp_path, "base.json", json.dumps({"schema_version": version, "rank_facts": []}).encode())
        with pytest.raises(InputError, match=needle) as err:
            RunFacts.load(p)
        assert "--save-baseline" in str(err.value) and str(p) in str(err.value)
    p = _make(
        tmp_path, "base.json", json.dumps({"schema_version": SCHEMA_VERSION, "rank_facts": [], "fsdp": None}).encode()
    )
    with pytest.raises(InputError, match=r"at \.fsdp"):
        RunFacts.load(p)
