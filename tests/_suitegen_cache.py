"""An on-disk cache of ``fsdpdoctor.analyze`` reports shared by every process of a test session
(the xdist workers), for inputs the tests never change: the generated scenario runs
(``_presets.analyzed_run``) and the committed recordings.

Under pytest-xdist's worksteal the same generated run is analysed by each worker that takes a test
reading it (test_whatif, test_saving_truth, test_rules, test_finding_coherence, ... share many
configs); here the first process analyses it, under a file lock, and pickles the
:class:`fsdpdoctor.Report`; the others wait and unpickle it (a few ms).

An entry is keyed by everything that decides its content:

* a hash of the analysing code: every file of the ``fsdpdoctor`` package and of ``rules/``
  (the built-in rules), the Python version and those of the libraries it computes with;
* the environment variables that change a report (``FSDPDOCTOR_*``: the rule inflation of
  ``benchmarks/inflate_rules.py``, the schema check, ...), except the folders of the recordings;
* the input: a name and a digest of what it is (a generated run: the generator's key and the
  config's ``repr``; a committed file: its bytes);
* the call's arguments.

Entries are written atomically (temp file + rename, under a file lock) into the session's shared
cache folder (``_presets.presets_cache_dir``), never beside the inputs.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Callable

from _recording import REPO

#: environment variables that say where inputs are, not what a report holds
_NOT_KEYED = {"FSDPDOCTOR_RECORDED_DIR", "FSDPDOCTOR_HANG_DIR", "FSDPDOCTOR_TEST_CACHE"}

_CODE_KEY: str | None = None


def code_key() -> str:
    """A hash of the code that makes a report: the fsdpdoctor package and the built-in rules
    (every file, not only .py: the schema, the savings tables), the Python and library versions."""
    global _CODE_KEY
    if _CODE_KEY is None:
        from importlib.metadata import PackageNotFoundError, version

        h = hashlib.sha256(sys.version.encode() + b"\0")
        for dist in ("numpy", "msgspec", "pandas", "numba"):  # the libraries a report is computed with
            try:
                h.update(f"{dist}={version(dist)}\0".encode())
            except PackageNotFoundError:
                h.update(f"{dist}=-\0".encode())
        for top in ("fsdpdoctor", "rules"):
            for f in sorted((REPO / top).rglob("*")):
                if not f.is_file() or "__pycache__" in f.parts or f.suffix in (".pyc", ".nbi", ".nbc"):
                    continue
                h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        _CODE_KEY = h.hexdigest()[:16]
    return _CODE_KEY


def env_key() -> str:
    items = sorted((k, v) for k, v in os.environ.items() if k.startswith("FSDPDOCTOR_") and k not in _NOT_KEYED)
    return repr(items)


def files_digest(paths: list[Path]) -> str:
    """A digest of the files' names and bytes (a committed recording's rank files)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


class ReportCache:
    """``cache(name, what, args, make) -> Report``: ``make()``'s report, made once per session
    (across processes) and once per process (kept in memory) for the key (``what``: a digest of the
    input, ``args``: the call's arguments)."""

    def __init__(self, base: Path | None) -> None:
        self.base = None if base is None else base / f"reports-{code_key()}"  # None: this process only
        if self.base is not None:
            self.base.mkdir(parents=True, exist_ok=True)
        self.memory: dict[str, Any] = {}

    def __call__(self, name: str, what: str, args: dict[str, Any], make: Callable[[], Any]) -> Any:
        key = hashlib.sha256(f"{what}\0{sorted(args.items())!r}\0{env_key()}".encode()).hexdigest()[:24]
        if key in self.memory:
            return self.memory[key]
        if self.base is None:
            self.memory[key] = make()
            return self.memory[key]
        from filelock import FileLock

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
        out = self.base / f"{safe}-{key}.pickle"
        with FileLock(str(out) + ".lock"):
            if out.exists():
                with out.open("rb") as fh:
                    rep = pickle.load(fh)
            else:
                rep = make()
                tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
                with tmp.open("wb") as fh:
                    pickle.dump(rep, fh, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, out)
        self.memory[key] = rep
        return rep


_COMMITTED: dict[str, Any] = {}


def committed_report(path: str | Path) -> Any:
    """``fsdpdoctor.analyze(path)`` (default options) of a committed recording under
    ``fixtures/recorded``, made once per process and shared by the modules that read the same
    recording (test_compute, test_compare_causes, test_compare_idle_raw, test_rules, test_check).
    A report is shared: read it, never change it."""
    import fsdpdoctor

    p = Path(path).resolve()
    assert (REPO / "fixtures" / "recorded") in p.parents, f"{p} is not a committed recording"
    key = str(p)
    if key not in _COMMITTED:
        _COMMITTED[key] = fsdpdoctor.analyze(key)
    return _COMMITTED[key]
