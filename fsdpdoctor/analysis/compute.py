"""Compute efficiency of one rank: FLOPs from recorded shapes, the engine each GEMM ran on, MFU.

FLOPs follow ``torch.utils.flop_counter.FlopCounterMode``: a matrix product of (M, K) by (K, N)
is 2·M·K·N (``mm``, ``addmm``, ``_scaled_mm``, batched for ``bmm`` / ``baddbmm``); scaled dot
product attention forward is two batched products, 4·B·H·P·D, its backward five,
2·B·H·P·(3·D + 2·Dv), where P is the (query, key) pairs the kernel computes: Sq·Sk, or about half
of it under the causal mask (``is_causal`` in the op's ``Concrete Inputs``; FlopCounterMode counts
the full square, TraceLens the triangle: this counts what the kernel computes). They are counted on the operators
that carry the shapes (``record_shapes=True``: ``Input Dims`` / ``Input type``) and attributed to
the GPU kernels those operators launched (the kernel's ``External id`` names its innermost CPU
op; attention kernels are launched by an inner op of the counted SDPA op). Composite ops
(``aten::linear``, ``aten::matmul``) are not counted: the ``addmm`` / ``mm`` inside them are.

A GEMM or attention op found inside the backward pass *under a forward composite*
(``aten::linear``, ``aten::matmul``, ``aten::scaled_dot_product_attention``) is activation
checkpointing's recompute: hardware FLOPs (HFU) count it, model FLOPs (MFU) do not.

Each such kernel is put on an engine from its name (cuBLAS / CUTLASS / xmma / nvjet on NVIDIA,
rocBLAS / hipBLASLt / Tensile on AMD) and, where the name does not say, the op's input dtype:
``fp32-simt`` (fp32 FMA on CUDA cores), ``tf32``, ``bf16``, ``fp16``, ``fp8``, ``fp4-fp8`` (an
e2m1 MXFP4 / NVFP4 operand times an FP8 one), ``fp4`` (tensor cores), ``fp32`` (fp32 inputs,
engine unknown).

GEMM and attention kernels that no counted op launched (a trace without shapes; custom ops such as
vLLM's fused MoE and FP8 attention) are found by their names (:func:`kernel_class`) and, where the
name states their engine (:func:`engine_in_name`), add their time to the engine's, without FLOPs
(:func:`add_named_kernels`).
"""

from __future__ import annotations

import math

import functools
import re
from dataclasses import dataclass

import msgspec
import numpy as np

from fsdpdoctor.facts import ComputeFacts
from fsdpdoctor.ingest.events import ATTN_BWD_OPS, ATTN_FWD_OPS, CONV_OPS, FLOP_OPS
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.ingest.shapes import decode_list, engine
from fsdpdoctor.analysis.compile_window import compile_rows
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.columns import Columns
from fsdpdoctor.analysis.comms import comm_kernel_mask, launch_rows
from fsdpdoctor.analysis.labels import enclosing
from fsdpdoctor.analysis.rows import name_rows, trace_cache
from fsdpdoctor.analysis.peaks import ENGINE_PEAK_DTYPE, device_peaks, has_tensor_cores
from fsdpdoctor.analysis.steps import PHASES, StepWindow, locate

#: a forward op found under one of these inside backward is checkpointing's recompute
FORWARD_COMPOSITES = frozenset(
    {
        "aten::linear",
        "aten::matmul",
        "aten::scaled_dot_product_attention",
        "aten::einsum",
        "aten::conv1d",
        "aten::conv2d",
        "aten::conv3d",
    }
)

ENGINES = ("fp32-simt", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4-fp8", "fp4")
TENSOR_CORE = frozenset({"tf32", "bf16", "fp16", "fp8", "fp4-fp8", "fp4"})
#: kernel names of matmuls and attention, for kernels no counted op launched (traces without
#: recorded shapes; custom ops such as vLLM's fused MoE): cuBLAS / cuBLASLt (``*gemm*``,
#: ``nvjet*``), CUTLASS, xmma, Tensile (``Cijk_``), TensorRT-LLM's generated GEMMs (``bmm_*``);
#: FBGEMM's embedding kernels (``fbgemm_gpu::``) are not GEMMs
MATMUL_NAME_RX = re.compile(r"^(?!.*fbgemm)(?:.*(?:gemm|nvjet|Cijk_|cutlass.*Kernel2|xmma|cublas)|bmm_)", re.I)
#: attention kernels: FlashAttention (``flash::flash_fwd_kernel``, ``FlashAttnFwdSm90``), cuDNN /
#: CUTLASS / TensorRT-LLM fmha, FlashInfer's prefill / decode, Triton ``attn_fwd``; not the
#: KV-cache writes named after them (``reshape_and_cache_flash_kernel``) nor FlashInfer's other
#: kernels (``flashinfer::`` quantization)
ATTENTION_NAME_RX = re.compile(
    r"^(?!.*(?:cache_flash|_cache_kernel))"
    r"(?:.*(?:fmha|flash_?(?:fwd|bwd|attn)|flashattn|flash::|attention|sdpa|attn_fwd|attn_bwd|(?:Prefill|Decode)With))",
    re.I,
)


@functools.lru_cache(maxsize=4096)
def kernel_class(name: str) -> str | None:
    """ "attention" or "gemm" when a kernel's name says it is one, else None."""
    if ATTENTION_NAME_RX.match(name):
        return "attention"
    if MATMUL_NAME_RX.match(name):
        return "gemm"
    return None


@functools.lru_cache(maxsize=4096)  # a trace repeats a few hundred kernel names many thousand times
def kernel_engine(name: str, op_dtype: str | None) -> str:
    """The engine a GEMM / attention kernel ran on, from its name, else its op's input dtype
    (which also tells bf16 from fp16 where a 16-bit kernel's name does not: cuDNN and MIOpen
    name bf16 kernels ``f16`` / ``half``)."""
    e = _engine_from_name(name, op_dtype)
    if e in ("bf16", "fp16") and op_dtype in ("bf16", "fp16"):
        return op_dtype
    return e


#: TensorRT-LLM's generated GEMMs: ``bmm_<out>_<A><B>_<accumulator>_…`` and
#: ``Gemm…Kernel_<out>_<A and B>_<accumulator>_…`` (the output dtype first: ``bmm_Bfloat16_
#: MxE2m1MxE4m3_Fp32`` multiplies MXFP4 by MXFP8 and writes bf16)
_TRTLLM_GEN = re.compile(r"^(?:bmm|Bmm|Gemm\w*Kernel)_((?:Mx)?[A-Z][a-z0-9]+)_((?:(?:Mx)?[A-Z][a-z0-9]+)+?)_Fp32_")
_TRTLLM_DTYPE = {"e4m3": "fp8", "e5m2": "fp8", "e2m1": "fp4", "bfloat16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def _trtllm_gen_engine(name: str) -> str | None:
    m = _TRTLLM_GEN.match(name)
    if m is None:
        return None
    ins = {_TRTLLM_DTYPE.get(t.lower().removeprefix("mx")) for t in re.findall(r"(?:Mx)?[A-Z][a-z0-9]+", m.group(2))}
    if None in ins or not ins:
        return None
    if ins == {"fp4"}:
        return "fp4"
    if ins == {"fp4", "fp8"}:
        return "fp4-fp8"  # Blackwell's mixed-operand MMA (FP4 × FP8) runs at the FP8 rate
    if "fp8" in ins:
        return "fp8"
    for d in ("bf16", "fp16"):  # 16-bit activations (FP4 weights widened in the kernel: W4A16)
        if d in ins:
            return d
    return None


def engine_in_name(name: str) -> str | None:
    """The engine a GEMM / attention kernel's name states, None where it does not say."""
    gen = _trtllm_gen_engine(name)
    if gen is not None:
        return gen
    n = name.lower()
    if "e2m1" in n:  # FP4 operands (MXFP4 / NVFP4)
        return "fp4-fp8" if ("e4m3" in n or "e5m2" in n) else "fp4"
    if any(k in n for k in ("e4m3", "e5m2", "fp8", "f8f6f4", "_f8_")):
        return "fp8"
    if "simt" in n or "ffma" in n or ("sgemm" in n and "tensorop" not in n) or ("fmha_cutlass" in n and "f32" in n):
        return "fp32-simt"
    if "bf16" in n or "bfloat16" in n or "_bbs_" in n or "_bb_" in n:
        return "bf16"
    if (
        "fp16" in n
        or "h1688" in n
        or "h16816" in n
        or "h884" in n  # Volta's fp16 HMMA (volta_h884gemm_…)
        or "hmma" in n
        or "_hhs_" in n
        or "half" in n
        or re.search(r"(?<!b)f16", n)
    ):
        return "fp16"
    if (
        "tf32" in n or "xf32" in n or "s1688" in n or "s16816" in n
    ):  # fp32 inputs on tensor cores (CUTLASS "s" = single)
        return "tf32"
    return None


def _engine_from_name(name: str, op_dtype: str | None) -> str:
    e = engine_in_name(name)
    if e is not None:
        return e
    if op_dtype in ("bf16", "fp16", "fp8"):
        return op_dtype
    return "fp32" if op_dtype == "fp32" else (op_dtype or "fp32")


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _ints(v) -> list[int] | None:
    """A concrete list argument ("[2, 2]" or [2, 2]) as ints."""
    if isinstance(v, str):
        try:
            v = msgspec.json.decode(v.encode()) if v else None
        except msgspec.DecodeError:
            return None
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v] if isinstance(v, list) and all(isinstance(x, int) for x in v) else None


def conv_flops(dims: list, concrete: list | None, backward: bool) -> float | None:
    """A convolution: 2 · N · prod(output spatial) · prod(weight) (FlopCounterMode's conv_flop);
    its backward (grad input and grad weight) twice that. The forward's output size needs the
    strides, padding and dilation from ``Concrete Inputs``; the backward has it as grad_output."""
    if backward:  # grad_output, input, weight, ...
        go, w = dims[0], dims[2]
        return 2.0 * 2.0 * go[0] * _prod(go[2:]) * _prod(w)
    x, w = dims[0], dims[1]  # input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    c = concrete or []
    stride, pad, dil = (_ints(c[i]) if len(c) > i else None for i in (3, 4, 5))
    if not stride or pad is None or not dil or len(x) < 3:
        return None
    nsp = len(x) - 2
    stride, pad, dil = ((v * nsp) if len(v) == 1 else v for v in (stride, pad, dil))
    out = [(x[2 + i] + 2 * pad[i] - dil[i] * (w[2 + i] - 1) - 1) // stride[i] + 1 for i in range(nsp)]
    return 2.0 * x[0] * _prod(out) * _prod(w)


#: position of ``is_causal`` among each attention op's arguments (its ATen schema), as its
#: ``Concrete Inputs`` list them
CAUSAL_ARG = {
    "aten::_scaled_dot_product_flash_attention": 4,
    "aten::_scaled_dot_product_efficient_attention": 6,
    "aten::_scaled_dot_product_cudnn_attention": 6,
    "aten::_scaled_dot_product_flash_attention_backward": 11,
    "aten::_scaled_dot_product_efficient_attention_backward": 11,
    "aten::_scaled_dot_product_cudnn_attention_backward": 14,
}


def is_causal(name: str, concrete: list | None) -> bool:
    """Whether an attention op ran with the causal mask: its ``is_causal`` argument in the op's
    recorded ``Concrete Inputs`` (False where the trace does not say)."""
    i = CAUSAL_ARG.get(name)
    return bool(concrete) and i is not None and len(concrete) > i and str(concrete[i]).strip() == "True"


def attended_pairs(sq: int, sk: int, causal: bool) -> float:
    """(query, key) pairs an attention kernel computes: Sq·Sk, or under the causal mask (aligned
    to the top left, as ``is_causal`` is) the lower triangle, Sq²/2 when Sq ≤ Sk and
    Sk²/2 + (Sq − Sk)·Sk beyond it (TraceLens's count: the kernels skip the masked blocks)."""
    if not causal:
        return float(sq) * sk
    if sq <= sk:
        return sq * sq / 2.0
    return sk * sk / 2.0 + float(sq - sk) * sk


def op_flops(name: str, dims: list, concrete: list | None = None) -> float | None:
    """FLOPs of one counted op from its input dims (None: the shapes do not fit the op, or give
    no finite, non-negative count: dims no profiler writes, such as 1e308 or negative sizes)."""
    f = _op_flops(name, dims, concrete)
    return f if f is None or (0.0 <= f < math.inf) else None


def _op_flops(name: str, dims: list, concrete: list | None = None) -> float | None:
    try:
        if name in CONV_OPS:
            return conv_flops(dims, concrete, name.endswith("_backward"))
        t = [d for d in dims if isinstance(d, list)]
        if name in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = t[0], t[1]
            return 2.0 * m * k * n
        if name in ("aten::addmm", "aten::_addmm_activation"):
            (m, k), (_, n) = t[1], t[2]
            return 2.0 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = t[0], t[1]
            return 2.0 * b * m * k * n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = t[1], t[2]
            return 2.0 * b * m * k * n
        if name in ATTN_FWD_OPS:  # q, k, v: (B, H, S, D)
            q, k, v = t[0], t[1], t[2]
            b, h, sq, d = q
            pairs = attended_pairs(sq, k[2], is_causal(name, concrete))
            return 2.0 * b * h * pairs * d + 2.0 * b * h * pairs * v[3]
        if name in ATTN_BWD_OPS:  # grad_out, q, k, v
            q, k, v = t[1], t[2], t[3]
            b, h, sq, d = q
            pairs = attended_pairs(sq, k[2], is_causal(name, concrete))
            return 2.0 * b * h * pairs * (3 * d + 2 * v[3])
    except (ValueError, TypeError, IndexError):
        return None
    return None


def _op_dtype(raw) -> str | None:
    for x in decode_list(raw):
        if isinstance(x, str) and x:
            return engine(x) or x
    return None


def launching_ops(rt: RankTrace, rows: np.ndarray) -> np.ndarray:
    """The CPU op that launched each GPU row: the ``cpu_op`` with the row's ``External id`` (the
    innermost op open at the launch), or -1.

    2023-era traces number a kernel's ``External id`` as its correlation id, which names no CPU
    op (the public send/recv trace: ``aten::mm`` 2864 launches ``ampere_sgemm`` 837038): for
    those, the runtime call with the same correlation id, and the innermost CPU op around it on
    its thread (as the collectives' orphan kernels, :func:`fsdpdoctor.analysis.comms.launch_rows`)."""
    out = np.full(rows.size, -1, dtype=np.int64)
    srt, sext = ops_by_external_id(rt)
    if srt.size == 0 or rows.size == 0:
        return out
    want = rt.external_id[rows]
    k = np.minimum(np.searchsorted(sext, want), sext.size - 1)
    hit = (want >= 0) & (sext[k] == want)
    out[hit] = srt[k[hit]]
    by_corr = np.flatnonzero(~hit & (want >= 0) & (want == rt.correlation[rows]))
    if by_corr.size:
        launches = launch_rows(rt, rows[by_corr])
        found = launches >= 0
        chains = enclosing(rt, np.flatnonzero(rt.mask_cat("cpu_op")), np.unique(launches[found]))
        for j, lr in zip(by_corr[found].tolist(), launches[found].tolist()):
            chain = chains.get(lr, [])
            if chain:
                out[j] = chain[-1]
    return out


def ops_by_external_id(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """The CPU ops with an ``External id``, in the order of their ids (rows in order among equal
    ids), and the sorted ids; read once per trace."""
    return trace_cache(rt, "cpu ops by external id", lambda: _ops_by_external_id(rt))


def _ops_by_external_id(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    ops_all = np.flatnonzero(rt.mask_cat("cpu_op") & (rt.external_id >= 0))
    srt = ops_all[np.argsort(rt.external_id[ops_all], kind="stable")]
    return (srt.astype(np.int32) if len(rt.ts) < 2**31 else srt), rt.external_id[srt]


@dataclass
class KernelFlops:
    """Per GPU kernel row of the trace that a counted op launched: its FLOPs and engine."""

    rows: np.ndarray  # kernel rows
    flops: np.ndarray  # FLOPs attributed to each (the op's, split by kernel duration)
    engine: list[str]
    attention: np.ndarray  # bool
    recompute: np.ndarray  # bool
    ops: np.ndarray | None = None  # the counted op row that launched each (its shapes and name)


def analyze_compute(
    rt: RankTrace, steps: list[StepWindow], device_name: str | None, n_steps: int
) -> tuple[ComputeFacts, KernelFlops]:
    """FLOPs, kernel time by engine and achieved throughput of one rank (step time filled in by
    :func:`finish`, which needs the run's step clock); GEMM and attention kernels that no op with
    recorded shapes launched are added to the time by engine from their names
    (:func:`add_named_kernels`)."""
    cf, kf = _from_shapes(rt, steps, ComputeFacts(device=device_name), n_steps)
    add_named_kernels(rt, steps, cf, kf, n_steps)
    return cf, kf


def add_named_kernels(rt: RankTrace, steps: list[StepWindow], cf: ComputeFacts, kf: KernelFlops, n_steps: int) -> None:
    """Kernels that are GEMMs or attention by their names (:func:`kernel_class`) and state their
    engine (:func:`engine_in_name`) but that no counted op launched (no shapes in the trace, or a
    custom op: vLLM's fused MoE, FP8 paged attention): their time per step goes to
    ``engine_ms_per_step`` (and ``named_ms_per_step``), without FLOPs. A step's kernels are those
    its CPU span launched; with no launch in the trace, none. Sets ``source`` to "names" where
    there were no shapes."""
    kern = np.flatnonzero(rt.mask_cat("kernel"))
    if kern.size == 0 or not steps:
        return
    kern = kern[~comm_kernel_mask(rt)[kern] & ~np.isin(kern, kf.rows)]
    ids = rt.name[kern].astype(np.int64)
    uniq, inv = np.unique(ids, return_inverse=True)
    cls = [kernel_class(rt.names[int(i)]) for i in uniq.tolist()]
    eng = [engine_in_name(rt.names[int(i)]) if c else None for c, i in zip(cls, uniq.tolist())]
    keep_u = np.array([e is not None for e in eng], dtype=bool)
    if not keep_u.any():
        return
    sel = keep_u[inv.reshape(-1)]
    kern, inv = kern[sel], inv.reshape(-1)[sel]
    lr = launch_rows(rt, kern)
    found = lr >= 0
    step_idx, _ = locate(steps, rt.ts[np.where(found, lr, kern)].astype(np.float64))
    mine = found & (step_idx >= 0)
    if not mine.any():
        return
    kern, inv = kern[mine], inv[mine]
    n = max(n_steps, 1)
    dur = rt.dur[kern].astype(np.float64)
    for u in np.unique(inv).tolist():
        m = inv == u
        e, t = eng[u], float(dur[m].sum()) / 1e3 / n
        cf.engine_ms_per_step[e] = cf.engine_ms_per_step.get(e, 0.0) + t
        cf.named_ms_per_step += t
        if cls[u] == "attention":
            cf.attention_engine_ms_per_step[e] = cf.attention_engine_ms_per_step.get(e, 0.0) + t
    if not cf.source:
        cf.source = "names"
        cf.tensor_cores = has_tensor_cores(cf.device)
    _engines_and_peak(cf)


def _from_shapes(
    rt: RankTrace, steps: list[StepWindow], cf: ComputeFacts, n_steps: int
) -> tuple[ComputeFacts, KernelFlops]:
    """:func:`analyze_compute` over the ops with recorded shapes."""
    counted = name_rows(rt, lambda n: n in FLOP_OPS, "cpu_op")
    empty = KernelFlops(np.zeros(0, np.int64), np.zeros(0), [], np.zeros(0, bool), np.zeros(0, bool))
    compiling = compile_rows(rt)
    if compiling.size and counted.size:
        chains = enclosing(rt, compiling, counted)
        inside = np.fromiter((bool(chains[r]) for r in counted.tolist()), dtype=bool, count=counted.size)
        cf.ops_in_compile = int(inside.sum())
        counted = counted[~inside]
    if counted.size == 0:
        return cf, empty
    names = [rt.names[c] for c in rt.name[counted].tolist()]
    flops = np.zeros(counted.size)
    dtypes: list[str | None] = []
    missing = 0
    # a step repeats the same shapes: each distinct (op, dims, concrete inputs) is decoded once
    by_shape: dict[tuple, float | None] = {}
    by_type: dict[bytes, str | None] = {}
    for i, (r, n) in enumerate(zip(counted.tolist(), names)):
        a = rt.args.get(r)
        f = None
        if a is not None and a.input_dims is not None:
            ci = a.concrete_inputs
            key = (n, bytes(a.input_dims), None if ci is None else bytes(ci))
            if key in by_shape:
                f = by_shape[key]
            else:
                f = by_shape[key] = op_flops(n, decode_list(a.input_dims), decode_list(ci))
        if f is None:
            missing += 1
        flops[i] = f or 0.0
        dt = None
        if a is not None and a.input_type is not None:
            t = bytes(a.input_type)
            dt = by_type[t] if t in by_type else by_type.setdefault(t, _op_dtype(a.input_type))
        dtypes.append(dt)
    cf.ops_with_shapes = int(counted.size - missing)
    cf.ops_without_shapes = int(missing)
    if cf.ops_with_shapes == 0:
        return cf, empty
    is_attn = np.array([n in ATTN_FWD_OPS or n in ATTN_BWD_OPS for n in names])
    fwd_op = np.array([n not in ATTN_BWD_OPS for n in names])
    # recompute: a forward op under a forward composite, inside the backward pass
    comp_rows = name_rows(rt, lambda n: n in FORWARD_COMPOSITES, "cpu_op")
    chains = enclosing(rt, comp_rows, counted)
    step_idx, phase_idx = locate(steps, rt.ts[counted])
    backward = phase_idx == PHASES.index("backward")
    under = np.array([bool(chains.get(int(r))) for r in counted])
    recompute = backward & under & fwd_op
    # kernels of each counted op: the kernel's External id names its innermost op; that op is
    # the counted op or lies inside it
    kern = np.flatnonzero(rt.mask_cat("kernel") & (rt.external_id >= 0))
    launcher = launching_ops(rt, kern)
    kern, launcher = kern[launcher >= 0], launcher[launcher >= 0]
    pos = {int(r): i for i, r in enumerate(counted.tolist())}
    owner = np.array([pos.get(int(x), -1) for x in launcher.tolist()], dtype=np.int64)
    inner = np.flatnonzero(owner < 0)
    if inner.size:
        up = enclosing(rt, counted, np.unique(launcher[inner]))
        for j in inner.tolist():
            chain = up.get(int(launcher[j]), [])
            owner[j] = pos[chain[-1]] if chain else -1
    kern, owner = kern[owner >= 0], owner[owner >= 0]
    if kern.size == 0:
        return cf, empty
    kdur = rt.dur[kern].astype(np.float64)
    tot = np.bincount(owner, weights=kdur, minlength=counted.size)
    kflops = np.where(tot[owner] > 0, flops[owner] * kdur / np.where(tot[owner] > 0, tot[owner], 1.0), 0.0)
    engines = [kernel_engine(rt.row_name(int(r)), dtypes[o]) for r, o in zip(kern.tolist(), owner.tolist())]
    n = max(n_steps, 1)
    in_step = step_idx >= 0
    cf.flops_per_step = float(flops[in_step].sum()) / n
    cf.recompute_flops_per_step = float(flops[in_step & recompute].sum()) / n
    cf.model_flops_per_step = cf.flops_per_step - cf.recompute_flops_per_step
    cf.attention_flops_per_step = float(flops[in_step & is_attn].sum()) / n
    cf.matmul_flops_per_step = cf.flops_per_step - cf.attention_flops_per_step
    for p, name in enumerate(PHASES):
        v = float(flops[in_step & (phase_idx == p)].sum()) / n
        if v:
            cf.flops_by_phase[name] = v
    kstep = step_idx[owner] >= 0
    ks, ke = rt.ts[kern].astype(np.float64), (rt.ts[kern] + rt.dur[kern]).astype(np.float64)
    attn_k = is_attn[owner]
    gemm_t = iv.total(iv.merge(ks[kstep & ~attn_k], ke[kstep & ~attn_k])) / 1e3 / n
    attn_t = iv.total(iv.merge(ks[kstep & attn_k], ke[kstep & attn_k])) / 1e3 / n
    cf.gemm_ms_per_step, cf.attention_ms_per_step = gemm_t, attn_t
    rk = kstep & recompute[owner]
    cf.recompute_ms_per_step = iv.total(iv.merge(ks[rk], ke[rk])) / 1e3 / n
    gf = float(kflops[kstep & ~attn_k].sum()) / n
    af = float(kflops[kstep & attn_k].sum()) / n
    cf.gemm_tflops = gf / (gemm_t * 1e9) if gemm_t > 0 else None
    cf.attention_tflops = af / (attn_t * 1e9) if attn_t > 0 else None
    by_engine: dict[str, float] = {}
    by_engine_flops: dict[str, float] = {}
    eng = np.array(engines, dtype=object)
    for e in sorted(set(engines)):
        m = kstep & (eng == e)
        by_engine[e] = float(kdur[m].sum()) / 1e3 / n
        by_engine_flops[e] = float(kflops[m].sum()) / n
        if (m & attn_k).any():
            cf.attention_engine_ms_per_step[e] = float(kdur[m & attn_k].sum()) / 1e3 / n
    cf.engine_ms_per_step = by_engine
    cf.engine_tflops = {e: by_engine_flops[e] / (by_engine[e] * 1e9) for e in by_engine if by_engine[e] > 0}
    cf.tensor_cores = has_tensor_cores(cf.device)
    _engines_and_peak(cf)
    cf.source = "shapes"
    return cf, KernelFlops(kern, kflops, engines, attn_k, recompute[owner], counted[owner])


def _peak_dtype(engine: str | None) -> str | None:
    return ENGINE_PEAK_DTYPE.get(engine or "")


def finish(cf: ComputeFacts, step_ms: float | None, peak_override: float | None = None) -> ComputeFacts:
    """Achieved TFLOP/s and MFU / HFU on the step clock (``step_ms``) against the device's dense
    BF16 peak (or ``peak_override`` TFLOP/s), and the MFU against the compute dtype's peak."""
    if peak_override:
        cf.peak_tflops, cf.peak_label = float(peak_override), "--peak-tflops"
        cf.dtype_peak, cf.dtype_peak_tflops, cf.peak_dtype = None, None, None
    cf.step_ms = step_ms or 0.0
    if not step_ms or not cf.flops_per_step:
        return cf
    cf.achieved_tflops = cf.model_flops_per_step / (step_ms * 1e9)
    cf.hardware_tflops = cf.flops_per_step / (step_ms * 1e9)
    if cf.peak_tflops:
        cf.mfu_pct = 100.0 * cf.achieved_tflops / cf.peak_tflops
        cf.hfu_pct = 100.0 * cf.hardware_tflops / cf.peak_tflops
    if cf.dtype_peak_tflops:
        cf.dtype_mfu_pct = 100.0 * cf.achieved_tflops / cf.dtype_peak_tflops
    return cf


_MEAN_ATTRS = (
    "flops_per_step",
    "model_flops_per_step",
    "matmul_flops_per_step",
    "attention_flops_per_step",
    "recompute_flops_per_step",
    "gemm_ms_per_step",
    "attention_ms_per_step",
    "recompute_ms_per_step",
)
_RATE_ATTRS = ("gemm_tflops", "attention_tflops")
_DICT_ATTRS = ("flops_by_phase", "engine_ms_per_step", "attention_engine_ms_per_step", "engine_tflops")
_NAMED_DICT_ATTRS = ("engine_ms_per_step", "attention_engine_ms_per_step")


class ComputeFold:
    """:func:`fold` as ranks arrive: each rank's compute figures go into columns (the rank's
    ComputeFacts need not be kept), read back in rank order."""

    __slots__ = ("cols", "first", "first_named")

    def __init__(self) -> None:
        self.cols = Columns()
        self.first: tuple[int, str | None, bool] | None = (
            None  # (rank, device, tensor cores) of the lowest rank with shapes
        )
        self.first_named: tuple[int, str | None, bool] | None = None  # … of the lowest rank with names only

    def add(self, rank: int, c: ComputeFacts | None) -> None:
        if c is None:
            return
        row: dict = {"without": float(c.ops_without_shapes), "in_compile": float(c.ops_in_compile)}
        if c.source == "shapes":
            row["shapes"], row["with"] = 1.0, float(c.ops_with_shapes)
            row["named_ms_per_step"] = c.named_ms_per_step
            for attr in (*_MEAN_ATTRS, *_RATE_ATTRS):
                v = getattr(c, attr)
                if v is not None:
                    row[attr] = v
            for attr in _DICT_ATTRS:
                for k, v in getattr(c, attr).items():
                    row[(attr, k)] = v
            if self.first is None or rank < self.first[0]:
                self.first = (rank, c.device, c.tensor_cores)
        elif c.source == "names":  # used only where no rank has shapes
            row["names"], row["names/named_ms_per_step"] = 1.0, c.named_ms_per_step
            for attr in _NAMED_DICT_ATTRS:
                for k, v in getattr(c, attr).items():
                    row[("names/" + attr, k)] = v
            if self.first_named is None or rank < self.first_named[0]:
                self.first_named = (rank, c.device, c.tensor_cores)
        self.cols.add(rank, row)

    def result(self, step_ms: float | None, peak_override: float | None = None) -> ComputeFacts | None:
        """The run's compute facts: per-device means over the ranks that have them, on the run's
        step clock (the ranks with shapes; where none has, the ranks with GEMM kernels known by name)."""
        if self.first is None:
            return self._named(step_ms, peak_override)
        cols = self.cols
        out = ComputeFacts(device=self.first[1], source="shapes")

        def mean(attr):
            vals = cols.values(attr)
            return float(np.mean(vals)) if vals else None

        for attr in _MEAN_ATTRS:
            setattr(out, attr, mean(attr) or 0.0)
        out.gemm_tflops, out.attention_tflops = mean("gemm_tflops"), mean("attention_tflops")
        out.named_ms_per_step = mean("named_ms_per_step") or 0.0
        out.ops_with_shapes = int(sum(cols.values("with")))
        out.ops_without_shapes = int(sum(cols.values("without")))
        out.ops_in_compile = int(sum(cols.values("in_compile")))
        for attr in _DICT_ATTRS:
            setattr(
                out, attr, {k: float(np.mean(cols.filled((attr, k), 0.0, among="shapes"))) for k in cols.keys(attr)}
            )
        out.tensor_cores = self.first[2]
        _engines_and_peak(out)
        return finish(out, step_ms, peak_override)

    def _named(self, step_ms: float | None, peak_override: float | None) -> ComputeFacts | None:
        if self.first_named is None:
            return None
        cols = self.cols
        out = ComputeFacts(device=self.first_named[1], source="names", tensor_cores=self.first_named[2])
        out.named_ms_per_step = float(np.mean(cols.values("names/named_ms_per_step")))
        out.ops_without_shapes = int(sum(cols.values("without")))
        for attr in _NAMED_DICT_ATTRS:
            key = "names/" + attr
            setattr(out, attr, {k: float(np.mean(cols.filled((key, k), 0.0, among="names"))) for k in cols.keys(key)})
        _engines_and_peak(out)
        return finish(out, step_ms, peak_override)


def fold(
    per_rank: list[ComputeFacts], step_ms: float | None, peak_override: float | None = None
) -> ComputeFacts | None:
    """The run's compute facts: per-device means over the ranks that have them (``per_rank`` in
    rank order), on the run's step clock."""
    acc = ComputeFold()
    for i, c in enumerate(per_rank):
        acc.add(i, c)
    return acc.result(step_ms, peak_override)


def _engines_and_peak(cf: ComputeFacts) -> None:
    """From the kernel time by engine: the dtype mix, the compute dtype (the engine with the most
    time), the device's dense BF16 peak (FP16 where it has none) and its peak for that dtype."""
    total = sum(cf.engine_ms_per_step.values())
    cf.dtype_mix = {e: 100.0 * v / total for e, v in cf.engine_ms_per_step.items()} if total else {}
    cf.compute_dtype = max(cf.engine_ms_per_step, key=cf.engine_ms_per_step.get) if cf.engine_ms_per_step else None
    peaks = device_peaks(cf.device)
    if peaks is not None:
        cf.peak_label = peaks[0]
        cf.device_peaks_tflops = dict(peaks[1])
        pd = _peak_dtype(cf.compute_dtype)
        cf.dtype_peak = pd if pd in peaks[1] else None
        cf.dtype_peak_tflops = peaks[1].get(pd) if pd else None
        cf.peak_dtype = "bf16" if "bf16" in peaks[1] else ("fp16" if "fp16" in peaks[1] else None)
        cf.peak_tflops = peaks[1].get(cf.peak_dtype) if cf.peak_dtype else None
