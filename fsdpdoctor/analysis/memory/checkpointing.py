"""Activation checkpointing already applied, read from the forward pass's stacks.

A checkpointed block's forward runs under ``torch/utils/checkpoint.py`` (``checkpoint``,
reentrant ``CheckpointFunction.forward``) and, when wrapped with ``checkpoint_wrapper``, under
``checkpoint_wrapper.py``'s ``forward``; with selective checkpointing (a policy from
``create_selective_checkpoint_contexts``) every op also dispatches through the policy's mode,
``checkpoint.py``'s ``__torch_dispatch__``. The user frame just outside the checkpoint frames is
the line that calls the blocks (``h = layer(h)`` in the model's loop); the outermost user frame
inside them is the block's forward. Every forward allocation below such a calling line and a
block's forward belongs to a block, checkpointed or not; consecutive allocations belong to one
call of the block until the calling line or the block's function changes, checkpointing starts or
stops, or an FSDP forward hook (the next unit's all-gather) runs in between; where no FSDP hook
runs between blocks (DDP, one unit for the whole model), until the block's line goes back (the
next block starts at its top).

The verdict is read from the forward pass with the most block calls (the first, on a tie):
``none`` (no allocation runs under checkpoint), ``full`` (every block), ``partial`` (some: the
share is ``checkpointed_blocks / forward_blocks``), ``selective`` (a policy decides per op), or
None when the stacks cannot tell (no forward allocation with Python frames).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdpdoctor.analysis.memory.stacks import PH_FORWARD, FrameInfo, Stack


@dataclass
class Checkpointing:
    verdict: str | None
    checkpointed: int | None  # block calls under checkpoint in the pass read
    blocks: int | None  # block calls in that pass
    unchecked_events: np.ndarray  # bool per event: an allocation in a block call not fully checkpointed


def _key(f: FrameInfo) -> tuple[str, str, int]:
    return (f.path, f.name, f.line)


def _call_site(s: Stack) -> tuple[str, str, int] | None:
    """The user frame that calls a checkpointed block: the first one outside the checkpoint frames."""
    py = s.py
    c = max((j for j, f in enumerate(py) if f.checkpoint), default=-1)
    if c < 0:
        return None
    return next((_key(py[j]) for j in range(c + 1, len(py)) if not py[j].in_torch), None)


def detect(ev: list[Stack], actions: list[str], phase: np.ndarray) -> Checkpointing:
    n = len(ev)
    unchecked = np.zeros(n, dtype=bool)
    fwd = [i for i in range(n) if actions[i] == "alloc" and phase[i] == PH_FORWARD and ev[i].py]
    if not fwd:
        return Checkpointing(None, None, None, unchecked)
    sites = {k for k in (_call_site(s) for s in {id(ev[i]): ev[i] for i in fwd}.values()) if k is not None}
    if not sites:
        return Checkpointing("none", 0, None, unchecked)

    memo: dict[int, tuple | None] = {}

    def block_of(s: Stack) -> tuple | None:
        """(calling line, block function, block line, checkpointed, selective) or None."""
        if id(s) in memo:
            return memo[id(s)]
        py, out = s.py, None
        q = max((j for j, f in enumerate(py) if _key(f) in sites), default=-1)
        inner = [j for j in range(q) if not py[j].in_torch] if q > 0 else []
        if inner:
            b = py[max(inner)]
            below = py[:q]
            ckpt, selective = any(f.checkpoint for f in below), any(f.selective for f in below)
            out = (_key(py[q]), (b.path, b.name), b.line, ckpt, selective)
        memo[id(s)] = out
        return out

    hooks = np.cumsum([x.fsdp is not None and x.phase == PH_FORWARD for x in ev])  # FSDP forward hooks so far
    starts = np.flatnonzero((phase == PH_FORWARD) & np.r_[True, phase[:-1] != PH_FORWARD])  # forward passes
    by_pass: dict[int, list[tuple[int, tuple]]] = {}
    for i in fwd:
        info = block_of(ev[i])
        if info is not None:
            by_pass.setdefault(int(np.searchsorted(starts, i, side="right")), []).append((i, info))
    passes: dict[int, list[list]] = {}  # pass -> block calls [checkpointed, selective, events]
    for p, events in by_pass.items():
        # FSDP units wrap the blocks: their forward hooks separate the calls; else the block's line going back does
        by_hooks = any(hooks[i] != hooks[j] for (j, _), (i, _) in zip(events, events[1:]))
        calls = passes[p] = []
        prev = None
        for i, info in events:
            new = (
                prev is None
                or prev[1][:2] != info[:2]
                or info[3] != prev[1][3]
                or (hooks[i] != hooks[prev[0]] if by_hooks else info[2] < prev[1][2])
            )
            if new:
                calls.append([info[3], info[4], []])
            calls[-1][1] |= info[4]
            calls[-1][2].append(i)
            prev = (i, info)
    for calls in passes.values():
        for ckpt, selective, events in calls:
            if not ckpt or selective:
                unchecked[events] = True
    best = max(passes.values(), key=len, default=[])
    blocks, ckpt = len(best), sum(1 for c in best if c[0])
    selective = any(c[0] and c[1] for c in best)
    verdict = "none" if not ckpt else "selective" if selective else "full" if ckpt == blocks else "partial"
    return Checkpointing(verdict, ckpt, blocks, unchecked)
