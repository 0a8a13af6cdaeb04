"""Repeated blocks of a model, read from the weight shapes of its forward GEMMs.

A transformer's forward pass is a prefix (embeddings), the same block N times, and a suffix (the
final norm, the head). With ``record_shapes=True`` every ``aten::mm`` / ``aten::addmm`` records its
operands, and the second (``mm``) or third (``addmm``) one is the weight, (K, N): the sequence of
weight shapes of one forward pass repeats with the block's period. The longest periodic run is
taken as the blocks (the smallest period where several cover the same run): how many there are,
the GEMM weight and bias elements of one, and where each one's forward starts on the CPU.

The backward GEMMs (grad input, grad weight, a recomputed forward under activation checkpointing)
repeat per block too, blocks last to first: block j's backward ends where the backward GEMMs of
the block before it begin, after its own norms and residuals. Norm weights and embeddings have
no GEMM: they count with the remainder, which is what a per-block wrapping leaves to the root
unit.

With gradient accumulation the blocks are read from the step's first forward pass and their
backward ends from its last backward pass (the one that reduces gradients).

Used by the what-if replay to split a too-coarse unit the way per-block wrapping would
(:func:`fsdpdoctor.analysis.whatif.fix_wrap`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.ingest.shapes import decode_list
from fsdpdoctor.analysis.rows import name_rows
from fsdpdoctor.analysis.steps import PHASES, StepWindow, locate

WEIGHT_OPS = {"aten::mm": 1, "aten::addmm": 2}  # op → position of the weight among its inputs
MIN_BLOCKS = 2


@dataclass
class RepeatedBlocks:
    count: int  # blocks in one forward pass
    period: int  # forward GEMMs per block
    block_numel: int  # GEMM weight and bias elements of one block
    # per step index: CPU µs where each block's first forward GEMM starts, and where each block's
    # backward ends (where the previous block's backward GEMMs begin; None: at the end of the pass)
    forward_starts: dict[int, list[float]] = field(default_factory=dict)
    backward_ends: dict[int, list[float | None]] = field(default_factory=dict)


def _weight(name: str, raw) -> tuple[int, int, bool] | None:
    """(K, N, has bias) of a GEMM's weight operand, from its recorded Input Dims."""
    dims = decode_list(raw)
    pos = WEIGHT_OPS[name]
    if len(dims) <= pos:
        return None
    w = dims[pos]
    if not (isinstance(w, list) and len(w) == 2 and all(isinstance(x, int) for x in w)):
        return None
    return int(w[0]), int(w[1]), name == "aten::addmm"


def _numel(sig: tuple[int, int, bool]) -> int:
    k, n, bias = sig
    return k * n + (n if bias else 0)


def periodic_run(sigs: list) -> tuple[int, int, int] | None:
    """(start, period, repeats) of the longest run of ``sigs`` that repeats one window at least
    MIN_BLOCKS times; among periods covering as much, the smallest. None when nothing repeats."""
    n = len(sigs)
    best = None  # (covered, -period, start, period, repeats)
    codes: dict = {}
    arr = np.array([codes.setdefault(s, len(codes)) for s in sigs], dtype=np.int64)
    for p in range(1, n // MIN_BLOCKS + 1):
        same = np.concatenate([arr[p:] == arr[:-p], [False]])
        # runs of True in ``same``: from i0 to i1, the window repeats over [i0, i1 + p)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], same.astype(np.int8), [0]])))
        for i0, i1 in zip(edges[::2].tolist(), edges[1::2].tolist()):
            reps = (i1 - i0 + p) // p
            if reps < MIN_BLOCKS:
                continue
            cand = (reps * p, -p, i0, p, reps)
            if best is None or cand[:2] > best[:2]:
                best = cand
    return None if best is None else (best[2], best[3], best[4])


def repeated_blocks(rt: RankTrace, steps: list[StepWindow]) -> RepeatedBlocks | None:
    """The repeated blocks of the first step with recorded GEMM shapes, located in every step
    whose forward GEMMs have the same shapes. None without shapes or repetition."""
    gemm = name_rows(rt, lambda n: n in WEIGHT_OPS, "cpu_op")
    if gemm.size == 0 or not steps:
        return None
    gemm = gemm[np.argsort(rt.ts[gemm], kind="stable")]
    ts_all = rt.ts[gemm]
    g_step, g_phase = locate(steps, ts_all)
    fwd, bwd = PHASES.index("forward"), PHASES.index("backward")
    out: RepeatedBlocks | None = None
    ref: list | None = None
    runs: dict = {}  # backward GEMM shapes → their periodic run (steps repeat them)
    for st, step in enumerate(steps):
        in_step = g_step == st
        if step.microbatches:  # gradient accumulation: one forward pass, and the backward that reduces
            rows = _within(gemm, ts_all, in_step, step.microbatches[0].get("forward"))
            back = _within(gemm, ts_all, in_step, step.microbatches[-1].get("backward"))
        else:
            rows, back = gemm[in_step & (g_phase == fwd)], gemm[in_step & (g_phase == bwd)]
        if rows.size < MIN_BLOCKS:
            continue
        sigs = []
        for r in rows.tolist():
            a = rt.args.get(r)
            s = _weight(rt.row_name(r), a.input_dims) if a is not None and a.input_dims is not None else None
            if s is None:
                break
            sigs.append(s)
        if len(sigs) != rows.size:
            continue
        if out is None:
            run = periodic_run(sigs)
            if run is None:
                return None
            i0, p, reps = run
            out = RepeatedBlocks(reps, p, sum(_numel(s) for s in sigs[i0 : i0 + p]))
            ref, start = sigs, i0
        elif sigs != ref:
            continue
        ts = rt.ts[rows].astype(np.float64)
        out.forward_starts[st] = [float(ts[start + j * out.period]) for j in range(out.count)]
        ends = _backward_ends(rt, back, out.count, runs)
        if ends is not None:
            out.backward_ends[st] = ends
    return out


def _within(rows: np.ndarray, ts: np.ndarray, mask: np.ndarray, window) -> np.ndarray:
    """``rows[mask]`` whose start lies in ``window`` (a (start, end) pair; none without one)."""
    if not window:
        return rows[:0]
    return rows[mask & (ts >= window[0]) & (ts < window[1])]


def _backward_ends(rt: RankTrace, rows: np.ndarray, count: int, runs: dict) -> list[float | None] | None:
    """Per block in forward order, the CPU µs its backward ends: where the backward GEMMs of the
    block before it (in forward order) begin; None for the first block (it ends the pass). The
    backward GEMMs repeat per block like the forward ones (grad input, grad weight, and any
    recomputed forward): their periodic run must hold as many blocks as the forward's."""
    sigs = []
    for r in rows.tolist():
        a = rt.args.get(r)
        if a is None or a.input_dims is None:
            return None
        sigs.append((rt.row_name(r), bytes(a.input_dims)))
    sigs = tuple(sigs)
    if sigs not in runs:
        runs[sigs] = periodic_run(list(sigs))
    run = runs[sigs]
    if run is None or run[2] != count:
        return None
    i0, p, _ = run
    ts = rt.ts[rows].astype(np.float64)
    # backward runs the blocks last to first: forward block j is backward block count-1-j, and
    # the next one (forward block j-1) starts at i0 + (count-j)·p
    return [float(ts[i0 + (count - j) * p]) if j > 0 else None for j in range(count)]
