"""The capture sidecar (``fsdpdoctor_meta.json``, written by :mod:`fsdpdoctor.capture`).

It says what a trace cannot: sharding strategy, prefetch and offload settings, unit FQNs for
FSDP1, versions. It is optional; a broken sidecar is reported as a note, never fatal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from ..errors import InputError
from ._io import read_input, short

SIDECAR_NAME = "fsdpdoctor_meta.json"


def find_sidecar(trace_files: list[Path]) -> Path | None:
    """The sidecar beside the traces (the first directory holding one)."""
    for d in dict.fromkeys(p.resolve().parent for p in trace_files):
        cand = d / SIDECAR_NAME
        if cand.is_file():
            return cand
    return None


def load_sidecar(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(sidecar, None) or (None, reason it was ignored)."""
    try:
        data = msgspec.json.decode(read_input(path, "sidecar file"))
    except InputError as exc:
        return None, f"{exc}; ignored"
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        return None, f"{path}: ignored, not readable JSON ({short(exc)})"
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("fsdpdoctor.meta/"):
        return None, f"{path}: ignored, not a fsdpdoctor sidecar (no 'schema': 'fsdpdoctor.meta/N')"
    return data, None
