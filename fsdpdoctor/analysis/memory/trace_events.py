"""Memory from a Kineto trace's ``[memory]`` instant events (``profile_memory=True``).

Each event carries the allocator's ``Total Allocated`` and ``Total Reserved`` after one
allocation or free, per device. Without a snapshot this gives the allocated/reserved curve, the
peak and reserved memory at the peak; categories need the stacks that only a snapshot has.
"""

from __future__ import annotations

import numpy as np

from fsdpdoctor.facts import MemoryFacts
from fsdpdoctor.facts.memory import MemoryDevice
from fsdpdoctor.analysis.memory.curve import downsample

CUDA_DEVICE_TYPE = 1


def memory_from_events(path: str, events: np.ndarray) -> MemoryFacts | None:
    """MemoryFacts of the GPU with the highest allocated peak; None without GPU events (of a
    total allocated of 0 or more).
    ``events`` has the columns of ``ingest.events.MEMORY_COLUMNS``."""
    if events.size == 0:
        return None
    ts, dev_type, dev_id, allocated, reserved = events.T
    # a negative total allocated is no reading of the allocator (the fuzz suite's, not a profiler's)
    gpu = (dev_type == CUDA_DEVICE_TYPE) & (allocated >= 0)
    if not gpu.any():
        return None
    devices, best, best_peak = [], None, -1.0
    for dev in np.unique(dev_id[gpu]):
        m = gpu & (dev_id == dev)
        peak = float(allocated[m].max())
        devices.append(MemoryDevice(device=int(dev), peak_allocated_bytes=int(peak), events=int(m.sum())))
        if peak > best_peak:
            best, best_peak = dev, peak
    m = gpu & (dev_id == best)
    order = np.argsort(ts[m], kind="stable")
    t, a, r = ts[m][order], allocated[m][order], reserved[m][order]
    k = int(np.argmax(a))
    return MemoryFacts(
        source="trace [memory] events",
        path=path,
        device=int(best),
        devices=devices,
        n_events=int(t.size),
        peak_allocated_bytes=int(a[k]),
        reserved_at_peak_bytes=int(r[k]),
        peak_time_us=float(t[k]),
        peak_event_index=k,
        end_allocated_bytes=int(a[-1]),
        end_reserved_bytes=int(r[-1]),
        curve=downsample(t, a, r, "time_us"),
        notes=["from the trace's [memory] events (profile_memory=True): categories need a snapshot (--memory)"],
    )
