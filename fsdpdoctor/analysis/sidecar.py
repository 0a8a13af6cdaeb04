"""Merge the capture sidecar into RunFacts: fill what the trace could not tell, name FSDP1
units, and note where the two disagree. Every fact records its source ("trace"/"sidecar")."""

from __future__ import annotations

from typing import Any

from fsdpdoctor.facts import RunFacts

_PREFETCH = {
    "implicit": "BACKWARD_PRE",  # FSDP2's default prefetch is the BACKWARD_PRE analogue
    "explicit": "BACKWARD_PRE",
    "backward_pre": "BACKWARD_PRE",
    "backward_post": "BACKWARD_POST",
    "none": "NONE",
    "disabled": "NONE",
}


def _prefetch(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("mode")
    if v is None:
        return None
    return _PREFETCH.get(str(v).lower(), str(v).upper())


def apply_sidecar(facts: RunFacts, side: dict[str, Any]) -> None:
    facts.sidecar = {k: v for k, v in side.items() if k != "units"} | {"unit_count": len(side.get("units") or [])}
    fs = facts.fsdp
    notes = facts.notes

    def fill(name: str, trace_value: Any, side_value: Any, set_value) -> None:
        if side_value is None:
            return
        if trace_value is None:
            set_value(side_value)
            fs.sources[name] = "sidecar"
        elif trace_value != side_value:
            notes.append(f"{name}: the trace shows {trace_value}, the sidecar says {side_value}; reporting the trace")

    sv = side.get("fsdp_version")
    if fs.version is None and sv in (1, 2):
        notes.append(f"sidecar says FSDP{sv} but the trace has no FSDP labels")
    fill(
        "backward_prefetch",
        fs.backward_prefetch,
        _prefetch(side.get("backward_prefetch")),
        lambda v: setattr(fs, "backward_prefetch", v),
    )
    fwd = side.get("forward_prefetch")
    fwd_bool = fwd if isinstance(fwd, bool) else None  # FSDP2 "implicit" says nothing explicit
    fill("forward_prefetch", fs.forward_prefetch, fwd_bool, lambda v: setattr(fs, "forward_prefetch", v))
    raf = side.get("reshard_after_forward")
    fill(
        "reshard_after_forward",
        fs.reshard_after_forward,
        raf if isinstance(raf, bool) else None,
        lambda v: setattr(fs, "reshard_after_forward", v),
    )
    if side.get("cpu_offload") and not fs.cpu_offload.detected:
        fs.cpu_offload.detected = True
        fs.cpu_offload.evidence = "sidecar: CPU offload enabled" + (
            "" if facts.gpu_present else " (no GPU in this run, so no copies to measure)"
        )
        fs.sources["cpu_offload"] = "sidecar"
    mp = side.get("mixed_precision")
    if fs.mixed_precision is None and isinstance(mp, dict) and mp.get("param_dtype"):
        fs.mixed_precision = str(mp["param_dtype"]) in ("bfloat16", "float16", "torch.bfloat16", "torch.float16")
        fs.sources["mixed_precision"] = "sidecar"
    if side.get("sharding_strategy"):
        fs.sharding_strategy = str(side["sharding_strategy"])
        fs.sources["sharding_strategy"] = "sidecar"
    _name_units(facts, side.get("units") or [])


def _name_units(facts: RunFacts, side_units: list[dict[str, Any]]) -> None:
    """Units found by order (FSDP1, torch-2.4 FSDP2) get their FQNs from the sidecar, matched
    by all-gather size; equal sizes are taken in sidecar order."""
    fs = facts.fsdp
    if not fs.units or not side_units or any(u.named for u in fs.units):
        return
    pool = [(su.get("all_gather_numel"), su.get("fqn", "")) for su in side_units]
    renamed = {}
    for u in fs.units:
        for k, (numel, fqn) in enumerate(pool):
            if numel is not None and numel == u.unsharded_numel:
                renamed[u.fqn] = fqn
                pool.pop(k)
                break
    if len(renamed) != len(fs.units):
        if len(side_units) == len(fs.units):  # sizes unknown: fall back to order
            renamed = {u.fqn: su.get("fqn", "") for u, su in zip(fs.units, side_units)}
        else:
            facts.notes.append(
                f"sidecar lists {len(side_units)} units, the trace shows {len(fs.units)}: unit names not applied"
            )
            return
    for u in fs.units:
        u.fqn, u.named = renamed[u.fqn], True
    for r in facts.rank_facts:
        for c in r.collectives:
            if c.unit in renamed:
                c.unit = renamed[c.unit]
    for sk in facts.cross_rank.top_skew if facts.cross_rank is not None else []:
        if sk.unit in renamed:
            sk.unit = renamed[sk.unit]
    fs.unit_source += "; FQNs from the sidecar, matched by all-gather size"
    fs.sources["units"] = "sidecar"
