"""The Python API behind the CLI: ``fsdpdoctor.analyze(paths) -> Report``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec
import pandas as pd

from . import __version__
from .analysis.ranks import fold, load_ranks
from .engine import Finding, run_rules
from .facts import RunFacts
from .analysis.sidecar import apply_sidecar
from .analysis.strategy import advise, expected_memory, inputs_from_facts
from .ingest.discover import discover
from .ingest.fs import name as fs_name
from .ingest.sidecar import find_sidecar, load_sidecar


@dataclass
class Report:
    """RunFacts plus the findings the rules drew from them."""

    facts: RunFacts
    findings: list[Finding] = field(default_factory=list)
    timeline: Any = None  # StepTimeline of one step of one rank (analyze(..., timeline_step=...)), or None

    # -- machine contract ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return self._dict(self.facts.to_dict())

    def _dict(self, facts_dict: dict[str, Any]) -> dict[str, Any]:
        f = self.facts
        fs = f.fsdp
        return {
            "schema_version": f.schema_version,
            "tool": f.tool,
            "ranks": f.ranks,
            "world_size": f.world_size,
            "gpu_present": f.gpu_present,
            "inputs": msgspec.to_builtins(f.inputs),
            "inputs_excluded": msgspec.to_builtins(f.inputs_excluded),
            "ranks_expected": f.ranks_expected if f.ranks_expected is not None else len(f.ranks),
            "fsdp": {
                "version": fs.version,
                "version_evidence": fs.version_evidence,
                "sharding_strategy": fs.sharding_strategy,
                "unit_count": fs.unit_count,
                "unit_source": fs.unit_source,
                "units": msgspec.to_builtins(fs.units),
                "backward_prefetch": fs.backward_prefetch,
                "backward_prefetch_evidence": fs.backward_prefetch_evidence,
                "forward_prefetch": fs.forward_prefetch,
                "reshard_after_forward": fs.reshard_after_forward,
                "cpu_offload": msgspec.to_builtins(fs.cpu_offload),
                "collective_dtypes": fs.collective_dtypes,
                "mixed_precision": fs.mixed_precision,
                "rate_limiter_ms_per_step": fs.rate_limiter_ms_per_step,
                "sources": fs.sources,
            },
            "steps": msgspec.to_builtins(f.steps),
            "overlap": msgspec.to_builtins(f.overlap),
            "exposed_comm": msgspec.to_builtins(f.exposed_comm),
            "timeline": msgspec.to_builtins(f.timeline),
            "collectives": msgspec.to_builtins(f.collectives),
            "memory": f.memory.to_dict() if f.memory is not None else None,
            "memory_expected": f.memory_expected or None,
            "strategy": msgspec.to_builtins(f.strategy) if f.strategy is not None else None,
            "sidecar": f.sidecar,
            "cross_rank": msgspec.to_builtins(f.cross_rank) if f.cross_rank is not None else None,
            "notes": f.notes,
            "findings": msgspec.to_builtins(self.findings),
            "facts": facts_dict,
        }

    def to_json(self, indent: int = 2) -> str:
        # the per-rank facts are encoded straight from their dataclasses (the same JSON as
        # to_dict()'s builtins, without a second copy of every rank in Python objects)
        facts = self.facts
        ranks, facts.rank_facts = facts.rank_facts, []
        try:
            d = facts.to_dict()
        finally:
            facts.rank_facts = ranks
        d["rank_facts"] = ranks
        return msgspec.json.format(msgspec.json.encode(self._dict(d)), indent=indent).decode()

    def to_markdown(self) -> str:
        from .report.markdown import render

        return render(self)

    # -- tables ----------------------------------------------------------------------------
    def steps_df(self) -> pd.DataFrame:
        """One row per (rank, step): step time and the GPU breakdown in ms."""
        rows = []
        for r in self.facts.rank_facts:
            for s in r.steps:
                d = msgspec.to_builtins(s)
                for k in ("exposed_by_phase", "exposed_by_kind", "phase_ms"):
                    for sub, v in d.pop(k).items():
                        d[f"{k}.{sub}"] = v
                rows.append({"rank": r.rank, **d})
        return pd.DataFrame(rows)

    def collectives_df(self) -> pd.DataFrame:
        """One row per collective per rank, with its unit, phase, bytes, timing and exposure."""
        rows = [{"rank": r.rank, **msgspec.to_builtins(c)} for r in self.facts.rank_facts for c in r.collectives]
        return pd.DataFrame(rows)

    def units_df(self) -> pd.DataFrame:
        return pd.DataFrame(msgspec.to_builtins(self.facts.fsdp.units))

    def ranks_df(self) -> pd.DataFrame:
        rows = []
        for r in self.facts.rank_facts:
            steps = [s.step_ms for s in r.steps]
            rows.append(
                {
                    "rank": r.rank,
                    "rank_source": r.rank_source,
                    "path": r.path,
                    "steps": len(steps),
                    "step_mean_ms": sum(steps) / len(steps) if steps else None,
                    "overlap_pct": r.overlap_pct,
                    "exposed_comm_ms_per_step": (sum(s.exposed_comm_ms for s in r.steps) / len(steps)) if steps else None,
                }
            )
        return pd.DataFrame(rows)


def analyze(
    paths: str | Path | Iterable[str | Path],
    memory: Any = None,
    *,
    config: dict[str, Any] | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    timeline_step: tuple[int | None, int | None] | None = None,
    scheduler: str | None = None,
    strict: bool = False,
) -> Report:
    """Analyse traces (files, directories or globs) and return the :class:`Report`.

    Raises :class:`fsdpdoctor.errors.InputError` when an input cannot be read.
    ``memory``: CUDA memory snapshot pickles (``torch.cuda.memory._dump_snapshot``), profiler
    memory-timeline exports (``.raw.json.gz``), or directories of them; the one with the highest
    peak becomes ``facts.memory``.
    ``timeline_step=(rank, step_index)`` also extracts that step's GPU timeline into
    ``Report.timeline`` (see :mod:`fsdpdoctor.analysis.timeline_extract`; ``None`` in either place
    means rank 0 / the median-length step).

    Paths may be URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``,
    ``file://``; see :mod:`fsdpdoctor.ingest.fs`). ``scheduler`` sends the per-rank analysis to
    a Dask cluster: ``"tcp://HOST:8786"`` (an existing one) or ``"local[:N]"`` (a LocalCluster
    of N worker processes); None uses this machine's process pool (``jobs``).

    A rank file that cannot be read is left out and named in ``facts.inputs_excluded`` (JSON
    ``inputs_excluded``), as is a gap in the rank ids; ``strict=True`` raises the first bad
    file's InputError instead. When no file can be read the first error is raised.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = discover(list(paths))
    load = load_ranks(files, jobs=jobs, progress=progress, strict=strict, scheduler=scheduler)
    facts = fold(load.ranks, load.excluded, load.cross_rank)
    side_path = find_sidecar(files)
    if side_path is not None:
        side, problem = load_sidecar(side_path)
        if side is not None:
            apply_sidecar(facts, side)
            facts.notes.append(f"sidecar {fs_name(side_path)} read: facts marked 'sidecar' came from it")
        else:
            facts.notes.append(problem)
    if memory:
        attach_memory(facts, memory)
    else:  # no snapshot: the allocator totals the trace recorded, if it did (profile_memory=True)
        traced = [r.memory_trace for r in facts.rank_facts if r.memory_trace is not None]
        if traced:
            facts.memory = max(traced, key=lambda m: m.peak_allocated_bytes)
    plan_inputs = inputs_from_facts(facts)
    if plan_inputs is not None:
        facts.strategy = advise(plan_inputs)
        if facts.memory is not None:
            facts.memory_expected = expected_memory(plan_inputs, plan_inputs.current)
    report = Report(facts=facts, findings=run_rules(facts, config))
    if timeline_step is not None:
        from .analysis.timeline_extract import extract_for_facts

        report.timeline = extract_for_facts(facts, *timeline_step)
    return report


MEMORY_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz", ".raw.json.gz", ".raw.json")


def memory_files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Snapshot / memory-timeline files named by ``paths`` (files, or directories of them)."""
    from .errors import InputError

    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(MEMORY_SUFFIXES))
            if not found:
                raise InputError(p, "directory contains no memory snapshots (*.pickle, *.raw.json.gz)")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(p, "no such file or directory")
    return out


def attach_memory(facts: RunFacts, memory: str | Path | Iterable[str | Path]) -> None:
    """Analyse every snapshot; keep the one with the highest peak in ``facts.memory``."""
    from .analysis.memory import analyze_memory

    best = None
    for f in memory_files(memory):
        mf = analyze_memory(f)
        facts.memory_per_input[str(f)] = mf.peak_allocated_bytes
        if best is None or mf.peak_allocated_bytes > best.peak_allocated_bytes:
            best = mf
    facts.memory = best


def analyze_memory_only(memory: str | Path | Iterable[str | Path], config: dict[str, Any] | None = None) -> Report:
    """A report from memory snapshots alone (``fsdpdoctor memory``)."""
    facts = RunFacts(tool=f"fsdpdoctor {__version__}")
    attach_memory(facts, memory)
    return Report(facts=facts, findings=run_rules(facts, config))
