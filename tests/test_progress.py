"""Progress reporting (bytes read) and the parallel per-rank workers."""

from __future__ import annotations

import io
import time
from pathlib import Path

from fsdpdoctor.analysis.ranks import analyze_ranks
from fsdpdoctor.progress import load_progress

REPO = Path(__file__).resolve().parents[1]
RECORDED = sorted((REPO / "fixtures" / "recorded" / "per-block").glob("rank*.json.gz"))


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_when_not_a_terminal():
    out = io.StringIO()
    with load_progress(stream=out, delay=0) as cb:
        cb(50, 100)
        cb(100, 100)
    assert out.getvalue() == ""


def test_no_bar_for_a_short_load():
    out = _Tty()
    with load_progress(stream=out, delay=60) as cb:
        cb(50, 100)
        cb(100, 100)
    assert out.getvalue() == ""


def test_bar_on_a_terminal_after_the_delay():
    out = _Tty()
    with load_progress(stream=out, delay=0) as cb:
        for i in range(5):
            cb(i * 2**20, 4 * 2**20)
            time.sleep(0.01)
    assert "reading traces" in out.getvalue()


def _progress_calls(jobs: int):
    calls: list[tuple[int, int]] = []
    ranks = analyze_ranks(RECORDED, jobs=jobs, progress=lambda d, t: calls.append((d, t)))
    return ranks, calls


def test_parallel_ranks_equal_sequential_and_report_bytes():
    total = sum(p.stat().st_size for p in RECORDED)
    seq, seq_calls = _progress_calls(1)
    par, par_calls = _progress_calls(2)
    assert [r.rank for r in par] == [r.rank for r in seq] == [0, 1]
    assert par == seq
    for calls in (seq_calls, par_calls):
        assert calls and calls[-1] == (total, total)
        assert all(t == total and 0 <= d <= total for d, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_bar_counts_ranks():
    out = _Tty()
    with load_progress(stream=out, delay=0) as cb:
        cb(1, 8 * 2**20)
        cb.ranks(3, 8)
        cb(4 * 2**20, 8 * 2**20)
    assert "3/8 ranks" in out.getvalue()


class _Recorder:
    def __init__(self) -> None:
        self.bytes: list[tuple[int, int]] = []
        self.done: list[tuple[int, int]] = []

    def __call__(self, d: int, t: int) -> None:
        self.bytes.append((d, t))

    def ranks(self, d: int, t: int) -> None:
        self.done.append((d, t))


def test_fan_out_reports_ranks_done():
    for jobs in (1, 2):
        rec = _Recorder()
        analyze_ranks(RECORDED, jobs=jobs, progress=rec)
        assert rec.done[-1] == (2, 2)
        assert [d for d, _ in rec.done] == sorted(d for d, _ in rec.done)
