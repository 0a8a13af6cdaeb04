"""Loading untrusted pickles: one refusing unpickler and its limits for every pickle we read.

Memory snapshots (:mod:`.snapshot`) and Flight Recorder dumps (:mod:`.flight_recorder`) are
pickles written by PyTorch. Both are plain data (dicts, lists, tuples, strings, numbers), so they
are loaded with an unpickler that refuses every global: a pickle that names ``os.system`` (or any
other callable or class) is rejected before anything runs. Loading is bounded too: the address
space grows by at most ``max(UNPICKLE_FLOOR, UNPICKLE_BYTES_PER_BYTE × size)`` while unpickling
(Linux), so a few hostile bytes that ask for gigabytes fail at once with a one-line error; the
bytes themselves come through :func:`._io.read_input` (regular files only, size and gzip limits).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import pickletools
from contextlib import contextmanager
from typing import Any

from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest._io import gc_paused, short

__all__ = ["load_plain_pickle", "looks_like_json", "PICKLE_MAGIC", "UNPICKLE_BYTES_PER_BYTE", "UNPICKLE_FLOOR"]

#: pickle protocols 2-5 start with PROTO (0x80) and the protocol number; torch writes 2 (the JIT
#: pickler of Flight Recorder dumps), 4 or 5
PICKLE_MAGIC = tuple(bytes([0x80, v]) for v in range(2, 6))

# What unpickling may allocate beyond what the process already has: the objects of a real
# snapshot take ~10-30x its pickle size. A hostile pickle can claim far more with a few bytes (a
# memo index of 2**28 makes CPython's unpickler size its memo table to 4 GiB and zero it).
UNPICKLE_BYTES_PER_BYTE = 64
UNPICKLE_FLOOR = 1 << 30


class _RefuseGlobals(pickle.Unpickler):
    """Unpickler that can build only builtin containers and scalars.

    GLOBAL, STACK_GLOBAL, INST and OBJ get their callable from ``find_class``, so refusing it here
    means REDUCE/BUILD/NEWOBJ never get anything to call. EXT1/2/4 do too, unless ``copyreg``'s
    extension cache already holds the object: :func:`_extension_opcode` covers that case.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"persistent id {pid!r}")


class _RefusedGlobal(pickle.UnpicklingError):
    pass


def _extension_opcode(data: bytes) -> str | None:
    """EXT1/2/4 opcodes resolve through ``copyreg``'s extension cache without ``find_class``.

    Nothing registers extension codes by default, so the (slow, pure-Python) opcode scan runs
    only when this process has some registered or cached.
    """
    if not (copyreg._extension_cache or copyreg._inverted_registry):
        return None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("EXT1", "EXT2", "EXT4"):
                return f"copyreg extension code {arg}"
    except (ValueError, EOFError):
        return None  # malformed: the unpickler reports it
    return None


def looks_like_json(data: bytes) -> bool:
    head = data[:64].lstrip()
    return head[:1] in (b"[", b"{")


def _vm_size() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@contextmanager
def _memory_bound(n: int):
    """Bound the address space while unpickling ``n`` bytes (Linux; elsewhere a no-op), so a
    pickle that asks for gigabytes fails at once with MemoryError instead of taking them."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    vm = _vm_size()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = None if vm is None else vm + max(UNPICKLE_FLOOR, UNPICKLE_BYTES_PER_BYTE * n)
    if (
        limit is None
        or (soft != resource.RLIM_INFINITY and soft <= limit)
        or (hard != resource.RLIM_INFINITY and hard < limit)
    ):
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_plain_pickle(path: Any, data: bytes, what: str, error: type[InputError] = InputError) -> Any:
    """The plain data in ``data`` (a pickle read from ``path``), or ``error(path, problem)``.

    ``what`` names the input in the problem ("a memory snapshot", "a Flight Recorder dump"): a
    pickle that references a global is refused as "refused to load: the pickle references
    os.system (<what> holds only plain data; this file may be malicious)"; truncated, corrupt and
    memory-hungry pickles get one line each."""
    if data[:2] == b"PK":
        raise error(path, f"is a zip archive (torch.save?), not {what} pickle")
    if data[:1] != b"\x80" and looks_like_json(data):
        raise error(path, f"is JSON, not {what} pickle")
    ext = _extension_opcode(data)
    if ext:
        raise error(path, f"refused to load: the pickle references {ext} ({what} holds only plain data)")
    try:
        with gc_paused(), _memory_bound(len(data)):
            # through a BufferedReader: the C unpickler prefetches with peek(); reading a pickle without
            # frames (protocol 2, as torch's JIT pickler writes) from a bare BytesIO costs a call per opcode (~4x)
            return _RefuseGlobals(io.BufferedReader(io.BytesIO(data), 1 << 16)).load()
    except _RefusedGlobal as exc:
        raise error(
            path,
            f"refused to load: the pickle references {exc} ({what} holds only plain data; this file may be malicious)",
        ) from None
    except EOFError:
        raise error(path, "truncated pickle (ran out of data)") from None
    except pickle.UnpicklingError as exc:
        msg = short(exc)
        if "truncated" in msg or "ran out of input" in msg.lower():
            raise error(path, "truncated pickle (ran out of data)") from None
        if data[:1] != b"\x80":
            raise error(path, f"not a pickle file (starts with {data[:8]!r})") from None
        raise error(path, f"corrupt pickle ({msg})") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        # the C unpickler raises these on malformed opcode streams
        if data[:1] != b"\x80":
            raise error(path, f"not a pickle file (starts with {data[:8]!r})") from None
        raise error(path, f"corrupt pickle ({type(exc).__name__}: {short(exc)})") from None
    except MemoryError:
        raise error(
            path,
            f"corrupt pickle: it asks for more memory than a {len(data)}-byte file can need "
            "(a memo index or length field out of range)",
        ) from None
