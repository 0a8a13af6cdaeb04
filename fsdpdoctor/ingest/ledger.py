"""The input ledger: every event of a trace counted by phase and category, with how many the
analysis read and the time they cover, and a warning when what it did not read looks like GPU
work, profiler steps or communication (under any spelling: ``Kernel``, ``mtia_ccp_events``,
``hccl:all_reduce`` …). Counting is per category code (numpy), never per event in Python.

"Read" is by category: the analysis reads complete (``X``) events of :data:`READ_CATEGORIES`
(after :mod:`.categories` renames the old spellings), ``[memory]`` instant events, and thread-name
metadata. Flows (``s``/``f``) are not read: the launch-to-kernel link they draw is each event's
correlation id, which is read.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

from fsdpdoctor.facts.ledger import InputLedger, LedgerRow
from fsdpdoctor.ingest.categories import canonical_category

#: categories whose complete events the analysis reads (names as read, after canonical_category)
READ_CATEGORIES = frozenset(
    {
        "kernel",
        "gpu_memcpy",
        "gpu_memset",
        "gpu_user_annotation",
        "cuda_runtime",
        "cuda_driver",
        "cpu_op",
        "user_annotation",
    }
)
#: categories of GPU (or other accelerator) work, read or not: CUDA/ROCm kernels, copies and sets,
#: CUPTI counter ranges (``cuda_profiler_range``), MTIA's ``mtia_ccp_events``, XPU/HPU device ops
DEVICE_CAT_RX = re.compile(r"kernel|memcpy|memset|^gpu_|ccp_events|profiler_range|device|^xpu|^hpu", re.I)
DEVICE_WORK_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # read device work (not annotations)
STEP_NAME_RX = re.compile(r"^ProfilerStep#\d+")
#: names of communication under any library's spelling
COMM_NAME_RX = re.compile(
    r"nccl|rccl|hccl|xccl|oneccl|^ccl|gloo|nvshmem|deep_?ep::|dpsk::ep::|^c10d::|record_param_comms|multimem_"
    r"|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|::(?:dispatch|combine|\w*notify)\b",
    re.I,
)
WHY = {
    "s": "flow start: the launch-to-kernel link is read from each event's correlation id",
    "f": "flow end: the launch-to-kernel link is read from each event's correlation id",
    "t": "flow step",
    "i": "instant event (only [memory] ones are read)",
    "C": "counter",
    "Trace": "the profiler's own span over the whole trace",
    "python_function": "Python frames (with_stack): not read",
    "overhead": "the profiler's own overhead",
    "mtia_ccp_events": "MTIA device work (not CUDA kernels): not read",
    "mtia_runtime": "MTIA runtime calls: not read",
    "cuda_profiler_range": "GPU work recorded as CUPTI hardware-counter ranges, not as kernels: not read",
    # analysis.compile_window.WARMUP_EVENTS (canonical_category leaves it as written)
    "torch.compile warm-up steps": "the leading steps that ran torch.compile's one-time work: left out, the "
    "steady steps after them read (compile-in-window)",
}
MIN_SHARE_PCT = 1.0  # unread notable events at or above this share of all notable ones: a warning


def _ms(v: float) -> float:
    return round(float(v) / 1e3, 3)


def trace_ledger(rt) -> InputLedger:
    """The ledger of one :class:`.kineto.RankTrace`."""
    ncat = len(rt.cats)
    counts = np.bincount(rt.cat, minlength=ncat) if len(rt.cat) else np.zeros(ncat, dtype=np.int64)
    durs = np.bincount(rt.cat, weights=rt.dur, minlength=ncat) if len(rt.cat) else np.zeros(ncat)
    # notable complete events by name (profiler steps, communication), per category: one test per distinct name
    names_notable = np.fromiter(
        (STEP_NAME_RX.match(n) is not None or COMM_NAME_RX.search(n) is not None for n in rt.names),
        dtype=bool,
        count=len(rt.names),
    )
    by_name = np.bincount(rt.cat[names_notable.take(rt.name)], minlength=ncat) if len(rt.cat) else counts * 0
    written: dict[str, list[str]] = defaultdict(list)
    for raw, canon in rt.cat_aliases.items():
        written[canon].append(raw)
    rows: list[LedgerRow] = []
    for code, cat in enumerate(rt.cats):
        n = int(counts[code])
        if not n:
            continue
        read = cat in READ_CATEGORIES
        dev = DEVICE_CAT_RX.search(cat) is not None and cat not in ("gpu_user_annotation",)
        rows.append(
            LedgerRow(
                ph="X",
                cat="/".join(written.get(cat, [])) or cat,
                events=n,
                used=n if read else 0,
                read_as=cat if read else None,
                dur_ms=_ms(durs[code]),
                used_ms=_ms(durs[code]) if read else 0.0,
                notable=n if dev else int(by_name[code]),
                why="" if read else WHY.get(cat, "category not read"),
            )
        )
    mem_left = len(rt.memory_events)
    for (ph, cat), n in sorted(rt.other_events.items(), key=lambda kv: (kv[0][0] != "M", -kv[1])):
        used = 0
        if ph == "M":
            used = n  # process and thread names
        elif ph == "i" and mem_left:
            used = min(n, mem_left)
            mem_left -= used
        canon = canonical_category(cat) if cat else cat
        dev = ph == "X" and DEVICE_CAT_RX.search(canon or "") is not None
        rows.append(
            LedgerRow(
                ph=ph,
                cat=cat,
                events=int(n),
                used=used,
                read_as=("metadata" if ph == "M" else "[memory]" if used else None),
                notable=int(n) if dev else 0,
                why="" if used == n else WHY.get(canon if ph == "X" else ph, "not read"),
            )
        )
    led = InputLedger(events=int(rt.event_count), rows=rows)
    led.used = sum(r.used for r in rows)
    led.unread_kinds = [f"{r.ph}/{r.cat or '-'}" for r in rows if r.used == 0]
    led.notable = sum(r.notable for r in rows)
    unread = [r for r in rows if r.used == 0 and r.notable]
    led.unread_notable = sum(r.notable for r in unread)
    led.unread_notable_pct = round(100.0 * led.unread_notable / led.notable, 2) if led.notable else None
    led.device_events = sum(r.events for r in rows if r.read_as in DEVICE_WORK_CATS) + sum(
        r.notable for r in unread if DEVICE_CAT_RX.search(canonical_category(r.cat)) is not None
    )
    if led.unread_notable_pct is not None and led.unread_notable_pct >= MIN_SHARE_PCT:
        kinds = ", ".join(f"{r.notable:,} {r.cat or r.ph}" for r in sorted(unread, key=lambda r: -r.notable)[:3])
        led.warning = (
            f"{led.unread_notable:,} events that look like GPU work, profiler steps or communication "
            f"were not read ({led.unread_notable_pct:.0f}% of such events): {kinds}"
        )
    return led
