"""Kineto event categories across eras: the names the analysis reads (today's, lowercase) and the
ones older profilers wrote for the same events.

Torch 1.8-1.9 traces (2020-21, the TensorBoard plugin's era) capitalise them: ``Operator``
(``ProfilerStep#N`` is one), ``Kernel``, ``Memcpy``, ``Memset``, ``Runtime``, ``Python``. Kineto
renamed them ``cpu_op``, ``kernel``, ``gpu_memcpy``, ``gpu_memset``, ``cuda_runtime``,
``python_function`` (the TensorBoard plugin maps them the same way, by lowercased name). Reading
them under today's names gives a 2021 trace the same facts as a current one; the input ledger
(:mod:`.ledger`) still shows each category as written.
"""

from __future__ import annotations

import numpy as np

#: the categories of current Kineto traces (torch >= 1.10), as the analysis reads them
CURRENT = frozenset(
    {
        "cpu_op",
        "user_annotation",
        "gpu_user_annotation",
        "gpu_memcpy",
        "gpu_memset",
        "kernel",
        "cuda_runtime",
        "cuda_driver",
        "python_function",
        "cpu_instant_event",
        "overhead",
    }
)
#: older names (lowercased) -> today's
LEGACY = {
    "operator": "cpu_op",
    "runtime": "cuda_runtime",
    "memcpy": "gpu_memcpy",
    "memset": "gpu_memset",
    "python": "python_function",
}


def canonical_category(cat: str) -> str:
    """The name the analysis reads ``cat`` under (itself when it is current or unknown)."""
    if cat in CURRENT:
        return cat
    low = cat.lower()
    if low in CURRENT:
        return low
    return LEGACY.get(low, cat)


def canonical_categories(codes: np.ndarray, cats: list[str]) -> tuple[np.ndarray, list[str], dict[str, str]]:
    """(codes, categories, {as written: as read}) with every category under its current name;
    two written names of one category (``Kernel`` and ``kernel``) become one code. A trace whose
    categories are all current (every trace since 2021) comes back as it was, at no cost."""
    new = [canonical_category(c) for c in cats]
    if new == cats:
        return codes, cats, {}
    aliases = {c: n for c, n in zip(cats, new) if c != n}
    out: list[str] = []
    remap = np.empty(len(new), dtype=np.int32)
    for i, n in enumerate(new):
        if n not in out:
            out.append(n)
        remap[i] = out.index(n)
    return (remap[codes] if len(codes) else codes), out, aliases
