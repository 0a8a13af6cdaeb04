"""Collectives: one row per collective the CPU issued, joined to the GPU kernels that ran it.

The CPU side is the ``record_param_comms`` op (its args carry the collective name, sizes, dtype,
group); the GPU side is the NCCL/RCCL kernel with the same ``External id``. Old traces whose
``record_param_comms`` has no args get the kind from the enclosing ``nccl:*`` annotation or the
kernel name; CPU-only (gloo) traces have no kernels and are timed on the CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.ingest.shapes import decode_list, dtype_bytes
from fsdpdoctor.ingest.kineto import Args, RankTrace
from fsdpdoctor.analysis.labels import enclosing
from fsdpdoctor.analysis.rows import name_lut, name_rows, trace_cache

# Same rule as Holistic Trace Analysis (hta/common/types.py), so overlap figures agree.
COMM_NAME_RX = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
#: collective kernels outside NCCL that HTA's rule counts as compute: PyTorch symmetric memory's
#: NVLS all-reduce (``multimem_all_reduce_kernel``, ``symm_mem::multimem_all_reduce_``) and its
#: one-/two-shot variants, vLLM's custom all-reduce (``cross_device_reduce_1stage`` / ``2stage``)
#: and TensorRT-LLM's (``allreduce_fusion_kernel…``, ``oneShotAllReduceKernel`` …)
EXTRA_COMM_NAME_RX = re.compile(
    r".*(?:multimem_all_reduce|multimem_all_gather|multimem_reduce_scatter|one_shot_all_reduce|two_shot_all_reduce"
    r"|cross_device_reduce_[12]stage|allreduce_fusion_kernel|[Oo]neShotAllReduce|[Tt]woShotAllReduce"
    # DeepEP's expert-parallel all-to-all (``dpsk::ep::internode::dispatch<…>`` in DeepSeek-V3's
    # traces, ``deep_ep::intranode::combine<…>`` in the released library; its ``layout::`` kernels
    # compute locally), NVSHMEM kernels, oneCCL/XCCL's
    r"|(?:dpsk::ep|deep_ep)::(?!layout::)|nvshmem|xccl|oneccl)"
)
_EP_KERNEL_RX = re.compile(r"(?:dpsk::ep|deep_ep)::")
#: the library a collective comes from, by the names of its kernels, op and annotations (first
#: match wins; NCCL-named kernels on ROCm are RCCL's, see :func:`library_of`)
LIBRARIES = (
    (re.compile(r"dpsk::ep::|deep_ep::|deep_ep\b", re.I), "DeepEP"),
    (re.compile(r"nvshmem", re.I), "NVSHMEM"),
    (re.compile(r"multimem_|symm_mem::|one_shot_all_reduce|two_shot_all_reduce"), "torch symmetric memory"),
    (re.compile(r"cross_device_reduce_[12]stage"), "vLLM custom all-reduce"),
    (re.compile(r"allreduce_fusion_kernel|[Oo]neShotAllReduce|[Tt]woShotAllReduce"), "TensorRT-LLM custom all-reduce"),
    (re.compile(r"hccl", re.I), "HCCL"),
    (re.compile(r"xccl|oneccl|^ccl:", re.I), "oneCCL/XCCL"),
    (re.compile(r"^gloo:"), "gloo"),
    (re.compile(r"rccl", re.I), "RCCL"),
    (re.compile(r"nccl", re.I), "NCCL"),
)
#: the CPU ops that launch them (each kernel's External id names its op): collectives issued
#: without ``record_param_comms``
EXTRA_ISSUE_OPS = (
    "symm_mem::multimem_all_reduce_",
    "symm_mem::multimem_one_shot_all_reduce",
    "symm_mem::multimem_one_shot_all_reduce_out",
    "symm_mem::multimem_all_gather_out",
    "symm_mem::one_shot_all_reduce",
    "symm_mem::one_shot_all_reduce_out",
    "symm_mem::two_shot_all_reduce_",
    "symm_mem::two_shot_all_reduce_out",
)
MEMORY_NAME_RX = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
NOT_COMPUTE_RX = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)"
    r"|(^runFunction)|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)"
    r"|(^collective_subgraph_execution)"
)

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv", "broadcast", "barrier", "other")

_COLLECTIVE_NAME_KIND = {
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_coalesced": "all_gather",
    "_all_gather_base": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "recvanysource": "send_recv",
    "sendrecv": "send_recv",
    "broadcast": "broadcast",
    "_broadcast_oop": "broadcast",
    "barrier": "barrier",
}
_KERNEL_KIND = [
    ("AllGather", "all_gather"),
    ("ReduceScatter", "reduce_scatter"),
    ("AllReduce", "all_reduce"),
    ("all_reduce", "all_reduce"),  # symmetric memory (multimem_all_reduce_kernel …)
    ("cross_device_reduce", "all_reduce"),  # vLLM custom all-reduce
    ("allreduce", "all_reduce"),
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("AllToAll", "all_to_all"),
    ("SendRecv", "send_recv"),
    ("alltoall", "all_to_all"),  # NVSHMEM, oneCCL
    ("Send", "send_recv"),
    ("Recv", "send_recv"),
    ("Broadcast", "broadcast"),
]


def kind_from_collective_name(name: str | None) -> str | None:
    if not name:
        return None
    key = name.strip().lower()
    if key in _COLLECTIVE_NAME_KIND:
        return _COLLECTIVE_NAME_KIND[key]
    for prefix in ("nccl:", "gloo:", "hccl:", "xccl:", "c10d::"):
        key = key.removeprefix(prefix)
    key = key.rstrip("_")
    return _COLLECTIVE_NAME_KIND.get(key)


def kind_from_kernel_name(name: str) -> str | None:
    if _EP_KERNEL_RX.search(name):  # DeepEP's dispatch / combine / notify: the expert all-to-all
        return "all_to_all"
    for token, kind in _KERNEL_KIND:
        if token in name:
            return kind
    return None


def message_bytes(kind: str, a: Args | None) -> int | None:
    """Collective size in the nccl-tests convention: the full buffer (all-gather output,
    reduce-scatter input, all-reduce buffer, all-to-all buffer)."""
    if a is None:
        return None
    width = dtype_bytes(a.dtype)
    if width is None:
        return None
    if kind == "all_gather":
        n = a.out_nelems
    elif kind == "reduce_scatter":
        n = a.in_nelems
    else:
        n = max(a.in_nelems or 0, a.out_nelems or 0) or None
    return None if n is None else int(n) * width


def bus_factor(kind: str, n: int | None) -> float:
    """nccl-tests busBw = algBw × factor."""
    if not n or n < 1:
        return 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass
class Collective:
    kind: str
    name: str  # Collective name arg, nccl:* annotation, or kernel name
    cpu_row: int  # record_param_comms row, -1 when found only as a kernel
    cpu_ts: float
    cpu_thread: int
    dtype: str | None = None
    in_nelems: int | None = None
    out_nelems: int | None = None
    group_size: int | None = None
    pg_name: str | None = None
    pg_desc: str | None = None
    bytes: int | None = None
    kernel_rows: list[int] = field(default_factory=list)
    gpu_start: float | None = None
    gpu_end: float | None = None
    stream: int | None = None
    # filled by later analyses
    step: int = -1
    microbatch: int = -1  # forward pass of the step it belongs to (0-based)
    phase: str = "other"
    labels: list[str] = field(default_factory=list)
    unit: str | None = None
    issue_label: str | None = None  # the innermost FSDP label that issued it
    role: str = "other"  # see ROLES
    group_size_recorded: bool = False  # the trace's Group size arg said it
    exposed_us: float = 0.0
    cpu_dur: float = 0.0  # µs the issuing CPU op took (the whole collective for gloo)
    library: str = "unknown"  # see LIBRARIES: NCCL, RCCL, DeepEP, NVSHMEM, gloo …
    # a collective without GPU kernels (gloo on CPU): the backend's own ``gloo:*`` span, on its
    # worker thread, from the issuing op's start (the c10d op itself only enqueues it); µs
    cpu_comm_us: float | None = None
    backend_span: str | None = None  # that annotation's name
    blocks: int | None = None  # the most thread blocks one of its kernels launched (the SMs it holds)

    @property
    def gpu_dur_us(self) -> float | None:
        if self.gpu_start is None or self.gpu_end is None:
            return None
        return self.gpu_end - self.gpu_start

    def busbw_gbps(self) -> float | None:
        d = self.gpu_dur_us
        if not self.bytes or not d or d <= 0:
            return None
        return self.bytes / (d * 1e-6) / 1e9 * bus_factor(self.kind, self.group_size)


def comm_kernel_mask(rt: RankTrace, hta: bool = False) -> np.ndarray:
    """Collective kernels: by name (NCCL/RCCL/HCCL, and the all-reduce kernels outside NCCL of
    :data:`EXTRA_COMM_NAME_RX` unless ``hta``: Holistic Trace Analysis's rule counts them as
    compute) or by their collective args. Read once per trace (a copy each time)."""
    return trace_cache(rt, f"comm kernels hta={hta}", lambda: _comm_kernel_mask(rt, hta)).copy()


def _comm_kernel_mask(rt: RankTrace, hta: bool) -> np.ndarray:
    """``kernel & (by name | by args)``, read on the kernel rows and the rows with args."""
    by_name = name_lut(
        rt,
        (lambda n: COMM_NAME_RX.match(n) is not None)
        if hta
        else (lambda n: COMM_NAME_RX.match(n) is not None or EXTRA_COMM_NAME_RX.match(n) is not None),
    )
    out = np.zeros(len(rt), dtype=bool)
    kern_code = rt.cat_code("kernel")
    if kern_code < 0:
        return out
    kern = np.flatnonzero(rt.cat == kern_code)
    out[kern] = by_name[rt.name[kern]]
    with_coll = trace_cache(
        rt,
        "rows with collective args",
        lambda: np.array([i for i, a in rt.args.items() if a.collective is not None], dtype=np.int64),
    )
    if with_coll.size:
        out[with_coll[rt.cat[with_coll] == kern_code]] = True
    return out


LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# CPU calls that block until GPU work is done (a pageable or synchronous copy returns when its
# copy is done)
SYNC_NAMES = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "hipDeviceSynchronize",
    "hipStreamSynchronize",
    "hipEventSynchronize",
    "hipMemcpy",
    "hipMemcpyAsync",
)


def launch_rows(rt: RankTrace, rows: np.ndarray) -> np.ndarray:
    """The runtime/driver row that launched each GPU row (same correlation id), or -1."""
    out = np.full(rows.size, -1, dtype=np.int64)
    if rows.size == 0:
        return out
    index = trace_cache(rt, "launches by correlation", lambda: _launch_index(rt))
    want = rt.correlation[rows]
    if isinstance(index, np.ndarray):  # a table by correlation id
        ok = (want >= 0) & (want < index.size)
        out[ok] = index[want[ok]]
        return out
    launch, order, corr_sorted = index
    if launch.size == 0:
        return out
    pos = np.minimum(corr_sorted.searchsorted(want), corr_sorted.size - 1)
    hit = (want >= 0) & (corr_sorted[pos] == want)
    out[hit] = launch[order[pos[hit]]]
    return out


def _launch_index(rt: RankTrace) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runtime/driver rows by correlation id, read once per trace: a table of the first
    such row of each id (-1: none) where the ids stay within a few times the trace's rows, else
    the rows, their order by id and the sorted ids."""
    launch = np.flatnonzero(rt.mask_cat(*LAUNCH_CATS) & (rt.correlation >= 0))
    corr = rt.correlation[launch]
    if launch.size and int(corr.max()) <= 4 * len(rt.ts) < 2**31:
        table = np.full(int(corr.max()) + 1, len(rt.ts), dtype=np.int32)
        np.minimum.at(table, corr, launch.astype(np.int32))  # the first row of each id
        table[table == len(rt.ts)] = -1
        return table
    order = np.argsort(corr, kind="stable")
    return launch, order, corr[order]


# kinds whose buffer size is the first input's size, so recorded shapes give the bytes
SHAPE_SIZED_KINDS = ("all_reduce", "broadcast", "all_to_all", "send_recv")


def _is_backend_annotation(name: str) -> bool:
    return name.startswith(("nccl:", "gloo:", "hccl:", "xccl:"))


def library_of(names: list[str], has_kernels: bool, rocm: bool, backend: str | None) -> str:
    """The communication library of a collective, from the names of its kernels, op and
    annotations (:data:`LIBRARIES`); NCCL-named kernels on ROCm are RCCL's. A collective without
    kernels or a name that says is the process group backend's (``gloo`` on CPU)."""
    for n in names:
        for rx, lib in LIBRARIES:
            if rx.search(n):
                return "RCCL" if lib == "NCCL" and rocm else lib
    b = (backend or "").lower()
    if not has_kernels and "gloo" in b:
        return "gloo"
    if has_kernels and ("nccl" in b or not b):
        return "RCCL" if rocm else "NCCL"
    return "unknown"


#: gloo reduces-scatters with an all-reduce (``c10d::_reduce_scatter_base_`` → ``gloo:all_reduce``):
#: kinds whose backend spans are matched as one sequence
_SPAN_GROUP = {"reduce_scatter": "all_reduce"}


def _backend_spans(rt: RankTrace, colls: list[Collective], ann: np.ndarray) -> None:
    """Give each collective without kernels the next backend annotation (``gloo:*``, ``hccl:*`` …,
    on the backend's worker thread) of its kind that starts at or after its issuing op, in order,
    each annotation once: its duration is the collective's communication time."""
    todo = [c for c in colls if not c.kernel_rows and c.cpu_row >= 0]
    if not todo or not ann.size:
        return
    by_kind: dict[str, list[int]] = {}
    for a in ann[np.argsort(rt.ts[ann], kind="stable")].tolist():
        if rt.row_name(a).startswith("nccl:"):  # NCCL's annotation is the CPU's enqueue; its kernels are the work
            continue
        k = kind_from_collective_name(rt.row_name(a))
        if k is not None:
            by_kind.setdefault(_SPAN_GROUP.get(k, k), []).append(a)
    pos: dict[str, int] = {}
    for c in sorted(todo, key=lambda c: c.cpu_ts):
        g = _SPAN_GROUP.get(c.kind, c.kind)
        rows = by_kind.get(g, [])
        i = pos.get(g, 0)
        while i < len(rows) and rt.ts[rows[i]] < c.cpu_ts:
            i += 1
        if i < len(rows):
            a = rows[i]
            c.cpu_comm_us = float(rt.dur[a])
            c.backend_span = rt.row_name(a)
            i += 1
        pos[g] = i


def kernel_blocks(rt: RankTrace, rows: list[int]) -> int | None:
    """The most thread blocks any of these kernels launched (its ``grid``): a communication
    kernel's blocks each hold one SM for its whole run (NCCL's channels, DeepEP's ``num_sms``)."""
    best = None
    for k in rows:
        a = rt.args.get(k)
        if a is None or a.grid is None:
            continue
        g = decode_list(a.grid)
        if g and all(isinstance(x, int) and x > 0 for x in g):
            n = int(np.prod(g))
            best = n if best is None else max(best, n)
    return best


def no_collectives_text(world_size: int | None) -> str:
    """What a rank without recognised collectives says: never "single process" against the
    trace's own world size (a rank of a larger job whose communication the trace does not show)."""
    if (world_size or 1) > 1:
        return f"no collectives recognised in this trace (world size {world_size})"
    return "no collectives"


def is_c10d_collective(name: str) -> bool:
    return (name.startswith("c10d::") and kind_from_collective_name(name) is not None) or name in EXTRA_ISSUE_OPS


def issue_rows(rt: RankTrace) -> np.ndarray:
    """Rows that issue a collective on the CPU: ``record_param_comms`` (NCCL, old and new) and
    c10d collective ops (``c10d::_allgather_base_`` …; the only record in gloo traces)."""
    return name_rows(rt, lambda n: n == "record_param_comms" or is_c10d_collective(n), "cpu_op")


def _nelems(dims) -> int:
    if isinstance(dims, list):
        if all(isinstance(d, int) for d in dims):
            return int(np.prod(dims)) if dims else 1
        return sum(_nelems(d) for d in dims if isinstance(d, list) and d)
    return 0


def args_from_shapes(name: str, a: Args | None, kind: str, group_size: int | None = None) -> Args | None:
    """Sizes and dtype of a c10d collective op from its recorded input shapes (gloo traces)."""
    if a is None or a.input_dims is None:
        return None
    dims, types = decode_list(a.input_dims), decode_list(a.input_type)
    if not dims:
        return None
    first = _nelems(dims[0])
    second = _nelems(dims[1]) if len(dims) > 1 else first
    dtype = next(
        (t for t in types if isinstance(t, str) and t and t not in ("TensorList", "Scalar", "ScalarList")), None
    )
    if dtype is None and types and types[0] == "TensorList":
        dtype = None
    if dtype is not None and name in EXTRA_ISSUE_OPS:
        dtype = dtype.removeprefix("c10::")  # as record_param_comms names it: BFloat16
    op = name.removeprefix("c10d::").rstrip("_")
    if kind in ("all_gather", "reduce_scatter") and op in (
        "_allgather_base",
        "allgather_into_tensor_coalesced",
        "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced",
    ):
        out_n, in_n = first, second  # (output, input, ...)
    elif op == "allgather":
        # (output tensor lists, input tensor list): outputs are recorded empty; gather = n x input
        in_n = second
        out_n = in_n * group_size if group_size else None
    else:
        out_n = in_n = first
    return Args(collective=op, in_nelems=in_n, out_nelems=out_n, dtype=dtype)


def find_collectives(rt: RankTrace, chains: dict[int, list[int]], group_size: int | None = None) -> list[Collective]:
    """Collectives of one rank.

    ``chains`` maps each issue row (see :func:`issue_rows`) to its enclosing label rows (see
    :func:`fsdpdoctor.analysis.labels.enclosing`). One collective per outermost issue row; a
    ``record_param_comms`` inside a c10d op lends it its args and its kernels' External id.
    ``group_size`` is the fallback when the trace does not say (gloo ops carry no group).
    """
    rows = issue_rows(rt)
    row_set = set(int(r) for r in rows)
    comm_k = np.flatnonzero(comm_kernel_mask(rt))
    kern_by_ext: dict[int, list[int]] = {}
    for r in comm_k:
        x = int(rt.external_id[r])
        if x >= 0:
            kern_by_ext.setdefault(x, []).append(int(r))
    # inner record_param_comms of each outer issue row
    inner: dict[int, list[int]] = {}
    outer_rows = []
    for r in rows:
        r = int(r)
        parents = [c for c in chains.get(r, []) if c in row_set]
        if parents:
            inner.setdefault(parents[0], []).append(r)
        else:
            outer_rows.append(r)
    # ``nccl:*`` / ``gloo:*`` annotations recorded inside an issue row name its collective
    ann = name_rows(rt, _is_backend_annotation, "user_annotation")
    child_ann: dict[int, str] = {}
    if ann.size and outer_rows:
        for a_row, chain in enclosing(rt, np.array(outer_rows, dtype=np.int64), ann).items():
            if chain:
                child_ann.setdefault(chain[0], rt.row_name(a_row))
    out: list[Collective] = []
    used_kernels: set[int] = set()
    for r in outer_rows:
        members = [r] + inner.get(r, [])
        label_names = [rt.row_name(c) for c in chains.get(r, [])]
        kernels = [k for m in members if rt.external_id[m] >= 0 for k in kern_by_ext.get(int(rt.external_id[m]), [])]
        a = next((rt.args[m] for m in members if m in rt.args and rt.args[m].collective), None)
        if a is None:
            a = next((rt.args[k] for k in kernels if k in rt.args and rt.args[k].collective), None)
        own = rt.row_name(r)
        kind = kind_from_collective_name(a.collective if a else None)
        name = a.collective if a and a.collective else None
        if kind is None and own.startswith("c10d::"):
            kind = kind_from_collective_name(own)
            name = own
        if kind is None and own in EXTRA_ISSUE_OPS:
            kind, name = kind_from_kernel_name(own), own
        if kind is None:
            for ln in [*reversed(label_names), child_ann.get(r, "")]:
                if _is_backend_annotation(ln):
                    kind = kind_from_collective_name(ln)
                    if kind:
                        name = name or ln
                        break
        if kind is None:
            for k in kernels:
                kind = kind_from_kernel_name(rt.row_name(k))
                if kind:
                    name = name or rt.row_name(k)
                    break
        if kind is None and not kernels:
            continue  # a record_param_comms with nothing to say what it is
        kind = kind or "other"
        if a is None and (own.startswith("c10d::") or kind in SHAPE_SIZED_KINDS):
            a = args_from_shapes(own, rt.args.get(r), kind, group_size)
        c = Collective(
            kind=kind,
            name=name or "unknown",
            cpu_row=r,
            cpu_ts=float(rt.ts[r]),
            cpu_thread=int(rt.thread[r]),
            labels=label_names,
        )
        c.cpu_dur = float(rt.dur[r])
        _fill_args(c, a)
        if c.group_size is None:
            c.group_size = group_size
        _attach_kernels(rt, c, kernels)
        used_kernels.update(kernels)
        out.append(c)
    # kernels whose External id names no issue row (2023-era traces number them differently):
    # the runtime call that launched them (same correlation id) sits inside the issuing op
    orphans = np.array([int(k) for k in comm_k if int(k) not in used_kernels], dtype=np.int64)
    if orphans.size and out:
        launches = launch_rows(rt, orphans)
        has = launches >= 0
        by_row = {c.cpu_row: c for c in out}
        owners = enclosing(rt, np.array(sorted(by_row), dtype=np.int64), launches[has])
        for k, lr in zip(orphans[has], launches[has]):
            chain = owners.get(int(lr), [])
            if chain:
                c = by_row[chain[0]]
                _attach_kernels(rt, c, c.kernel_rows + [int(k)])
                used_kernels.add(int(k))
    # kernels with no CPU op found at all (launched before the trace window, trimmed traces):
    # the GPU-side ``nccl:*`` annotation around the kernel still names the collective
    left = np.array([int(k) for k in comm_k if int(k) not in used_kernels], dtype=np.int64)
    gpu_ann = name_rows(rt, _is_backend_annotation, "gpu_user_annotation")
    around = enclosing(rt, gpu_ann, left) if left.size and gpu_ann.size else {}
    for k in left:
        k = int(k)
        a = rt.args.get(k)
        chain = around.get(k, [])
        kind = (
            kind_from_collective_name(a.collective if a else None)
            or kind_from_kernel_name(rt.row_name(k))
            or (kind_from_collective_name(rt.row_name(chain[-1])) if chain else None)
            or "other"
        )
        c = Collective(
            kind=kind,
            name=(a.collective if a and a.collective else rt.row_name(k)),
            cpu_row=-1,
            cpu_ts=float(rt.ts[k]),
            cpu_thread=-1,
        )
        _fill_args(c, a)
        _attach_kernels(rt, c, [k])
        out.append(c)
    _backend_spans(rt, out, ann)
    rocm = any(n.startswith("hip") for n in rt.names)
    backend = rt.distributed_info.get("backend") if isinstance(rt.distributed_info.get("backend"), str) else None
    libraries: dict[tuple, str] = {}
    for c in out:
        names = [rt.row_name(k) for k in c.kernel_rows[:1]] + [c.name, *c.labels]
        if c.cpu_row in child_ann:
            names.append(child_ann[c.cpu_row])
        if c.backend_span:
            names.append(c.backend_span)
        lib_key = (tuple(names), bool(c.kernel_rows))  # collectives repeat every step: each case read once
        if lib_key not in libraries:
            libraries[lib_key] = library_of(names, bool(c.kernel_rows), rocm, backend)
        c.library = libraries[lib_key]
        c.blocks = kernel_blocks(rt, c.kernel_rows)
    out.sort(key=lambda c: c.cpu_ts)
    return out


ROLES = ("fsdp_shard", "hsdp_replicate", "tensor_parallel", "expert", "data_parallel", "other")
_FSDP_LABEL_PREFIXES = ("FSDP::", "FullyShardedDataParallel.")
# DeviceMesh names its groups ``mesh_<dim>`` (shared/notes/process-groups.md); torchtitan's dims
_DESC_ROLE = (
    (("replicate", "dp_replicate"), "hsdp_replicate"),
    (("tp",), "tensor_parallel"),
    (("ep", "efsdp", "expert"), "expert"),
    (("shard", "dp_shard", "dp", "fsdp", "dp_shard_cp"), "fsdp_shard"),
)


def role_of_desc(desc: str | None) -> str | None:
    """Role a DeviceMesh group description names (``mesh_tp`` → tensor_parallel), or None."""
    if not desc or not desc.startswith("mesh_"):
        return None
    dim = desc[len("mesh_") :]
    for names, role in _DESC_ROLE:
        if dim in names:
            return role
    return None


def mesh_sizes(pg_config: list[dict]) -> dict[str, int]:
    """Role → group size from ``distributedInfo.pg_config`` (mesh groups only)."""
    out: dict[str, int] = {}
    for g in pg_config:
        if not isinstance(g, dict):
            continue
        role = role_of_desc(g.get("pg_desc"))
        size = g.get("pg_size")
        if role is not None and isinstance(size, int) and role not in out:
            out[role] = size
    return out


def assign_roles(colls: list[Collective], pg_config: list[dict], world_size: int | None, ddp: bool = False) -> None:
    """Give every collective its process-group role and, where the trace did not record it, the
    size of its group.

    Order of evidence: the group's own description (``Process Group Description`` on NCCL
    collectives: ``mesh_tp`` …); the FSDP hook that issued it (all-gather / reduce-scatter of a
    unit → FSDP shard group; an all-reduce inside the post-backward reduce → the HSDP replicate
    group, or data parallel without any reduce-scatter); DDP labels → data parallel; otherwise,
    in an FSDP run whose mesh has a ``tp`` dimension, tensor parallel; all-reduces of a DDP run
    (``ddp``: the trace has ``DistributedDataParallel.*`` labels) are data parallel. Group sizes: the trace's
    ``Group size`` arg, else output/input elements of an all-gather / reduce-scatter (gloo), else
    the size of the mesh group of that role in ``pg_config``, else the world size.
    """
    sizes = mesh_sizes(pg_config)
    desc_by_name = {str(g.get("pg_name")): g.get("pg_desc") for g in pg_config if isinstance(g, dict)}
    size_by_name = {str(g.get("pg_name")): g.get("pg_size") for g in pg_config if isinstance(g, dict)}
    fsdp_run = any(any(lab.startswith(_FSDP_LABEL_PREFIXES) for lab in c.labels) for c in colls)
    sharded = any(
        c.kind == "reduce_scatter" and any(lab.startswith(_FSDP_LABEL_PREFIXES) for lab in c.labels) for c in colls
    )
    for c in colls:
        recorded = c.group_size if c.group_size_recorded else None
        desc = c.pg_desc or desc_by_name.get(str(c.pg_name)) if c.pg_name is not None or c.pg_desc else None
        role = role_of_desc(desc)
        in_fsdp = any(lab.startswith(_FSDP_LABEL_PREFIXES) for lab in c.labels)
        if role is None:
            if in_fsdp and c.kind in ("all_gather", "reduce_scatter"):
                role = "fsdp_shard"
            elif in_fsdp and c.kind == "all_reduce":
                role = "hsdp_replicate" if sharded else "data_parallel"
            elif c.kind in ("all_reduce", "broadcast") and any(
                lab.startswith("DistributedDataParallel.") for lab in c.labels
            ):
                role = "data_parallel"  # buffer broadcast / all-reduce in DDP's forward (model-parallel ops inside it are not)
            elif fsdp_run and "tensor_parallel" in sizes:
                role = "tensor_parallel"
            elif ddp and not fsdp_run and c.kind == "all_reduce":
                role = "data_parallel"  # DDP's reducer all-reduces buckets from autograd hooks, under no label
            elif c.name in EXTRA_ISSUE_OPS:
                role = "tensor_parallel"  # symmetric-memory all-reduce: a tensor-parallel layer's (vLLM, async TP)
            else:
                role = "other"
        c.role = role
        if recorded is None and c.pg_name is not None and isinstance(size_by_name.get(str(c.pg_name)), int):
            recorded = size_by_name[str(c.pg_name)]
        if recorded is not None:
            c.group_size = recorded
        elif c.kind == "all_gather" and c.in_nelems and c.out_nelems and c.out_nelems % c.in_nelems == 0:
            c.group_size = c.out_nelems // c.in_nelems
        elif c.kind == "reduce_scatter" and c.in_nelems and c.out_nelems and c.in_nelems % c.out_nelems == 0:
            c.group_size = c.in_nelems // c.out_nelems
        elif role in sizes:
            c.group_size = sizes[role]
        elif c.group_size is None:
            c.group_size = world_size
    _replica_dtypes(colls)


def _replica_dtypes(colls: list[Collective]) -> None:
    """gloo records no dtype for all-reduces: an HSDP replica all-reduce reduces the output of the
    reduce-scatter issued just before it inside the same FSDP hook, so it has that dtype."""
    last_rs: dict[str, Collective] = {}
    for c in sorted(colls, key=lambda c: c.cpu_ts):
        hook = c.labels[-1] if c.labels else ""
        if c.kind == "reduce_scatter":
            last_rs[hook] = c
        elif c.kind == "all_reduce" and c.role == "hsdp_replicate" and c.dtype is None and hook in last_rs:
            rs = last_rs[hook]
            width = dtype_bytes(rs.dtype)
            if width and c.in_nelems and rs.out_nelems == c.in_nelems:
                c.dtype = rs.dtype
                c.bytes = int(c.in_nelems) * width


def parallelism_facts(colls: list[Collective], pg_config: list[dict], n_steps: int):
    """Mesh sizes: the group size of each role's collectives (the most common one)."""
    from collections import Counter

    from fsdpdoctor.facts import ParallelismFacts

    def size(role: str) -> int | None:
        sz = Counter(c.group_size for c in colls if c.role == role and c.group_size)
        return sz.most_common(1)[0][0] if sz else None

    n = max(n_steps, 1)
    roles = Counter(c.role for c in colls if c.step >= 0)
    pf = ParallelismFacts(
        shard_size=size("fsdp_shard"),
        replicate_size=size("hsdp_replicate"),
        tp_size=size("tensor_parallel"),
        dp_size=size("data_parallel"),
        roles={r: k / n for r, k in sorted(roles.items())},
    )
    groups = [
        f"{g.get('pg_desc')}={g.get('pg_size')}"
        for g in pg_config
        if isinstance(g, dict) and role_of_desc(g.get("pg_desc"))
    ]
    pf.evidence = "group sizes from collective args / all-gather and reduce-scatter element ratios" + (
        f"; mesh groups in distributedInfo.pg_config: {', '.join(groups)}" if groups else ""
    )
    return pf


def _fill_args(c: Collective, a: Args | None) -> None:
    if a is None:
        return
    c.dtype = a.dtype
    c.in_nelems = a.in_nelems
    c.out_nelems = a.out_nelems
    c.group_size = a.group_size
    c.group_size_recorded = a.group_size is not None
    c.pg_name = a.pg_name
    c.pg_desc = a.pg_desc
    c.bytes = message_bytes(c.kind, a)


def _attach_kernels(rt: RankTrace, c: Collective, kernels: list[int]) -> None:
    if not kernels:
        return
    c.kernel_rows = list(kernels)
    c.gpu_start = float(min(rt.ts[k] for k in kernels))
    c.gpu_end = float(max(rt.ts[k] + rt.dur[k] for k in kernels))
    c.stream = int(rt.stream[kernels[0]])
