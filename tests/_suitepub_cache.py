"""pytest plugin: the public traces (../shared/traces/public) read once, and analysed once, for
every test module that reads them (issue #44 item 2: the suite's time).

Register from ``tests/conftest.py`` with ``pytest_plugins = [..., "_suitepub_cache"]``.

Eight test modules read the same public files: each parsed the raw JSON with the standard library
(8-10 CPU-s for all of them, mtia_rank_0 alone 2.2-2.8 s) and analysed it with fsdpdoctor, in every
xdist worker that took one of its tests. Here:

``raw(path, reading)``
    ``reading(doc)``: a test's independent reading of a trace, a function of the parsed JSON in
    plain Python (json/gzip/re, none of fsdpdoctor), registered with :func:`stdlib_reading` by the
    module that defines it. The first test that asks for any reading of a file parses the file
    once (``json.loads``) and computes every registered reading that applies to it; the results
    (small summaries, never the document) are kept in this process and written to the session's
    shared cache folder, where the other processes of the session find them. A result is keyed
    by the source of the module that defines its reading and of the modules a reading may use
    (tests/_*.py, fixtures/scenarios/*.py), and by the file's path, size and modification time.

``report(path)``, ``read_rank(path)``
    ``fsdpdoctor.analyze(path)`` with the default arguments (a file's RankFacts without the
    what-if replay), analysed once per session (under a
    file lock, the first process that asks) and shared by every module and process: kept in this
    process, and pickled into the shared folder keyed by a hash of the whole fsdpdoctor package
    (every file of it), the versions of the libraries it computes with, the test-only rule
    inflation (``FSDPDOCTOR_TEST_INFLATE``) and the input's files (path, size, modification
    time). A report is shared: read it, never change it.

The shared folder is the session's (beside the recordings and the generated runs; under
pytest's base temporary folder, or ``$FSDPDOCTOR_TEST_CACHE``). Outside a pytest session (no
folder set) both caches are this process's only.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

PUBLIC_TRACES = REPO.parent / "shared" / "traces" / "public"
RECORDED = REPO / "fixtures" / "recorded"

_DIR: Path | None = None  # the session's shared folder, set by the fixture below
_READINGS: dict[str, tuple[Callable[[Any], Any], tuple[Path, ...], str]] = {}
_RAW: dict[tuple[str, str], Any] = {}  # (file key, reading key) -> result
_CACHE: Any = None  # the ReportCache, made on first use
_SOURCE_KEYS: dict[str, str] = {}


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p + b"\0")
    return h.hexdigest()[:20]


def _file_digest(path: Path) -> str:
    key = str(path)
    if key not in _SOURCE_KEYS:
        _SOURCE_KEYS[key] = _digest(path.read_bytes())
    return _SOURCE_KEYS[key]


def stdlib_reading(*roots: Path):
    """Register ``reading(doc) -> result`` (plain Python over the parsed JSON): computed in the
    one pass over each file under ``roots`` or named by them (default: the public traces), and
    on demand for any other file. Returns the function unchanged."""
    roots = tuple(Path(r).resolve() for r in roots or (PUBLIC_TRACES,))

    def register(fn):
        src = Path(inspect.getsourcefile(fn) or "-").resolve()
        own = _file_digest(src) if src.is_file() else _digest(fn.__code__.co_code, repr(fn.__code__.co_consts).encode())
        helpers = [*sorted(TESTS.glob("_*.py")), *sorted((REPO / "fixtures" / "scenarios").glob("*.py"))]
        key = _digest(
            f"{fn.__module__}.{fn.__qualname__}".encode(),
            own.encode(),
            *(_file_digest(f).encode() for f in helpers),  # what a reading may import (tests/_*.py, fixtures)
        )
        _READINGS[key] = (fn, roots, f"{fn.__module__}.{fn.__qualname__}")
        fn._suitepub_key = key
        return fn

    return register


def _stat_key(path: Path) -> str:
    """The input's identity: resolved path, size and mtime of the file, or of every file under
    the folder."""
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    parts = [str(p).encode()]
    for q in files:
        st = q.stat()
        parts.append(f"{q}:{st.st_size}:{st.st_mtime_ns}".encode())
    return _digest(*parts)


def load_json(path: str | Path) -> Any:
    """The trace's JSON (gzip by its magic bytes), with the standard library alone."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return json.loads(data)


def _lock(name: str):
    from filelock import FileLock

    return FileLock(str(_DIR / f"{name}.lock"))


def _disk_get(name: str) -> tuple[bool, Any]:
    if _DIR is None:
        return False, None
    f = _DIR / f"{name}.pkl"
    if not f.exists():
        return False, None
    with open(f, "rb") as fh:
        return True, pickle.load(fh)


def _disk_put(name: str, value: Any) -> None:
    if _DIR is None:
        return
    tmp = _DIR / f"{name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(value, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, _DIR / f"{name}.pkl")


def raw(path: str | Path, reading: Callable[[Any], Any]) -> Any:
    """``reading(doc)`` of the trace at ``path`` (see the module doc): read once per session."""
    path = Path(path)
    rkey = getattr(reading, "_suitepub_key", None)
    if rkey is None:
        raise TypeError(f"{reading!r} is not registered with @stdlib_reading")
    fkey = _stat_key(path)
    if (fkey, rkey) in _RAW:
        return _RAW[fkey, rkey]
    where = path.resolve()
    wanted = {k for k, (_fn, roots, _n) in _READINGS.items() if any(r == where or r in where.parents for r in roots)}
    wanted.add(rkey)
    if _DIR is None:
        _one_pass(path, fkey, wanted, rkey)
    else:
        with _lock(f"raw-{fkey}"):
            missing = set()
            for k in wanted:
                ok, value = _disk_get(f"raw-{fkey}-{k}")
                if ok:
                    _RAW[fkey, k] = value
                else:
                    missing.add(k)
            if missing:
                for k in _one_pass(path, fkey, missing, rkey):
                    _disk_put(f"raw-{fkey}-{k}", _RAW[fkey, k])
    return _RAW[fkey, rkey]


def _one_pass(path: Path, fkey: str, keys: set[str], asked: str) -> list[str]:
    """Parse the file once, compute the readings ``keys``; those the test did not ask for are
    kept only when they succeed (a reading that fails on this file fails where it is asked)."""
    doc = load_json(path)
    done = []
    for k in sorted(keys):
        if k == asked:
            _RAW[fkey, k] = _READINGS[k][0](doc)
        else:
            try:
                _RAW[fkey, k] = _READINGS[k][0](doc)
            except Exception:  # noqa: BLE001 - not this test's reading
                continue
        done.append(k)
    return done


def _analysed(path: Path, what: str, compute: Callable[[], Any]) -> Any:
    """``compute()``'s report for ``path``, through the session's one report cache
    (:class:`_suitegen_cache.ReportCache`: keyed by the analysing code, the environment, the input
    and the call), or this process's alone outside a session."""
    from _suitegen_cache import ReportCache

    global _CACHE
    if _CACHE is None:
        _CACHE = ReportCache(_DIR if _DIR is not None else None)
    return _CACHE(path.name, _stat_key(path), {"call": what}, compute)


def report(path: str | Path):
    """``fsdpdoctor.analyze(path)`` (default arguments), once per session (see the module doc)."""
    import fsdpdoctor

    path = Path(path)
    return _analysed(path, "analyze", lambda: fsdpdoctor.analyze(path))


def read_rank(path: str | Path):
    """A trace file's RankFacts without the what-if replay (``_read_rank(load_trace(path), 0)``,
    what ``analyze_rank`` computes before its replay), once per session like :func:`report`."""
    from fsdpdoctor.analysis.ranks.rank import _read_rank
    from fsdpdoctor.ingest.kineto import load_trace

    path = Path(path)
    return _analysed(path, "read_rank", lambda: _read_rank(load_trace(path), 0)[0])


def rank_facts(path: str | Path):
    """The one rank's RankFacts of a trace file: ``report(path)``'s (what ``analyze_rank``
    returns for it, the what-if replay included)."""
    (rf,) = report(path).facts.rank_facts
    return rf


@pytest.fixture(scope="session", autouse=True)
def _suitepub_shared_dir(tmp_path_factory):
    """Point both caches at the session's shared folder (every process of the session)."""
    global _DIR
    from _recording import session_root

    root = session_root(tmp_path_factory)
    _DIR = root / "fsdpdoctor-suitepub"
    _DIR.mkdir(parents=True, exist_ok=True)
    yield
