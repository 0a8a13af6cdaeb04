"""A bounded, drawable extract of one step of one rank: per-stream GPU intervals, exposed
communication and FSDP unit boundaries. The HTML report draws its GPU timeline from it.

RunFacts keep per-step totals and per-collective timings, not every kernel, so this module reads
the rank's :class:`~fsdpdoctor.ingest.kineto.RankTrace` again for the one chosen step. It uses
the same classification and the same step assignment as :mod:`fsdpdoctor.analysis.timeline`
(a GPU activity belongs to the step in which the CPU launched it), so the intervals drawn add up
to the step's numbers in RunFacts:

- compute / comm / memcpy come from :func:`~fsdpdoctor.analysis.timeline.classify_gpu`;
- exposed comm = merged comm \\ merged compute (:func:`~fsdpdoctor.analysis.intervals.subtract`),
  exactly the set whose length is ``StepFacts.exposed_comm_ms``;
- FSDP unit boundaries: each pre-forward / pre-backward hook range of the step
  (``FSDP::pre_forward (<fqn>)``, ``FSDP::pre_backward (<fqn>)``, FSDP1
  ``FullyShardedDataParallel._pre_forward`` / ``._pre_backward_hook``) is kept as its CPU range,
  and mapped onto the GPU timeline at the start of the first compute kernel launched after the
  hook began (and before the next hook began). The CPU runs ahead of the GPU, so the hook itself
  is usually far earlier than the unit's GPU work; the mapped time is where that work starts.

Times in the extract are microseconds relative to the start of the step's ``ProfilerStep`` span
(the CPU and GPU clocks of a Kineto trace are the same clock). At most ``max_events`` kernels are
kept (the longest ones, so that what a screen can show survives); totals are computed on all of
them before any cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import kind_from_collective_name, kind_from_kernel_name
from fsdpdoctor.analysis.fsdp import placeholder_name
from fsdpdoctor.analysis.rows import name_rows
from fsdpdoctor.analysis.steps import StepWindow
from fsdpdoctor.analysis.timeline import classify_gpu

__all__ = [
    "KernelSpan",
    "ExposedSpan",
    "UnitMark",
    "StepTimeline",
    "extract_step",
    "extract_for_facts",
    "median_step_index",
    "short_name",
]

FWD_HOOKS = ("FSDP::pre_forward", "FullyShardedDataParallel._pre_forward")
BWD_HOOKS = ("FSDP::pre_backward", "FullyShardedDataParallel._pre_backward_hook")
_HOOK_RX = re.compile(
    r"^(?P<hook>FSDP::pre_forward|FSDP::pre_backward|FullyShardedDataParallel\._pre_forward"
    r"|FullyShardedDataParallel\._pre_backward_hook)(?: \((?P<fqn>.*)\))?$"
)
ROOT_LABEL = "(root)"


@dataclass
class KernelSpan:
    """One GPU activity (kernel, memcpy, memset) of the step."""

    stream: int
    start_us: float  # relative to the step start
    end_us: float
    category: str  # "compute" | "comm" | "memcpy" | "other" (sync/wait kernels, neither)
    name: str  # short name (see :func:`short_name`)
    kind: str | None = None  # collective kind for comm kernels
    unit: str | None = None  # FSDP unit of the collective, when known
    bytes: int | None = None  # collective size (nccl-tests convention), when known


@dataclass
class ExposedSpan:
    """The part of one comm kernel that no compute kernel overlaps."""

    stream: int
    start_us: float
    end_us: float
    kind: str


@dataclass
class UnitMark:
    """One FSDP pre-forward / pre-backward hook of the step and where its unit's GPU work starts."""

    unit: str  # FQN ("(root)" for the root), ``unit<k>`` by order without FQNs, or "backward #k"
    pass_: str  # "forward" | "backward"
    label: str  # the CPU range's name
    cpu_start_us: float
    cpu_end_us: float
    gpu_us: float | None  # start of the first compute kernel launched after the hook began
    gpu_kernel: str | None = None  # that kernel's short name


@dataclass
class StepTimeline:
    rank: int | None
    step_index: int  # position among the rank's steps (as ``CollectiveFacts.step``)
    step_number: int  # the ProfilerStep number
    step_start_us: float  # absolute CPU time of the step start (the origin of every time here)
    step_ms: float
    gpu_present: bool
    kernels: list[KernelSpan] = field(default_factory=list)
    exposed: list[tuple[float, float]] = field(default_factory=list)  # merged exposed comm
    exposed_spans: list[ExposedSpan] = field(default_factory=list)  # per comm kernel
    units: list[UnitMark] = field(default_factory=list)
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)  # CPU, relative
    streams: list[int] = field(default_factory=list)  # in display order
    stream_roles: dict[int, str] = field(default_factory=dict)  # stream → dominant category
    # totals on every kernel of the step (before truncation), in ms
    gpu_window_ms: float = 0.0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    kernel_count: int = 0
    truncated: int = 0  # kernels left out of ``kernels`` (max_events)
    notes: list[str] = field(default_factory=list)


def short_name(name: str, limit: int = 64) -> str:
    """A kernel name fit for a label: no ``void``, no anonymous namespaces, no template arguments,
    no parameter list (``void at::native::(anonymous namespace)::foo<float>(int)`` → ``at::native::foo``)."""
    n = name.strip()
    if n.startswith(("Memcpy", "Memset", "hipMemcpy", "hipMemset")):
        return n if len(n) <= limit else n[: limit - 1] + "…"
    n = n.removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (n.find("<"), n.find("(")) if i > 0), default=len(n))
    n = n[:cut].strip() or name.strip()
    return n if len(n) <= limit else n[: limit - 1] + "…"


def _comm_kind(rt: RankTrace, row: int) -> str:
    a = rt.args.get(row)
    return (
        kind_from_collective_name(a.collective if a is not None else None)
        or kind_from_kernel_name(rt.row_name(row))
        or "other"
    )


def extract_step(
    rt: RankTrace,
    step_window: StepWindow,
    max_events: int = 20000,
    *,
    step_index: int = 0,
    collectives: list | None = None,
    unit_names: list[str] | None = None,
) -> StepTimeline:
    """The drawable timeline of ``step_window`` (one entry of ``find_steps(rt).steps``).

    ``collectives`` (the rank's ``CollectiveFacts``, optional) lend comm kernels their kind, FSDP
    unit and size; without them the kind comes from the kernel's args or name. ``unit_names``
    (``FsdpFacts.units`` FQNs in index order, optional) name the forward hooks when the trace's
    labels carry no FQN (FSDP1, torch 2.4 FSDP2), e.g. after a sidecar named the units.
    """
    st = step_window
    t0 = float(st.start)
    tl = StepTimeline(
        rank=rt.rank,
        step_index=step_index,
        step_number=st.number,
        step_start_us=t0,
        step_ms=st.dur / 1e3,
        gpu_present=bool(rt.mask_cat("kernel").any()),
        phases={k: (a - t0, b - t0) for k, (a, b) in st.phases.items()},
    )
    g = classify_gpu(rt)
    in_step = (g.launch_ts >= st.start) & (g.launch_ts < st.end)
    rows = g.rows[in_step]
    s = rt.ts[rows]
    e = s + rt.dur[rows]
    cm, cp, mm = g.comm[in_step], g.compute[in_step], g.memory[in_step]
    launch = g.launch_ts[in_step]
    tl.kernel_count = int(rows.size)
    if rows.size:
        comp = iv.merge(s[cp], e[cp])
        comm = iv.merge(s[cm], e[cm])
        exposed = iv.subtract(comm, comp)
        tl.gpu_window_ms = float(e.max() - s.min()) / 1e3
        tl.compute_ms = iv.total(comp) / 1e3
        tl.comm_ms = iv.total(comm) / 1e3
        tl.exposed_comm_ms = iv.total(exposed) / 1e3
    else:
        comp = comm = exposed = iv.EMPTY

    # -- kernels ------------------------------------------------------------------------------
    cat = np.where(cm, "comm", np.where(cp, "compute", np.where(mm, "memcpy", "other")))
    streams = rt.stream[rows]
    keep = np.arange(rows.size)
    if rows.size > max_events:
        keep = np.sort(np.argsort(-(e - s), kind="stable")[:max_events])
        tl.truncated = int(rows.size - max_events)
        tl.notes.append(
            f"{rows.size} GPU activities in this step; the {max_events} longest are drawn "
            f"({tl.truncated} shorter ones left out; totals use all of them)"
        )
    coll_index = _collective_index(collectives, step_index)
    for k in keep[np.argsort(s[keep], kind="stable")]:
        r = int(rows[k])
        span = KernelSpan(
            stream=int(streams[k]),
            start_us=float(s[k] - t0),
            end_us=float(e[k] - t0),
            category=str(cat[k]),
            name=short_name(rt.row_name(r)),
        )
        if cm[k]:
            span.kind = _comm_kind(rt, r)
            c = _match_collective(coll_index, span.stream, float(s[k]), float(e[k]))
            if c is not None:
                span.kind, span.bytes = c.kind, c.bytes
                span.unit = None if c.unit is None else (c.unit or ROOT_LABEL)
        tl.kernels.append(span)

    # streams: compute first, then by role, then by id; role = category with the most busy time
    busy: dict[int, dict[str, float]] = {}
    for sp in tl.kernels:
        d = busy.setdefault(sp.stream, {})
        d[sp.category] = d.get(sp.category, 0.0) + (sp.end_us - sp.start_us)
    role_order = {"compute": 0, "comm": 1, "memcpy": 2, "other": 3}
    tl.stream_roles = {st_: max(d, key=d.get) for st_, d in busy.items()}
    tl.streams = sorted(busy, key=lambda x: (role_order.get(tl.stream_roles[x], 9), x))

    # -- exposed communication ---------------------------------------------------------------------
    ex_s, ex_e = exposed
    order = np.arange(ex_s.size)
    if ex_s.size > max_events:
        order = np.sort(np.argsort(-(ex_e - ex_s), kind="stable")[:max_events])
        tl.notes.append(f"{ex_s.size} exposed intervals; the {max_events} longest are drawn")
    tl.exposed = [(float(ex_s[i] - t0), float(ex_e[i] - t0)) for i in order]
    if ex_s.size:
        for sp in tl.kernels:
            if sp.category != "comm":
                continue
            ps, pe = iv.clip(exposed, sp.start_us + t0, sp.end_us + t0)
            for a, b in zip(ps, pe, strict=True):
                if b > a:
                    tl.exposed_spans.append(ExposedSpan(sp.stream, float(a - t0), float(b - t0), sp.kind or "other"))

    # -- FSDP unit boundaries ------------------------------------------------------------------
    tl.units = _unit_marks(rt, st, s[cp], launch[cp], rows[cp], unit_names)
    if not tl.gpu_present:
        tl.notes.append("no GPU kernels in this trace: only the CPU side (phases, FSDP hooks) can be drawn")
    elif rows.size == 0:
        tl.notes.append("no GPU activity was launched in this step")
    return tl


def _collective_index(collectives, step_index: int) -> dict[int, list]:
    """Collectives of the step with GPU timings, by stream, sorted by GPU start."""
    out: dict[int, list] = {}
    for c in collectives or []:
        if getattr(c, "step", -1) != step_index or c.gpu_start_us is None or c.stream is None:
            continue
        out.setdefault(int(c.stream), []).append(c)
    for lst in out.values():
        lst.sort(key=lambda c: c.gpu_start_us)
    return out


def _match_collective(index: dict[int, list], stream: int, start: float, end: float):
    """The collective on ``stream`` whose GPU span [gpu_start, gpu_start + dur] contains the kernel."""
    lst = index.get(stream)
    if not lst:
        return None
    eps = 1e-3
    for c in lst:
        gs = c.gpu_start_us
        ge = gs + (c.gpu_dur_us or 0.0)
        if gs - eps <= start and end <= ge + eps:
            return c
        if gs > start + eps:
            break
    return None


def _unit_marks(
    rt: RankTrace,
    st: StepWindow,
    comp_start: np.ndarray,
    comp_launch: np.ndarray,
    comp_rows: np.ndarray,
    unit_names: list[str] | None = None,
) -> list[UnitMark]:
    rows = name_rows(rt, lambda n: _HOOK_RX.match(n) is not None, "cpu_op", "user_annotation")
    rows = rows[(rt.ts[rows] >= st.start) & (rt.ts[rows] < st.end)]
    if rows.size == 0:
        return []
    rows = rows[np.argsort(rt.ts[rows], kind="stable")]
    names = [rt.row_name(int(r)) for r in rows]
    matches = [_HOOK_RX.match(n) for n in names]
    has_fqn = any(m.group("fqn") is not None for m in matches)
    order = np.argsort(comp_launch, kind="stable")
    cl, cs, cr = comp_launch[order], comp_start[order], comp_rows[order]
    t0 = float(st.start)
    out: list[UnitMark] = []
    fwd_k = bwd_k = 0
    for i, (r, n, m) in enumerate(zip(rows, names, matches, strict=True)):
        pass_ = "forward" if m.group("hook") in FWD_HOOKS else "backward"
        if has_fqn:
            fqn = m.group("fqn")
            unit = ROOT_LABEL if not fqn else fqn
        elif pass_ == "forward":
            if unit_names is not None and fwd_k < len(unit_names):
                unit = unit_names[fwd_k] or ROOT_LABEL
            else:
                unit = placeholder_name(fwd_k)  # the naming of fsdpdoctor.analysis.fsdp without FQNs
        else:
            unit = f"backward #{bwd_k}"  # FSDP1/2.4 backward hooks do not say which unit
        if pass_ == "forward":
            fwd_k += 1
        else:
            bwd_k += 1
        begin = float(rt.ts[r])
        nxt = float(rt.ts[rows[i + 1]]) if i + 1 < rows.size else float(st.end)
        j = int(np.searchsorted(cl, begin, side="left"))
        gpu_us = kernel = None
        if j < cl.size and cl[j] < nxt:
            gpu_us = float(cs[j] - t0)
            kernel = short_name(rt.row_name(int(cr[j])))
        out.append(
            UnitMark(
                unit=unit,
                pass_=pass_,
                label=n,
                cpu_start_us=begin - t0,
                cpu_end_us=float(rt.ts[r] + rt.dur[r]) - t0,
                gpu_us=gpu_us,
                gpu_kernel=kernel,
            )
        )
    return out


def median_step_index(step_ms: list[float]) -> int | None:
    """Index of the median-length step (the lower median for an even count)."""
    if not step_ms:
        return None
    order = sorted(range(len(step_ms)), key=lambda i: (step_ms[i], i))
    return order[(len(order) - 1) // 2]


def extract_for_facts(
    facts, rank: int | None = None, step_index: int | None = None, max_events: int = 20000
) -> StepTimeline:
    """Load ``rank``'s trace again (the path in its RankFacts) and extract ``step_index``.

    Defaults: rank 0 (else the lowest rank), the median-length step of that rank. Raises
    :class:`~fsdpdoctor.errors.InputError` for a rank or step that is not in the input.
    """
    from fsdpdoctor.errors import InputError
    from fsdpdoctor.ingest.kineto import load_trace
    from fsdpdoctor.analysis.steps import find_steps

    ranks = facts.all_ranks()  # a rank kept as its summary line: its path and step times are there
    if not ranks:
        raise InputError("--timeline-rank", "no traces to draw a timeline from")
    if rank is None:
        rf = next((r for r in ranks if r.rank == 0), ranks[0])
    else:
        rf = next((r for r in ranks if r.rank == rank), None)
        if rf is None:
            raise InputError(f"rank {rank}", f"not in the input (ranks: {', '.join(str(r.rank) for r in ranks)})")
    if step_index is None:
        step_index = median_step_index(facts.step_times().get(rf.rank) or [s.step_ms for s in rf.steps]) or 0
    rt = load_trace(rf.path)
    steps = find_steps(rt).steps
    if not 0 <= step_index < len(steps):
        raise InputError(f"step {step_index}", f"rank {rf.rank} has {len(steps)} steps (indices 0..{len(steps) - 1})")
    names = [u.fqn for u in sorted(facts.fsdp.units, key=lambda u: u.index)]
    tl = extract_step(
        rt, steps[step_index], max_events, step_index=step_index, collectives=rf.collectives, unit_names=names or None
    )
    tl.rank = rf.rank
    return tl
