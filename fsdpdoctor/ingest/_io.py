"""Opening input files, in one place: what may be opened, how much may be read, and the errors.

Every reader (traces, snapshots, memory timelines, sidecars, baselines) opens its file through
:func:`open_input` (a stream) or :func:`read_input` (the whole content), which

* refuse anything that is not a regular file — FIFOs, devices, sockets, directories — by
  ``stat`` before reading a byte (a FIFO would block forever, ``/dev/zero`` never ends), and turn
  missing files and permission problems into one-line :class:`InputError`\\ s naming the file;
* gunzip transparently (gzip detected by its magic bytes, not the name), with isal when present;
* bound the bytes a file may produce: a plain file by its size, a gzip stream by the smaller of
  an absolute cap and ``MAX_RATIO`` × its compressed size (never below ``RATIO_FLOOR``), so a gzip
  bomb is refused after reading at most that much, in seconds. ``--max-input-bytes N`` (or the
  environment variable ``FSDPDOCTOR_MAX_INPUT_BYTES``, which also reaches worker processes)
  replaces both with the one absolute cap N.

:class:`InputStream` wraps any already-opened binary stream too (``InputStream.wrap``), so a
reader for other file systems applies the same limits and error wording.
"""

from __future__ import annotations

import gc
import gzip
import os
import stat
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from fsdpdoctor.errors import InputError
from fsdpdoctor.fmt import parse_size

try:  # isal's gzip is several times faster than zlib's: same API, its own exception class
    from isal import igzip as gzip_impl
    from isal.isal_zlib import error as _IsalError
except ImportError:  # pragma: no cover - only without the isal wheel
    gzip_impl = gzip  # type: ignore[assignment]
    _IsalError = zlib.error  # type: ignore[assignment,misc]

# everything a truncated or corrupt .gz can raise while being read
GZIP_ERRORS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, gzip.BadGzipFile, _IsalError)

MAX_INPUT_ENV = "FSDPDOCTOR_MAX_INPUT_BYTES"
DEFAULT_MAX_BYTES = 64 << 30  # absolute cap on the (decompressed) bytes of one input
# Real Kineto traces gzip 5-20x, snapshots less; gzip itself cannot exceed ~1032x. A stream that
# expands past 100x its compressed size (and past the floor) is refused as a likely bomb.
MAX_RATIO = 100
RATIO_FLOOR = 256 << 20

_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def short(exc: BaseException) -> str:
    """The first line of an exception's message, for a one-line error."""
    msg = str(exc).strip() or type(exc).__name__
    return msg.splitlines()[0][:120]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def explicit_max_bytes() -> int | None:
    """The cap set by ``--max-input-bytes`` / ``FSDPDOCTOR_MAX_INPUT_BYTES``, if any."""
    raw = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not raw:
        return None
    try:
        return max(0, int(parse_size(raw)))
    except ValueError:
        return None


@contextmanager
def input_limit(max_bytes: int | None) -> Iterator[None]:
    """Within the block (and in processes started inside it), cap every input at ``max_bytes``."""
    prev = os.environ.get(MAX_INPUT_ENV)
    if max_bytes is not None:
        os.environ[MAX_INPUT_ENV] = str(int(max_bytes))
    try:
        yield
    finally:
        if max_bytes is not None:
            if prev is None:
                os.environ.pop(MAX_INPUT_ENV, None)
            else:
                os.environ[MAX_INPUT_ENV] = prev


def byte_budget(on_disk: int, compressed: bool) -> tuple[int, str]:
    """(the most bytes this input may produce, why) for a file of ``on_disk`` bytes."""
    explicit = explicit_max_bytes()
    if explicit is not None:
        return explicit, f"the --max-input-bytes limit of {fmt_bytes(explicit)}"
    if compressed:
        ratio_cap = max(RATIO_FLOOR, MAX_RATIO * on_disk)
        if ratio_cap < DEFAULT_MAX_BYTES:
            return ratio_cap, (f"{MAX_RATIO}x its compressed size of {fmt_bytes(on_disk)}, likely a gzip bomb")
    return DEFAULT_MAX_BYTES, f"the default limit of {fmt_bytes(DEFAULT_MAX_BYTES)}"


def check_regular(path: str | Path, what: str = "file", error: type[InputError] = InputError) -> os.stat_result:
    """``stat`` the path and refuse anything but a readable-looking regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(path, "no such file") from None
    except NotADirectoryError:
        raise error(path, "no such file (a parent is not a directory)") from None
    except PermissionError:
        raise error(path, "permission denied") from None
    except OSError as exc:
        raise error(path, f"cannot read ({exc.strerror or short(exc)})") from None
    return _check_mode(path, st, what, error)


def _check_mode(path, st: os.stat_result, what: str, error: type[InputError]) -> os.stat_result:
    if stat.S_ISDIR(st.st_mode):
        raise error(path, f"is a directory, expected a {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(path, f"is {kind}, not a regular file; give the {what} as a file")
    return st


class InputStream:
    """Decompressed bytes of one input, with the limits and one-line errors of this module.

    ``raw`` is the file on disk (``raw.tell()`` for progress), ``gz`` the gzip reader or None,
    ``size`` the size on disk, ``offset`` the decompressed bytes handed out so far.
    """

    def __init__(
        self,
        path: str | Path,
        raw: IO[bytes],
        size: int,
        error: type[InputError] = InputError,
        describe: Callable[[BaseException], str] | None = None,
    ):
        self.path = path
        self.raw = raw
        self.size = size
        self.error = error
        self.describe = describe  # remote streams: their back-end's errors (HTTP, auth, network) in words
        self.offset = 0
        try:
            head = raw.read(2)
            raw.seek(0)
        except IsADirectoryError:
            raw.close()
            raise error(path, "is a directory") from None
        except Exception as exc:  # noqa: BLE001 - a remote back-end raises its own kinds
            raw.close()
            if describe is not None:
                raise error(path, describe(exc)) from None
            if isinstance(exc, OSError):
                raise error(path, f"cannot read ({exc.strerror or short(exc)})") from None
            raise
        self.gz = gzip_impl.open(raw, "rb") if head == b"\x1f\x8b" else None
        self.limit, self._why = byte_budget(size, self.gz is not None)
        if self.gz is None and size > self.limit:
            raw.close()
            raise error(path, f"is {fmt_bytes(size)}, more than {self._why}; raise --max-input-bytes to read it")

    @classmethod
    def open(cls, path: str | Path, what: str = "file", error: type[InputError] = InputError) -> "InputStream":
        """Open a local file: checked by ``stat`` first, opened without blocking on a FIFO."""
        check_regular(path, what, error)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise error(path, "no such file") from None
        except IsADirectoryError:
            raise error(path, f"is a directory, expected a {what}") from None
        except PermissionError:
            raise error(path, "permission denied") from None
        except OSError as exc:
            raise error(path, f"cannot open ({exc.strerror or short(exc)})") from None
        try:
            st = _check_mode(path, os.fstat(fd), what, error)  # replaced between stat and open?
            if hasattr(os, "set_blocking"):
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, os.fdopen(fd, "rb"), st.st_size, error)

    @classmethod
    def wrap(
        cls,
        path: str | Path,
        raw: IO[bytes],
        size: int,
        error: type[InputError] = InputError,
        describe: Callable[[BaseException], str] | None = None,
    ) -> "InputStream":
        """Limits and errors for a stream opened elsewhere (``size``: its size on storage;
        ``describe``: how its back-end's errors read, e.g. :func:`.remote.problem`)."""
        return cls(path, raw, size, error, describe)

    def _count(self, n: int) -> None:
        self.offset += n
        if self.offset > self.limit:
            self.close()
            raise self.error(
                self.path,
                f"expands to more than {fmt_bytes(self.limit)} ({self._why}); "
                "refused, raise --max-input-bytes if the file is genuine",
            )

    def read(self, n: int = 1 << 20) -> bytes:
        try:
            out = self.gz.read(n) if self.gz is not None else self.raw.read(n)
        except _GZIP_READ_ERRORS as exc:
            raise self.error(self.path, f"truncated or corrupt gzip data ({short(exc)})") from None
        except Exception as exc:  # noqa: BLE001
            self._remote_error(exc)
        self._count(len(out))
        return out

    def readinto(self, view: memoryview) -> int:
        try:
            n = self.gz.readinto(view) if self.gz is not None else self.raw.readinto(view)
        except _GZIP_READ_ERRORS as exc:
            raise self.error(self.path, f"truncated or corrupt gzip data ({short(exc)})") from None
        except Exception as exc:  # noqa: BLE001
            self._remote_error(exc)
        self._count(n)
        return n

    def _remote_error(self, exc: BaseException) -> None:
        if self.describe is None:  # a local file: not an input problem we know how to word
            raise exc
        raise self.error(self.path, self.describe(exc)) from None

    def read_all(self) -> bytes:
        """Everything that is left (up to the limit)."""
        parts = []
        while chunk := self.read(16 << 20):
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        if self.gz is not None:
            self.gz.close()
        self.raw.close()

    def __enter__(self) -> "InputStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_GZIP_READ_ERRORS = GZIP_ERRORS


def open_input(path: str | Path, what: str = "file", error: type[InputError] = InputError) -> InputStream:
    """The one way an input is opened: a local file (:meth:`InputStream.open`) or a URL through
    fsspec (:mod:`.remote`), gunzipped as needed, within the byte limits, its errors one line."""
    from fsdpdoctor.ingest import remote

    if remote.is_url(path):
        try:
            raw, size = remote.open_url(str(path))
        except InputError as exc:
            raise error(path, exc.problem) from None
        return InputStream.wrap(path, raw, size, error, describe=remote.problem)
    return InputStream.open(path, what, error)


def read_input(path: str | Path, what: str = "file", error: type[InputError] = InputError) -> bytes:
    """The whole (gunzipped) content of an input, local or URL (:func:`open_input`), within the limits."""
    with open_input(path, what, error) as s:
        return s.read_all()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Decoding and unpickling allocate millions of small objects; the cyclic GC passing over
    them costs several times the load. Paused inside the block."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def convert_checked(value: Any, typ: Any, error: Callable[[str], Exception], where: str) -> Any:
    """``value`` converted to ``typ`` (msgspec), or ``error("wrong structure: ...")`` raised with
    where in the document it went wrong: the one structure check of every typed reader."""
    import msgspec

    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        msg, _, at = str(exc).partition(" - at `$")
        raise error(f"wrong structure: {where}{at.rstrip('`')}: {msg[:100]}") from None
    except RecursionError:
        raise error(f"wrong structure: {where} is nested too deeply") from None
    except UnicodeError:
        raise error(f"wrong structure: {where} holds a string that is not valid Unicode") from None
