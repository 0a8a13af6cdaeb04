"""The capture sidecar (``fsdpdoctor_meta.json``, written by :mod:`fsdpdoctor.capture`).

It says what a trace cannot: sharding strategy, prefetch and offload settings, unit FQNs for
FSDP1, versions. It is optional; a broken sidecar is reported as a note, never fatal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest._io import read_input, short

SIDECAR_NAME = "fsdpdoctor_meta.json"


def find_sidecar(trace_files: list[Path | str]) -> Path | str | None:
    """The sidecar beside the traces (the first directory holding one); for URLs (see
    :mod:`.remote`) the sidecar's URL."""
    from fsdpdoctor.ingest import remote

    for d in dict.fromkeys(p.rsplit("/", 1)[0] if remote.is_url(p) else Path(p).resolve().parent for p in trace_files):
        if isinstance(d, str):
            cand_url = f"{d}/{SIDECAR_NAME}"
            if remote.size(cand_url) > 0:
                return cand_url
            continue
        cand = d / SIDECAR_NAME
        if cand.is_file():
            return cand
    return None


def _read(path: Path | str) -> bytes:
    """Local or URL, within the byte limits of every input (a sidecar is a few KB)."""
    return read_input(path, "sidecar file")


def load_sidecar(path: Path | str) -> tuple[dict[str, Any] | None, str | None]:
    """(sidecar, None) or (None, reason it was ignored)."""
    try:
        data = msgspec.json.decode(_read(path))
    except InputError as exc:
        return None, f"{exc}; ignored"
    except (OSError, msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        return None, f"{path}: ignored, not readable JSON ({short(exc)})"
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("fsdpdoctor.meta/"):
        return None, f"{path}: ignored, not a fsdpdoctor sidecar (no 'schema': 'fsdpdoctor.meta/N')"
    return data, None
