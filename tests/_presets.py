"""pytest plugin: generated scenario runs (``fixtures/scenarios/generator.py``), generated once per
test session and shared by every process of it.

Register from ``tests/conftest.py`` with ``pytest_plugins = [..., "_presets"]``.

Many modules generate the same presets (test_scenarios, test_check, test_compare, test_rules,
test_whatif, ...), and under pytest-xdist's worksteal a module's fixtures run again in every worker
that takes one of its tests. Generating a preset costs 0.3-1.4 CPU-s; here each config is generated
once, by the first process that asks for it, under a file lock (``_recording.once``), into the
session's shared cache folder (``_recording.shared_cache_dir``'s parent, or
``$FSDPDOCTOR_TEST_CACHE``), in a folder named by a hash of the generator's source and the config's
full ``repr`` - so a modified config, or a changed generator, is generated afresh.

Fixture (session-scoped):

``generated_run``
    ``generated_run(cfg) -> Path``: the folder holding ``rank{R}.json.gz`` and ``truth.json`` for
    ``cfg`` (a ``ScenarioConfig``: a preset or a ``dataclasses.replace`` of one). The folder is
    shared: read it, never write into it (a test that damages rank files generates its own).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import pytest
from _recording import REPO, once, session_root

GENERATOR_DIR = REPO / "fixtures" / "scenarios"


def generator_key() -> str:
    """A hash of the generator's source: every module of fixtures/scenarios and what it imports
    from fsdpdoctor (the thresholds in fsdpdoctor/config.py)."""
    h = hashlib.sha256()
    for f in [*sorted(GENERATOR_DIR.glob("*.py")), REPO / "fsdpdoctor" / "config.py"]:
        if f.exists():
            h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def presets_cache_dir(tmp_path_factory) -> Path:
    """The folder every process of this session shares for generated runs (beside the recordings)."""
    root = session_root(tmp_path_factory)
    out = root / f"fsdpdoctor-generated-{generator_key()}"
    out.mkdir(parents=True, exist_ok=True)
    return out


class _Generated:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.dirs: dict[str, Path] = {}

    def __call__(self, cfg) -> Path:
        key = repr(cfg)
        if key not in self.dirs:
            from fixtures.scenarios import generator as gen

            digest = hashlib.sha256(key.encode()).hexdigest()[:16]
            self.dirs[key] = once(self.base, f"{cfg.name}-{digest}", lambda out: gen.generate(cfg, out))
        return self.dirs[key]


_GENERATED: _Generated | None = None


@pytest.fixture(scope="session")
def generated_run(tmp_path_factory) -> Callable[[object], Path]:
    """Factory: ``generated_run(cfg) -> Path`` of the generated run of ``cfg`` (see module doc)."""
    global _GENERATED
    if _GENERATED is None:
        _GENERATED = _Generated(presets_cache_dir(tmp_path_factory))
    return _GENERATED


@pytest.fixture(scope="session")
def analyzed_run(generated_run) -> Callable[[object], tuple]:
    """Factory: ``analyzed_run(cfg) -> (fsdpdoctor.analyze(generated_run(cfg)), its truth.json)``,
    analysed once per session with the default options (``_suitegen_cache``: the first process
    pickles it, the others read it) and shared by every module that asks for the same config. A
    report is shared: read it, never change it."""
    import fsdpdoctor
    from _suitegen_cache import ReportCache
    from fixtures.scenarios import generator as gen

    reports = ReportCache(_GENERATED.base.parent)
    cache: dict[str, tuple] = {}

    def get(cfg) -> tuple:
        key = repr(cfg)
        if key not in cache:
            out = generated_run(cfg)
            # the report is made once per session, across processes (_suitegen_cache: keyed by the
            # analysing code, the generator's source and this config)
            rep = reports(cfg.name, f"generated {generator_key()} {key}", {}, lambda: fsdpdoctor.analyze(out))
            cache[key] = (rep, gen.read_truth(out))
        return cache[key]

    return get
