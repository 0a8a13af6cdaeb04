"""Which CPU ranges enclose an event: the FSDP hook, c10d op and annotation stack above it."""

from __future__ import annotations

import numpy as np

from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis.rows import name_rows

# Ranges worth knowing as ancestors. Everything else (aten ops, python functions) is skipped,
# which keeps the sweep proportional to the number of labels, not of events.
LABEL_PREFIXES = (
    "FSDP::",
    "FullyShardedDataParallel.",
    "DistributedDataParallel.",
    "nccl:",
    "gloo:",
    "c10d::",
    "record_param_comms",
    "ProfilerStep#",
    "Optimizer.",
    "fsdp::",
)


def label_rows(rt: RankTrace) -> np.ndarray:
    """CPU rows whose names make them useful ancestors (FSDP hooks, c10d ops, annotations)."""
    return name_rows(rt, lambda n: n.startswith(LABEL_PREFIXES), "cpu_op", "user_annotation")


def enclosing(rt: RankTrace, labels: np.ndarray, queries: np.ndarray) -> dict[int, list[int]]:
    """For each query row, the label rows on the same thread that contain it, outermost first.

    A label contains a query when it starts no later and ends no earlier. Ranges recorded on one
    thread nest, so a sweep in start order with a stack of open labels finds every chain in
    O((labels + queries) log) time.
    """
    out: dict[int, list[int]] = {q: [] for q in queries.tolist()}
    if labels.size == 0 or queries.size == 0:
        return out
    rows = np.concatenate([labels, queries])
    ts, thr = rt.ts[rows], rt.thread[rows]
    end = ts + rt.dur[rows]  # the rows' own, not every row's
    is_query = np.concatenate([np.zeros(labels.size, bool), np.ones(queries.size, bool)])
    # by thread, then start; at equal starts the longer range first, and a label before a query
    # of the same extent so that the label contains it
    order = np.lexsort((is_query, -end, ts, thr))
    eps = 1e-6
    r_o = rows[order]
    stack: list[int] = []
    stack_end: list[float] = []
    cur_thread = -1
    # plain Python values: indexing numpy arrays element by element is several times slower
    for r, th, e, q in zip(r_o.tolist(), thr[order].tolist(), end[order].tolist(), is_query[order].tolist()):
        if th != cur_thread:
            stack, stack_end = [], []
            cur_thread = th
        # whatever on the stack ends before this row ends cannot contain it (or anything later)
        while stack_end and stack_end[-1] < e - eps:
            stack.pop()
            stack_end.pop()
        if q:
            out[r] = [x for x in stack if x != r]  # a row can be both label and query
        else:
            stack.append(r)
            stack_end.append(e)
    return out


# Hook labels by the pass they run in. FSDP2 (torch 2.4-2.13): ``FSDP::<hook> (<fqn>) [pg=N]``
# and ``FSDP::<pass>_prefetch for <fqn>``; FSDP1: ``FullyShardedDataParallel.<hook>``.
_FORWARD_HOOKS = (
    "pre_forward",
    "post_forward",
    "root_pre_forward",
    "forward_prefetch",
    "forward",
    "_pre_forward",
    "_post_forward",
    "_root_pre_forward",
    "_pre_forward_prefetch",
    "_to_kwargs",
    "inputs_to_device",
    "cast_forward_inputs",
    "cast_forward_outputs",
)
_BACKWARD_MARK = "backward"


def hook_name(label: str) -> str | None:
    """``pre_forward`` for ``FSDP::pre_forward (layers.0) [pg=2]``, ``_pre_backward_hook`` for
    ``FullyShardedDataParallel._pre_backward_hook``; None for a label that is not an FSDP hook."""
    if label.startswith("FSDP::"):
        rest = label[len("FSDP::") :]
    elif label.startswith("FullyShardedDataParallel."):
        rest = label[len("FullyShardedDataParallel.") :]
    else:
        return None
    return rest.split(" ", 1)[0]


def phase_from_labels(labels: list[str]) -> str | None:
    """The pass (``forward`` / ``backward``) of the innermost FSDP hook label that says one:
    pre_forward / forward prefetch → forward; pre_backward, backward_prefetch, post_backward* and
    the root post-backward callback → backward. None when no enclosing hook says."""
    for lab in reversed(labels):
        h = hook_name(lab)
        if h is None:
            continue
        if _BACKWARD_MARK in h:
            return "backward"
        if h in _FORWARD_HOOKS:
            return "forward"
    return None
