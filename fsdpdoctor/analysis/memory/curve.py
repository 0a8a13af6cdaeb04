"""The allocated / reserved curve the reports draw, from a snapshot's replay or a trace's
``[memory]`` events alike: at most ``CURVE_POINTS`` points, each bucket's highest, so that the
peak of every step survives, not only the global one."""

from __future__ import annotations

import numpy as np

from fsdpdoctor.facts.memory import MemoryCurve

CURVE_POINTS = 500


def downsample(x: np.ndarray, alloc: np.ndarray, reserved: np.ndarray | None, x_unit: str) -> MemoryCurve:
    n = len(alloc)
    if n <= CURVE_POINTS:
        idx = np.arange(n)
    else:  # per bucket keep the highest point, so the peak survives
        bounds = np.linspace(0, n, CURVE_POINTS + 1).astype(np.int64)
        idx = np.array(
            [lo + int(np.argmax(alloc[lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]
        )
    return MemoryCurve(
        x_unit=x_unit,
        x=[float(v) if x_unit == "time_us" else int(v) for v in x[idx]],
        allocated=[int(v) for v in alloc[idx]],
        reserved=[int(v) for v in reserved[idx]] if reserved is not None else [None] * len(idx),
    )
