"""The hang diagnosis: every rank's Flight Recorder dump matched across ranks (``RunFacts.hang``).

Each dump is first reduced to a :class:`~.hang_views.RankView` (in worker processes when there
are many). A process group is identified by its member ranks and its name (names repeat across
ranks for different groups): the ranks the dumps' ``pg_config`` lists, or where it lists none (gloo)
the ranks whose dumps use the group, every rank for the default group. Within a group collectives
are matched by ``collective_seq_id`` (the ops of a coalesced group as one), p2p ops per (sender,
receiver) channel in order. The diagnosis is the first of these found (``HangFacts.kind``):

* **mismatch**: the earliest collective at which ranks recorded different signatures (op, sizes,
  dtypes); the ranks outside the majority are the culprits (without a majority, all of them).
* **missing**: ranks whose last collective in a group is older than the others' never entered the
  next one, in which those wait. A rank that waits in another group itself is a victim; the
  culprits are the ranks that wait in nothing (the sinks of the wait-for graph). The stuck
  collective shown is the culprit's absence the waiting ranks met first.
* **late**: every rank entered a group's last collective, some ``late_s`` (default 1 s) or more
  after the others (``time_created_ns``; the clocks of different hosts agree to NTP's accuracy).
* **no_dump**: every rank with a dump entered it, and some ranks left no dump.
* **in_collective**: every rank entered it and none completed it (only NCCL records states).
* **none**: nothing above (a dump taken on demand from a healthy job).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fsdpdoctor.errors import InputError
from fsdpdoctor.facts.hang import DumpLedger, FrProcessGroup, HangCulprit, HangFacts, HangOp, LateRank, RankProgress
from fsdpdoctor.fmt import rank_list, ranks_text, seconds
from fsdpdoctor.analysis.hang.stacks import frame_text
from fsdpdoctor.analysis.hang.views import GroupSeqs, OpView, RankView, view_of, view_task

DEFAULT_LATE_S = 1.0
ALSO_STUCK_LINES = 10


@dataclass
class Group:
    """One process group across ranks."""

    name: str
    desc: str
    members: list[int]
    ranks_from: str
    per_rank: dict[int, GroupSeqs] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.desc or self.name} [{rank_list(self.members, 8)}]"


# --------------------------------------------------------------------------- loading


def load_views(paths: list, jobs: int | None = None) -> list[RankView]:
    """Every dump's view, in worker processes when there are many; the first bad dump raises its
    InputError (one line naming the file)."""
    paths = [str(p) for p in paths]
    workers = min(jobs or _cores(), len(paths))
    if len(paths) < 32 or workers <= 1:
        out = [view_task(p) for p in paths]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method)) as pool:
            out = list(pool.map(view_task, paths, chunksize=max(1, len(paths) // (workers * 8))))
    for r in out:
        if isinstance(r, InputError):
            raise r
    return out  # type: ignore[return-value]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- groups


def _dedupe(views: list[RankView], notes: list[str]) -> dict[int, RankView]:
    by_rank: dict[int, RankView] = {}
    for v in views:
        old = by_rank.get(v.rank)
        if old is None:
            by_rank[v.rank] = v
            continue
        keep, drop = (v, old) if (v.form, v.n_entries) > (old.form, old.n_entries) else (old, v)
        by_rank[v.rank] = keep
        notes.append(f"two dumps of rank {v.rank}: {keep.path} read, {drop.path} not (the pickle has stacks)")
    return dict(sorted(by_rank.items()))


def _world(by_rank: dict[int, RankView]) -> int:
    n = max(by_rank) + 1 if by_rank else 0
    for v in by_rank.values():
        for g in v.groups:
            if g.ranks and v.rank in g.ranks:
                n = max(n, max(g.ranks) + 1)
            if g.size and (g.desc == "default_pg" or g.name == "0"):
                n = max(n, g.size)
    return n


def _groups(by_rank: dict[int, RankView], world: int) -> dict[tuple, Group]:
    out: dict[tuple, Group] = {}
    for r, v in by_rank.items():
        for g in v.groups:
            known = bool(g.ranks) and r in (g.ranks or ())
            key = (g.name, tuple(sorted(g.ranks))) if known else (g.name, g.desc, None)
            grp = out.get(key)
            if grp is None:
                grp = out[key] = Group(
                    g.name, g.desc, sorted(g.ranks) if known else [], "pg_config" if known else "dumps"
                )
            grp.per_rank[r] = g
    for grp in out.values():
        if grp.ranks_from == "dumps":
            present = sorted(grp.per_rank)
            size = max((g.size or 0) for g in grp.per_rank.values())
            default = grp.desc == "default_pg" or grp.name == "0"
            grp.members = list(range(max(world, size))) if default else present
    return out


# --------------------------------------------------------------------------- matching


@dataclass
class Mismatch:
    group: Group
    seq: int
    by_sig: dict[int, list[int]]  # global signature → ranks
    t: int


def _global_sigs(by_rank: dict[int, RankView]) -> dict[int, np.ndarray]:
    """rank → its local signature ids mapped to ids shared by every rank."""
    table: dict[Any, int] = {}
    return {
        r: np.asarray([table.setdefault(s, len(table)) for s in v.sigs], dtype=np.int64) for r, v in by_rank.items()
    }


def _mismatch(grp: Group, gsig: dict[int, np.ndarray]) -> Mismatch | None:
    """The earliest sequence number at which the ranks of ``grp`` recorded different signatures:
    every rank's (sequence number, signature) pairs as one sorted key array, then the sequence
    numbers that occur with two signatures (one pass, a few bytes per collective of every rank)."""
    per: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for r, g in grp.per_rank.items():
        n = len(g.seqs)
        lo = 1 if g.partial_first and n else 0  # a wrapped buffer may have cut its first coalesced group
        if n - lo > 0:
            per[r] = (np.frombuffer(g.seqs, dtype=np.int64)[lo:], gsig[r][np.frombuffer(g.sigs, dtype=np.int32)[lo:]])
    if len(per) < 2:
        return None
    width = int(max(int(s.max()) for _, s in per.values())) + 1
    key = np.concatenate([q * width + s for q, s in per.values()])
    key.sort()
    key = key[np.concatenate(([True], key[1:] != key[:-1]))]  # distinct (seq, signature) pairs
    seq_of = key // width
    dup = seq_of[1:] == seq_of[:-1]  # a sequence number with a second signature
    if not dup.any():
        return None
    seq = int(seq_of[1:][dup].min())
    by_sig: dict[int, list[int]] = {}
    t = None
    for r, (q, s) in per.items():
        hit = np.nonzero(q == seq)[0]
        if len(hit):
            i = int(hit[0])
            by_sig.setdefault(int(s[i]), []).append(r)
            g = grp.per_rank[r]
            ti = g.times[i + (1 if g.partial_first else 0)]
            t = ti if t is None else min(t, ti)
    return Mismatch(grp, seq, {k: sorted(v) for k, v in by_sig.items()}, t or 0)


def _last(grp: Group, by_rank: dict[int, RankView]) -> dict[int, int]:
    """rank → its last collective's sequence number in the group, for the members with a dump (0:
    a member whose unwrapped buffer holds none of the group's collectives)."""
    out = {r: max(g.seqs) for r, g in grp.per_rank.items() if g.seqs}
    if grp.ranks_from == "pg_config" or grp.desc == "default_pg" or grp.name == "0":
        for r in grp.members:
            v = by_rank.get(r)
            if r not in out and v is not None and not v.wrapped:
                out[r] = 0
    return out


@dataclass
class Stuck:
    group: Group
    seq: int
    laggards: list[int]
    waiting: list[int]
    t: int  # when the first waiting rank entered it


def _stuck(grp: Group, last: dict[int, int]) -> Stuck | None:
    if len(last) < 2:
        return None
    lo, hi = min(last.values()), max(last.values())
    if lo == hi:
        return None
    seq = lo + 1
    waiting = sorted(r for r, s in last.items() if s > lo)
    t = min((_time_at(grp.per_rank[r], seq) for r in waiting), default=0)
    return Stuck(grp, seq, sorted(r for r, s in last.items() if s == lo), waiting, t)


def _time_at(g: GroupSeqs, seq: int) -> int:
    try:
        return g.times[g.seqs.index(seq)]
    except ValueError:
        return g.times[-1] if g.times else 0


def _p2p_stuck(grp: Group, by_rank: dict[int, RankView]) -> list[Stuck]:
    """p2p ops per (sender, receiver) channel: the n-th send must meet the n-th receive."""
    members = grp.members
    sends: dict[tuple[int, int], list[tuple[int, OpView]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, OpView]]] = {}
    for r, g in grp.per_rank.items():
        for v in g.p2p:
            if v.peer is None:
                continue
            peer = members[v.peer] if grp.ranks_from == "pg_config" and v.peer < len(members) else v.peer
            if v.op == "send":
                sends.setdefault((r, peer), []).append((r, v))
            elif v.op == "recv":
                recvs.setdefault((peer, r), []).append((r, v))
    out = []
    for ch in set(sends) | set(recvs):
        src, dst = ch
        s, q = sends.get(ch, []), recvs.get(ch, [])
        if src not in by_rank or dst not in by_rank or len(s) == len(q):
            continue
        if len(s) > len(q):  # dst never posted the receive matching send #len(q)
            v = s[len(q)][1]
            out.append(Stuck(grp, v.p2p_seq, [dst], [src], v.time_created_ns))
        else:
            v = q[len(s)][1]
            out.append(Stuck(grp, v.p2p_seq, [src], [dst], v.time_created_ns))
    return out


# --------------------------------------------------------------------------- describing


def op_name(ops: list[OpView]) -> str:
    if len(ops) == 1:
        return ops[0].op
    names = list(dict.fromkeys(o.op for o in ops if o.op != "coalesced"))
    return "coalesced(" + ", ".join(names) + ")"


def _step(v: OpView, from_start: bool) -> str | None:
    if v.phase not in ("forward", "backward"):
        return None
    if v.pass_index <= 0:  # the dumps do not establish it (no FSDP forward collective counts the passes)
        return f"{v.phase}, step unknown"
    return f"{v.phase} of step {v.pass_index}" if from_start else f"{v.phase} of pass {v.pass_index} of the buffer"


def context(v: OpView, from_start: bool) -> str:
    """ "FSDP2 unshard, forward of step 3", or the call site "train.py:88 in main"."""
    parts = []
    if v.fsdp:
        parts.append(v.fsdp + (f" of unit {v.unit}" if v.unit and v.phase == "forward" and "unshard" in v.fsdp else ""))
    step = _step(v, from_start)
    if step:
        parts.append(step)
    if not parts and v.call_site:
        parts.append(v.call_site)
    elif not parts and v.phase:
        parts.append(v.phase)
    return ", ".join(parts)


def payload(ops: list[OpView], word: str = "of") -> str:
    """ " of a scalar", " of [68] Float" (``word`` "with input": " with input [68] Float")."""
    v = ops[0]
    if len(ops) == 1 and v.input_sizes == [[]]:
        return " of a scalar"
    if len(ops) == 1 and v.input_sizes:
        dt = v.input_dtypes[0] if v.input_dtypes else ""
        return f" {word} {'+'.join(str(list(s)) for s in v.input_sizes)} {dt}".rstrip()
    return ""


def _op_of(ops: list[OpView] | None, status: str, rank: int, from_start: bool, late: float | None) -> HangOp:
    if not ops:
        return HangOp(rank, status)
    h = ops[0]
    return HangOp(
        rank,
        status,
        op_name(ops),
        h.profiling_name,
        h.p2p_seq if h.is_p2p else h.seq,
        [s for o in ops for s in o.input_sizes],
        [s for o in ops for s in o.output_sizes],
        [d for o in ops for d in o.input_dtypes],
        [d for o in ops for d in o.output_dtypes],
        min(
            (o.state for o in ops),
            key=lambda s: (
                ("scheduled", "started", "completed").index(s) if s in ("scheduled", "started", "completed") else 0
            ),
        ),
        h.time_created_ns,
        late,
        h.fsdp,
        h.phase or None,
        h.pass_index if h.phase in ("forward", "backward") and h.pass_index > 0 and from_start else None,
        h.unit,
        h.call_site,
    )


def _stack(view: RankView, v: OpView | None) -> list[str]:
    if v is None or not (0 <= v.stack < len(view.stacks)):
        return []
    return [frame_text(f) for f in view.stacks[v.stack][:40]]


# --------------------------------------------------------------------------- the diagnosis


def diagnose(views: list[RankView], *, late_s: float = DEFAULT_LATE_S, world_size: int | None = None) -> HangFacts:
    """The :class:`HangFacts` of one dump per rank (see the module doc)."""
    notes: list[str] = []
    by_rank = _dedupe(views, notes)
    world = max(world_size or 0, _world(by_rank))
    groups = _groups(by_rank, world)
    from_start = not any(v.wrapped for v in by_rank.values())
    facts = HangFacts(
        dumps=len(by_rank),
        world_size=world or None,
        backend=Counter(v.backend for v in by_rank.values() if v.backend).most_common(1)[0][0]
        if any(v.backend for v in by_rank.values())
        else "",
        versions=sorted({v.version for v in by_rank.values()}),
        forms=sorted({v.form for v in by_rank.values()}),
        steps_from_start=from_start,
        paths=[v.path for v in by_rank.values()],
        notes=notes,
        ranks_without_dump=sorted(set(range(world)) - set(by_rank)),
    )
    if any(v.pg_config_names and not any(g.ranks for g in v.groups) for v in by_rank.values()):
        notes.append(
            "the dumps' pg_config names no group their collectives use (gloo): group members are "
            "the ranks whose dumps use the group, every rank for the default group"
        )
    if not from_start:
        notes.append("a recorder buffer wrapped: steps are counted from the oldest forward pass it holds")
    if not all(v.steps_known for v in by_rank.values()):
        notes.append(
            "step unknown: steps are counted on FSDP's forward all-gathers, and the forward passes of "
            + ranks_text(sorted(r for r, v in by_rank.items() if not v.steps_known))
            + " record none (DDP records no collective in forward)"
        )
    facts.unrecorded_ops = {r: v.unrecorded_ops for r, v in sorted(by_rank.items()) if v.unrecorded_ops}
    facts.dump_ledger = [
        DumpLedger(r, v.n_entries, v.n_p2p, v.states, v.unrecorded_ops, v.unread_keys, v.steps_known)
        for r, v in sorted(by_rank.items())
    ]
    unread = sorted({k for v in by_rank.values() for k in v.unread_keys})
    if unread:
        notes.append("not read from the dumps: " + ", ".join(unread))
    if by_rank and all(set(v.states) <= {"scheduled"} for v in by_rank.values() if v.states):
        notes.append("no entry records a started or completed state (gloo tracks none): states not used")
    facts.progress = _progress(by_rank)
    gsig = _global_sigs(by_rank)
    lasts = {k: _last(g, by_rank) for k, g in groups.items()}
    stucks = [s for k, g in groups.items() if (s := _stuck(g, lasts[k])) is not None]
    p2p = [s for g in groups.values() for s in _p2p_stuck(g, by_rank)]
    mismatches = [m for g in groups.values() if (m := _mismatch(g, gsig)) is not None]
    if mismatches:
        _fill_mismatch(facts, min(mismatches, key=lambda m: (m.t, m.seq)), by_rank, gsig, from_start)
    elif stucks or p2p:
        _fill_missing(facts, stucks, p2p, by_rank, from_start)
    else:
        late = _late(groups, lasts, late_s)
        if late is not None:
            _fill_late(facts, *late, by_rank, from_start)
        else:
            _fill_rest(facts, groups, lasts, by_rank, from_start)
    if facts.process_group is None and facts.kind != "none":
        facts.kind = "none"
    if facts.unrecorded_ops and facts.kind in ("missing", "no_dump", "late") and facts.culprits:
        named = facts.culprit_ranks
        ahead = sorted(facts.unrecorded_ops.items())
        facts.caveat = (
            f"{ranks_text(named)} may be {'victims' if len(named) > 1 else 'a victim'} of an unrecorded send/recv: "
            f"op_id runs ahead of collective_seq_id by {', '.join(str(n) for _, n in ahead)} on "
            f"{ranks_text([r for r, _ in ahead])} (ops no entry records; {facts.backend or 'this backend'} "
            "records no send/recv)"
        )
        notes.append(facts.caveat)
    return facts


def _progress(by_rank: dict[int, RankView]) -> list[RankProgress]:
    out = []
    for r, v in by_rank.items():
        status = {tuple(v.pg_names.get(pid, ["", ""])): st for pid, st in v.pg_status.items()}
        for g in v.groups:
            st = status.get((g.name, g.desc))
            last = g.detail.get(g.seqs[-1]) if g.seqs else None

            def val(x):
                return None if x is None or x < 0 else x

            out.append(
                RankProgress(
                    r,
                    g.desc or g.name,
                    g.seqs[-1] if g.seqs else None,
                    op_name(last) if last else None,
                    val(st.last_enqueued) if st else None,
                    val(st.last_started) if st else None,
                    val(st.last_completed) if st else None,
                )
            )
    return out


def _ops_at(by_rank: dict[int, RankView], grp: Group, seq: int) -> dict[int, tuple[RankView, list[OpView]]]:
    """rank → (its view, its ops at ``seq`` in ``grp``), reading a dump again where the view does
    not keep that collective in full (an old mismatch)."""
    out = {}
    for r, g in grp.per_rank.items():
        ops = g.detail.get(seq)
        view = by_rank[r]
        if ops is None and seq in g.seqs:
            view = view_of(view.path, r, {(grp.name, g.desc, seq)})
            g2 = next((x for x in view.groups if (x.name, x.desc) == (g.name, g.desc)), None)
            ops = g2.detail.get(seq) if g2 is not None else None
        if ops:
            out[r] = (view, ops)
    return out


def _pg(grp: Group) -> FrProcessGroup:
    return FrProcessGroup(grp.name, grp.desc, list(grp.members), grp.ranks_from)


def _group_text(grp: Group) -> str:
    return "" if grp.desc == "default_pg" else f" of {grp.label}"


def _fill_mismatch(facts: HangFacts, m: Mismatch, by_rank, gsig, from_start: bool) -> None:
    grp = m.group
    counts = sorted(m.by_sig.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    top = len(counts[0][1])
    majority = counts[0][0] if len(counts) == 1 or len(counts[1][1]) < top else None
    at = _ops_at(by_rank, grp, m.seq)
    facts.kind, facts.process_group, facts.seq_id = "mismatch", _pg(grp), m.seq
    maj_ranks = m.by_sig.get(majority, []) if majority is not None else []
    ref_rank = maj_ranks[0] if maj_ranks else counts[0][1][0]
    ref_ops = at.get(ref_rank, (None, []))[1]
    facts.op = op_name(ref_ops) if ref_ops else None
    culprits = sorted(r for s, rs in m.by_sig.items() if s != majority for r in rs)
    for r in grp.members:
        if r not in by_rank:
            facts.ops.append(HangOp(r, "no_dump"))
        elif r in at:
            status = "different" if r in culprits else "entered"
            h = _op_of(at[r][1], status, r, from_start, None)
            facts.ops.append(h)
            if status == "different":
                facts.mismatched_ranks.append(h)
        else:
            facts.ops.append(HangOp(r, "not_entered"))
    facts.waiting_ranks = sorted(r for r in at if r not in culprits)
    ref = _op_of(ref_ops, "entered", ref_rank, from_start, None) if ref_ops else None
    for r in culprits:
        view, ops = at[r]
        v = ops[0]
        what = f"ran {op_name(ops)}{payload(ops)}"
        if ref is not None and majority is not None:
            what += f" at #{m.seq} where {ranks_text(maj_ranks)} ran {facts.op}{payload(ref_ops)}"
        facts.culprits.append(
            HangCulprit(
                r,
                "mismatch",
                what,
                None,
                v.call_site,
                v.fsdp,
                v.phase or None,
                v.pass_index if v.pass_index > 0 and from_start else None,
                _stack(view, v),
            )
        )
    first = facts.mismatched_ranks[0] if facts.mismatched_ranks else None
    if majority is None:
        parts = "; ".join(
            f"{ranks_text(rs)} ran {op_name(at[rs[0]][1]) if rs[0] in at else '?'}{payload(at[rs[0]][1]) if rs[0] in at else ''}"
            for _, rs in counts
        )
        facts.summary = f"ranks disagree at collective #{m.seq}{_group_text(grp)} (no majority): {parts}"
    elif first is not None:
        cv = at[first.rank][1]
        same_op = op_name(cv) == facts.op
        where = context(cv[0], from_start) or cv[0].call_site or ""
        if same_op:
            facts.summary = (
                f"{ranks_text(culprits)} ran {facts.op} #{m.seq}{_group_text(grp)}{payload(cv, 'with input')} "
                f"where {ranks_text(maj_ranks)} ran it{payload(ref_ops, 'with input')}"
                + (f" ({where})" if where else "")
            )
        else:
            facts.summary = (
                f"{ranks_text(culprits)} ran {op_name(cv)}{payload(cv)}"
                + (f" ({where})" if where else "")
                + f" where {ranks_text(maj_ranks)} ran {facts.op} #{m.seq}{_group_text(grp)}"
            )
    if facts.ranks_without_dump:
        facts.summary += f"; no dump from {ranks_text(facts.ranks_without_dump)}"


def _fill_missing(facts: HangFacts, stucks: list[Stuck], p2p: list[Stuck], by_rank, from_start: bool) -> None:
    all_stuck = stucks + p2p
    waits_out = {r for s in all_stuck for r in s.waiting}
    culprits = sorted({r for s in all_stuck for r in s.laggards if r not in waits_out})
    if culprits:
        mine = [s for s in all_stuck if set(s.laggards) & set(culprits)]
    else:  # every lagging rank waits elsewhere (a cycle): the earliest stuck collective
        mine = all_stuck
    primary = min(mine, key=lambda s: (s.t, s.seq))
    grp, seq = primary.group, primary.seq
    is_p2p = primary in p2p
    facts.kind, facts.process_group, facts.seq_id, facts.is_p2p = "missing", _pg(grp), seq, is_p2p
    facts.missing_ranks = sorted(primary.laggards)
    facts.waiting_ranks = sorted(primary.waiting)
    at = {} if is_p2p else _ops_at(by_rank, grp, seq)
    if is_p2p:
        for r in primary.waiting:
            v = next((o for o in grp.per_rank[r].p2p if o.p2p_seq == seq), None)
            if v is not None:
                at[r] = (by_rank[r], [v])
    ref = next(iter(at.values()), (None, []))[1]
    facts.op = op_name(ref) if ref else None
    for r in (
        sorted(set(primary.waiting) | set(primary.laggards)) if is_p2p else grp.members
    ):  # p2p: the channel's two ends
        if r not in by_rank:
            facts.ops.append(HangOp(r, "no_dump"))
        elif r in at:
            facts.ops.append(_op_of(at[r][1], "entered", r, from_start, None))
        else:
            facts.ops.append(HangOp(r, "not_entered"))
    for r in facts.missing_ranks:
        view = by_rank[r]
        g = grp.per_rank.get(r)
        mine_last = g.detail.get(g.seqs[-1]) if g is not None and g.seqs else None
        last_any = view.last
        v = (mine_last[0] if mine_last else None) or last_any
        last_txt = None
        if v is not None:
            last_txt = f"{v.op} #{v.p2p_seq if v.is_p2p else v.seq}" + (
                f" ({context(v, from_start)})" if context(v, from_start) else ""
            )
        waits_elsewhere = [s for s in all_stuck if r in s.waiting]
        if waits_elsewhere:
            s2 = waits_elsewhere[0]
            what = f"waits in #{s2.seq}{_group_text(s2.group)} for {ranks_text(s2.laggards)}"
        else:
            what = f"never entered {facts.op or 'the collective'} #{seq}"
            if ref and last_any is not None and ref[0].pass_index > last_any.pass_index > 0:
                what += f": its last collective was in step {last_any.pass_index}, the others are in step {ref[0].pass_index}"
        facts.culprits.append(
            HangCulprit(
                r,
                "missing",
                what,
                last_txt,
                last_any.call_site if last_any else None,
                last_any.fsdp if last_any else None,
                (last_any.phase or None) if last_any else None,
                last_any.pass_index if last_any and last_any.pass_index > 0 and from_start else None,
                _stack(view, last_any),
            )
        )
    ctx = context(ref[0], from_start) if ref else ""
    kind = "p2p " if is_p2p else ""
    facts.summary = (
        f"{ranks_text(facts.missing_ranks)} never entered {kind}{facts.op or 'the collective'} #{seq}"
        f"{_group_text(grp)}"
        + (f" ({ctx})" if ctx else "")
        + f" that {ranks_text(facts.waiting_ranks)} wait{'s' if len(facts.waiting_ranks) == 1 else ''} in"
    )
    for s in sorted(all_stuck, key=lambda s: (s.t, s.seq)):
        if s is primary:
            continue
        if len(facts.also_stuck) >= ALSO_STUCK_LINES:
            facts.also_stuck.append(f"… {len(all_stuck) - 1 - ALSO_STUCK_LINES} more")
            break
        facts.also_stuck.append(
            f"{ranks_text(s.waiting)} wait{'s' if len(s.waiting) == 1 else ''} in #{s.seq}"
            f"{_group_text(s.group) or ' of the default group'} for {ranks_text(s.laggards)}"
        )


def _late(groups: dict[tuple, Group], lasts: dict[tuple, dict[int, int]], late_s: float):
    best = None
    for k, grp in groups.items():
        last = lasts[k]
        if len(last) < 2 or len(set(last.values())) != 1:
            continue
        seq = next(iter(last.values()))
        t = {r: _time_at(grp.per_rank[r], seq) for r in last if r in grp.per_rank}
        if len(t) < 2:
            continue
        states = [g.states[-1] for g in grp.per_rank.values() if g.states]
        if states and min(states) == 2:  # completed everywhere: not stuck in it
            continue
        med = statistics.median(t.values())
        late = {r: (x - med) / 1e9 for r, x in t.items() if (x - med) / 1e9 >= late_s}
        if not late:
            continue
        on_time = [x for r, x in t.items() if r not in late]
        ref = max(on_time) if on_time else med
        lateness = {r: (t[r] - ref) / 1e9 for r in late}
        score = max(lateness.values())
        if best is None or score > best[-1]:
            best = (grp, seq, lateness, t, score)
    return None if best is None else best[:4]


def _fill_late(
    facts: HangFacts, grp: Group, seq: int, lateness: dict[int, float], t: dict[int, int], by_rank, from_start: bool
) -> None:
    at = _ops_at(by_rank, grp, seq)
    facts.kind, facts.process_group, facts.seq_id = "late", _pg(grp), seq
    ref = next((at[r][1] for r in sorted(at) if r not in lateness), None) or next(iter(at.values()))[1]
    facts.op = op_name(ref)

    def gap(r: int) -> float | None:
        g = grp.per_rank[r]
        i = g.seqs.index(seq) if seq in g.seqs else -1
        return (g.times[i] - g.times[i - 1]) / 1e9 if i > 0 else None

    others = [x for r in t if r not in lateness and (x := gap(r)) is not None]
    og = statistics.median(others) if others else None
    for r in grp.members:
        if r not in by_rank:
            facts.ops.append(HangOp(r, "no_dump"))
        elif r in at:
            facts.ops.append(
                _op_of(at[r][1], "entered", r, from_start, round(lateness[r], 3) if r in lateness else None)
            )
    for r, s in sorted(lateness.items()):
        facts.late_ranks.append(LateRank(r, round(s, 3), gap(r), og))
        view, ops = at[r]
        v = ops[0]
        g = gap(r)
        what = f"entered {facts.op} #{seq} {seconds(s)} after the others"
        if g is not None:
            what += f"; {seconds(g)} passed between its previous collective and this one" + (
                f" (the others: {seconds(og)})" if og is not None else ""
            )
        facts.culprits.append(
            HangCulprit(
                r,
                "late",
                what,
                None,
                v.call_site,
                v.fsdp,
                v.phase or None,
                v.pass_index if v.pass_index > 0 and from_start else None,
                _stack(view, v),
            )
        )
    facts.waiting_ranks = sorted(r for r in t if r not in lateness)
    worst = max(lateness, key=lateness.get)
    ctx = context(ref[0], from_start)
    facts.summary = (
        f"{ranks_text(sorted(lateness))} entered {facts.op} #{seq}{_group_text(grp)}"
        + (f" ({ctx})" if ctx else "")
        + f" {seconds(lateness[worst])} after the others"
    )


def _fill_rest(facts: HangFacts, groups, lasts, by_rank, from_start: bool) -> None:
    """Every rank with a dump is at the same collective in every group: left no dump, stuck inside
    it, or nothing wrong."""
    cands = []
    for k, grp in groups.items():
        last = lasts[k]
        if not last:
            continue
        seq = max(last.values())
        states = [g.states[-1] for g in grp.per_rank.values() if g.states]
        t = max((_time_at(g, seq) for g in grp.per_rank.values() if g.seqs), default=0)
        cands.append((grp, seq, min(states) if states else 0, t))
    if not cands:
        facts.summary = "the dumps hold no collectives"
        return
    tracked = any(g.states and max(g.states) > 0 for grp in groups.values() for g in grp.per_rank.values())
    no_dump = [(grp, seq, st, t) for grp, seq, st, t in cands if set(grp.members) - set(by_rank)]
    if facts.ranks_without_dump and no_dump:
        grp, seq, _, _ = max(no_dump, key=lambda c: c[3])
        kind = "no_dump"
    else:
        open_ = [c for c in cands if c[2] < 2]
        if not (tracked and open_):
            facts.summary = (
                "every rank's dump ends at the same collective in every group and nothing is missing, "
                "late or different" + ("" if tracked else " (the backend records no completion)")
            )
            return
        grp, seq, _, _ = max(open_, key=lambda c: c[3])
        kind = "in_collective"
    at = _ops_at(by_rank, grp, seq)
    facts.kind, facts.process_group, facts.seq_id = kind, _pg(grp), seq
    ref = next(iter(at.values()))[1] if at else []
    facts.op = op_name(ref) if ref else None
    for r in grp.members:
        facts.ops.append(
            HangOp(r, "no_dump")
            if r not in by_rank
            else _op_of(at[r][1], "entered", r, from_start, None)
            if r in at
            else HangOp(r, "not_entered")
        )
    facts.waiting_ranks = sorted(at)
    ctx = context(ref[0], from_start) if ref else ""
    if kind == "no_dump":
        missing = sorted(set(grp.members) - set(by_rank))
        facts.summary = (
            f"{ranks_text(missing)} left no dump; {ranks_text(sorted(at))} all entered {facts.op} #{seq}"
            f"{_group_text(grp)}" + (f" ({ctx})" if ctx else "")
        )
        for r in missing:
            facts.culprits.append(
                HangCulprit(r, "no_dump", "left no Flight Recorder dump (crashed, killed, or its dump failed)")
            )
    else:
        states = sorted({o.state for _, ops in at.values() for o in ops})
        facts.summary = (
            f"every rank entered {facts.op} #{seq}{_group_text(grp)}"
            + (f" ({ctx})" if ctx else "")
            + f" and none completed it (states: {', '.join(states)}): stuck inside the collective"
        )
