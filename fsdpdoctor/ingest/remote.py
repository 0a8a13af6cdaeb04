"""Trace paths through fsspec: ``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``,
``file://`` and plain local paths, as files, directories or globs.

Local paths (and ``file://`` URLs, which become local paths) never go through fsspec: they keep
``open()``, ``os.pread`` and the parallel block decoder. Anything else with a ``scheme://`` is a
URL string (never a :class:`~pathlib.Path`, which would fold ``//``) opened with
``fsspec.open``; the block decoder streams it chunk by chunk just as it streams a local file.

The cloud back-ends are optional extras (``pip install fsdpdoctor[s3]`` / ``[gcs]`` /
``[azure]``; ``http(s)://`` needs ``aiohttp``); a missing one is an :class:`InputError` naming
the package to install.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import IO, Any

from fsdpdoctor.errors import InputError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

# scheme → the package that provides it (for the error when it is missing)
_BACKENDS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
}


def scheme(path: str | Path) -> str | None:
    """The URL scheme of ``path`` (``"s3"``, ``"memory"``...), None for a plain local path."""
    if isinstance(path, Path):
        return None
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def is_url(path: str | Path) -> bool:
    """True when ``path`` is read through fsspec (a URL other than ``file://``)."""
    s = scheme(path)
    return s is not None and s != "file"


def localize(path: str | Path) -> str | Path:
    """``file://`` URLs as local path strings; everything else unchanged."""
    if scheme(path) == "file":
        import fsspec.implementations.local as local

        return local.make_path_posix(str(path)[len("file://") :])
    return path


def name(path: str | Path) -> str:
    """The last component of a path or URL (``rank3.json.gz``)."""
    s = str(path).rstrip("/")
    return s.rsplit("/", 1)[-1] if is_url(s) else Path(s).name


def _filesystem(url: str):
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        pkg = _BACKENDS.get(scheme(url) or "", "the fsspec back-end")
        raise InputError(
            url, f"reading {scheme(url)}:// needs the '{pkg}' package ({exc.msg if hasattr(exc, 'msg') else exc})"
        ) from None
    except ValueError as exc:  # unknown protocol
        raise InputError(url, f"cannot read this URL ({exc})") from None
    return fs, root


# Packages whose exceptions are I/O or back-end failures of a remote read (network, HTTP, auth,
# cloud SDKs): those make a URL input unreadable. Anything else raised while analysing is a bug.
_BACKEND_PACKAGES = frozenset(
    {
        "fsspec",
        "aiohttp",
        "requests",
        "urllib3",
        "http",
        "ssl",
        "socket",
        "botocore",
        "boto3",
        "s3fs",
        "aiobotocore",
        "gcsfs",
        "google",
        "adlfs",
        "azure",
        "huggingface_hub",
    }
)


def is_backend_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an I/O or storage back-end error (not a bug of the analysis)."""
    if isinstance(exc, (OSError, EOFError)):
        return True
    return any(k.__module__.split(".")[0] in _BACKEND_PACKAGES for k in type(exc).__mro__)


def problem(exc: BaseException) -> str:
    """One line for an error a back-end raised while opening or reading a URL."""
    status = getattr(exc, "status", None)  # aiohttp's ClientResponseError (HTTP status)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return "no such file"
    if status in (401, 403):
        return "permission denied"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, expected a trace file"
    msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return f"cannot read ({type(exc).__name__}: {msg})"


def open_url(url: str) -> tuple[IO[bytes], int]:
    """(binary file object, size in bytes or 0 when the server does not say) for a URL."""
    fs, root = _filesystem(url)
    try:
        fh: Any = fs.open(root, "rb")
    except Exception as exc:  # noqa: BLE001 - every back-end has its own errors: one line each
        raise InputError(url, problem(exc)) from None
    size = getattr(fh, "size", None)
    if not isinstance(size, int):
        try:
            size = int(fs.size(root) or 0)
        except Exception:  # noqa: BLE001 - size only feeds the progress bar
            size = 0
    return fh, size


def size(path: str | Path) -> int:
    """Bytes of a local file or URL (0 when unknown); feeds the progress bar only."""
    path = localize(path)
    try:
        if is_url(path):
            fs, root = _filesystem(str(path))
            return int(fs.size(root) or 0)
        return Path(path).stat().st_size
    except Exception:  # noqa: BLE001 - unknown size only makes the bar less precise
        return 0


def listing(url: str) -> list[str] | None:
    """The one listing of a URL: the objects directly in a directory, or those a glob matches,
    as full URLs, sorted; None when the URL names one object (or nothing). The store's errors are
    one InputError line."""
    fs, root = _filesystem(url)
    proto = scheme(url) or ""

    def full(p: str) -> str:
        return p if scheme(p) else fs.unstrip_protocol(p) if proto not in ("http", "https") else p

    try:
        if any(ch in root for ch in "*?[") and proto not in ("http", "https"):
            return sorted(full(p) for p in fs.glob(root) if fs.isfile(p))
        if fs.isdir(root):
            return sorted(full(p) for p in fs.ls(root, detail=False) if fs.isfile(p))
        return None if fs.exists(root) else []
    except Exception as exc:  # noqa: BLE001
        raise InputError(url, problem(exc)) from None


def expand_url(url: str, is_trace_name) -> list[str]:
    """The trace files a URL names: a file, a directory (its direct children that
    ``is_trace_name`` accepts) or a glob; as full URLs, sorted (:func:`listing`)."""
    _, root = _filesystem(url)
    glob = any(ch in root for ch in "*?[")
    if is_trace_name(name(url)) and not glob:
        return [url]  # a file: read (and its errors reported) by the worker, no extra round trip
    found = listing(url)
    if found is None:
        return [url]
    if glob and (scheme(url) or "") not in ("http", "https"):
        if not found:
            raise InputError(url, "pattern matches no files")
        return found
    if not found and _is_missing(url):
        raise InputError(url, "no such file or directory")
    found = [u for u in found if is_trace_name(name(u))]
    if not found:
        raise InputError(url, "directory contains no trace files (*.json, *.json.gz)")
    return found


def _is_missing(url: str) -> bool:
    fs, root = _filesystem(url)
    try:
        return not fs.exists(root)
    except Exception as exc:  # noqa: BLE001
        raise InputError(url, problem(exc)) from None


def forget_instances() -> None:
    """Drop fsspec's cached filesystem instances (in a forked worker process: the parent's
    instances hold async sessions bound to an event loop that does not run in the child)."""
    import sys

    if "fsspec" not in sys.modules:
        return
    from fsspec.registry import _registry

    for cls in list(_registry.values()):
        cls.clear_instance_cache()
