"""The statement that ran out of memory, and what it already holds.

The failing statement is the innermost user line of the failed request (the first Python frame
outside torch, else the innermost torch line), with its enclosing function. The statement began
at the earliest event, going back from the OOM without a break, that runs in the same call of
that function (the same caller chain, frame for frame) at the failing line or below it (the
further lines of one statement written over several, such as torchtitan's
``F.cross_entropy(`` / ``pred.flatten(0, 1).float(), ...)``); frameless events (the autograd
thread, C++ code) do not break the run. The blocks that statement allocated since and still
holds at the OOM, from its own lines, from torch functions it called (an upcast inside
``F.cross_entropy``) or from a helper of the user's it called (``upcast(logits)``), are its
temporaries: Python frees them once the statement completes, and autograd keeps what torch's
functions return (the log-softmax output), not these. Blocks allocated below a module call
(``nn.Module.__call__``) are left to the lifetime rules: a module's forward saves tensors for
backward.

Nothing here keys on how a test generator writes its stacks: only on the call (function and
callers) and the lines the recorder gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.analysis.memory.allocator import Replay
from fsdpdoctor.analysis.memory.stacks import OPT, PH_FORWARD, PH_OPTIM, PH_RECOMPUTE, FrameInfo, Stack, short_path

#: torch.nn.functional losses over a vocabulary (the log-softmax of the logits is their largest tensor)
_LOSS_FUNCS = {
    "cross_entropy",
    "nll_loss",
    "log_softmax",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
}
#: the ATen ops of those losses, as C++ frames name them (stacks="all")
_LOSS_OPS = {"_log_softmax", "log_softmax", "cross_entropy_loss", "nll_loss_forward", "nll_loss", "nll_loss_nd"}


@dataclass
class Statement:
    site: str  # "function (file:line)", as sites are written
    function: str
    file: str  # short path
    line: int  # the failing line
    lines: list[int]  # the lines of the statement seen in the trace (one statement over several lines)
    kind: str | None  # "loss" / "activation" / "allgather" / "optimizer"; None: not recognised
    op: str | None  # the ATen op of the failed request (C++ frames only)
    first_event_index: int
    temporaries: set[int] = field(default_factory=set)  # block ids

    def as_dict(self, size: np.ndarray) -> dict:
        return {
            "site": self.site,
            "function": self.function,
            "file": self.file,
            "line": self.line,
            "lines": self.lines,
            "kind": self.kind,
            "op": self.op,
            "first_event_index": self.first_event_index,
            "temporaries": len(self.temporaries),
            "temporaries_bytes": int(sum(int(size[b]) for b in self.temporaries)),
        }


def _key(f: FrameInfo) -> tuple[str, str, int]:
    return (f.path, f.name, f.line)


def _kind(s: Stack, anchor: FrameInfo, phase: int) -> str | None:
    if s.label in ("allgather_buffers", "parameters_unsharded"):
        return "allgather"
    if s.label in ("optimizer_state", OPT) or phase == PH_OPTIM:
        return "optimizer"
    torch_loss = any(f.in_torch and f.name in _LOSS_FUNCS and f.path.endswith("nn/functional.py") for f in s.py)
    if torch_loss or s.op in _LOSS_OPS or "loss" in anchor.name.lower():
        return "loss"
    if phase in (PH_FORWARD, PH_RECOMPUTE) and any(f.module_call for f in s.py):
        return "activation"
    return None


def failing_statement(r: Replay, ev: list[Stack], st: list[Stack], phase: np.ndarray) -> Statement | None:
    """The statement of the last OOM and the blocks it holds (module doc); None without an OOM or
    without Python frames on the failed request."""
    if not r.ooms:
        return None
    i = int(r.ooms[-1]["index"])
    s = ev[i] if 0 <= i < len(ev) else None
    if s is None or not s.py:
        return None
    py = s.py
    k = next((j for j, f in enumerate(py) if not f.in_torch), 0)
    anchor = py[k]
    callers = tuple(_key(f) for f in py[k + 1 :])
    depth = len(callers)
    memo: dict[int, tuple[int, bool] | None] = {}

    def in_call(x: Stack) -> tuple[int, bool] | None:
        """(line, below a module call) of stack x in the failing call of the statement's function."""
        got = memo.get(id(x), ())
        if got != ():
            return got
        p, out = x.py, None
        n = len(p)
        if n > depth and (not depth or tuple(_key(f) for f in p[n - depth :]) == callers):
            f = p[n - depth - 1]
            if f.path == anchor.path and f.name == anchor.name:
                out = (f.line, any(g.module_call for g in p[: n - depth - 1]))
        memo[id(x)] = out
        return out

    lines = {anchor.line}
    start = i
    for j in range(i - 1, -1, -1):
        x = ev[j]
        if not x.py:
            continue
        got = in_call(x)
        if got is None or got[0] < anchor.line:
            break
        lines.add(got[0])
        start = j
    held = np.flatnonzero((r.alloc_idx >= start) & (r.alloc_idx < i) & (r.free_req > i))
    temps = set()
    for b in held.tolist():
        if st[b].label is not None:
            continue
        got = in_call(st[b])
        if got is not None and got[0] in lines and not got[1]:
            temps.add(b)
    return Statement(
        site=anchor.site,
        function=anchor.name,
        file=short_path(anchor.path),
        line=anchor.line,
        lines=sorted(lines),
        kind=_kind(s, anchor, int(phase[i])),
        op=s.op,
        first_event_index=start,
        temporaries=temps,
    )
