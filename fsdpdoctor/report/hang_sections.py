"""The hang's headline and table: what the Flight Recorder dumps say (part of :mod:`.sections`)."""

from __future__ import annotations

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.fmt import rank_list, ranks_text, seconds
from fsdpdoctor.report.tables import Table


def hang_headline(f: RunFacts) -> list[tuple[str, str]]:
    """The hang's lines, first in every report: what is stuck and who is to blame, then the dumps."""
    h = f.hang
    if h is None:
        return []
    dumps = (
        f"{h.dumps} Flight Recorder dump{'s' if h.dumps != 1 else ''} · {h.backend or 'no collectives'} · "
        f"version {', '.join(h.versions)}" + (f" · world size {h.world_size}" if h.world_size else "")
    )
    if h.ranks_without_dump:
        dumps += f" · no dump from {ranks_text(h.ranks_without_dump)}"
    if h.kind == "none":
        return [("Hang", "none found: " + h.summary), ("Dumps", dumps)]
    lines = [("Hang", h.summary)]
    if h.culprits:
        lines.append(
            (
                "Culprits",
                "; ".join(f"rank {c.rank} ({c.kind})" for c in h.culprits[:6])
                + (f"; … {len(h.culprits) - 6} more" if len(h.culprits) > 6 else ""),
            )
        )
    if h.caveat:
        lines.append(("Caveat", h.caveat))
    return lines + [("Dumps", dumps)]


def hang_table(f: RunFacts) -> Table | None:
    """What each rank ran at the stuck collective, ranks with the same row together."""
    h = f.hang
    if h is None or not h.ops:
        return None
    rows: dict[tuple, list[int]] = {}
    for o in h.ops:
        coll = ""
        if o.op:
            coll = (
                f"{o.op} "
                + "+".join(str(list(x)) for x in o.input_sizes)
                + " "
                + "/".join(dict.fromkeys(o.input_dtypes))
            )
        said = ", ".join(
            x for x in (o.fsdp, f"{o.phase} of step {o.step}" if o.step is not None else o.phase, o.call_site) if x
        )
        key = (
            o.status.replace("_", " "),
            coll.strip(),
            o.state or "",
            seconds(o.late_s) if o.late_s is not None else "",
            said,
        )
        rows.setdefault(key, []).append(o.rank)
    pg = h.process_group
    title = (
        f"Hang: what each rank ran at #{h.seq_id} of {pg.desc or pg.name} (ranks {rank_list(pg.ranks)})"
        if pg
        else "Hang"
    )
    return Table(
        title,
        ["ranks", "status", "collective", "state", "late", "what its stack says"],
        [[rank_list(rs), *k] for k, rs in sorted(rows.items(), key=lambda kv: kv[1][0])],
        note="state as recorded (gloo records none: every entry 'scheduled'); step: forward pass, counted from 1",
    )
