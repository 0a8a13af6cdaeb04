"""Shared test fixtures.

Real inputs live in ``../shared`` beside the repository (never copied into it); tests that need
them skip cleanly when it is absent.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PUBLIC_TRACES = SHARED / "traces" / "public"
PUBLIC_SNAPSHOTS = SHARED / "snapshots" / "public"

if str(REPO) not in sys.path:  # lets tests import fixtures.* (recorders, generators)
    sys.path.insert(0, str(REPO))

pytest_plugins = ["_recording", "_presets", "_suiteweb_order", "_suitepub_cache"]

# Every report produced while testing (in this process and in CLI subprocesses, which inherit
# the environment) is validated against the published JSON Schema (fsdpdoctor.api._checked).
os.environ["FSDPDOCTOR_CHECK_SCHEMA"] = "1"


def cli_in_process(argv: list[str]) -> tuple[int, str]:
    """Run the fsdpdoctor CLI in this process: (exit code, what it wrote on stderr)."""
    import contextlib
    import io

    from fsdpdoctor.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main.main(args=argv, prog_name="fsdpdoctor", standalone_mode=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()


def public_trace_files() -> list[Path]:
    if not PUBLIC_TRACES.is_dir():
        return []
    return sorted(PUBLIC_TRACES.glob("*/*.json.gz"))


@pytest.fixture(scope="session")
def scenario_case(generated_run, analyzed_run):
    """preset name -> (fsdpdoctor.analyze() of the generated run, its truth.json), analysed once per
    process (``_presets.analyzed_run``); the run is generated once per session
    (``_presets.generated_run``). Both are shared: read them, never change them."""
    from fixtures.scenarios import generator as gen

    def get(name: str):
        get.dirs[name] = generated_run(gen.PRESETS[name])  # the rank files, for tests that read them raw
        return analyzed_run(gen.PRESETS[name])

    get.dirs = {}
    return get


@pytest.fixture(scope="session")
def public_report():
    """path -> ``fsdpdoctor.analyze(path)`` of a public trace file, analysed once per session and
    shared by the modules that read every public trace (test_rules, test_shapes,
    test_finding_coherence; ``_suitepub_cache.report``: once per session). A report is shared:
    read it, never change it."""
    from _suitepub_cache import report

    return report


@pytest.fixture
def shared_traces() -> Path:
    if not PUBLIC_TRACES.is_dir():
        pytest.skip("../shared/traces/public is absent")
    return PUBLIC_TRACES


#: Set by ``.ci/run``: CI always has ``../shared`` beside the clone, so a test that skips because
#: a shared input is missing there is a failure (a moved or renamed file must not turn a real-input
#: test into a silent skip). Every such skip names ``../shared`` in its reason.
REQUIRE_SHARED = os.environ.get("FSDPDOCTOR_REQUIRE_SHARED") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_SHARED and report.skipped and call.excinfo is not None:
        reason = str(call.excinfo.value)
        if "../shared" in reason:
            report.outcome = "failed"
            report.longrepr = f"FSDPDOCTOR_REQUIRE_SHARED=1 but the test skipped: {reason}"


def pytest_sessionstart(session):
    # Tests parametrized over the shared files collect nothing (rather than skip) without them.
    if REQUIRE_SHARED and not (PUBLIC_TRACES.is_dir() and PUBLIC_SNAPSHOTS.is_dir()):
        raise pytest.UsageError(f"FSDPDOCTOR_REQUIRE_SHARED=1 but {SHARED} has no traces/public and snapshots/public")


#: ``FSDPDOCTOR_TEST_INFLATE=FSD007`` (or ``FSD007:1.25``): every finding of that rule leaves its
#: check with its estimated saving (and its ceiling, the part of the step the fix acts on)
#: multiplied by the factor (default 1.25), before the engine bounds, ranges and ranks it. Used by
#: ``benchmarks/inflate_rules.py``: a test with independent truth must then fail (issue #42).
INFLATE = os.environ.get("FSDPDOCTOR_TEST_INFLATE", "")


def _inflate(code: str, factor: float) -> None:
    import dataclasses

    from fsdpdoctor import engine

    real = engine.load_rules

    def wrap(check):
        def inflated(facts, cfg):
            out = check(facts, cfg)
            for f in out:
                if f.est_saving_ms is not None:
                    f.est_saving_ms *= factor
                if f.saving_ceiling_ms is not None:
                    f.saving_ceiling_ms *= factor
                if f.saving_span_ms is not None:
                    f.saving_span_ms = [x * factor for x in f.saving_span_ms]
            return out

        return inflated

    def load_rules():
        return tuple(dataclasses.replace(r, check=wrap(r.check)) if r.code == code else r for r in real())

    engine.load_rules = load_rules


if INFLATE:
    _code, _, _factor = INFLATE.partition(":")
    _inflate(_code.upper(), float(_factor or 1.25))
