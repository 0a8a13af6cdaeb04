"""The Python API behind the CLI: ``fsdpdoctor.analyze(paths) -> Report``."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import msgspec

from fsdpdoctor import __version__
from fsdpdoctor.analysis.ranks import fold, load_ranks
from fsdpdoctor.analysis.runs import differences as run_differences
from fsdpdoctor.engine import Finding, run_rules
from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest._io import short
from fsdpdoctor.facts import RANK_DETAIL, RunFacts
from fsdpdoctor.analysis.framework import detect as detect_framework
from fsdpdoctor.analysis.sidecar import apply_sidecar
from fsdpdoctor.analysis.strategy import advise, expected_memory, inputs_from_facts
from fsdpdoctor.ingest.discover import discover
from fsdpdoctor.ingest.remote import name as fs_name
from fsdpdoctor.ingest.sidecar import find_sidecar, load_sidecar

if TYPE_CHECKING:  # pandas loads only when a DataFrame is asked for
    import pandas as pd


@dataclass
class Report:
    """RunFacts plus the findings the rules drew from them."""

    facts: RunFacts
    findings: list[Finding] = field(default_factory=list)
    timeline: Any = None  # StepTimeline of one step of one rank (analyze(..., timeline_step=...)), or None
    rank_detail: str = "auto"  # which ranks' RankFacts to_json writes (fsdpdoctor.facts.RANK_DETAIL)
    # rank → its exposed-comm and GPU-idle intervals (analysis.spans.RankSpans), for the ranks
    # ``rank_detail`` writes in full (analyze(..., spans=True): the Perfetto drawing), or None
    spans: dict[int, Any] | None = None

    # -- machine contract ------------------------------------------------------------------
    def to_dict(self, rank_detail: str | None = None) -> dict[str, Any]:
        """The report as one JSON document: every fact once, then the findings.

        Its JSON Schema is :func:`fsdpdoctor.schema.report_schema` (``fsdpdoctor schema``).
        ``rank_detail`` (default: :attr:`rank_detail`) says which ranks' RankFacts it holds
        (:meth:`fsdpdoctor.facts.RunFacts.ranks_to_write`); every rank has its summary.
        """
        d = self.facts.to_dict(rank_detail or self.rank_detail)
        d["findings"] = msgspec.to_builtins(self.findings)
        return d

    def to_json(self, indent: int = 2, rank_detail: str | None = None) -> str:
        """:meth:`to_dict` as JSON. The per-rank facts are encoded straight from their dataclasses
        (the same JSON, without a second copy of every rank as Python objects)."""
        return self.to_json_bytes(indent, rank_detail).decode()

    def to_json_bytes(self, indent: int = 2, rank_detail: str | None = None) -> bytes:
        """:meth:`to_json` as UTF-8 bytes, for writing (no str copy of a report of many ranks)."""
        facts = self.facts
        ranks, sums, policy = facts.ranks_to_write(rank_detail or self.rank_detail)
        kept = facts.rank_facts, facts.rank_summaries
        facts.rank_facts, facts.rank_summaries = [], []
        try:
            d = facts.to_dict()
        finally:
            facts.rank_facts, facts.rank_summaries = kept
        d["rank_facts"] = ranks
        d["rank_summaries"] = sums
        d["rank_detail"] = policy
        d["findings"] = self.findings
        return msgspec.json.format(msgspec.json.encode(d), indent=indent)

    def to_markdown(self) -> str:
        from fsdpdoctor.report.markdown import render

        return render(self)

    # -- tables ----------------------------------------------------------------------------
    def steps_df(self) -> pd.DataFrame:
        """One row per (rank, step): step time and the GPU breakdown in ms."""
        import pandas as pd

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
        import pandas as pd

        rows = [{"rank": r.rank, **msgspec.to_builtins(c)} for r in self.facts.rank_facts for c in r.collectives]
        return pd.DataFrame(rows)

    def units_df(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(msgspec.to_builtins(self.facts.fsdp.units))

    def ranks_df(self) -> pd.DataFrame:
        """One row per rank (every rank: a rank written as its summary line counts its mean step)."""
        import pandas as pd

        counts = {s.rank: s.steps for s in self.facts.rank_summaries}
        rows = []
        for r in self.facts.all_ranks():
            steps = [s.step_ms for s in r.steps]
            rows.append(
                {
                    "rank": r.rank,
                    "rank_source": r.rank_source,
                    "path": r.path,
                    "steps": counts.get(r.rank, len(steps)),
                    "step_mean_ms": sum(steps) / len(steps) if steps else None,
                    "overlap_pct": r.overlap_pct,
                    "exposed_comm_ms_per_step": (sum(s.exposed_comm_ms for s in r.steps) / len(steps))
                    if steps
                    else None,
                }
            )
        return pd.DataFrame(rows)


def _checked(report: Report) -> Report:
    """With ``FSDPDOCTOR_CHECK_SCHEMA=1`` (the test suite sets it), every report is validated
    against the published JSON Schema before it is returned, so a field that breaks the contract
    fails the first test that produces it."""
    if os.environ.get("FSDPDOCTOR_CHECK_SCHEMA") == "1":
        from fsdpdoctor.schema import validate

        validate(msgspec.json.decode(report.to_json()))
    return report


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
    cycle: int | None = None,
    allow_mixed_runs: bool = False,
    rank_detail: str = "auto",
    iteration: int | None = None,
    spans: bool = False,
) -> Report:
    """Analyse traces (files, directories or globs) and return the :class:`Report`.

    Raises :class:`fsdpdoctor.errors.InputError` when an input cannot be read.
    PyTorch Flight Recorder dumps (one per rank, any name; found by content in the directories
    given and their torchtitan ``comm_trace(s)/`` folder) are read alongside, or alone: the hang
    diagnosis goes into ``facts.hang`` (:func:`attach_hang`); a dump that cannot be read raises.
    ``memory``: CUDA memory snapshot pickles (``torch.cuda.memory._dump_snapshot``), profiler
    memory-timeline exports (``.raw.json.gz``), or directories of them; the one with the highest
    peak becomes ``facts.memory``.
    ``timeline_step=(rank, step_index)`` also extracts that step's GPU timeline into
    ``Report.timeline`` (see :mod:`fsdpdoctor.analysis.timeline.extract`; ``None`` in either place
    means rank 0 / the median-length step). ``spans=True`` also reads again the exposed-comm and
    GPU-idle intervals of the ranks ``rank_detail`` writes in full into ``Report.spans`` (see
    :mod:`fsdpdoctor.analysis.spans`), for :mod:`fsdpdoctor.report.perfetto`.

    Paths may be URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``,
    ``file://``; see :mod:`fsdpdoctor.ingest.remote`). ``scheduler`` sends the per-rank analysis to
    a Dask cluster: ``"tcp://HOST:8786"`` (an existing one) or ``"local[:N]"`` (a LocalCluster
    of N worker processes); None uses this machine's process pool (``jobs``).

    A rank file that cannot be read is left out and named in ``facts.inputs_excluded`` (JSON
    ``inputs_excluded``), as is a gap in the rank ids; ``strict=True`` raises the first bad
    file's InputError instead. When no file can be read the first error is raised.

    A directory contributes the files whose content is a trace (other JSON beside them is
    skipped and listed in ``facts.notes``); when ``fsdpdoctor.capture(repeat > 1)`` wrote several
    profiling cycles, ``cycle`` picks one (default: the last). A framework's dump folder
    (torchtitan's ``job.dump_folder``; :mod:`fsdpdoctor.ingest.layouts`) gives the profile traces
    of iteration ``iteration`` (default: the latest) and the memory snapshots of that iteration.

    Traces that look like different runs (world size, device, backend or NCCL version differ, or
    they start more than an hour apart; :mod:`fsdpdoctor.analysis.runs`) raise an InputError
    naming what differs; ``allow_mixed_runs=True`` analyses them together and lists the
    differences in ``facts.mixed_runs`` (cross-rank findings such as stragglers are then not drawn).

    ``rank_detail`` ("auto", "all", "none"; :data:`fsdpdoctor.facts.RANK_DETAIL`) is which ranks'
    full RankFacts the JSON report holds (every rank has its summary line); "all" also keeps every
    rank's list of collectives, which runs of more than
    :data:`~fsdpdoctor.analysis.ranks.DETAIL_RANKS` ranks otherwise leave on the workers, and
    every rank's RankFacts whole: otherwise the ranks beyond those are kept as their summary line
    (:class:`~fsdpdoctor.analysis.ranks.Arrivals`; every figure is the same), so that
    ``facts.rank_facts`` and :meth:`Report.steps_df` hold the kept ranks and
    ``facts.all_ranks()`` every rank.
    """
    if rank_detail not in RANK_DETAIL:
        raise ValueError(f"rank_detail must be one of {RANK_DETAIL}, not {rank_detail!r}")
    if isinstance(paths, (str, Path)):
        paths = [paths]
    skipped: list[tuple[str, str]] = []
    dumps: list[Path] = []
    named_memory: list[Path] = []  # snapshots and memory timelines among the paths, by content
    files = discover(list(paths), cycle=cycle, skipped=skipped, iteration=iteration, dumps=dumps, memory=named_memory)
    if files:
        load = load_ranks(
            files,
            jobs=jobs,
            progress=progress,
            strict=strict,
            scheduler=scheduler,
            **({"detail_ranks": None} if rank_detail == "all" else {}),
        )
        mixed = run_differences(load.ranks)
        if mixed and not allow_mixed_runs:
            raise InputError(
                load.ranks[1].path if len(load.ranks) > 1 else files[0],
                "not one run: " + "; ".join(mixed) + " (--allow-mixed-runs analyses them together)",
            )
        facts = fold(load.ranks, load.excluded, load.cross_rank, arrived=load.arrived)
        traced_memory = [r.memory_trace for r in load.ranks if r.memory_trace is not None]
    else:  # Flight Recorder dumps or memory inputs alone (a hung job, a snapshot)
        mixed, traced_memory = [], []
        facts = RunFacts(tool=f"fsdpdoctor {__version__}")
    if dumps:
        attach_hang(facts, dumps, jobs=jobs, config=config)
    if config and config.get("peak_tflops") and facts.compute is not None:  # --peak-tflops
        from fsdpdoctor.analysis.compute import finish

        finish(facts.compute, facts.step_clock_ms, float(config["peak_tflops"]))
        if facts.efficiency is not None:
            from fsdpdoctor.analysis.efficiency import split

            split(facts.efficiency, float(config["peak_tflops"]))
        facts.notes = [n for n in facts.notes if not n.startswith("MFU not computed")]
    if mixed:
        facts.mixed_runs = mixed
        facts.notes.insert(0, "inputs from different runs analysed together (--allow-mixed-runs): " + "; ".join(mixed))
    if skipped:
        facts.notes.append(
            f"{len(skipped)} file(s) beside the traces not analysed: "
            + "; ".join(f"{Path(p).name} ({why})" for p, why in skipped)
        )
    side_path = find_sidecar(files)
    side = None
    if side_path is not None:
        side, problem = load_sidecar(side_path)
        if side is not None:
            apply_sidecar(facts, side)
            facts.notes.append(f"sidecar {fs_name(side_path)} read: facts marked 'sidecar' came from it")
        else:
            facts.notes.append(problem)
    fetched: dict[str, str] = {}  # snapshots fetched from object storage: local copy → URL
    explicit = list(memory or []) if memory is None or not isinstance(memory, (str, Path)) else [memory]
    explicit += [p for p in named_memory if p not in explicit]
    found = [] if memory else _found_snapshots(list(paths), facts, fetched, iteration)
    seen = {Path(p).resolve() for p in explicit if not isinstance(p, str) or "://" not in p}
    found = [p for p in found if isinstance(p, str) or Path(p).resolve() not in seen]
    try:
        if explicit:
            attach_memory(facts, explicit + found)
        elif found:
            attach_memory(facts, found, found=bool(files))
    finally:
        for local in fetched:
            shutil.rmtree(Path(local).parent, ignore_errors=True)
    if facts.memory is not None and facts.memory.path in fetched:
        facts.memory.path = fetched[facts.memory.path]
    facts.memory_per_input = {fetched.get(k, k): v for k, v in facts.memory_per_input.items()}
    if facts.memory is None:  # no snapshot: the allocator totals the trace recorded, if it did (profile_memory=True)
        if traced_memory:
            facts.memory = max(traced_memory, key=lambda m: m.peak_allocated_bytes)
    facts.framework = detect_framework(facts, side)
    plan_inputs = inputs_from_facts(facts)
    if plan_inputs is not None:
        if plan_inputs.world_size > 1:  # on one GPU every strategy holds the same and sends nothing
            facts.strategy = advise(plan_inputs)
        if facts.memory is not None:
            facts.memory_expected = expected_memory(plan_inputs, plan_inputs.current)
    _pressure(facts, config)
    report = _checked(Report(facts=facts, findings=run_rules(facts, config), rank_detail=rank_detail))
    if timeline_step is not None and (facts.rank_facts or timeline_step != (None, None)):  # dumps alone: no timeline
        from fsdpdoctor.analysis.timeline.extract import extract_for_facts

        report.timeline = extract_for_facts(facts, *timeline_step)
    if spans:
        from fsdpdoctor.analysis.spans import spans_for_facts

        report.spans = spans_for_facts(facts, facts.ranks_to_write(rank_detail)[0])
    return report


def attach_hang(
    facts: RunFacts, dumps: list[Path], *, jobs: int | None = None, config: dict[str, Any] | None = None
) -> None:
    """Read the Flight Recorder dumps (one per rank) and put the hang diagnosis in ``facts.hang``
    (:mod:`fsdpdoctor.analysis.hang`). A dump that cannot be read raises its InputError."""
    from fsdpdoctor.analysis.hang import DEFAULT_LATE_S, diagnose, load_views

    late = float((config or {}).get("hang_late_s", DEFAULT_LATE_S))
    facts.hang = diagnose(load_views(dumps, jobs), late_s=late, world_size=facts.world_size)
    h = facts.hang
    facts.notes.append(
        f"{h.dumps} Flight Recorder dump{'s' if h.dumps != 1 else ''} read "
        f"({h.backend or 'no collectives'}, version {', '.join(h.versions)}"
        + (f"; no dump from {len(h.ranks_without_dump)} of {h.world_size} ranks" if h.ranks_without_dump else "")
        + ")"
    )


MEMORY_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz", ".raw.json.gz", ".raw.json")


def memory_files(paths: str | Path | Iterable[str | Path], iteration: int | None = None) -> list[Path]:
    """Snapshot / memory-timeline files named by ``paths`` (files, or directories of them). A
    framework's dump folder (:mod:`fsdpdoctor.ingest.layouts`) gives the snapshots of iteration
    ``iteration``, by default its latest (an out-of-memory exit's included)."""
    from fsdpdoctor.ingest.layouts import dump_folder

    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        dump = dump_folder(p, iteration)
        if dump is not None:
            if not dump.latest_snapshots:
                raise InputError(p, f"a {dump.layout} dump folder without memory snapshots")
            out.extend(dump.latest_snapshots)
        elif p.is_dir():
            try:
                found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(MEMORY_SUFFIXES))
            except PermissionError:
                raise InputError(p, "permission denied (cannot list the directory)") from None
            if not found:
                raise InputError(p, "directory contains no memory snapshots (*.pickle, *.raw.json.gz)")
            out.extend(found)
        elif p.exists():
            out.append(p)  # not a regular file (a FIFO, a device)? the reader refuses it by stat
        else:
            raise InputError(p, "no such file or directory")
    return out


def _found_snapshots(paths: list, facts: RunFacts, fetched: dict[str, str], iteration: int | None = None) -> list[Path]:
    """Memory snapshots lying beside the traces (:func:`fsdpdoctor.ingest.discover.snapshots_beside`);
    one in object storage is fetched into a temporary folder under its own name first (``fetched``:
    local copy → URL)."""
    import tempfile

    from fsdpdoctor.ingest import remote
    from fsdpdoctor.ingest._io import read_input
    from fsdpdoctor.ingest.discover import snapshots_beside

    out = []
    for p in snapshots_beside(paths, iteration):
        if not isinstance(p, str):
            out.append(p)
            continue
        try:
            data = read_input(p, "memory snapshot")
        except InputError as exc:
            facts.notes.append(f"memory snapshot {p} beside the traces not read: {exc.problem}")
            continue
        local = Path(tempfile.mkdtemp(prefix="fsdpdoctor-snap-")) / remote.name(p).removesuffix(".gz")
        local.write_bytes(data)
        fetched[str(local)] = p
        out.append(local)
    return out


def attach_memory(
    facts: RunFacts, memory: str | Path | Iterable[str | Path], *, found: bool = False, iteration: int | None = None
) -> None:
    """Analyse every snapshot; keep the one with the highest peak in ``facts.memory``.

    ``found``: the snapshots were found beside the traces, not named with ``--memory``: the
    notes say which were read, and one that cannot be read is a note, not an error."""
    from fsdpdoctor.analysis.memory import analyze_memory
    from fsdpdoctor.ingest.layouts import snapshot_rank

    best = None
    read = []
    for f in memory_files(memory, iteration):
        try:
            mf = analyze_memory(f)
        except InputError as exc:
            if not found:
                raise
            facts.notes.append(f"memory snapshot {Path(f).name} beside the traces not read: {exc.problem}")
            continue
        read.append(Path(f).name)
        mf.rank = snapshot_rank(f)
        mf.discovered = found
        facts.memory_per_input[str(f)] = mf.peak_allocated_bytes
        if best is None or mf.peak_allocated_bytes > best.peak_allocated_bytes:
            best = mf
    facts.memory = best
    if found and read:
        facts.notes.insert(
            0,
            "memory snapshot"
            + ("s " if len(read) > 1 else " ")
            + ", ".join(read)
            + " found beside the traces and read (no --memory needed)",
        )


def analyze_memory_only(
    memory: str | Path | Iterable[str | Path], config: dict[str, Any] | None = None, iteration: int | None = None
) -> Report:
    """A report from memory snapshots alone (``fsdpdoctor memory``); ``iteration`` chooses in a
    framework's dump folder (default: its latest snapshot)."""
    facts = RunFacts(tool=f"fsdpdoctor {__version__}")
    attach_memory(facts, memory, iteration=iteration)
    facts.framework = detect_framework(facts)
    _pressure(facts, config)
    return _checked(Report(facts=facts, findings=run_rules(facts, config)))


def _pressure(facts: RunFacts, config: dict[str, Any] | None) -> None:
    """``facts.memory_pressure`` against ``--memory-budget`` or the GPU's memory."""
    from fsdpdoctor.analysis.pressure import memory_pressure
    from fsdpdoctor.config import defaults

    cfg = defaults() | (config or {})
    facts.memory_pressure = memory_pressure(facts, float(cfg["memory_budget_gib"]), float(cfg["memory_pressure_pct"]))


# ------------------------------------------------------------------------------------------
# loading a run for compare and check: traces, or a saved report / baseline
# ------------------------------------------------------------------------------------------


@dataclass
class LoadedRun:
    facts: RunFacts
    findings: list[Finding]
    label: str
    source: str  # "traces" or "saved facts"


def is_saved_facts(path: str) -> bool:
    """True for a ``.json`` file holding fsdpdoctor facts/report JSON (not a Kineto trace)."""

    p = Path(path)
    if p.suffix.lower() != ".json" or not p.is_file():
        return False
    try:
        with open(p, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return False
    return b'"schema_version"' in head or b'"rank_facts"' in head


def load_run(
    paths: str | list[str],
    config: dict[str, Any] | None = None,
    jobs: int | None = None,
    memory: list | None = None,
    *,
    scheduler: str | None = None,
    strict: bool = False,
    cycle: int | None = None,
    allow_mixed_runs: bool = False,
) -> LoadedRun:
    """Anything ``analyze`` accepts, or one saved facts/report JSON (``analyze --save-baseline``).

    Saved files bring their own findings (the report JSON's top-level ``findings``); a bare
    RunFacts JSON has none, so the rules run on its facts. Raises InputError for bad input.
    """
    items = [paths] if isinstance(paths, str) else [str(p) for p in paths]
    label = " ".join(items)
    if len(items) == 1 and is_saved_facts(items[0]):
        path = items[0]
        facts, raw = RunFacts.load_document(path)
        if isinstance(raw.get("findings"), list):
            try:
                findings = msgspec.convert(raw["findings"], list[Finding])
            except msgspec.ValidationError as exc:
                raise InputError(path, f"its findings do not match the schema ({short(exc)})") from None
        else:
            findings = run_rules(facts, config)
        return LoadedRun(facts, findings, label, "saved facts")
    report = analyze(
        items,
        memory=memory or None,
        config=config,
        jobs=jobs,
        scheduler=scheduler,
        strict=strict,
        cycle=cycle,
        allow_mixed_runs=allow_mixed_runs,
    )
    return LoadedRun(report.facts, report.findings, label, "traces")
