"""What a Flight Recorder entry's Python stack says: the phase of the step, the FSDP operation, and
the user's line that led to it (for :mod:`fsdpdoctor.analysis.hang`).

A stack is the list of frames the recorder captured when the collective was enqueued, innermost
first (``all_gather_into_tensor`` in ``distributed_c10d.py`` first, the script's ``<module>``
last). Frames are recognised by function name and file, as they are in torch 2.4-2.13:

* FSDP2 (``torch/distributed/fsdp/_fully_shard/``, ``_composable/fsdp/`` before 2.6): an
  all-gather under ``foreach_all_gather`` / ``FSDPParamGroup.unshard``, issued in forward from
  ``pre_forward`` (the unit's forward pre-hook) or in backward from ``pre_backward``; the
  gradient reduction under ``foreach_reduce`` from ``post_backward`` (reduce-scatter on NCCL; an
  all-reduce on gloo, which has no reduce-scatter), the last one from
  ``_root_post_backward_final_callback``.
* FSDP1 (``torch/distributed/fsdp/_runtime_utils.py``, ``_flat_param.py``): ``_unshard`` /
  ``_all_gather_flat_param`` from ``_pre_forward`` or ``_pre_backward_hook``; ``_reduce_grad``
  from ``_post_backward_hook``.
* the phase: backward when the autograd engine (``_engine_run_backward``,
  ``Tensor.backward``) is on the stack, forward when a module call or FSDP's forward hook is,
  optimizer for ``torch/optim`` and ``clip_grad_norm_``; anything else is "other" (a collective
  the training script calls itself, such as a metric's all-reduce).
* the call site: the innermost frame outside torch and the Python library (``train.py:88``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Iterable

from fsdpdoctor.ingest.flight_recorder import Frame

_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python", "/torch/", "\\site-packages\\", "\\torch\\")
_BACKWARD = {
    "_engine_run_backward",
    "run_backward",
    "_backward_hook",
    "_post_backward_hook",
    "_pre_backward_hook",
    "post_backward",
    "pre_backward",
    "_root_post_backward_final_callback",
    "_post_backward_final_callback",
}
_FORWARD = {
    "_pre_forward",
    "pre_forward",
    "_root_pre_forward",
    "_call_impl",
    "_wrapped_call_impl",
    "_pre_forward_unshard",
}


@dataclass(frozen=True, slots=True)
class StackInfo:
    phase: str  # forward / backward / optimizer / other / "" (no stack)
    fsdp: str | None  # "FSDP2 unshard", "FSDP2 post_backward reduce", "FSDP1 unshard", ... or None
    fsdp_kind: str | None  # "unshard" / "reduce" / "init" / None: what the ordinal within a pass counts
    call_site: str | None  # "train.py:88 (main)": the innermost frame outside torch and the library


def is_library(filename: str) -> bool:
    return filename.startswith("<") or any(s in filename for s in _LIBRARY)


def site(f: Frame) -> str:
    return f"{PurePath(f.filename).name}:{f.line} in {f.name}"


def short_path(filename: str) -> str:
    """A library file from where its package starts (``torch/distributed/...``, ``multiprocessing/...``);
    the training script's files as recorded."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    i = filename.find("/lib/python")
    if i >= 0:
        rest = filename[i + len("/lib/python") :]
        return rest.split("/", 1)[1] if "/" in rest else rest
    return filename


def frame_text(f: Frame) -> str:
    return f"{f.name} ({short_path(f.filename)}:{f.line})"


def read_stack(frames: Iterable[Frame]) -> StackInfo:
    frames = list(frames)
    if not frames:
        return StackInfo("", None, None, None)
    names = {f.name for f in frames}
    torch_names = {f.name for f in frames if is_library(f.filename)}
    fsdp2 = any("/_fully_shard/" in f.filename or "/_composable/fsdp/" in f.filename for f in frames)
    fsdp1 = not fsdp2 and any("/distributed/fsdp/" in f.filename for f in frames)
    if torch_names & _BACKWARD or any(
        f.name == "backward" and ("/autograd/" in f.filename or f.filename.endswith("_tensor.py")) for f in frames
    ):
        phase = "backward"
    elif any("/torch/optim/" in f.filename for f in frames) or "clip_grad_norm_" in names:
        phase = "optimizer"
    elif torch_names & _FORWARD:
        phase = "forward"
    else:
        phase = "other"
    fsdp, kind = None, None
    if fsdp2:
        if names & {"foreach_reduce", "post_backward", "_root_post_backward_final_callback"}:
            fsdp, kind = "FSDP2 post_backward reduce", "reduce"
        elif names & {"foreach_all_gather", "unshard", "wait_for_unshard"}:
            fsdp, kind = "FSDP2 unshard", "unshard"
        elif names & {"lazy_init", "_lazy_init", "_init_shared_state"}:
            fsdp, kind = "FSDP2 lazy init", "init"
        else:
            fsdp, kind = "FSDP2", None
    elif fsdp1:
        if names & {"_reduce_grad", "_post_backward_hook", "_reduce_grad_no_shard"}:
            fsdp, kind = "FSDP1 post_backward reduce", "reduce"
        elif names & {"_unshard", "_all_gather_flat_param", "unshard"}:
            fsdp, kind = "FSDP1 unshard", "unshard"
        elif names & {"_lazy_init", "_sync_module_params_and_buffers", "_init_param_handle_from_module"}:
            fsdp, kind = "FSDP1 init", "init"
        else:
            fsdp, kind = "FSDP1", None
    elif "clip_grad_norm_" in names:
        fsdp = "clip_grad_norm_"
    user = next((f for f in frames if not is_library(f.filename)), None)
    return StackInfo(phase, fsdp, kind, site(user) if user is not None else None)
