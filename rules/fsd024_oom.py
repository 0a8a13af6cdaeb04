"""What it detects
    An out-of-memory event recorded in the snapshot.

Why it hurts
    The run crashed (or retried after freeing the cache).

How it shows in a trace
    An ``oom`` entry in the snapshot's ``device_traces``: the requested size, the free device
    memory, and what was allocated at that moment.

Fix
    Depends on what filled memory at that moment (the categories listed in the evidence):
    activation checkpointing for activations, ``expandable_segments`` for fragmentation, more
    sharding for parameters and optimizer state.
"""

from fsdpdoctor.fmt import mib

from ._util import finding

CODE = "FSD024"
SLUG = "oom"
TITLE = "Out of memory"
SEVERITY = "critical"
THRESHOLDS = ()


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.oom:
        return []
    o = m.oom
    cats = sorted(((k, v) for k, v in (o.get("categories") or {}).items() if v), key=lambda kv: -kv[1])[:4]
    evidence = [
        f"requested {mib(o.get('requested_bytes'))}; device free {mib(o.get('device_free_bytes'))}; "
        f"allocated {mib(o.get('allocated_bytes'))}, reserved {mib(o.get('reserved_bytes'))}, cached free {mib(o.get('cached_free_bytes'))}",
        "filled by: " + ", ".join(f"{k} {mib(v)}" for k, v in cats),
    ]
    if o.get("count", 1) > 1:
        evidence.append(f"{o['count']} OOM events recorded; the last is described")
    return [
        finding(
            __name__,
            f"Out of memory requesting {mib(o.get('requested_bytes'))}: {o.get('explanation', '')}.",
            evidence=evidence,
            cause=str(o.get("explanation", "")),
            fix={"any": "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # if fragmentation\n"
                 "apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))  # if activations"},
            confidence=0.9,
        )
    ]
