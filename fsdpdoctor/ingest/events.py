"""The Kineto event schema fsdpdoctor reads: the typed structs (whole-file and block
decoders both build theirs from :data:`ARG_FIELDS`), the lenient per-event conversion, and the
``[memory]`` event rows. Nothing here opens a file or builds a table (that is :mod:`.kineto`
and :mod:`.blocks`, which both import this module)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec
import numpy as np

# --------------------------------------------------------------------------------------------
# Typed schema: the fields we read, nothing else. Unknown fields are skipped by the decoder.
# --------------------------------------------------------------------------------------------

IntOrStr = Union[int, str]
# integers the analysis reads are 64-bit; a larger one is corrupt input, not a number to compute with
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


#: The ``args`` the analysis reads, as (attribute, type, JSON key): one table, from which both
#: :class:`Args` and the block decoder's structs (:mod:`.blocks`, other defaults) are built.
ARG_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("external_id", I64 | None, "External id"),
    ("correlation", I64 | None, "correlation"),
    ("stream", I64 | None, "stream"),
    ("device", I64 | None, "device"),
    ("collective", str | None, "Collective name"),
    ("in_nelems", I64 | None, "In msg nelems"),
    ("out_nelems", I64 | None, "Out msg nelems"),
    ("group_size", I64 | None, "Group size"),
    ("dtype", str | None, "dtype"),
    ("pg_name", str | None, "Process Group Name"),
    ("pg_desc", str | None, "Process Group Description"),
    ("pg_ranks", str | list[int] | None, "Process Group Ranks"),
    ("nbytes", I64 | str | None, "bytes"),  # ROCm traces write memcpy byte counts as strings
    ("name", str | None, "name"),  # thread/process names on ph == "M" events
    # shapes/types (record_shapes=True) stay undecoded: only c10d collective ops need them.
    # msgspec cannot decode ``Raw | None`` (it accepts only null): plain Raw, None when absent
    ("input_dims", msgspec.Raw, "Input Dims"),
    ("input_type", msgspec.Raw, "Input type"),
    ("concrete_inputs", msgspec.Raw, "Concrete Inputs"),  # scalar / list arguments (convolution strides)
    # torch 1.8-1.9 traces (2021) spell it in lowercase on GPU and runtime events: read where
    # ``External id`` is absent
    ("external_id_lc", I64 | None, "external id"),
    # a kernel's launch grid (undecoded): kept for communication kernels, whose blocks each hold an SM
    ("grid", msgspec.Raw, "grid"),
)
#: the undecoded (Raw) shape fields: copied out of the file's buffer for the few rows kept
#: the runtime calls that launch GPU kernels (CUDA runtime and driver, HIP; graphs launch many)
KERNEL_LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "hipLaunchKernel",
    "hipExtLaunchKernel",
    "hipExtModuleLaunchKernel",
    "hipModuleLaunchKernel",
    "hipGraphLaunch",
)
RAW_FIELDS = ("input_dims", "input_type", "concrete_inputs", "grid")
#: kernel names of communication libraries (NCCL/RCCL/HCCL, DeepEP, NVSHMEM, symmetric memory,
#: custom all-reduces) whose rows keep their args (the launch grid: the SMs a collective holds);
#: which of them are collectives is fsdpdoctor.analysis.comms's to say
COMM_KERNEL_HINT = re.compile(
    r"nccl|rccl|hccl|xccl|dpsk::ep::|deep_ep|nvshmem|multimem_|one_shot_all_reduce|two_shot_all_reduce"
    r"|cross_device_reduce|allreduce|AllReduce",
)
#: CPU ops whose recorded shapes (``Input Dims`` / ``Input type``) are kept besides the c10d
#: collectives': the matmul and attention operators whose FLOPs fsdpdoctor.analysis.compute counts
GEMM_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_addmm_activation"}
)
ATTN_FWD_OPS = frozenset(
    {
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_cudnn_attention",
    }
)
ATTN_BWD_OPS = frozenset(n + "_backward" for n in ATTN_FWD_OPS)
CONV_OPS = frozenset({"aten::convolution", "aten::convolution_backward"})
FLOP_OPS = GEMM_OPS | ATTN_FWD_OPS | ATTN_BWD_OPS | CONV_OPS
#: the ops around a synchronization whose first input a sync-in-step finding names (``.to("cpu")``, ``.item()``)
SYNC_OPS = frozenset({"aten::to", "aten::item", "aten::_local_scalar_dense", "aten::cpu"})


def keeps_shapes(name: str) -> bool:
    """Whether an op's recorded shapes are kept: c10d and symmetric-memory collectives (their
    sizes: gloo and ``symm_mem::`` ops carry no ``record_param_comms``), the ops whose FLOPs are
    counted, and the ops whose read-backs synchronize (:data:`SYNC_OPS`)."""
    return (
        name.startswith(("c10d::", "symm_mem::"))
        or name == "record_param_comms"
        or name in FLOP_OPS
        or name in SYNC_OPS
        or COMM_KERNEL_HINT.search(name) is not None
    )


#: Top-level keys of a trace document that the analysis reads besides ``traceEvents`` (both
#: decoders: the head before the event array and the tail after it). ``baseTimeNanoseconds``
#: (Kineto, torch 2.1+) is the wall-clock time that event timestamps (µs) count from.
META_KEYS = (
    "distributedInfo",
    "deviceProperties",
    "schemaVersion",
    "traceName",
    "baseTimeNanoseconds",
    "computeProperties",  # deviceProperties' name in torch 1.9-era traces (2021)
)

#: ``[memory]`` instant events (profile_memory=True): allocator totals after each event
MEMORY_ARG_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("total_allocated", I64 | None, "Total Allocated"),
    ("total_reserved", I64 | None, "Total Reserved"),
    ("device_type", I64 | None, "Device Type"),
    ("device_id", I64 | None, "Device Id"),
)


def args_struct(
    name: str, fields: tuple[tuple[str, Any, str], ...], defaults: dict[str, Any] | None = None, **kw: Any
) -> type:
    """A msgspec Struct decoding ``fields`` (absent ones take ``defaults``, else None)."""
    d = defaults or {}
    return msgspec.defstruct(name, [(a, t, msgspec.field(name=j, default=d.get(a))) for a, t, j in fields], **kw)


Args = args_struct("Args", ARG_FIELDS + MEMORY_ARG_FIELDS, gc=False, omit_defaults=True, module=__name__)


MEMORY_EVENT = "[memory]"
MEMORY_COLUMNS = ("ts", "device_type", "device_id", "allocated", "reserved")


def memory_row(e) -> tuple | None:
    """(ts, device type, device id, total allocated, total reserved) of a ``[memory]`` event."""
    a = e.args
    if e.name != MEMORY_EVENT or a is None or a.total_allocated is None:
        return None
    return (e.ts, _or(a.device_type, -1), _or(a.device_id, -1), a.total_allocated, _or(a.total_reserved, 0))


def _or(v, default):
    return default if v is None else v


def memory_array(rows: list) -> np.ndarray:
    return np.array(rows, dtype=np.float64).reshape(-1, len(MEMORY_COLUMNS))


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: IntOrStr = 0
    tid: IntOrStr = 0
    ts: float = 0.0
    dur: float = 0.0
    args: Args | None = None


_args_fields = set(Args.__struct_fields__)

# Categories whose rows are kept. Python-function rows (with_stack) are the bulk of some traces
# and nothing downstream reads them.
DROPPED_CATEGORIES = frozenset({"python_function"})


def add_frame(frames: dict, name: str, calls: int, dur_ns: int) -> None:
    """Count ``calls`` events of the Python frame ``name`` lasting ``dur_ns`` in all into ``frames``
    (name → [events, total ns]: :attr:`fsdpdoctor.ingest.kineto.RankTrace.python_frames`). Integer
    nanoseconds: the sum is the same in whatever order the decoders add."""
    got = frames.get(name)
    if got is None:
        frames[name] = [calls, int(dur_ns)]
    else:
        got[0] += calls
        got[1] += int(dur_ns)


def decode_lenient_utf8(decoder, data):
    """``decoder.decode(data)``; invalid UTF-8 inside strings (labels: names, categories, group
    names; numbers are ASCII) is replaced by U+FFFD instead of failing the file."""
    try:
        return decoder.decode(data)
    except UnicodeDecodeError:
        return decoder.decode(bytes(data).decode("utf-8", "replace").encode())


TOO_DEEP = "JSON nested too deeply; a profiler trace is a few levels deep"
OVERFLOW = "a field holds an integer outside the 64-bit range (event ids, stream, sizes, rank)"


# --------------------------------------------------------------------------------------------
# Lenient conversion (a file whose fields have unexpected types)
# --------------------------------------------------------------------------------------------


def _to_int(v: Any) -> int | None:
    """An integer field, leniently (None when it is not a number); past 64 bits: OverflowError."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        if not -(1 << 63) <= v < (1 << 63):
            raise OverflowError(OVERFLOW)
        return v
    if isinstance(v, float) and v.is_integer():
        return _to_int(int(v))
    if isinstance(v, str):
        try:
            return _to_int(int(v.strip()))
        except ValueError:
            return None
    return None


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _coerce_event(d: Any) -> Event | None:
    if not isinstance(d, dict):
        return None
    a = d.get("args")
    args = None
    if isinstance(a, dict):
        args = Args(**{attr: _CONVERT[attr](a.get(key)) for attr, _t, key in ARG_FIELDS + MEMORY_ARG_FIELDS})
    pid, tid = d.get("pid", 0), d.get("tid", 0)
    return Event(
        ph=str(d.get("ph", "")),
        cat=str(d.get("cat", "") or ""),
        name=str(d.get("name", "") or ""),
        pid=pid if isinstance(pid, (int, str)) else str(pid),
        tid=tid if isinstance(tid, (int, str)) else str(tid),
        ts=_to_float(d.get("ts", 0.0)),
        dur=_to_float(d.get("dur", 0.0)),
        args=args,
    )


def _raw(v: Any) -> msgspec.Raw | None:
    return None if v is None else msgspec.Raw(msgspec.json.encode(v))


def _str_or_none(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else str(v)


def _converter(t: Any):
    if t is msgspec.Raw:
        return _raw
    return _str_or_none if getattr(t, "__args__", (None,))[0] is str else _to_int


_CONVERT = {attr: _converter(t) for attr, t, _key in ARG_FIELDS + MEMORY_ARG_FIELDS}
