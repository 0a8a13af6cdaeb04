"""Turn the user's PATH arguments (files, directories, globs) into an ordered list of trace files."""

from __future__ import annotations

import glob
import os
import stat
from pathlib import Path

from ..errors import InputError
from . import fs

TRACE_PATTERNS = ("*.json", "*.json.gz")
# JSON files that sit next to traces but are not traces.
NOT_TRACES = {"fsdpdoctor_meta.json", "truth.json"}


def _is_trace_name(p: Path) -> bool:
    n = p.name
    if n in NOT_TRACES or n.endswith(".meta.json"):
        return False
    return n.endswith(".json") or n.endswith(".json.gz")


def discover(paths: list[str | Path]) -> list[Path | str]:
    """Trace files named by ``paths``, in a stable order, without duplicates.

    A directory contributes every ``*.json`` / ``*.json.gz`` directly inside it (not recursively);
    a pattern with ``*?[`` is expanded as a glob; anything else must be an existing file.
    URLs (``s3://``, ``gs://``, ``http(s)://``, ``memory://``...; see :mod:`.fs`) are expanded
    the same way through fsspec and come back as URL strings; ``file://`` URLs as local Paths.
    """
    out: list[Path | str] = []
    for raw in paths:
        raw = fs.localize(raw)
        if fs.is_url(raw):
            out.extend(fs.expand_url(str(raw), lambda n: _is_trace_name(Path(n))))
            continue
        s = str(raw)
        p = Path(s)
        try:
            st = os.stat(p)
        except PermissionError:
            raise InputError(p, "permission denied") from None
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            try:
                found = sorted(q for q in p.iterdir() if q.is_file() and _is_trace_name(q))
            except PermissionError:
                raise InputError(p, "permission denied (cannot list the directory)") from None
            except OSError as exc:
                raise InputError(p, f"cannot list the directory ({exc.strerror or exc})") from None
            if not found:
                raise InputError(p, "directory contains no trace files (*.json, *.json.gz)")
            out.extend(found)
        elif st is not None:
            out.append(p)  # not a regular file? the reader says so, by stat, before opening
        elif any(ch in s for ch in "*?["):
            found = sorted(Path(q) for q in glob.glob(s) if Path(q).is_file())
            if not found:
                raise InputError(s, "pattern matches no files")
            out.extend(found)
        else:
            raise InputError(p, "no such file or directory")
    seen: set[Path | str] = set()
    unique = []
    for p in out:
        key = p if isinstance(p, str) else p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    if not unique:
        raise InputError(" ".join(map(str, paths)) or "(no paths)", "no trace files given")
    return unique
