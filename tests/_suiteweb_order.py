"""pytest plugin: the suite's known-long tests start first, one share per xdist worker.

Register from ``tests/conftest.py`` with ``pytest_plugins = [..., "_suiteweb_order"]``.

Under ``-n auto --dist worksteal`` each worker is first sent one contiguous slice of the collection
(the first worker ``N // n`` tests, the next ``(N - N//n) // (n-1)``, ...) and a worker that runs
dry steals the *end* of the longest queue. A 15-25 s test that sits late in a slice is never
stolen, so it can run alone at the end while the other core idles. Here the tests listed in
``LONG`` (whole modules where their module fixtures are shared, single tests where they have
none) are dealt to the workers longest first, each to the worker with the least listed time so
far, and put at the *front* of that worker's slice; every other test keeps its collection order
and its slice boundaries, so the stealing balances the rest.

The Flight Recorder dumps of the hung jobs (``hang_recording``, ``fixtures/record_hang.py``) are
recorded in the session when ``FSDPDOCTOR_HANG_DIR`` does not hold them (CI): ~20-55 s of wall
time that is mostly the scenarios' collective timeouts and sleeps, not CPU. The first test that
asks for them waited that long (test_perfetto's ``test_flight_recorder_dumps_alone_have_nothing_to_draw``
took 24 s in CI, 0.04 s with the preset), and so did any other worker that asked meanwhile. Here
the first worker (or the only process) starts that recording in a background thread as soon as
it has collected a test that uses the fixture; the tests that need the dumps find them made, or
wait on the same file lock for the rest of it.

The reordering changes nothing without xdist workers (``-n0``, ``-p no:xdist``) or with one worker. A listed
test that no longer exists is ignored; an unlisted long test only loses the head start.
Estimates are CPU seconds from ``--durations=0`` of the whole suite (2 workers, pre-recorded runs).
"""

from __future__ import annotations

import os
import threading

import pytest

#: node id prefix -> estimated seconds (a module's prefix takes all its tests, in their order)
LONG: dict[str, float] = {
    "tests/test_fuzz.py::": 44.0,  # 11 tests, CPU-s after the suitefuzz trimming (was 67)
    "tests/test_html.py::": 25.0,  # five chromium page loads, one launch each
    "tests/test_docs.py::test_site_builds_strict_with_a_page_per_rule": 15.0,  # mkdocs build --strict
    "tests/test_one_figure.py::test_headlines_page_is_current": 14.0,  # benchmarks/headlines.py --check
    "tests/test_integrations_hf.py::": 9.5,  # a real HF Trainer FSDP2 run in the module fixture
    "tests/test_integrations_lightning.py::": 9.0,  # a real Lightning FSDP run in the module fixture
    "tests/test_integrations_doctor.py::": 9.0,  # the hang watchdog ends a hung job (7.6 s)
    "tests/test_readme.py::test_readme_examples_are_what_the_tool_prints": 6.0,
}


def _slices(n_items: int, n_workers: int) -> list[int]:
    """The sizes of the first slices worksteal sends (xdist's ``check_schedule``)."""
    sizes, left = [], n_items
    for i in range(n_workers):
        size = left // (n_workers - i)
        sizes.append(size)
        left -= size
    return sizes


def reorder(items: list, n_workers: int) -> list:
    """``items`` (anything with ``.nodeid``) laid out so that each worker's slice opens with its
    share of the ``LONG`` tests."""
    if n_workers < 2:
        return list(items)
    groups: dict[str, list] = {}
    rest = []
    for it in items:
        key = next((k for k in LONG if it.nodeid.startswith(k)), None)
        (groups.setdefault(key, []) if key else rest).append(it)
    load = [0.0] * n_workers
    heads: list[list] = [[] for _ in range(n_workers)]
    for key in sorted(groups, key=lambda k: -LONG[k]):
        w = min(range(n_workers), key=lambda i: load[i])
        heads[w].extend(groups[key])
        load[w] += LONG[key]
    out, pos = [], 0
    for w, size in enumerate(_slices(len(items), n_workers)):
        take = max(0, size - len(heads[w]))
        out += heads[w] + rest[pos : pos + take]
        pos += take
    out += rest[pos:]
    assert len(out) == len(items)
    return out


_PREFETCH: threading.Thread | None = None


def _prefetch_hangs(config, items) -> None:
    """Start recording the hung jobs' dumps in the background (see the module's docstring)."""
    global _PREFETCH
    if _PREFETCH is not None or config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    if not any("hang_recording" in getattr(it, "fixturenames", ()) for it in items):
        return
    import _recording

    if _recording._HANGS is None:  # what the hang_recording fixture does on its first use
        _recording._HANGS = _recording._HangRecordings(_recording.shared_cache_dir(config._tmp_path_factory))
    factory = _recording._HANGS

    def record() -> None:
        try:
            factory("leave-early")  # records every scenario (or returns the preset's at once)
        except BaseException:  # noqa: BLE001 - a test that asks again records and reports the failure
            pass

    _PREFETCH = threading.Thread(target=record, name="fsdpdoctor-hang-recording")
    _PREFETCH.start()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers >= 2:  # in an xdist worker (there ``config.option.dist`` reads "no", whatever the mode)
        items[:] = reorder(items, workers)
    _prefetch_hangs(config, items)


def pytest_unconfigure(config):
    if _PREFETCH is not None:
        _PREFETCH.join()
