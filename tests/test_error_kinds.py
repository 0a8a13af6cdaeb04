"""Errors that say what they are (issue 26): a product bug met on one input is an internal error
naming that input (exit 3), never "cannot read" as if the file were at fault; an I/O or back-end
failure of a URL stays an input problem; a rule plugin that fails to load is a warning naming it."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
from conftest import cli_in_process

REC = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "per-block"


_cli = cli_in_process  # (conftest)


@pytest.fixture
def served():
    """The recorded per-block run's rank 0, served from fsspec's memory:// file system."""
    mem = fsspec.filesystem("memory")
    mem.pipe("/t26/run/rank0.json.gz", (REC / "rank0.json.gz").read_bytes())
    try:
        yield "memory://t26/run/rank0.json.gz"
    finally:
        mem.rm("/t26", recursive=True)


def _raise(exc: BaseException):
    def f(*_a, **_k):
        raise exc

    return f


def test_served_run_is_read(served):
    code, err = _cli(["analyze", served, "-j", "1", "--format", "json"])
    assert code == 0, err


@pytest.mark.parametrize("where", ["url", "local"])
def test_a_bug_on_one_input_is_an_internal_error_naming_it(served, monkeypatch, where):
    import fsdpdoctor.analysis.ranks as ranks

    monkeypatch.setattr(ranks, "analyze_rank", _raise(ZeroDivisionError("float division by zero")))
    path = served if where == "url" else str(REC / "rank0.json.gz")
    code, err = _cli(["analyze", path, "-j", "1"])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 3, err
    assert len(lines) == 1 and "internal error" in lines[0] and path.split("://")[-1] in lines[0], err
    assert "ZeroDivisionError" in lines[0] and "cannot read" not in lines[0], err


def test_a_back_end_failure_stays_an_input_problem(served, monkeypatch):
    import fsdpdoctor.analysis.ranks as ranks

    monkeypatch.setattr(ranks, "analyze_rank", _raise(ConnectionResetError(104, "Connection reset by peer")))
    code, err = _cli(["analyze", served, "-j", "1", "--strict"])
    assert code == 2, err
    assert "cannot read" in err and "internal error" not in err, err


class _BrokenEntryPoint:
    name, value = "acme", "acme_rules.fsdp:rule"

    def load(self):
        raise ModuleNotFoundError("No module named 'acme_rules'")


def test_a_plugin_that_fails_to_load_is_a_warning_naming_it(monkeypatch):
    import fsdpdoctor.engine as engine

    monkeypatch.setattr(engine, "entry_points", lambda group: [_BrokenEntryPoint()])
    monkeypatch.setattr(engine, "PLUGIN_PROBLEMS", {})
    code, err = _cli(["analyze", str(REC), "-j", "1", "--format", "json"])
    assert code == 0, err
    warn = [ln for ln in err.splitlines() if "warning" in ln and "plugin" in ln]
    assert len(warn) == 1 and "acme" in warn[0] and "No module named 'acme_rules'" in warn[0], err
    assert "Traceback" not in err
