"""Record what fsdpdoctor needs from a training run: one profiler trace per rank plus a sidecar.

This is the only module of fsdpdoctor that uses torch, and it imports torch lazily (inside the
functions that need it), so ``import fsdpdoctor`` and ``import fsdpdoctor.capture`` work
without torch installed.

Usage (every rank runs the same code)::

    from fsdpdoctor.capture import capture

    with capture("traces/", model=model, wait=1, warmup=1, active=3) as cap:
        for batch in loader:
            train_step(batch)
            cap.step()

What ends up in ``traces/``:

``rank{R}.json.gz``
    The Kineto Chrome trace of rank ``R``, exactly as ``torch.profiler`` writes it
    (``export_chrome_trace`` gzips when the name ends in ``.gz``). It covers the ``active``
    steps of the first profiling cycle. If ``repeat`` > 1, later cycles are written as
    ``rank{R}.cycle{K}.json.gz`` (K = 1, 2, ...).
``rank{R}.memory.pickle``
    CUDA caching-allocator snapshot (``torch.cuda.memory._dump_snapshot``) of rank ``R``, taken
    when the ``with`` block ends; only with ``memory_history=True`` and when CUDA is available.
``comm_traces/rank_{R}``
    The PyTorch Flight Recorder buffer of rank ``R`` (its last collectives, with their sizes,
    sequence numbers and stacks), dumped when the ``with`` block ends; only with
    ``flight_recorder=True``. The folder and name are torchtitan's, where ``analyze`` finds
    dumps by content. The recorder keeps ``TORCH_FR_BUFFER_SIZE`` entries (set it before the
    process group's first collective; ``flight_recorder=True`` sets it when it is unset).
``fsdpdoctor_meta.json``
    One sidecar per run, written by rank 0 only (FSDP/DDP training is SPMD: every rank has the
    same wrapping and policies, and per-rank facts such as the rank itself are already in each
    trace's ``distributedInfo``). It records what a trace cannot say: FSDP version, sharding
    strategy, prefetch settings, CPU offload, mixed-precision dtypes, the FSDP units with their
    FQNs and parameter sizes, library versions, and the capture settings. Its layout is
    described by :data:`META_SCHEMA` and :func:`describe_model` (:mod:`.capture_model`). Rank 0 writes it when its
    first trace is written and again (complete) when the ``with`` block ends.

The profiler settings are those the doctor relies on: CPU activity always, CUDA activity when
CUDA is available, ``record_shapes=True`` (the collective ``record_param_comms`` events carry
their message sizes either way, but shapes let the doctor size the copy-in/copy-out ops), and a
``torch.profiler.schedule(skip_first, wait, warmup, active, repeat)`` so only steady-state steps
are kept. Call :meth:`Capture.step` once at the end of every training step; the profiler labels
step ``N`` as ``ProfilerStep#N``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from fsdpdoctor.capture.model import describe_model, empty_description

__all__ = [
    "META_FILENAME",
    "META_SCHEMA",
    "Capture",
    "capture",
    "describe_model",
    "dump_flight_recorder",
    "flight_recorder_filename",
    "memory_snapshot_filename",
    "trace_filename",
]

#: File name of the per-run sidecar written by rank 0.
META_FILENAME = "fsdpdoctor_meta.json"

#: Value of the sidecar's ``schema`` key. Bump the trailing number on incompatible changes.
META_SCHEMA = "fsdpdoctor.meta/1"


def trace_filename(rank: int, cycle: int = 0) -> str:
    """Name of the trace file of ``rank`` for profiling cycle ``cycle`` (0-based)."""
    if cycle == 0:
        return f"rank{rank}.json.gz"
    return f"rank{rank}.cycle{cycle}.json.gz"


def memory_snapshot_filename(rank: int) -> str:
    """Name of the CUDA memory snapshot of ``rank``."""
    return f"rank{rank}.memory.pickle"


def flight_recorder_filename(rank: int) -> str:
    """Name (under the capture folder) of the Flight Recorder dump of ``rank``: torchtitan's."""
    return f"comm_traces/rank_{rank}"


#: Entries the Flight Recorder keeps when ``flight_recorder=True`` and ``TORCH_FR_BUFFER_SIZE`` is unset.
FR_BUFFER_SIZE = 2000


def dump_flight_recorder(out_dir: str | os.PathLike[str], rank: int) -> Path | None:
    """Write this rank's Flight Recorder buffer to ``out_dir/comm_traces/rank_<rank>`` (the
    pickle the watchdog writes on a timeout, on demand): the NCCL recorder where torch has one
    (CUDA builds), else the generic one (gloo). None when this torch has neither."""
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) if torch.cuda.is_available() else None
    dump = dump or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    path = Path(out_dir) / flight_recorder_filename(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(dump())
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "nccl": None,
        "python": platform.python_version(),
    }
    try:
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    return out


#: the training frameworks whose modules, when imported, the sidecar lists (``framework.loaded``)
FRAMEWORK_MODULES = ("transformers", "peft", "trl", "accelerate", "lightning", "pytorch_lightning", "torchtitan")


def frameworks_loaded(name: str | None = None, trainer: str | None = None) -> dict[str, Any]:
    """The sidecar's ``framework``: who drives the run (``name``, ``trainer``: set by the
    integrations, None for a plain ``capture``) and the framework packages imported in this
    process, with their versions (imported is not used: a plain loop may import transformers
    for a tokenizer; the analysis weighs it as such)."""
    loaded = {}
    for mod in FRAMEWORK_MODULES:
        m = sys.modules.get(mod)
        if m is not None:
            loaded[mod] = str(getattr(m, "__version__", "") or "") or None
    version = loaded.get(name) if name else None
    return {"name": name, "trainer": trainer, "version": version, "loaded": loaded}


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:  # pragma: no cover
        initialized = False
    if rank is None:
        rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1"))
    return rank, world_size


def _backend() -> str | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:  # pragma: no cover
        pass
    return None


# ----------------------------------------------------------------------------------------------
# The capture context
# ----------------------------------------------------------------------------------------------


class Capture:
    """A ``torch.profiler.profile`` set up for fsdpdoctor, plus the sidecar and memory snapshot.

    Prefer the :func:`capture` factory. Use as a context manager and call :meth:`step` once at
    the end of every training step. Every rank must create its own ``Capture`` with the same
    arguments.

    Args:
        out_dir: directory for the traces, snapshots and sidecar (created if missing).
        model: the wrapped model (FSDP2/FSDP1/DDP); inspected by :func:`describe_model` for the
            sidecar. May be None.
        wait, warmup, active, repeat, skip_first: passed to ``torch.profiler.schedule``. The
            profiled steps are ``skip_first + wait + warmup`` ... ``+ active - 1`` (0-based
            ``step()`` count) for the first cycle. Keep ``wait + warmup >= 1`` so that lazy
            initialisation and the first-iteration work stay out of the trace.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
            ``with_stack`` adds ``python_function`` events and makes traces much larger.
        memory_history: record CUDA allocator history from ``__enter__`` and dump one snapshot
            per rank at ``__exit__``. Ignored (and noted in the sidecar) without CUDA.
        memory_history_max_entries: ``max_entries`` for ``_record_memory_history``.
        flight_recorder: dump this rank's Flight Recorder buffer at ``__exit__``
            (:func:`dump_flight_recorder`); sets ``TORCH_FR_BUFFER_SIZE`` when it is unset.
        memory_history_options: further keyword arguments for
            ``torch.cuda.memory._record_memory_history`` (e.g. ``{"stacks": "python"}`` to
            skip C++ stacks, or ``{"global_record_annotations": True}`` to tag allocations
            with the enclosing ``record_function`` labels such as ``FSDP::all_gather``).
        wrap_policy: free-text description of how FSDP units were chosen, for the sidecar
            (e.g. ``"fully_shard(block) for block in model.layers; fully_shard(model)"``).
        extra: JSON-serialisable dict stored under ``extra`` in the sidecar.
        framework: who drives the training loop, ``{"name": "transformers", "trainer": "Trainer"}``
            (the integrations set it), for the sidecar's ``framework`` (:func:`frameworks_loaded`).
        rank, world_size: override the values read from ``torch.distributed`` (or the
            ``RANK``/``WORLD_SIZE`` environment variables when it is not initialised).
        activities: override the profiler activities (default: CPU, plus CUDA if available).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        model: Any = None,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = False,
        memory_history: bool = False,
        memory_history_max_entries: int = 100_000,
        memory_history_options: dict[str, Any] | None = None,
        flight_recorder: bool = False,
        wrap_policy: str | None = None,
        extra: dict[str, Any] | None = None,
        framework: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        activities: Any = None,
    ) -> None:
        if active < 1:
            raise ValueError("active must be >= 1")
        if min(wait, warmup, skip_first) < 0 or repeat < 0:
            raise ValueError("wait, warmup, skip_first and repeat must be >= 0")
        self.out_dir = Path(out_dir)
        self.model = model
        self.wait = wait
        self.warmup = warmup
        self.active = active
        self.repeat = repeat
        self.skip_first = skip_first
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.memory_history_requested = memory_history
        self.memory_history_max_entries = memory_history_max_entries
        self.memory_history_options = dict(memory_history_options or {})
        self.flight_recorder = flight_recorder
        self.flight_recorder_path: Path | None = None
        if flight_recorder:
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))
        self.wrap_policy = wrap_policy
        self.extra = dict(extra or {})
        self.framework = dict(framework) if framework else None
        self._rank_override = rank
        self._world_override = world_size
        self._activities = activities
        self.rank = 0
        self.world_size = 1
        self.profiler: Any = None
        self.trace_paths: list[Path] = []
        self.memory_snapshot_path: Path | None = None
        self.steps_done = 0
        self._profiled_steps: list[list[int]] = []
        self._memory_history_on = False
        self._started_at: float | None = None

    # -- public ---------------------------------------------------------------------------

    @property
    def meta_path(self) -> Path:
        """Path of the sidecar (written by rank 0 only)."""
        return self.out_dir / META_FILENAME

    @property
    def cuda(self) -> bool:
        """Whether CUDA activity is being profiled."""
        import torch

        return bool(torch.cuda.is_available())

    def profiled_steps(self, cycle: int = 0) -> list[int]:
        """0-based step indices (the ``N`` of ``ProfilerStep#N``) that ``cycle`` records."""
        start = self.skip_first + cycle * (self.wait + self.warmup + self.active)
        first = start + self.wait + self.warmup
        return list(range(first, first + self.active))

    def step(self) -> None:
        """Mark the end of a training step (advances the profiler schedule)."""
        self.steps_done += 1
        if self.profiler is not None:
            self.profiler.step()

    def __enter__(self) -> "Capture":
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, self.world_size = _rank_and_world(self._rank_override, self._world_override)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._started_at = time.time()
        activities = self._activities
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
        self._activity_names = [getattr(a, "name", str(a)) for a in activities]

        if self.memory_history_requested and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(
                max_entries=self.memory_history_max_entries, **self.memory_history_options
            )
            self._memory_history_on = True

        self.profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
                skip_first=self.skip_first,
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self.profiler.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self.profiler is not None:
                self.profiler.__exit__(exc_type, exc, tb)
        finally:
            self.profiler = None
            if self._memory_history_on:
                import torch

                try:
                    path = self.out_dir / memory_snapshot_filename(self.rank)
                    torch.cuda.memory._dump_snapshot(str(path))
                    self.memory_snapshot_path = path
                finally:
                    torch.cuda.memory._record_memory_history(enabled=None)
                    self._memory_history_on = False
            if self.flight_recorder:
                self.flight_recorder_path = dump_flight_recorder(self.out_dir, self.rank)
            if self.rank == 0:
                self.write_meta(complete=exc_type is None)

    # -- sidecar --------------------------------------------------------------------------

    def meta(self, complete: bool = True) -> dict[str, Any]:
        """The sidecar content (see the module docstring and :func:`describe_model`)."""
        import torch

        cycles = len(self._profiled_steps)
        meta: dict[str, Any] = {
            "schema": META_SCHEMA,
            "complete": complete,
            "created_by": "fsdpdoctor.capture",
            "created_unix": self._started_at,
            "host": socket.gethostname(),
            "world_size": self.world_size,
            "backend": _backend(),
            "device_type": "cuda" if torch.cuda.is_available() else "cpu",
            "versions": _versions(),
            "capture": {
                "wait": self.wait,
                "warmup": self.warmup,
                "active": self.active,
                "repeat": self.repeat,
                "skip_first": self.skip_first,
                "record_shapes": self.record_shapes,
                "profile_memory": self.profile_memory,
                "with_stack": self.with_stack,
                "activities": getattr(self, "_activity_names", None),
                "memory_history": self.memory_history_requested and torch.cuda.is_available(),
                "flight_recorder": self.flight_recorder,
                "steps_run_by_rank0": self.steps_done,
                "profiled_steps": [list(s) for s in self._profiled_steps],
            },
            "trace_files": [trace_filename(r, c) for c in range(cycles) for r in range(self.world_size)],
            "memory_snapshot_files": (
                [memory_snapshot_filename(r) for r in range(self.world_size)]
                if self.memory_history_requested and torch.cuda.is_available()
                else []
            ),
            "flight_recorder_files": (
                [flight_recorder_filename(r) for r in range(self.world_size)] if self.flight_recorder else []
            ),
        }
        try:
            meta.update(describe_model(self.model, wrap_policy=self.wrap_policy))
        except Exception as exc:  # never lose the traces over an inspection problem
            meta.update(empty_description())
            meta["wrap_policy"] = self.wrap_policy
            meta["describe_error"] = f"{type(exc).__name__}: {exc}"
        meta["extra"] = self.extra
        meta["framework"] = frameworks_loaded(**(self.framework or {}))
        return meta

    def write_meta(self, complete: bool = True) -> Path:
        """Write the sidecar now (rank 0 calls this itself; other ranks need not)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.meta(complete), indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.meta_path)
        return self.meta_path

    # -- internals ------------------------------------------------------------------------

    def _on_trace_ready(self, prof: Any) -> None:
        cycle = len(self._profiled_steps)
        path = self.out_dir / trace_filename(self.rank, cycle)
        # torch.profiler.profile.export_chrome_trace writes through a temporary .json file and
        # gzips it when the path ends in ".gz"; the content is byte-for-byte Kineto's JSON.
        prof.export_chrome_trace(str(path))
        self.trace_paths.append(path)
        self._profiled_steps.append(self.profiled_steps(cycle))
        if self.rank == 0:
            self.write_meta(complete=False)


def capture(
    out_dir: str | os.PathLike[str],
    model: Any = None,
    **kwargs: Any,
) -> Capture:
    """Return a :class:`Capture` context manager (see there for the arguments).

    Example::

        with capture("traces/", model=model, wait=1, warmup=1, active=3) as cap:
            for batch in loader:
                train_step(batch)
                cap.step()
    """
    return Capture(out_dir, model, **kwargs)
