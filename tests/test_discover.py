"""Which files of a directory are traces: decided by content, and one capture cycle at a time."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpdoctor
from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest.discover import cycle_of, discover

REC = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"


def _traces(run: str) -> list[Path]:
    return sorted((REC / run).glob("rank*.json.gz"))


def test_json_beside_the_traces_is_skipped_and_listed(tmp_path):
    for p in _traces("per-block"):
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(REC / "per-block" / "fsdpdoctor_meta.json", tmp_path)
    (tmp_path / "train_config.json").write_text(json.dumps({"lr": 3e-4, "traceEvents_note": "a key named alike"}))
    with gzip.open(tmp_path / "rank0.raw.json.gz", "wt") as f:  # an export_memory_timeline file
        json.dump([[0, 1, 2], [0, 1, 2]], f)
    (tmp_path / "truth.json").write_text(json.dumps({"scenario": "x"}))
    skipped: list[tuple[str, str]] = []
    files = discover([tmp_path], skipped=skipped)
    assert [p.name for p in files] == [p.name for p in _traces("per-block")]
    assert sorted(Path(p).name for p, _ in skipped) == ["rank0.raw.json.gz", "train_config.json", "truth.json"]
    rep = fsdpdoctor.analyze(tmp_path)
    assert rep.facts.ranks == [0, 1] and rep.facts.fsdp.unit_count == 5  # root + 4 blocks
    assert any("3 file(s) beside the traces not analysed" in n for n in rep.facts.notes)


def test_a_file_named_explicitly_is_read_and_refused_when_not_a_trace(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"lr": 1}')
    assert discover([p]) == [p]
    with pytest.raises(InputError):
        fsdpdoctor.analyze(p)


@pytest.mark.slow
def test_capture_cycles_are_grouped(tmp_path):
    """capture(repeat=2) writes rank{R}.json.gz and rank{R}.cycle1.json.gz side by side."""
    for p in _traces("per-block"):  # cycle 0: BACKWARD_PRE
        shutil.copy(p, tmp_path / p.name)
    for p in _traces("no-backward-prefetch"):  # cycle 1: prefetch off
        shutil.copy(p, tmp_path / p.name.replace(".json.gz", ".cycle1.json.gz"))
    assert cycle_of(tmp_path / "rank1.cycle1.json.gz") == 1 and cycle_of(tmp_path / "rank1.json.gz") == 0

    def run(*extra):
        r = subprocess.run(
            [sys.executable, "-m", "fsdpdoctor", "analyze", str(tmp_path), "--format", "json", *extra],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    last, first = run(), run("--cycle", "0")
    assert last["ranks"] == first["ranks"] == [0, 1]  # no "rank 0 appears twice"
    assert last["fsdp"]["backward_prefetch"] == "NONE" and first["fsdp"]["backward_prefetch"] == "BACKWARD_PRE"
    assert any("capture cycle 0" in n for n in last["notes"])
    r = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(tmp_path), "--cycle", "5"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "cycles [0, 1], not 5" in r.stderr and "Traceback" not in r.stderr


def test_a_large_non_trace_json_is_skipped_by_content_whatever_its_size(tmp_path):
    """Issue 26: the 1,024-rank benchmark's own truth.json (MBs, an object without traceEvents)
    beside the traces was counted as a failed rank. Judged from its head, it is listed, not a rank."""
    for p in _traces("per-block"):
        shutil.copy(p, tmp_path / p.name)
    truth = {"scenario": "bench", "ranks": [{"rank": r, "step_ms": [12.5] * 64} for r in range(8192)]}
    (tmp_path / "truth.json").write_text(json.dumps(truth))
    assert (tmp_path / "truth.json").stat().st_size > 2 << 20  # past the bytes read to judge it
    with gzip.open(tmp_path / "big_list.json.gz", "wt") as f:  # a large gzip non-trace too
        json.dump({"rows": list(range(600_000))}, f)
    skipped: list[tuple[str, str]] = []
    files = discover([tmp_path], skipped=skipped)
    assert [p.name for p in files] == [p.name for p in _traces("per-block")]
    assert sorted(Path(p).name for p, _ in skipped) == ["big_list.json.gz", "truth.json"]
    rep = fsdpdoctor.analyze(tmp_path)
    assert rep.facts.ranks == [0, 1] and not rep.facts.inputs_excluded
    assert any("2 file(s) beside the traces not analysed" in n for n in rep.facts.notes)


def test_one_input_path_bounds_a_sidecar_read_from_a_url(monkeypatch):
    """#37: every reader goes through open_input; the sidecar read from a URL had no byte limit.
    A 3 MiB "sidecar" on an fsspec memory store with a 1 MiB input limit is refused, in words."""
    import fsspec

    from fsdpdoctor.ingest import _io
    from fsdpdoctor.ingest.sidecar import load_sidecar

    fs = fsspec.filesystem("memory")
    fs.pipe("/bounded/fsdpdoctor_meta.json", b'{"schema": "fsdpdoctor.meta/1", "pad": "' + b"x" * (3 << 20) + b'"}')
    try:
        monkeypatch.setenv(_io.MAX_INPUT_ENV, str(1 << 20))
        side, problem = load_sidecar("memory://bounded/fsdpdoctor_meta.json")
        assert side is None and "more than" in problem and "max-input-bytes" in problem
        monkeypatch.delenv(_io.MAX_INPUT_ENV)
        side, problem = load_sidecar("memory://bounded/fsdpdoctor_meta.json")
        assert problem is None and side["schema"] == "fsdpdoctor.meta/1"
    finally:
        fs.rm("/bounded", recursive=True)
