"""pytest plugin: record real FSDP2 / FSDP1 / DDP runs on CPU (gloo) once per test session.

Register from ``tests/conftest.py`` with ``pytest_plugins = ["_recording"]``.

Fixtures (all session-scoped):

``recorded_run``
    A factory ``recorded_run(variant) -> Path``: the directory holding ``rank{R}.json.gz`` for
    every rank and the sidecar ``fsdpdoctor_meta.json``, as written by
    ``fixtures/record_cpu.py`` through ``fsdpdoctor.capture``. The first call records every
    variant in :data:`VARIANTS` in one subprocess (one torch start-up, all variants in the same
    two gloo ranks, about 20 s on 2 cores); later calls return the cached directories. Skips
    the test when torch is not installed.
    Also the run shapes of :data:`SHAPES` (gradient accumulation, activation checkpointing,
    compiled blocks, per-parameter meshes, HSDP 2x2, TP+FSDP 2x2), recorded per group of
    :data:`SHAPE_GROUPS` on first use (2 or 4 gloo ranks, a few seconds each).
``recorder``
    ``fixtures/record_cpu.py`` loaded as a module (model definition, ``unit_params``,
    ``VARIANTS``, ``WAIT``/``WARMUP``/``ACTIVE``...), for computing expected values.
``recorded_world_size``
    The world size the runs are recorded with (2).
``hang_recording``
    A factory ``hang_recording(scenario) -> Path``: real Flight Recorder dumps of a hung FSDP2 /
    FSDP1 job on 4 gloo processes (``fixtures/record_hang.py``, every scenario at the first call,
    ~20 s); ``FSDPDOCTOR_HANG_DIR=/some/dir`` reuses ``record_hang.py --all --out /some/dir``.

Set ``FSDPDOCTOR_RECORDED_DIR=/some/dir`` to reuse recordings made earlier with
``python fixtures/record_cpu.py --all --out /some/dir`` instead of recording again.

Shared by every process of a session: under pytest-xdist each group of recordings is made once,
by the first worker that asks for it, under a file lock, into a cache folder that every worker of
the session reads (the parent of the workers' base temp folders). The folder's name is a hash of
the recorders, ``fsdpdoctor``'s capture modules and the torch version, so
``FSDPDOCTOR_TEST_CACHE=/some/dir`` (a folder kept between sessions, e.g. ``~/.cache/fsdpdoctor``)
records once until one of those changes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
RECORDER = REPO / "fixtures" / "record_cpu.py"
COMMITTED = REPO / "fixtures" / "recorded"
WORLD_SIZE = 2
VARIANTS = (
    "per-block",
    "root-only",
    "per-linear",
    "no-backward-prefetch",
    "no-reshard",
    "bf16-mp",
    "ddp",
    "fsdp1",
)
# Run shapes (gradient accumulation, checkpointing, compile, meshes; see fixtures/record_cpu.py).
# Each group is one recorder subprocess: a group's process groups show in the traces'
# distributedInfo.pg_config, so the two 2-D mesh shapes are recorded in processes of their own.
SHAPE_GROUPS = {
    (
        "ga-fsdp2",
        "ga-fsdp2-sync",
        "ga-fsdp1",
        "ga-fsdp1-sync",
        "ac",
        "ac-fsdp1",
        "no-shard-fsdp1",
        "compiled",
        "per-param-mesh",
    ): 2,
    ("hsdp",): 4,
    ("tp-fsdp",): 4,
    # profiled from the first step: a process of their own, so that no other shape compiled before
    # compiled-cold (compiled-recompile, after it, compiles in its own warm-up steps)
    ("compiled-cold", "compiled-recompile"): 2,
}
SHAPES = tuple(v for group in SHAPE_GROUPS for v in group)
RECORD_TIMEOUT_S = 600
HANG_RECORDER = REPO / "fixtures" / "record_hang.py"
HANG_TIMEOUT_S = 300


def recording_key() -> str:
    """A hash of what a recording depends on: the recorders, the capture code, torch, Python."""
    h = hashlib.sha256()
    files = [RECORDER, HANG_RECORDER, *sorted((REPO / "fsdpdoctor").rglob("capture*.py"))]
    for f in files:
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    h.update(f"torch {torch_version} python {sys.version_info[:3]}".encode())
    return h.hexdigest()[:16]


def session_root(tmp_path_factory) -> Path:
    """The folder every process of this session shares: ``$FSDPDOCTOR_TEST_CACHE``, else the
    session's temp root (the parent of each xdist worker's base temp; the base temp without xdist).
    The recordings, the generated runs and the shared reports each keep a keyed folder in it."""
    preset = os.environ.get("FSDPDOCTOR_TEST_CACHE")
    if preset:
        return Path(preset).expanduser()
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def shared_cache_dir(tmp_path_factory) -> Path:
    """The session's folder of the CPU recordings (keyed by the recording scripts), in :func:`session_root`."""
    out = session_root(tmp_path_factory) / f"fsdpdoctor-recordings-{recording_key()}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def once(cache: Path, name: str, record: Callable[[Path], None]) -> Path:
    """``cache/name``, made by ``record(folder)`` once across this session's processes: the first
    process takes the lock and records, the others wait and reuse it (``.complete`` marks it done)."""
    from filelock import FileLock

    out = cache / name
    with FileLock(str(cache / f"{name}.lock")):
        if not (out / ".complete").exists():
            if out.exists():  # a process that died half-way
                shutil.rmtree(out)
            out.mkdir(parents=True)
            record(out)
            (out / ".complete").write_text(f"recorded by pid {os.getpid()}\n")
    return out


def load_recorder():
    """Import ``fixtures/record_cpu.py`` as a module (needs torch)."""
    name = "fsdpdoctor_fixtures_record_cpu"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, RECORDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_recorder(variants: list[str], out: Path, world_size: int = WORLD_SIZE) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, str(RECORDER), "--out", str(out), "--world-size", str(world_size)]
    for v in variants:
        cmd += ["--variant", v]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RECORD_TIMEOUT_S, cwd=str(REPO))
    if proc.returncode != 0:
        raise RuntimeError(
            f"recording {variants} failed (exit {proc.returncode}):\n"
            f"$ {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return time.perf_counter() - t0


class _Recordings:
    def __init__(self, base: Path) -> None:
        self.base = base  # the session's shared cache (see shared_cache_dir)
        self.dirs: dict[str, Path] = {}
        self.seconds: dict[tuple[str, ...], float] = {}
        preset = os.environ.get("FSDPDOCTOR_RECORDED_DIR")
        self.preset = Path(preset) if preset else None

    def __call__(self, variant: str) -> Path:
        if variant not in VARIANTS and variant not in SHAPES:
            raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS + SHAPES)}")
        if variant in self.dirs:
            return self.dirs[variant]
        if (
            self.preset is not None
            and (self.preset / variant / ("rank0.json.gz" if variant in SHAPES else "fsdpdoctor_meta.json")).exists()
        ):
            self.dirs[variant] = self.preset / variant
            return self.dirs[variant]
        pytest.importorskip("torch")
        if variant in SHAPES:
            group, ws = next((g, n) for g, n in SHAPE_GROUPS.items() if variant in g)
            name = "shapes-" + group[0]
        else:
            group, ws, name = VARIANTS, WORLD_SIZE, "variants"

        def record(out: Path) -> None:
            self.seconds[group] = _run_recorder(list(group), out, ws)

        out = once(self.base, name, record)
        for v in group:
            self.dirs[v] = out / v
        return self.dirs[variant]


# One cache per process, shared by every registration of these fixtures (a test module may
# import them while conftest also registers this plugin), so each variant is recorded once.
_RECORDINGS: _Recordings | None = None


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory) -> Callable[[str], Path]:
    """Factory: ``recorded_run(variant) -> Path`` of a freshly recorded run (see module doc)."""
    global _RECORDINGS
    if _RECORDINGS is None:
        _RECORDINGS = _Recordings(shared_cache_dir(tmp_path_factory))
    return _RECORDINGS


@pytest.fixture(scope="session")
def recorder():
    """``fixtures/record_cpu.py`` as a module (skips without torch)."""
    pytest.importorskip("torch")
    return load_recorder()


@pytest.fixture(scope="session")
def recorded_world_size() -> int:
    return WORLD_SIZE


@pytest.fixture(scope="session")
def recorded_report(recorded_run) -> Callable[[str], "object"]:
    """variant -> fsdpdoctor.analyze() of that recorded run, analysed once per session."""
    import fsdpdoctor

    cache: dict[str, object] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = fsdpdoctor.analyze(recorded_run(variant))
        return cache[variant]

    return get


# -- Flight Recorder dumps of real hung jobs (fixtures/record_hang.py) ---------------------------


class _HangRecordings:
    """scenario → the folder ``fixtures/record_hang.py`` recorded it into (``dumps/``, ``truth.json``);
    every scenario is recorded on the first call, in one recorder process (~20 s)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.dirs: dict[str, Path] = {}
        self.seconds: float | None = None
        preset = os.environ.get("FSDPDOCTOR_HANG_DIR")
        self.preset = Path(preset) if preset else None

    def __call__(self, scenario: str) -> Path:
        if scenario in self.dirs:
            return self.dirs[scenario]
        if self.preset is not None and (self.preset / scenario / "truth.json").exists():
            self.dirs[scenario] = self.preset / scenario
            return self.dirs[scenario]
        pytest.importorskip("torch")
        out = once(self.base, "hangs", self._record)
        for d in out.iterdir():
            if (d / "truth.json").exists():
                self.dirs[d.name] = d
        if scenario not in self.dirs:
            raise ValueError(f"unknown hang scenario {scenario!r}; recorded: {sorted(self.dirs)}")
        return self.dirs[scenario]

    def _record(self, out: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, str(HANG_RECORDER), "--all", "--out", str(out)]
        if self.preset is not None:  # a preset made before a scenario was added: record only those it lacks
            from fixtures.record_hang import SCENARIOS

            missing = [sc for sc in SCENARIOS if not (self.preset / sc / "truth.json").exists()]
            cmd = [sys.executable, str(HANG_RECORDER), "--out", str(out)]
            for sc in missing:
                cmd += ["--scenario", sc]
            for sc in SCENARIOS:
                if sc not in missing:
                    self.dirs[sc] = self.preset / sc
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S, cwd=str(REPO))
        self.seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"recording the hangs failed (exit {proc.returncode}):\n$ {' '.join(cmd)}\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
            )


_HANGS: _HangRecordings | None = None


@pytest.fixture(scope="session")
def hang_recording(tmp_path_factory) -> Callable[[str], Path]:
    """Factory: ``hang_recording(scenario) -> Path`` of a real hung FSDP2 job recorded on gloo
    (``fixtures/record_hang.py``); ``FSDPDOCTOR_HANG_DIR`` reuses an earlier ``--all --out DIR``."""
    global _HANGS
    if _HANGS is None:
        _HANGS = _HangRecordings(shared_cache_dir(tmp_path_factory))
    return _HANGS
