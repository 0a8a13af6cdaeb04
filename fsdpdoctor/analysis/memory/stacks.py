"""What an allocation stack says: the rule label of the innermost FSDP / optimizer frame, the
phase marker (forward, backward, optimizer, checkpoint recomputation, between steps) and the
allocation site (the innermost user line, else the innermost Python line).

Frames are innermost first. Match on (path suffix, function name), never on line numbers; ``\\``
is normalised to ``/`` (Windows snapshots exist). See ``notes/memory-categorization.md``.

Stacks come as the recorder wrote them: ``stacks="python"`` gives Python frames only;
``stacks="all"`` (torchtitan's memory profiler, for one) adds C++ frames (``torch::``, ``c10::``,
``at::``, ``??``; line 0, or a ``.cpp`` / ``.h`` file and line where symbols were found) and
CPython's own C frames (``cfunction_call (Objects/methodobject.c:543)``, ``_PyEval_EvalFrameDefault``)
between and after the Python ones. Sites, labels, phases and statements are read from the
Python frames only; the C++ op (``at::_ops::_log_softmax::call``) is kept as the allocation's op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

# =========================================================================== stack frames

# labels beyond CATEGORIES that need lifetime to decide
RS = "rs"  # reduce-scatter input (buffer) or output (sharded gradient)
OPT = "optim"  # inside an optimizer step: state if it survives the step, else temporary

_FSDP2_DIRS = ("torch/distributed/fsdp/_fully_shard/", "torch/distributed/_composable/fsdp/")
_FSDP1_DIR = "torch/distributed/fsdp/"

_FSDP2_RULES = {
    "_fsdp_collectives.py": {
        "foreach_all_gather": "allgather_buffers",
        "_get_param_all_gather_inputs": "allgather_buffers",
        "foreach_all_gather_copy_out": "parameters_unsharded",
        "foreach_reduce": RS,
        "foreach_reduce_scatter": RS,
    },
    "_fsdp_param.py": {
        "alloc_storage": "parameters_unsharded",
        "init_all_gather_outputs": "parameters_unsharded",
        "alloc_all_gather_outputs": "parameters_unsharded",
        "init_unsharded_param": "parameters_unsharded",
        "_init_sharded_param": "parameters_sharded",
        "reset_sharded_param": "parameters_sharded",
        "to_sharded_post_forward": "parameters_sharded",
        "to_accumulated_grad_if_needed": "gradients",
        "accumulate_unsharded_grad_if_needed": "gradients",
        "all_gather_inputs": "allgather_buffers",
    },
}
_FSDP1_RULES = {
    "_flat_param.py": {
        "_alloc_padded_unsharded_flat_param": "parameters_unsharded",
        "unshard": "parameters_unsharded",
        "_all_gather_flat_param": "parameters_unsharded",
        "_use_low_precision_shard": "allgather_buffers",
        "flatten_tensors": "parameters_sharded",
        "flatten_tensors_into_flat_param": "parameters_sharded",
        "_init_flat_param_and_metadata": "parameters_sharded",
        "_get_shard": "parameters_sharded",
        "_get_unpadded_shard": "parameters_sharded",
        "shard": "parameters_sharded",
        "_use_unsharded_grad_views": "gradients",
        "_use_sharded_grad_views": "gradients",
        "prepare_gradient_for_backward": "gradients",
        "prepare_gradient_for_optim": "gradients",
    },
    "_runtime_utils.py": {
        "_get_reduce_scatter_tensors": RS,
        "_reduce_grad": RS,
        "_reduce_grad_no_shard": RS,
        "_post_backward_hook": RS,
        "_cast_grad_to_param_dtype": "gradients",
        "_accumulate_sharded_grad": "gradients",
        "_unshard": "parameters_unsharded",
    },
}
_OPTIM_STATE_FUNCS = {"_init_group", "load_state_dict", "_process_value_according_to_param_policy"}
#: optimizer file stem -> states kept per parameter (besides the parameter)
OPTIM_STATES = {
    "adam": 2,
    "adamw": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,
    "adadelta": 2,
    "sgd": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "rprop": 2,
    "asgd": 2,
}

_BACKWARD_PY = {
    ("torch/_tensor.py", "backward"),
    ("torch/autograd/__init__.py", "backward"),
    ("torch/autograd/__init__.py", "grad"),
    ("torch/autograd/__init__.py", "_make_grads"),
    ("torch/autograd/graph.py", "_engine_run_backward"),
}
_FSDP_BACKWARD_FUNCS = {
    "pre_backward",
    "post_backward",
    "_pre_backward",
    "_post_backward",
    "_pre_backward_hook",
    "_post_backward_hook",
    "_root_post_backward_final_callback",
    "_post_backward_final_callback",
    "foreach_reduce",
    "_reduce_grad",
    "backward",
}
_FSDP_FORWARD_FUNCS = {"pre_forward", "post_forward", "_pre_forward", "_post_forward", "_pre_forward_unshard"}
#: torch/utils/checkpoint.py functions that run the recomputation in backward (non-reentrant:
#: unpack_hook -> recompute_fn on the autograd thread; reentrant: CheckpointFunction.backward)
_RECOMPUTE_FUNCS = {"unpack_hook", "recompute_fn", "_recompute", "backward"}
_CPP_BACKWARD = re.compile(
    r"torch::autograd::(Engine::|generated::\w+Backward|AccumulateGrad)|^<built-in method run_backward "
)
#: source files that are not Python: C / C++ / CUDA sources and headers (CPython's ``Objects/*.c``,
#: ``Python/*.c``, ``Include/cpython/*.h``, generated ``*.c.h``; torch's ``*.cpp``)
_NATIVE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".hxx", ".cu", ".cuh", ".inl", ".inc", ".S", ".s")
#: the ATen operator a C++ frame runs (``at::_ops::_log_softmax::call(...)``)
_CPP_OP = re.compile(r"\bat::_ops::(\w+)::(?:call|redispatch)\b")
#: ops that only hand out memory for another op: the op above them names the allocation
_ALLOCATION_OPS = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "empty_memory_format",
}
#: torch/utils/checkpoint.py and checkpoint_wrapper.py frames a checkpointed forward runs under
_CHECKPOINT_FORWARD = {"checkpoint", "forward", "_checkpoint_without_reentrant_generator", "checkpoint_sequential"}
_MODULE_CALL = ("_call_impl", "_wrapped_call_impl")
#: selective activation checkpointing: the policy's dispatch modes (torch >= 2.4)
_SELECTIVE_FUNCS = {"__torch_dispatch__", "_policy_from_bool", "create_selective_checkpoint_contexts"}
# _memory_viz._profile_to_snapshot writes Python frames as {"filename": "none", "line": 0, "name": "path(line): func"}
_PROFILER_FRAME = re.compile(r"^(?P<path>[^()]+\.py)\((?P<line>\d+)\): (?P<func>.+)$")

PH_UNKNOWN, PH_FORWARD, PH_BACKWARD, PH_OPTIM, PH_RECOMPUTE, PH_IDLE = 0, 1, 2, 3, 4, 5
# PH_RECOMPUTE: checkpoint recomputation (module forwards run inside backward); PH_IDLE: from
# zero_grad to the next forward (the input batch is loaded there: it is not optimizer memory)
PHASE_NAMES = {
    PH_UNKNOWN: None,
    PH_FORWARD: "forward",
    PH_BACKWARD: "backward",
    PH_OPTIM: "optimizer",
    PH_RECOMPUTE: "backward",
    PH_IDLE: None,
}
# which marker wins when one stack carries several (recompute runs module forwards in backward)
_PHASE_PRIORITY = (PH_IDLE, PH_OPTIM, PH_RECOMPUTE, PH_BACKWARD, PH_FORWARD)


@dataclass(frozen=True)
class FrameInfo:
    label: str | None  # rule label when this frame decides the category
    phase: int  # phase marker carried by this frame
    python: bool
    in_torch: bool
    site: str
    fsdp: str | None  # "fsdp1" / "fsdp2" when the frame is FSDP code
    optimizer: str | None  # torch.optim file stem
    autograd: bool = False  # torch/autograd/ code (custom Function.backward runs under it)
    script: bool = False  # a script's top level (`<module>`): the bottom of a main-thread stack
    path: str = ""  # normalised file name
    name: str = ""
    line: int = 0
    op: str | None = None  # the ATen op a C++ frame runs (allocation primitives left out)
    module_call: bool = False  # torch/nn/modules/module.py's _call_impl: a module's forward below it
    checkpoint: bool = False  # a checkpointed forward runs below it (torch.utils.checkpoint, checkpoint_wrapper)
    selective: bool = False  # selective checkpointing's policy dispatch


def is_native(path: str, name: str, line: int) -> bool:
    """A C / C++ / CPython frame (not Python): no line, no file (``??``), a C source or header
    (``Objects/methodobject.c``, ``/build/Python-3.12.3/Python/ceval.c``, ``cpython/abstract.h``,
    ``torch/csrc/...cpp``), or a C++ symbol (``c10::``, ``at::``, ``torch::``)."""
    return (
        line <= 0 or path in ("??", "") or path.endswith(_NATIVE_SUFFIXES) or "/build/Python-" in path or "::" in name
    )


def short_path(path: str) -> str:
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if path.startswith("torch/"):
        return path
    i = path.find("/torch/")
    if i >= 0:
        return path[i + 1 :]
    parts = path.rsplit("/", 2)
    return "/".join(parts[-2:])


@lru_cache(maxsize=1 << 16)
def frame_info(filename: str, name: str, line: int) -> FrameInfo:
    if line == 0 and filename in ("none", "") and (m := _PROFILER_FRAME.match(name)):
        filename, name, line = m["path"], m["func"], int(m["line"])
    path = filename.replace("\\", "/")
    python = not is_native(path, name, line)
    base = path.rsplit("/", 1)[-1]
    label = None
    phase = PH_UNKNOWN
    fsdp = None
    optimizer = None
    in_torch = "/torch/" in path or path.startswith("torch/")
    if python and in_torch:
        if any(d in path for d in _FSDP2_DIRS):
            fsdp = "fsdp2"
            label = _FSDP2_RULES.get(base, {}).get(name)
        elif _FSDP1_DIR in path:
            fsdp = "fsdp1"
            label = _FSDP1_RULES.get(base, {}).get(name)
        if fsdp:
            if name in _FSDP_BACKWARD_FUNCS:
                phase = PH_BACKWARD
            elif name in _FSDP_FORWARD_FUNCS:
                phase = PH_FORWARD
        if path.endswith("torch/optim/optimizer.py") and name == "zero_grad":
            phase = PH_IDLE  # frees gradients; what follows belongs to the next step
        elif "torch/optim/" in path or "torch/distributed/optim/" in path:
            phase = PH_OPTIM
            optimizer = base[:-3] if "torch/optim/" in path else None
            label = "optimizer_state" if name in _OPTIM_STATE_FUNCS else OPT
        elif path.endswith("torch/utils/checkpoint.py"):
            # forward under checkpoint is plain forward (lifetime decides); recomputation is backward
            if name in _RECOMPUTE_FUNCS:
                phase = PH_RECOMPUTE
        elif any(path.endswith(p) and name == f for p, f in _BACKWARD_PY):
            phase = PH_BACKWARD
        elif path.endswith("torch/nn/modules/module.py") and name in ("_call_impl", "_wrapped_call_impl"):
            phase = PH_FORWARD
    elif not python and _CPP_BACKWARD.search(name):
        phase = PH_BACKWARD
    site = f"{name} ({short_path(path)}:{line})" if python else name
    op = None
    if not python and (m := _CPP_OP.search(name)) and m[1] not in _ALLOCATION_OPS:
        op = m[1]
    torch_py = python and in_torch
    ckpt_file = path.endswith(("torch/utils/checkpoint.py", "_checkpoint/checkpoint_wrapper.py"))
    return FrameInfo(
        label,
        phase,
        python,
        in_torch,
        site,
        fsdp,
        optimizer,
        python and "torch/autograd/" in path,
        name == "<module>",
        path=path,
        name=name,
        line=line,
        op=op,
        module_call=torch_py and path.endswith("torch/nn/modules/module.py") and name in _MODULE_CALL,
        checkpoint=torch_py and ckpt_file and name in _CHECKPOINT_FORWARD,
        selective=torch_py and path.endswith("torch/utils/checkpoint.py") and name in _SELECTIVE_FUNCS,
    )


@dataclass(frozen=True)
class Stack:
    """What one allocation/free stack says: its phase marker, rule label and allocation site."""

    phase: int = PH_UNKNOWN
    label: str | None = None
    site: str | None = None
    fsdp: str | None = None
    optimizer: str | None = None
    # no phase marker, nothing from torch/autograd, and the stack bottoms out at a script's top
    # level: the main thread, which is blocked in backward while the autograd thread runs it (whose
    # Python hooks have no `<module>` frame), so such a stack is outside backward
    main_thread: bool = False
    # Python frames, none of them in torch: the user's own line allocated it (a cast, an
    # elementwise op, a tensor creation), not a module, a functional or an optimizer
    user_only: bool = False
    op: str | None = None  # the innermost ATen op of its C++ frames (stacks="all"), allocation primitives left out
    # the Python frames, innermost first (C, C++ and CPython frames left out)
    py: tuple[FrameInfo, ...] = ()


NO_STACK = Stack()


def summarize(key: tuple) -> Stack:
    infos = [frame_info(str(f), str(n), int(ln or 0)) for f, n, ln in key]
    phases = {i.phase for i in infos}
    phase = next((ph for ph in _PHASE_PRIORITY if ph in phases), PH_UNKNOWN)
    hit = next((i for i in infos if i.label is not None), None)  # innermost matching frame wins
    if hit is not None:
        site = hit.site
    else:
        python = [i for i in infos if i.python]
        user = [i for i in python if not i.in_torch]
        site = (user or python)[0].site if python else None
    return Stack(
        phase=phase,
        label=hit.label if hit else None,
        site=site,
        fsdp=next((i.fsdp for i in infos if i.fsdp), None),
        optimizer=next((i.optimizer for i in infos if i.optimizer), None),
        main_thread=phase == PH_UNKNOWN
        and any(i.script for i in infos if i.python)
        and not any(i.autograd for i in infos),
        user_only=any(i.python for i in infos) and not any(i.in_torch for i in infos if i.python),
        op=next((i.op for i in infos if i.op), None),
        py=tuple(i for i in infos if i.python),
    )


class StackCache:
    """Stacks repeat (same code path, same frames): summarise each distinct one once."""

    def __init__(self) -> None:
        self.seen: dict[tuple, Stack] = {}

    def __call__(self, frames: list | None) -> Stack:
        if not frames:
            return NO_STACK
        key = tuple([(f.get("filename", ""), f.get("name", ""), f.get("line", 0)) for f in frames])
        st = self.seen.get(key)
        if st is None:
            st = self.seen[key] = summarize(key)
        return st
