"""What it detects
    Memory reserved by the caching allocator but unusable: cached free blocks too fragmented
    for the requests that follow, up to an OOM with enough free memory in total.

Why it hurts
    Reserved-but-free memory counts against the device like allocated memory; large requests
    fail when no single cached block is big enough.

How it shows in a trace
    Reserved much larger than allocated at the peak, many free blocks inside segments; an OOM
    whose requested size is below the total cached free memory but above the largest free block.

    The snapshot's ``allocator_settings`` (torch >= 2.3) say whether expandable segments are
    already on, and the maximum split size and garbage-collection threshold in force.

Fix
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lets segments grow in place instead of
    fragmenting into fixed-size segments. When it is already on, what remains is free space
    between live blocks of the mapped pages: release the cache between phases
    (``garbage_collection_threshold``) and make the large requests uniform.

Known problems
    Every cached free block at the peak counts as fragmented, though a later request of its size
    would reuse it: the bytes are an upper bound on what expandable segments recover. The state is
    judged at the allocated peak (and at an OOM), not at other moments. On the committed and public
    snapshots the cached free memory at the peak is 76.9 to 822.9 MiB (18% of the 4.42 GiB reserved
    on the H200 GPT-2 run), under ``fragmentation_min_mib``: it has not fired on a real snapshot.
"""

from fsdpdoctor.fmt import mib, pct

from ._util import finding

CODE = "FSD022"
SLUG = "allocator-fragmentation"
TITLE = "Caching-allocator fragmentation"
SEVERITY = "warning"
MEMORY_ADVICE = True  # a warning only under memory pressure (engine.judge_pressure)
THRESHOLDS = ("fragmentation_pct", "fragmentation_min_mib")

TURN_ON = (
    "# before the first CUDA allocation (e.g. in the launch script)\n"
    "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
ALREADY_ON = """# expandable_segments is already on (the snapshot's allocator_settings): the free space left
# sits between live blocks. Let the allocator release cached blocks before it runs short, and
# keep the largest requests one size (pad or bucket sequence lengths):
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.8"""


def check(facts, cfg):
    m = facts.memory
    if m is None:
        return []
    ext = m.external_fragmentation_bytes or 0
    res = m.reserved_at_peak_bytes or 0
    oom_frag = m.oom is not None and m.oom.cause == "fragmentation"
    big = res and 100 * ext / res >= cfg["fragmentation_pct"] and ext >= cfg["fragmentation_min_mib"] * 2**20
    if not (oom_frag or big):
        return []
    evidence = [
        f"cached free blocks {mib(ext)} = {pct(100 * ext / res) if res else '–'} of {mib(res)} reserved at the peak"
    ]
    st = m.allocator_settings
    on = bool(st and st.expandable_segments)
    if st is not None:
        evidence.append(
            f"allocator settings: expandable_segments {'on' if on else 'off'}, max split size "
            f"{mib(st.max_split_size_bytes) if st.max_split_size_bytes else 'unlimited'}, garbage collection threshold "
            f"{st.garbage_collection_threshold or 'off'}"
        )
    if oom_frag:
        o = m.oom
        evidence.append(
            f"OOM: requested {mib(o.requested_bytes)}, cached free {mib(o.cached_free_bytes)}, "
            f"largest free block {mib(o.largest_cached_free_block_bytes)}"
        )
    return [
        finding(
            __name__,
            f"{mib(ext)} of reserved memory sits in fragmented free blocks"
            + (" and caused the OOM" if oom_frag else "")
            + ("; expandable_segments is already on." if on else "."),
            evidence=evidence,
            cause=(
                "free space between live blocks of expandable segments (already on)"
                if on
                else "variable-size allocations split the allocator's fixed segments"
            ),
            fix={"any": ALREADY_ON if on else TURN_ON},
            confidence=0.8 if oom_frag else 0.6,
            severity="critical" if oom_frag else SEVERITY,
            est_saving_bytes=ext,
        )
    ]
