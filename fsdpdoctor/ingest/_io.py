"""Shared pieces of reading input files: the gzip implementation and the errors it raises."""

from __future__ import annotations

import gzip
import zlib

try:  # isal's gzip is several times faster than zlib's: same API, its own exception class
    from isal import igzip as gzip_impl
    from isal.isal_zlib import error as _IsalError
except ImportError:  # pragma: no cover - only without the isal wheel
    gzip_impl = gzip  # type: ignore[assignment]
    _IsalError = zlib.error  # type: ignore[assignment,misc]

# everything a truncated or corrupt .gz can raise while being read
GZIP_ERRORS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, gzip.BadGzipFile, _IsalError)


def short(exc: BaseException) -> str:
    """The first line of an exception's message, for a one-line error."""
    msg = str(exc).strip() or type(exc).__name__
    return msg.splitlines()[0][:120]
