"""Findings drawn on the trace: the ranks' Kineto traces merged into one Chrome Trace Event JSON
file (gzipped where the name ends in ``.gz``) that ui.perfetto.dev and chrome://tracing open,
with fsdpdoctor's own tracks beside each rank's events.

- One process per rank, named ``rank N`` (``pid`` = :data:`PID_BASE` + N). The ranks whose
  RankFacts the report writes in full (``--rank-detail``, :meth:`RunFacts.ranks_to_write`) bring
  their raw events, unchanged but for the process id (every event of the rank, CPU and GPU, in
  the rank's process), a thread id where two of the rank's processes used the same one, and the
  flow / async ids (made unique across ranks: ``id × ranks merged + slot``). The original
  process-name metadata is replaced by the rank's; thread names are kept.
- Every rank (merged or not) has fsdpdoctor threads (``tid`` from :data:`TID_BASE`):

  * ``fsdpdoctor waterfall``: each step as a slice over its interval on the step clock
    (``StepFacts.step_ms`` ending at the step's completion; the intervals tile the steps) and,
    inside it, the waterfall parts (``EfficiencyFacts.parts_ms``) end to end. The waterfall is
    measured over the rank's steps, as a mean per step: each step shows that split scaled to the
    step's own time, so the parts' slices, summed over the steps and divided by their number,
    are the rank's parts the JSON report prints (``rank_facts[].efficiency.parts_ms``, the
    summary's ``waterfall_ms``);
  * ``fsdpdoctor exposed comm`` and ``fsdpdoctor GPU idle`` (merged ranks with a GPU): the
    intervals of :mod:`fsdpdoctor.analysis.spans`, each with its collective kind and unit, or
    its idle cause and where it sat (sync site, FSDP hook);
  * one thread per finding (``FSD0xx slug``): a slice over the time its evidence names: the
    rank's steps (``where.rank``), the unit's collectives in each step (``where.unit``, ranks
    with collectives), else every step of the ranks merged; its code, summary, evidence and
    saving in the args.

Size: the raw events of the ranks merged, plus about ten slices per step for every rank: a
1,024-rank run under ``--rank-detail auto`` merges the handful of ranks that matter.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import msgspec

from fsdpdoctor.errors import InputError
from fsdpdoctor.facts.efficiency import PARTS
from fsdpdoctor.report.waterfall import PART_LABEL as WATERFALL_PART_LABEL

PID_BASE = 1_000_000  # rank N is process PID_BASE + N
TID_BASE = 2_000_000_000  # fsdpdoctor's threads: TID_BASE, TID_BASE + 1, … in each rank's process
REMAP_TID_BASE = 1_500_000_000  # a raw thread id another process of the rank already used
CAT = "fsdpdoctor"
PART_LABEL = {**WATERFALL_PART_LABEL, "exposed_comm": "exposed communication"}  # slice names: room to spell out
CAUSE_LABEL = {
    "sync_drain": "a synchronization drained the queue",
    "fsdp_hooks": "FSDP hooks on the CPU",
    "data_loading": "data loading",
    "optimizer_cpu": "the optimizer step's CPU side",
    "launch": "kernel launch",
    "python": "Python and ops",
    "gpu_dependency": "queued behind a dependency",
    "unattributed": "unattributed",
}
_FLOW_PH = frozenset("stfben")  # events whose "id" binds them to others (flows, async slices)
_RANK_META = frozenset({"process_name", "process_labels", "process_sort_index"})
_ENC = msgspec.json.Encoder()


def check_output(output: Path, paths: list[str] | tuple[str, ...]) -> None:
    """Refuse an output inside a folder the input comes from: the merged file is a trace, which the
    next ``analyze`` of that folder would read as a rank. Raises InputError."""
    out = Path(output).expanduser().resolve()
    for p in paths:
        s = str(p)
        if "://" in s and not s.startswith("file://"):
            continue
        s = s.removeprefix("file://")
        cut = min((i for i in (s.find(c) for c in "*?[") if i >= 0), default=-1)
        base = Path(s[:cut] if cut >= 0 else s).expanduser().resolve()
        folder = base if base.is_dir() else base.parent
        if out == base or out.is_relative_to(folder):
            raise InputError(
                output,
                f"is inside the input folder {folder}: a later analyze of that folder would read it as a rank "
                "trace; write it elsewhere",
            )


def write(report, output: Path, rank_detail: str | None = None) -> dict[str, Any]:
    """Write ``report`` as a merged trace to ``output``; returns what was written (ranks, ranks
    merged, events, bytes). Raises InputError when a merged rank's trace cannot be read again."""
    from fsdpdoctor.ingest._io import read_input

    facts = report.facts
    merged, _, _ = facts.ranks_to_write(rank_detail or report.rank_detail)
    merged = sorted(merged, key=lambda r: r.rank)
    detail = {r.rank: r for r in facts.rank_facts}
    summaries = {s.rank: s for s in facts.rank_summaries}
    ranks = sorted(set(summaries) | set(detail))
    windows = {rk: _step_windows(detail.get(rk), summaries.get(rk)) for rk in ranks}
    if not ranks:
        raise InputError(output, "no profiler trace among the inputs: nothing to draw")
    spans = report.spans or {}
    findings = _finding_places(report.findings, facts, windows, [r.rank for r in merged], spans)
    other = {
        "fsdpdoctor": {
            "ranks": len(ranks),
            "ranks_merged": [r.rank for r in merged],
            "rank_detail": rank_detail or report.rank_detail,
            "inputs": [r.path for r in merged],
            "notes": [f"rank {rk}: {n}" for rk, sp in sorted(spans.items()) for n in sp.notes],
        }
    }
    n_events = 0
    opener = gzip.open if str(output).endswith(".gz") else open
    try:
        with opener(output, "wb") as fh:
            fh.write(b'{"displayTimeUnit":"ms","otherData":' + _ENC.encode(other) + b',"traceEvents":[')
            first = True

            def emit(events: list) -> None:
                nonlocal first, n_events
                if not events:
                    return
                body = _ENC.encode(events)[1:-1]
                fh.write(body if first else b"," + body)
                first = False
                n_events += len(events)

            for rk in ranks:
                emit(_rank_track(rk, windows[rk], detail.get(rk), summaries.get(rk), spans.get(rk), findings.get(rk)))
            for slot, rf in enumerate(merged):
                doc = msgspec.json.decode(read_input(rf.path, "trace"))
                raw = doc.get("traceEvents") if isinstance(doc, dict) else doc
                if not isinstance(raw, list):
                    raise InputError(rf.path, "no traceEvents list to merge")
                emit(_remapped(raw, rf.rank, slot, len(merged)))
                del doc, raw
            fh.write(b"]}\n")
    except OSError as exc:
        raise InputError(output, f"cannot write output ({exc.strerror or exc})") from None
    except msgspec.DecodeError as exc:
        raise InputError(output, f"a merged trace is not valid JSON ({exc})") from None
    return {
        "ranks": len(ranks),
        "merged": [r.rank for r in merged],
        "events": n_events,
        "bytes": Path(output).stat().st_size,
    }


# -- fsdpdoctor's tracks ---------------------------------------------------------------------


def _step_windows(rf, summary) -> list[tuple[int, float, float]]:
    """(step number, start µs, end µs) of each step on the step clock: the intervals of
    :func:`fsdpdoctor.analysis.efficiency.step_windows` (``step_ms`` ending at the completions,
    or at the CPU spans' ends where the step clock is the CPU's), read from RankFacts; for a rank
    kept as its summary only, its step times laid end to end up to its last completion."""
    if rf is not None and rf.steps:
        st = rf.steps
        t = [s.step_ms * 1e3 for s in st]
        cpu_end, m = [], float("-inf")
        for s in st:
            m = max(m, s.start_us + s.cpu_span_ms * 1e3)
            cpu_end.append(m)
        prev = min(st[0].start_us, cpu_end[0])
        cpu = []
        for e in cpu_end:
            cpu.append(e - prev)
            prev = e
        on_cpu = all(abs(a - b) <= 1e-6 + 1e-9 * abs(b) for a, b in zip(t, cpu))
        ends = cpu_end if on_cpu else [s.end_us if s.end_us is not None else e for s, e in zip(st, cpu_end)]
        return [(s.number, e - d, e) for s, d, e in zip(st, t, ends)]
    if summary is None or summary.mean_step is None or not summary.step_times_ms:
        return []
    end = summary.mean_step.end_us
    if end is None:
        return []
    nums = summary.step_numbers or list(range(len(summary.step_times_ms)))
    out = []
    for num, ms in zip(reversed(nums), reversed(summary.step_times_ms)):
        out.append((num, end - ms * 1e3, end))
        end -= ms * 1e3
    return out[::-1]


def _x(pid: int, tid: int, name: str, a: float, b: float, args: dict | None = None) -> dict:
    ts = round(a, 3)
    ev = {"ph": "X", "cat": CAT, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": round(round(b, 3) - ts, 3)}
    if args:
        ev["args"] = args
    return ev


def _meta(pid: int, tid: int | None, name: str, args: dict) -> dict:
    ev = {"ph": "M", "name": name, "pid": pid, "args": args}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _rank_track(rank: int, windows, rf, summary, spans, findings) -> list[dict]:
    pid = PID_BASE + rank
    ev = [
        _meta(pid, None, "process_name", {"name": f"rank {rank}"}),
        _meta(pid, None, "process_sort_index", {"sort_index": rank}),
    ]
    threads = ["fsdpdoctor waterfall"]
    if spans is not None:
        threads += ["fsdpdoctor exposed comm", "fsdpdoctor GPU idle"]
    threads += [f"fsdpdoctor {f.code} {f.slug}" for f, _ in findings or []]
    for j, name in enumerate(threads):
        ev.append(_meta(pid, TID_BASE + j, "thread_name", {"name": name}))
        ev.append(_meta(pid, TID_BASE + j, "thread_sort_index", {"sort_index": -1000 + j}))
    # the waterfall: the rank's mean split, scaled to each step
    eff = rf.efficiency if rf is not None and rf.efficiency is not None else None
    parts = dict(eff.parts_ms) if eff is not None else dict(summary.waterfall_ms) if summary is not None else {}
    total = sum(v for v in parts.values() if v > 0)  # a negative unattributed part: the others over-count
    over = -parts.get("unattributed", 0.0) if parts.get("unattributed", 0.0) < 0 else 0.0
    tid = TID_BASE
    clock = {s.number: s.clock_parts_ms for s in rf.steps} if rf is not None else {}
    for num, a, b in windows:
        args = {"step_ms": round((b - a) / 1e3, 6)}
        if clock.get(num):
            args["step_clock_ms"] = {k: round(v, 6) for k, v in clock[num].items()}
        if total <= 0:
            args["waterfall"] = "none: no GPU work measured on this rank"
        if over:
            args["unattributed_ms"] = round(-over, 6)  # the parts over-count the step by this much
        ev.append(_x(pid, tid, f"step {num}", a, b, args))
        if total <= 0:
            continue
        scale = (b - a) / (total * 1e3)
        t = a
        for k, part in enumerate(PARTS):
            ms = parts.get(part, 0.0)
            if ms <= 0:
                continue
            end = b if all(parts.get(p, 0.0) <= 0 for p in PARTS[k + 1 :]) else t + ms * 1e3 * scale
            ev.append(
                _x(
                    pid,
                    tid,
                    PART_LABEL[part],
                    t,
                    end,
                    {
                        "part": part,
                        "rank_ms_per_step": round(ms, 6),
                        "basis": "the rank's waterfall (mean per step) scaled to this step's time",
                    },
                )
            )
            t = end
    if spans is not None:
        for s in spans.exposed:
            args = {"kind": s.label, "step": s.step}
            if s.detail:
                args["unit"] = s.detail
            ev.append(_x(pid, TID_BASE + 1, f"exposed {s.label}", s.start_us, s.end_us, args))
        for s in spans.idle:
            args = {"cause": s.label, "step": s.step}
            if s.detail:
                args["where"] = s.detail
            ev.append(
                _x(pid, TID_BASE + 2, f"GPU idle: {CAUSE_LABEL.get(s.label, s.label)}", s.start_us, s.end_us, args)
            )
    for j, (f, places) in enumerate(findings or []):
        tid = TID_BASE + (3 if spans is not None else 1) + j
        args = {
            "code": f.code,
            "slug": f.slug,
            "severity": f.severity,
            "summary": f.summary,
            "saving_ms_per_step": f.est_saving_ms,
            "saving_range_ms": f.saving_range_ms,
            "saving_pct_of_step": f.saving_pct_of_step,
            "saving_basis": f.saving_basis or None,
            "evidence": list(f.evidence),
            "where": {k: v for k, v in f.where.items() if isinstance(v, (str, int, float, bool))},
        }
        if f.folded_into:
            args["folded_into"] = f.folded_into
        args = {k: v for k, v in args.items() if v is not None}
        for a, b, over in places:
            ev.append(_x(pid, tid, f"{f.code} {f.slug}", a, b, {**args, "over": over}))
    return ev


def _finding_places(findings, facts, windows, merged: list[int], spans: dict) -> dict[int, list]:
    """rank → [(finding, [(start, end, what the slice covers)])]: where each finding is drawn.

    Over what its ``where`` names: the GPU idle a hook (``unit`` and ``hook``) or a sync
    ``site`` caused (each idle piece attributed to it, on the ranks merged); a ``rank``'s steps;
    a ``unit``'s collectives; else every step of the ranks merged."""
    out: dict[int, list] = {}
    detail = {r.rank: r for r in facts.rank_facts}

    def steps_of(rk: int) -> list:
        w = windows.get(rk) or []
        return [(w[0][1], w[-1][2], f"the rank's {len(w)} step{'s' if len(w) != 1 else ''}")] if w else []

    fallback = merged or ([min(windows)] if windows else [])
    for f in findings:
        where = f.where or {}
        rank, unit, hook, site = (where.get(k) for k in ("rank", "unit", "hook", "site"))
        cited = f"{unit or '(root)'} {hook}" if isinstance(unit, str) and isinstance(hook, str) else site
        places = {}
        if isinstance(cited, str):
            for rk in merged:
                idle = spans[rk].idle if rk in spans else []
                places[rk] = [(s.start_us, s.end_us, f"GPU idle at {cited}") for s in idle if s.detail == cited]
        if not any(places.values()) and isinstance(rank, int) and not isinstance(rank, bool) and rank in windows:
            places = {rank: steps_of(rank)}
        if not any(places.values()) and isinstance(unit, str):
            places = {rk: _unit_ranges(detail.get(rk), unit) for rk in merged}
        if not any(places.values()):
            places = {rk: steps_of(rk) for rk in fallback}
        for rk, pl in places.items():
            if pl:
                out.setdefault(rk, []).append((f, pl))
    return out


def _unit_ranges(rf, unit: str) -> list:
    """Per step, from the first to the last GPU kernel of ``unit``'s collectives."""
    if rf is None:
        return []
    by_step: dict[int, list[float]] = {}
    for c in rf.collectives:
        if c.gpu_start_us is None or c.step < 0 or c.unit is None or c.unit != ("" if unit == "(root)" else unit):
            continue
        lo_hi = by_step.setdefault(c.step, [c.gpu_start_us, c.gpu_start_us + (c.gpu_dur_us or 0.0)])
        lo_hi[0] = min(lo_hi[0], c.gpu_start_us)
        lo_hi[1] = max(lo_hi[1], c.gpu_start_us + (c.gpu_dur_us or 0.0))
    return [
        (a, b, f"unit {unit or '(root)'}'s collectives in step index {k}")
        for k, (a, b) in sorted(by_step.items())
        if b > a
    ]


# -- the raw events ------------------------------------------------------------------------


def _remapped(raw: list, rank: int, slot: int, n_merged: int) -> list:
    """The rank's events in its process: ``pid`` replaced, a ``tid`` another of its processes
    used already moved to a fresh one, flow / async ids made unique across the ranks merged, the
    original process metadata dropped. The events are changed in place."""
    pid = PID_BASE + rank
    tids: dict[tuple, Any] = {}
    used: set = set()
    fresh = REMAP_TID_BASE
    out = []
    for e in raw:
        if not isinstance(e, dict):
            continue
        ph = e.get("ph")
        if ph == "M" and e.get("name") in _RANK_META:
            continue
        key = (_hashable(e.get("pid")), _hashable(e.get("tid")))
        tid = tids.get(key)
        if tid is None:
            tid = key[1]
            if tid in used or not isinstance(tid, int) or isinstance(tid, bool):
                tid, fresh = fresh, fresh + 1
            used.add(tid)
            tids[key] = tid
        e["pid"] = pid
        if "tid" in e or ph != "M":
            e["tid"] = tid
        if ph in _FLOW_PH and "id" in e:
            i = e["id"]
            e["id"] = i * n_merged + slot if isinstance(i, int) and not isinstance(i, bool) else f"{i}@rank{rank}"
        out.append(e)
    return out


def _hashable(v: Any) -> Any:
    return v if isinstance(v, (int, str, float, type(None))) else repr(v)
