"""``compare``'s tables: what changed in structure and configuration, which findings appeared or
disappeared, and the per-rank, per-unit and per-collective rows, each aligned across the two runs
(ranks by index, FSDP units by FQN, collectives by unit, phase and kind). Plain functions over two
:class:`~fsdpdoctor.facts.RunFacts`; :func:`fsdpdoctor.analysis.compare.compare` assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdpdoctor.engine import Finding
from fsdpdoctor.facts import RankFacts, RunFacts

PHASES = ("forward", "backward", "optimizer", "other")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclass
class Change:
    key: str
    label: str
    before: str
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after


@dataclass
class FindingChange:
    slug: str
    code: str
    severity: str
    status: str  # appeared / disappeared / persisting
    summary: str
    est_saving_before_ms: float | None
    est_saving_after_ms: float | None
    fix: dict[str, str] = field(default_factory=dict)


@dataclass
class RankRow:
    rank: int
    step_before_ms: float | None
    step_after_ms: float | None
    compute_before_ms: float | None = None
    compute_after_ms: float | None = None
    exposed_before_ms: float | None = None
    exposed_after_ms: float | None = None


@dataclass
class UnitRow:
    fqn: str
    status: str  # both / added / removed
    ag_per_step: tuple[float | None, float | None]
    ag_bytes: tuple[float | None, float | None]
    rs_bytes: tuple[float | None, float | None]
    exposed_ms: tuple[float | None, float | None]


@dataclass
class CollectiveRow:
    unit: str
    phase: str
    kind: str
    count: tuple[float, float]
    bytes: tuple[float | None, float | None]
    exposed_ms: tuple[float, float]


def _fmt_bytes(v: float | None) -> str:
    from fsdpdoctor.fmt import mib

    return mib(v)


def _yn(v: bool | None) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def structure_diff(b: RunFacts, a: RunFacts) -> list[Change]:
    """Structure and configuration of both runs, one row per fact (``changed`` marks differences)."""
    rows: list[Change] = []

    def row(key: str, label: str, fn) -> None:
        rows.append(Change(key, label, str(fn(b)), str(fn(a))))

    def dev(f: RunFacts) -> str:
        return next((r.device_name for r in f.rank_facts if r.device_name), None) or (
            "GPU" if f.gpu_present else "no GPU"
        )

    row("world_size", "world size", lambda f: f.world_size if f.world_size is not None else "unknown")
    row("ranks", "ranks analysed", lambda f: len(f.ranks))
    row("device", "device", dev)
    row(
        "fsdp_version",
        "FSDP version",
        lambda f: f"FSDP{f.fsdp.version}" if f.fsdp.version else (f.parallelism.run_kind or "not detected"),
    )
    row("sharding_strategy", "sharding strategy", lambda f: f.fsdp.sharding_strategy or "unknown")
    row("unit_count", "FSDP units", lambda f: f.fsdp.unit_count)
    row("backward_prefetch", "backward prefetch", lambda f: f.fsdp.backward_prefetch or "unknown")
    row("forward_prefetch", "forward prefetch", lambda f: _yn(f.fsdp.forward_prefetch))
    row("reshard_after_forward", "reshard after forward", lambda f: _yn(f.fsdp.reshard_after_forward))
    row("cpu_offload", "CPU offload", lambda f: "yes" if f.fsdp.cpu_offload.detected else "no")
    row("mixed_precision", "low-precision all-gathers", lambda f: _yn(f.fsdp.mixed_precision))
    row("activation_checkpointing", "activation checkpointing", lambda f: _yn(f.fsdp.activation_checkpointing))
    row(
        "compute_dtype",
        "GEMMs run",
        lambda f: f.compute.compute_dtype if f.compute is not None and f.compute.compute_dtype else "unknown",
    )
    kinds = sorted(
        {c.kind for f in (b, a) for c in f.collectives} | {k for f in (b, a) for k in f.fsdp.collective_dtypes}
    )
    for k in kinds:
        row(
            f"dtype.{k}",
            f"{k.replace('_', '-')} dtype",
            lambda f, k=k: ", ".join(sorted(f.fsdp.collective_dtypes.get(k, []))) or _dtypes_of(f, k),
        )
    for k in kinds:
        row(f"count.{k}", f"{k.replace('_', '-')} per step", lambda f, k=k: _coll_count(f, k))
        row(f"bytes.{k}", f"bytes per {k.replace('_', '-')}", lambda f, k=k: _coll_bytes(f, k))
    # host copies: how many, and whether from / to pageable memory (synchronous copies)
    row("copies.h2d", "host-to-device copies per step", lambda f: _per_step(f, lambda o: o.h2d_count))
    row("copies.d2h", "device-to-host copies per step", lambda f: _per_step(f, lambda o: o.d2h_count))
    row(
        "copies.pageable",
        "copies from or to pageable memory per step",
        lambda f: _per_step(f, lambda o: o.pageable_count),
    )
    if b.fsdp.cpu_offload.detected or a.fsdp.cpu_offload.detected:  # the optimizer step runs on the CPU
        row("optimizer_cpu_ms", "optimizer step CPU time", _optimizer_cpu)
    row("step_method", "steps found by", lambda f: f.steps.method or "–")
    return rows


def _ranks_with_steps(f: RunFacts) -> list[RankFacts]:
    return [r for r in f.all_ranks() if r.steps]


def _per_step(f: RunFacts, count) -> str:
    """A per-rank count of the whole trace, per step, mean over ranks."""
    rs = _ranks_with_steps(f)
    return f"{_mean([count(r.fsdp.cpu_offload) / len(r.steps) for r in rs]):.1f}" if rs else "–"


def _optimizer_cpu(f: RunFacts) -> str:
    from fsdpdoctor.fmt import ms

    rs = _ranks_with_steps(f)
    return ms(_mean([_mean([s.phase_ms.get("optimizer", 0.0) for s in r.steps]) for r in rs])) if rs else "–"


def _stats(f: RunFacts, kind: str):
    return next((c for c in f.collectives if c.kind == kind), None)


def _dtypes_of(f: RunFacts, kind: str) -> str:
    c = _stats(f, kind)
    return ", ".join(sorted(c.dtypes)) if c and c.dtypes else "–"


def _coll_count(f: RunFacts, kind: str) -> str:
    c = _stats(f, kind)
    return "0" if c is None else f"{c.count_per_step:.1f}"


def _coll_bytes(f: RunFacts, kind: str) -> str:
    c = _stats(f, kind)
    if c is None or c.bytes_per_step is None or not c.count_per_step:
        return "–"
    return _fmt_bytes(c.bytes_per_step / c.count_per_step)


def findings_diff(before: list[Finding], after: list[Finding]) -> list[FindingChange]:
    """Findings by slug: appeared (only after), disappeared (only before), persisting."""
    bmap = {f.slug: f for f in before}
    amap = {f.slug: f for f in after}
    out = []
    for f in after:
        st = "persisting" if f.slug in bmap else "appeared"
        sb = bmap[f.slug].est_saving_ms if f.slug in bmap else None
        out.append(FindingChange(f.slug, f.code, f.severity, st, f.summary, sb, f.est_saving_ms, dict(f.fix)))
    for f in before:
        if f.slug not in amap:
            out.append(
                FindingChange(f.slug, f.code, f.severity, "disappeared", f.summary, f.est_saving_ms, None, dict(f.fix))
            )
    return out


def _rank_rows(b: RunFacts, a: RunFacts, basis: str) -> list[RankRow]:
    bm = {r.rank: r for r in b.all_ranks()}
    am = {r.rank: r for r in a.all_ranks()}

    def m(r: RankFacts | None, attr: str) -> float | None:
        if r is None or not r.steps:
            return None
        if attr != "step_ms" and all(s.clock_split_ms for s in r.steps):  # compare's parts, on the step clock
            keep = (lambda k: k == "compute") if attr == "compute_ms" else (lambda k: k.startswith("comm:"))
            return _mean([sum(v for k, v in s.clock_split_ms.items() if keep(k)) for s in r.steps])
        return _mean([getattr(s, attr) for s in r.steps])

    rows = []
    for k in sorted(set(bm) | set(am)):
        rb, ra = bm.get(k), am.get(k)
        row = RankRow(k, m(rb, "step_ms"), m(ra, "step_ms"))
        if basis == "gpu":
            row.compute_before_ms, row.compute_after_ms = m(rb, "compute_ms"), m(ra, "compute_ms")
            row.exposed_before_ms, row.exposed_after_ms = m(rb, "exposed_comm_ms"), m(ra, "exposed_comm_ms")
        rows.append(row)
    return rows


def _unit_rows(b: RunFacts, a: RunFacts) -> list[UnitRow]:
    bu = {u.fqn: u for u in b.fsdp.units}
    au = {u.fqn: u for u in a.fsdp.units}
    order = [u.fqn for u in a.fsdp.units] + [u.fqn for u in b.fsdp.units if u.fqn not in au]
    rows = []
    for fqn in order:
        ub, ua = bu.get(fqn), au.get(fqn)
        status = "both" if ub and ua else ("added" if ua else "removed")

        def g(u, fn):
            return None if u is None else fn(u)

        rows.append(
            UnitRow(
                fqn,
                status,
                (
                    g(ub, lambda u: u.forward_all_gathers + u.backward_all_gathers),
                    g(ua, lambda u: u.forward_all_gathers + u.backward_all_gathers),
                ),
                (g(ub, lambda u: u.all_gather_bytes), g(ua, lambda u: u.all_gather_bytes)),
                (g(ub, lambda u: u.reduce_scatter_bytes), g(ua, lambda u: u.reduce_scatter_bytes)),
                (
                    g(ub, lambda u: u.all_gather_exposed_ms + u.reduce_scatter_exposed_ms),
                    g(ua, lambda u: u.all_gather_exposed_ms + u.reduce_scatter_exposed_ms),
                ),
            )
        )
    return rows


def _collective_groups(f: RunFacts) -> dict[tuple[str, str, str], tuple[float, float | None, float]]:
    """(unit, phase, kind) → (count, bytes, exposed ms) per step, mean over ranks."""
    per_rank: list[dict[tuple[str, str, str], list[float]]] = []
    for r in f.rank_facts:
        n = len(r.steps)
        if not n or r.collectives_dropped:  # large runs: the mean over the ranks that kept their detail
            continue
        d: dict[tuple[str, str, str], list[float]] = {}
        for c in r.collectives:
            if not 0 <= c.step < n:
                continue
            key = (c.unit if c.unit is not None else "?", c.phase, c.kind)
            acc = d.setdefault(key, [0.0, 0.0, 0.0, 0.0])  # count, bytes, exposed ms, known-bytes count
            acc[0] += 1 / n
            if c.bytes is not None:
                acc[1] += c.bytes / n
                acc[3] += 1
            acc[2] += c.exposed_us / 1e3 / n
        per_rank.append(d)
    keys = {k for d in per_rank for k in d}
    out = {}
    for k in keys:
        vals = [d.get(k, [0.0, 0.0, 0.0, 0.0]) for d in per_rank]
        known = any(v[3] for v in vals)
        out[k] = (
            _mean([v[0] for v in vals]),
            _mean([v[1] for v in vals]) if known else None,
            _mean([v[2] for v in vals]),
        )
    return out


def _collective_rows(b: RunFacts, a: RunFacts) -> list[CollectiveRow]:
    gb, ga = _collective_groups(b), _collective_groups(a)
    phase_order = {p: i for i, p in enumerate(PHASES)}
    rows = []
    for k in sorted(set(gb) | set(ga), key=lambda k: (phase_order.get(k[1], 9), k[2], k[0])):
        vb, va = gb.get(k, (0.0, None, 0.0)), ga.get(k, (0.0, None, 0.0))
        rows.append(CollectiveRow(k[0], k[1], k[2], (vb[0], va[0]), (vb[1], va[1]), (vb[2], va[2])))
    return rows


def _alignment(b: RunFacts, a: RunFacts) -> dict[str, Any]:
    rb, ra = set(b.ranks), set(a.ranks)
    ub, ua = {u.fqn for u in b.fsdp.units}, {u.fqn for u in a.fsdp.units}

    return {
        "ranks": {"common": sorted(rb & ra), "only_before": sorted(rb - ra), "only_after": sorted(ra - rb)},
        "steps": {
            "before": b.step_numbers(),
            "after": a.step_numbers(),
            "note": "steps are averaged per rank, then over ranks; step numbers need not match",
        },
        "units": {"common": sorted(ub & ua), "only_before": sorted(ub - ua), "only_after": sorted(ua - ub)},
    }


# ------------------------------------------------------------------------------------------
# causes
# ------------------------------------------------------------------------------------------
