"""Streaming block decoder: a Kineto trace of any size → columns, in memory proportional to the
columns rather than to the JSON.

The file is read (and gunzipped, with isal) in chunks of a few MiB. The ``traceEvents`` array is
cut into blocks at separators between events (``}`` ``,`` ``{`` with any whitespace between), each
block is decoded by a typed msgspec decoder as ``[`` block ``]`` and its columns extracted, with
(category, name, pid, tid) interned to integer codes. Events are a union tagged by ``ph``: only
complete (``X``) events are decoded in full, thread-name metadata as far as needed, every other
phase (flows, instants...) is skipped by the decoder.

Why a cut is safe without a bracket-aware scanner: a block always starts at a true event
boundary, and JSON parsing is deterministic from there, so ``[`` + block + ``]`` decodes only if the
cut is a true top-level boundary too. A cut that fell inside a string or a nested object fails in
a recognisable way (input truncated, or malformed exactly at the closing ``]`` we added), and the
block is extended to a later separator; "trailing characters" means the event array ended inside
the block. Any other error lies in data the whole-file decoder would have read the same way, so
it is reported as that decoder reports it, with the byte offset in the file. Compact JSON (no
newlines at all) is handled the same way.

Metadata before the array (``deviceProperties``, ``distributedInfo`` ...) is decoded from the head;
metadata after it, with the last block, by decoding ``{"traceEvents": [`` + rest of the file.
Anything else (no ``traceEvents`` array found, a top level that is not an object or array) goes
to the whole-file decoder in :mod:`.kineto`, which also defines what every error says.

With ``workers`` > 0, blocks of large files are decoded in worker processes: for an uncompressed
file the workers read their blocks from the file themselves (this process only finds the cuts);
for gzip this process gunzips into a ring of slots in shared memory the (forked) workers read
from. Results are appended in file order; on anything but a clean decode the stream from that
block on is handed back to the one-block-at-a-time path, so results and errors are identical.

A field with an unexpected type (a string where the schema says int), or a ``ph`` outside the
Chrome trace format, restarts the file in lenient mode: every block decoded untyped and
converted event by event, as the whole-file lenient path does.
"""

from __future__ import annotations

import gc
import os
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest import remote
from fsdpdoctor.ingest import events as K

from fsdpdoctor.ingest._io import open_input
from fsdpdoctor.ingest._io import short as _short
from fsdpdoctor.ingest.block_schema import (
    _BLOCK,
    _FINAL_OBJ,
    _META_KEYS,
    _UNTYPED,
    Columns,
    KeyTable,
    Part,
    _internal,
    _Lenient,
    _Whole,
    extract,
)

Progress = Callable[[int, int], None]

CHUNK_BYTES = 2 << 20  # decompressed bytes per read; one block is about this size
HEAD_LIMIT = 64 << 20  # give up looking for the event array after this many bytes
PARALLEL_AFTER = 32 << 20  # worker processes only for files larger than this (decompressed)

_SEP = re.compile(rb"\}\s*,\s*\{")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BYTE_POS = re.compile(r"\(byte (\d+)\)")
_WS = b" \t\r\n"
OVERFLOW = K.OVERFLOW


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _Source:
    """Decompressed bytes of one file, chunk by chunk, with progress; opening, limits and errors
    are :class:`._io.InputStream`'s."""

    def __init__(self, path: Path, progress: Progress | None):
        self.path = path
        self.progress = progress
        self.local = not remote.is_url(path)  # local files can also be read by offset in parallel
        self.stream = open_input(path, "trace file")  # a URL: a stream of the object, read chunk by chunk
        self.raw, self.gz, self.size = self.stream.raw, self.stream.gz, self.stream.size

    @property
    def offset(self) -> int:  # decompressed bytes handed out so far
        return self.stream.offset

    def read(self, n: int | None = None) -> bytes:
        out = self.stream.read(n or CHUNK_BYTES)
        if self.progress is not None:
            self.progress(self.raw.tell() if out else self.size, self.size)
        return out

    def readinto(self, view: memoryview) -> int:
        n = self.stream.readinto(view)
        if self.progress is not None:
            self.progress(self.raw.tell() if n else self.size, self.size)
        return n

    def read_rest(self) -> bytes:
        parts = []
        while chunk := self.read(16 << 20):
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        self.stream.close()


# --------------------------------------------------------------------------------------------
# The stream
# --------------------------------------------------------------------------------------------


def _last_separator(data, lo: int, hi: int | None = None) -> int:
    """The cut at the last ``}, {`` separator whose ``}`` lies in ``data[lo:hi]``, or -1.

    The cut is the index of the byte just before the separator's ``,`` (the ``}`` itself, or the
    last blank after it), so the byte after the cut is always the ``,``: a block is decoded with
    that byte overwritten by ``]``, and the next block starts at it (its sacrificial byte). With
    blanks between ``}`` and ``,`` a cut at the ``}`` would leave the ``,`` inside the next block."""
    hi = len(data) if hi is None else hi
    j = hi
    while True:
        j = data.rfind(b"}", lo, j)
        if j < 0:
            return j
        m = _SEP.match(data, j, hi)
        if m:
            return _comma_before(data, j, m.end())


def _comma_before(data, brace: int, end: int) -> int:
    """For a separator matched from ``brace`` to ``end``: the index just before its ``,``."""
    return data.find(b",", brace, end) - 1


def _decode_error(path: Path, exc: msgspec.DecodeError, shift: int) -> InputError:
    msg = str(exc)
    if "truncated" in msg.lower():
        return InputError(path, "truncated JSON (the file ends mid-document)")
    msg = _BYTE_POS.sub(lambda m: f"(byte {int(m.group(1)) + shift})", msg)
    return InputError(path, f"not valid JSON ({_short(msgspec.DecodeError(msg))})")


_decode = K.decode_lenient_utf8  # invalid UTF-8 in labels becomes U+FFFD, as in the whole-file decoder


def _too_deep(path: Path, offset: int | None = None) -> InputError:
    where = f" (near byte {offset})" if offset is not None else ""
    return InputError(path, f"JSON nested too deeply{where}; a profiler trace is a few levels deep")


def _bad_cut(exc: msgspec.DecodeError, sentinel: int) -> bool:
    msg = str(exc)
    if "truncated" in msg.lower():
        return True
    m = _BYTE_POS.search(msg)
    return m is not None and int(m.group(1)) >= sentinel


def _extract(evs: list, lenient: bool, table: KeyTable) -> Part:
    if not lenient:
        return extract(evs, table)
    conv = [K._coerce_event(d) for d in evs]
    conv = [_internal(e) for e in conv if e is not None]
    return extract(conv, table, counted=len(conv))


_worker_table: KeyTable | None = None  # in a worker process


_ring = None  # the shared block ring, inherited by forked workers


def _job_ring(off: int, n: int, lenient: bool) -> tuple[str, Any]:
    """In a worker process: the block at ``off`` in the shared ring."""
    return _job(memoryview(_ring)[off : off + n], lenient)


_worker_files: dict[str, Any] = {}


def _job_range(path: str, start: int, end: int, lenient: bool) -> tuple[str, Any]:
    """In a worker process: the block whose sacrificial byte is at ``start`` and whose last
    byte (the event's ``}``) is at ``end - 1``, read from the file, as ``[`` block ``]``."""
    fh = _worker_files.get(path)
    if fh is None:
        fh = _worker_files[path] = open(path, "rb", buffering=0)
    n = end - start - 1
    buf = bytearray(n + 2)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fh.fileno(), [view[1 + got : 1 + n]], start + 1 + got)
        if k <= 0:
            return "error", "short read"
        got += k
    buf[0] = 0x5B
    buf[n + 1] = 0x5D
    del view
    return _job(buf, lenient)


def _job(block: bytes, lenient: bool) -> tuple[str, Any]:
    """In a worker process: decode one block and extract its columns."""
    global _worker_table
    gc.disable()  # also under spawn/forkserver; the worker does nothing else
    if _worker_table is None:
        _worker_table = KeyTable()
    try:
        evs = _decode(_BLOCK if not lenient else _UNTYPED, block)
    except msgspec.ValidationError as exc:
        return "lenient", str(exc)
    except (msgspec.DecodeError, RecursionError) as exc:
        return "error", str(exc)  # the one-block-at-a-time path words it
    try:
        return "ok", _extract(evs, lenient, _worker_table)
    except OverflowError as exc:
        return "error", str(exc)


class _Stream:
    def __init__(self, path: Path, progress: Progress | None, lenient: bool, workers: int = 0):
        self.path = path
        self.lenient = lenient
        self.workers = workers
        self.pool = None
        self._ring = None
        self.src = _Source(path, progress)
        self.cols = Columns()
        self.table = KeyTable()

    # -- the head: where does the event array start? --------------------------------------
    def _head(self) -> tuple[bytes, int, str, dict]:
        """(buffer, index of the array's '[', 'object'|'array', head metadata)."""
        buf = b""
        searched = 0
        first_read = True
        while True:
            chunk = self.src.read(min(1 << 16, CHUNK_BYTES) if first_read else CHUNK_BYTES)
            first_read = False
            eof = not chunk
            buf += chunk
            if not buf.translate(None, _WS):  # (translate is ~6x faster than lstrip on blanks)
                if eof:
                    raise _Whole(buf)
                buf = b""  # only whitespace so far: nothing to keep (offsets come from src.offset)
                continue
            i = len(buf) - len(buf.lstrip(_WS))
            first = buf[i : i + 1]
            if first == b"[":
                return buf, i, "array", {}
            if first != b"{":
                raise _Whole(buf + self.src.read_rest())
            for m in _EVENTS_KEY.finditer(buf, max(i, searched - 64)):
                head = buf[i : m.start()].rstrip()
                if head.endswith(b","):
                    head = head[:-1]
                try:
                    meta = _decode(_UNTYPED, head + b"}")
                except msgspec.DecodeError:
                    continue  # "traceEvents" inside a string or a nested object
                except RecursionError:
                    raise _too_deep(self.path, self.src.offset - len(buf) + i) from None
                if isinstance(meta, dict):
                    return buf, m.end() - 1, "object", {k: meta.get(k) for k in _META_KEYS}
            searched = len(buf)
            if eof or len(buf) > HEAD_LIMIT:
                raise _Whole(buf + self.src.read_rest())

    # -- the blocks -----------------------------------------------------------------------
    def _add(self, evs) -> None:
        self.cols.append(_extract(evs, self.lenient, self.table))

    def run(self) -> tuple[dict, Columns]:
        try:
            return self._run()
        except msgspec.ValidationError:
            raise _Lenient from None
        except RecursionError:
            raise _too_deep(self.path) from None
        except OverflowError:
            raise InputError(self.path, OVERFLOW) from None
        finally:
            self.src.close()
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
            if self._ring is not None:
                global _ring
                _ring = None
                ring, mv = self._ring
                mv.release()
                ring.close()

    def _run(self) -> tuple[dict, Columns]:
        buf, start, kind, meta = self._head()
        # ``rest`` always begins with one sacrificial byte (the '[' or a separator's ',') that
        # is replaced by '[' to decode; ``base`` is the file offset of rest[0].
        rest = buf[start:]
        base = self.src.offset - len(rest)
        del buf
        if self.workers > 0 and self.src.local and self.src.gz is None and self.src.size - base > PARALLEL_AFTER:
            rest, base = self._parallel_direct(base)
        elif self.workers > 0:
            rest, base = self._parallel_ring(rest, base)
        rest, base = self._sequential(rest, base)
        tail_meta = self._finish(rest, base, kind)
        for k, v in tail_meta.items():
            if v is not None or k not in meta:
                meta[k] = v
        return meta, self.cols

    def _sequential(self, rest: bytes, base: int) -> tuple[bytes, int]:
        """Decode blocks here until the end of the array; returns what is left (the last events
        and the tail), the whole rest of the file."""
        need = 0
        ended = False
        data = bytearray(rest)
        del rest
        # No separator's '}' lies before ``lo`` in ``data``: a failed search never rescans the
        # bytes it has seen (whitespace or one huge event would make that quadratic), except
        # after a bad cut, where the block doubles before the next search.
        lo = 1
        scanned = 0  # data[:scanned] was searched without finding a separator (0: not yet)
        while not ended:
            chunk = self.src.read()
            if not chunk:
                break
            data += chunk
            del chunk
            if len(data) < need:
                continue
            if scanned and data.find(b"{", scanned) < 0:
                # every separator ends with '{': none can have completed in the new bytes
                j = data.rfind(b"}", scanned)
                lo = j if j >= 1 else lo
                scanned = len(data)
                continue
            cut = _last_separator(data, lo)
            if cut < 0:
                j = data.rfind(b"}", lo)
                lo = j if j >= 1 else len(data)
                scanned = len(data)
                continue
            after = data[cut + 1]
            data[0] = 0x5B  # '[' over the sacrificial byte
            data[cut + 1] = 0x5D  # ']' over the byte after the '}' (',' or blank if the cut is good)
            try:
                evs = _decode(_BLOCK if not self.lenient else _UNTYPED, memoryview(data)[: cut + 2])
            except msgspec.ValidationError:
                raise
            except msgspec.DecodeError as exc:
                data[cut + 1] = after  # the cut may have been inside a string
                lo, scanned = 1, 0
                if "trailing characters" in str(exc):
                    ended = True  # the array closed inside this block: the rest is the tail
                elif _bad_cut(exc, cut + 1):
                    need = 2 * len(data)  # cut inside an event: try again with a longer block
                else:
                    raise _decode_error(self.path, exc, base) from None
                continue
            self._add(evs)
            del evs
            data = bytearray(memoryview(data)[cut + 1 :])
            base += cut + 1
            need = 0
            lo, scanned = 1, 0
        return bytes(data) + self.src.read_rest(), base

    def _parallel_direct(self, base: int) -> tuple[bytes, int]:
        """Like :meth:`_parallel` for an uncompressed file: this process only finds the cuts
        (reading a small window at each), the workers read their blocks from the file."""
        from concurrent.futures import ProcessPoolExecutor

        raw, size, path = self.src.raw, self.src.size, str(self.path)
        self.pool = ProcessPoolExecutor(max_workers=self.workers)
        inflight: deque = deque()  # (future, start, end) in file order
        max_inflight = 2 * self.workers + 1
        pos = base  # file offset of the next block's sacrificial byte
        failed_at = None
        while failed_at is None:
            target = pos + CHUNK_BYTES
            cut = -1
            width = 8192
            while target + width < size and width <= CHUNK_BYTES:
                window = os.pread(raw.fileno(), width, target)
                m = _SEP.search(window)
                if m is not None:
                    cut = target + _comma_before(window, m.start(), m.end())
                    break
                width *= 4  # an event longer than the window
            if cut >= 0:
                inflight.append((self.pool.submit(_job_range, path, pos, cut + 1, self.lenient), pos, cut + 1))
                pos = cut + 1
            while inflight and (cut < 0 or len(inflight) > max_inflight or inflight[0][0].done()):
                fut, start, end = inflight.popleft()
                status, payload = fut.result()
                if status == "ok":
                    self.cols.append(payload)
                    if self.src.progress is not None:
                        self.src.progress(end, size)
                    continue
                if status == "lenient":
                    raise msgspec.ValidationError(payload)
                failed_at = start  # back to one block at a time from here
                for f, *_ in inflight:
                    f.cancel()
                inflight.clear()
            if cut < 0:
                break
        pos = pos if failed_at is None else failed_at
        raw.seek(pos)  # _sequential reads on from here: the last events and the tail
        return b"", pos

    def _parallel_ring(self, rest: bytes, base: int) -> tuple[bytes, int]:
        """Decode blocks in worker processes while reading (and gunzipping) on. Blocks travel
        through a ring of slots in an anonymous shared mapping that the forked workers
        inherit: no pickling, no pipe. Where fork is unavailable, :meth:`_parallel` pipes them.

        On anything but a clean decode (a cut inside an event, the end of the array, an error)
        the stream from that block on goes back to :meth:`_sequential`, which knows what to do
        and what to say."""
        import mmap
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        global _ring
        # small files never start processes: only once this much has been read
        parts, size = [rest], len(rest)
        while size < PARALLEL_AFTER:
            chunk = self.src.read()
            if not chunk:
                return b"".join(parts), base
            parts.append(chunk)
            size += len(chunk)
        pending = memoryview(b"".join(parts))  # read already, still to go through the ring
        del parts, rest
        try:
            ctx = multiprocessing.get_context("fork")
        except ValueError:  # pragma: no cover - no fork on this platform
            return self._parallel(bytes(pending), base)
        nslots, slot = 2 * self.workers + 2, 2 * CHUNK_BYTES + (1 << 16)
        ring = mmap.mmap(-1, nslots * slot)
        mv = memoryview(ring)
        _ring = ring  # what the workers forked from here see
        self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
        self._ring = (ring, mv)  # closed by run()
        free = deque(range(nslots))
        inflight: deque = deque()  # (future, offset, cut, base, byte after the cut) in file order
        carry = bytes(pending[:1])  # from the sacrificial byte at ``base`` on
        pending = pending[1:]

        def take() -> bool:
            """Append the oldest block's columns; False when it did not decode cleanly."""
            fut, off = inflight[0][:2]
            status, payload = fut.result()
            if status == "lenient":
                raise msgspec.ValidationError(payload)
            if status != "ok":
                return False
            inflight.popleft()
            free.append(off // slot)
            self.cols.append(payload)
            return True

        def back() -> tuple[bytes, int]:
            """The stream from the oldest block in flight on, for one block at a time."""
            b0 = inflight[0][3] if inflight else base
            pieces = [b" "]
            for fut, off, cut, _b, after in inflight:
                fut.cancel()
                pieces.append(bytes(mv[off + 1 : cut + 1]))
                pieces.append(bytes((after,)))
            inflight.clear()
            pieces.append(carry[1:])
            return b"".join(pieces), b0

        while True:
            while inflight and (not free or inflight[0][0].done()):
                if not take():
                    return back()
            if len(carry) > slot - CHUNK_BYTES:  # one event bigger than a block: not for the ring
                while inflight:
                    if not take():
                        return back()
                return carry + bytes(pending), base
            off = free[0] * slot
            mv[off : off + len(carry)] = carry
            start = off + len(carry)
            if len(pending):
                n = min(len(pending), CHUNK_BYTES)
                mv[start : start + n] = pending[:n]
                pending = pending[n:]
            else:
                # the slice is released even when the read raises (a refused bomb, a corrupt
                # stream): a traceback that still held it would keep the ring from closing
                with mv[start : start + CHUNK_BYTES] as dst:
                    n = self.src.readinto(dst)
            if n == 0:
                break
            end = start + n
            cut = _last_separator(ring, off + 1, end)
            if cut < 0:
                carry = bytes(mv[off:end])
                continue
            after = ring[cut + 1]
            carry = bytes(mv[cut + 1 : end])
            ring[off] = 0x5B  # '[' over the sacrificial byte
            ring[cut + 1] = 0x5D  # ']' after the block's last '}'
            free.popleft()
            inflight.append((self.pool.submit(_job_ring, off, cut + 2 - off, self.lenient), off, cut, base, after))
            base += cut + 1 - off
        while inflight:
            if not take():
                return back()
        return carry, base

    def _parallel(self, rest: bytes, base: int) -> tuple[bytes, int]:
        """Decode blocks in worker processes while reading on. On anything but a clean decode
        (a cut inside an event, the end of the array, an error) hand the stream from that block
        on back to :meth:`_sequential`, which knows what to do and what to say."""
        # small files never start processes: only once this much has been read
        parts, size = [rest], len(rest)
        while size < PARALLEL_AFTER:
            chunk = self.src.read()
            if not chunk:
                return b"".join(parts), base
            parts.append(chunk)
            size += len(chunk)
        rest = b"".join(parts)
        del parts
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(max_workers=self.workers)
        inflight: deque = deque()  # (future, base, data, cut) in file order
        max_inflight = 2 * self.workers + 1

        def drain(block: bool) -> tuple[bytes, int] | None:
            while inflight and (block or len(inflight) > max_inflight or inflight[0][0].done()):
                fut, b0, data, cut = inflight.popleft()
                status, payload = fut.result()
                if status == "ok":
                    self.cols.append(payload)
                    continue
                if status == "lenient":
                    raise msgspec.ValidationError(payload)
                # back to one block at a time, from the start of this block
                tail = [data[: cut + 1]] + [d[: c + 1] for _, _, d, c in inflight]
                for f, *_ in inflight:
                    f.cancel()
                inflight.clear()
                return b"".join(tail), b0
            return None

        data = rest
        while True:
            cut = _last_separator(data, 1)
            if cut > 0:
                block = b"[" + memoryview(data)[1 : cut + 1] + b"]"
                inflight.append((self.pool.submit(_job, block, self.lenient), base, data, cut))
                del block
                rest = data[cut + 1 :]
                base += cut + 1
            else:
                rest = data
            back = drain(False)
            if back is not None:
                return back[0] + rest, back[1]
            chunk = self.src.read()
            if not chunk:
                break
            data = rest + chunk
            del chunk
        back = drain(True)
        if back is not None:
            return back[0] + rest, back[1]
        return rest, base

    def _finish(self, rest: bytes, base: int, kind: str) -> dict:
        """Decode the last events and whatever follows the array."""
        prefix = b'{"traceEvents":[' if kind == "object" else b"["
        doc = prefix + rest[1:]
        shift = base + 1 - len(prefix)
        try:
            if self.lenient:
                raw = _decode(_UNTYPED, doc)
                events = raw.get("traceEvents") if kind == "object" else raw
                self._add(events)
                return {k: raw.get(k) for k in _META_KEYS} if kind == "object" else {}
            if kind == "object":
                d = _decode(_FINAL_OBJ, doc)
                self._add(d.traceEvents or [])
                return {k: getattr(d, k) for k in _META_KEYS}
            self._add(_decode(_BLOCK, doc))
            return {}
        except msgspec.ValidationError:
            raise
        except msgspec.DecodeError as exc:
            raise _decode_error(self.path, exc, shift) from None


def load_blocks(path: Path, progress: Progress | None = None, workers: int = 0) -> tuple[dict, Columns, str] | bytes:
    """(metadata, columns, decode mode), or the file's bytes when only a whole-file decode can
    read it. Raises InputError for unreadable files and invalid JSON.

    ``workers`` > 0 decodes blocks in that many worker processes (files over
    ``PARALLEL_AFTER`` bytes only); the result is the same.
    """
    for lenient in (False, True):
        try:
            meta, cols = _Stream(path, progress, lenient, workers).run()
            return meta, cols, "lenient" if lenient else "typed"
        except _Lenient:
            continue
        except _Whole as w:
            return w.data
    raise AssertionError("unreachable")
