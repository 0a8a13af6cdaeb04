"""Record what fsdpdoctor needs from a training run: one profiler trace per rank plus a sidecar.

This is the only module of fsdpdoctor that uses torch, and it imports torch lazily (inside the
functions that need it), so ``import fsdpdoctor`` and ``import fsdpdoctor.capture`` work
without torch installed.

Usage (every rank runs the same code)::

    from fsdpdoctor.capture import capture

    with capture("traces/", model=model, wait=1, warmup=1, active=3) as cap:
        for batch in loader:
            train_step(batch)
            cap.step()

What ends up in ``traces/``:

``rank{R}.json.gz``
    The Kineto Chrome trace of rank ``R``, exactly as ``torch.profiler`` writes it
    (``export_chrome_trace`` gzips when the name ends in ``.gz``). It covers the ``active``
    steps of the first profiling cycle. If ``repeat`` > 1, later cycles are written as
    ``rank{R}.cycle{K}.json.gz`` (K = 1, 2, ...).
``rank{R}.memory.pickle``
    CUDA caching-allocator snapshot (``torch.cuda.memory._dump_snapshot``) of rank ``R``, taken
    when the ``with`` block ends; only with ``memory_history=True`` and when CUDA is available.
``fsdpdoctor_meta.json``
    One sidecar per run, written by rank 0 only (FSDP/DDP training is SPMD: every rank has the
    same wrapping and policies, and per-rank facts such as the rank itself are already in each
    trace's ``distributedInfo``). It records what a trace cannot say: FSDP version, sharding
    strategy, prefetch settings, CPU offload, mixed-precision dtypes, the FSDP units with their
    FQNs and parameter sizes, library versions, and the capture settings. Its layout is
    described by :data:`META_SCHEMA` and :func:`describe_model`. Rank 0 writes it when its
    first trace is written and again (complete) when the ``with`` block ends.

The profiler settings are those the doctor relies on: CPU activity always, CUDA activity when
CUDA is available, ``record_shapes=True`` (the collective ``record_param_comms`` events carry
their message sizes either way, but shapes let the doctor size the copy-in/copy-out ops), and a
``torch.profiler.schedule(skip_first, wait, warmup, active, repeat)`` so only steady-state steps
are kept. Call :meth:`Capture.step` once at the end of every training step; the profiler labels
step ``N`` as ``ProfilerStep#N``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

__all__ = [
    "META_FILENAME",
    "META_SCHEMA",
    "Capture",
    "capture",
    "describe_model",
    "memory_snapshot_filename",
    "trace_filename",
]

#: File name of the per-run sidecar written by rank 0.
META_FILENAME = "fsdpdoctor_meta.json"

#: Value of the sidecar's ``schema`` key. Bump the trailing number on incompatible changes.
META_SCHEMA = "fsdpdoctor.meta/1"


def trace_filename(rank: int, cycle: int = 0) -> str:
    """Name of the trace file of ``rank`` for profiling cycle ``cycle`` (0-based)."""
    if cycle == 0:
        return f"rank{rank}.json.gz"
    return f"rank{rank}.cycle{cycle}.json.gz"


def memory_snapshot_filename(rank: int) -> str:
    """Name of the CUDA memory snapshot of ``rank``."""
    return f"rank{rank}.memory.pickle"


# ----------------------------------------------------------------------------------------------
# Model inspection
# ----------------------------------------------------------------------------------------------

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_fqn(name: str) -> str:
    """Strip FSDP1 / activation-checkpoint / torch.compile wrapper components from an FQN."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    for suffix in ("._fsdp_wrapped_module", "._checkpoint_wrapped_module", "._orig_mod"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"):
        name = ""
    return name


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _enum_name(value: Any) -> str | None:
    if value is None:
        return None
    return getattr(value, "name", str(value))


def _summarise(values: list[Any]) -> Any:
    """One value if all units agree, ``"mixed"`` if they do not, None if there are none."""
    distinct = []
    for value in values:
        if value not in distinct:
            distinct.append(value)
    if not distinct:
        return None
    if len(distinct) == 1:
        return distinct[0]
    return "mixed"


def _empty_description() -> dict[str, Any]:
    return {
        "parallelism": None,
        "fsdp_version": None,
        "sharding_strategy": None,
        "reshard_after_forward": None,
        "backward_prefetch": None,
        "forward_prefetch": None,
        "limit_all_gathers": None,
        "use_orig_params": None,
        "cpu_offload": None,
        "mixed_precision": None,
        "units": [],
        "ddp": None,
    }


def _fsdp2_units(model: Any) -> list[dict[str, Any]]:
    """Describe every FSDP2 (``fully_shard``) parameter group in ``model``.

    Reads torch 2.13 ``torch.distributed.fsdp._fully_shard`` internals, each access guarded:
    ``module._get_fsdp_state()`` -> ``FSDPState`` with ``_fsdp_param_groups`` (one
    ``_fsdp_param_group`` in torch 2.11 and earlier),
    ``_states_to_forward_prefetch``, ``_states_to_backward_prefetch`` and ``_is_root``; each
    ``FSDPParamGroup`` has ``mp_policy``, ``offload_policy``, ``mesh_info``,
    ``post_forward_mesh_info`` (None <=> ``reshard_after_forward=False``; same size as the
    shard mesh <=> True; smaller <=> the int it was given) and ``fsdp_params``, each with
    ``_orig_size`` and ``padded_sharded_param_size``.
    """
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): name for name, m in model.named_modules()}
    seen_states: set[int] = set()
    units: list[dict[str, Any]] = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            state = module._get_fsdp_state()
        except Exception:  # pragma: no cover - torch internals moved
            continue
        if id(state) in seen_states:
            continue
        seen_states.add(id(state))
        groups = _param_groups(state)

        def _targets(states: list[Any]) -> list[str]:
            out = []
            for target_state in states:
                for target_group in _param_groups(target_state):
                    out.append(_group_fqn(target_group, names))
            return out

        fwd_states = list(getattr(state, "_states_to_forward_prefetch", None) or [])
        bwd_states = list(getattr(state, "_states_to_backward_prefetch", None) or [])
        is_root = getattr(state, "_is_root", None)
        auto_reshard = getattr(state, "_auto_reshard_after_forward", None)
        module_fqns = [_clean_fqn(names.get(id(m), name)) for m in getattr(state, "_modules", (module,))]
        for group in groups:
            units.append(
                _fsdp2_group_description(
                    group,
                    names=names,
                    default_fqn=_clean_fqn(name),
                    module_fqns=module_fqns,
                    is_root=is_root,
                    auto_reshard=auto_reshard,
                    forward_prefetch=(
                        {"mode": "explicit", "targets": _targets(fwd_states)}
                        if fwd_states
                        else {"mode": "implicit", "targets": []}
                    ),
                    backward_prefetch=(
                        {"mode": "explicit", "targets": _targets(bwd_states)}
                        if bwd_states
                        else {"mode": "implicit", "targets": []}
                    ),
                )
            )
    return units


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list ``_fsdp_param_groups`` in torch releases with
    per-parameter meshes, one ``_fsdp_param_group`` (None without parameters) before (2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


def _group_fqn(group: Any, names: dict[int, str]) -> str:
    fqn = getattr(group, "_module_fqn", None)
    if isinstance(fqn, str):
        return fqn
    modules = getattr(group, "modules", ()) or ()
    return ", ".join(_clean_fqn(names.get(id(m), "?")) for m in modules)


def _fsdp2_group_description(
    group: Any,
    *,
    names: dict[int, str],
    default_fqn: str,
    module_fqns: list[str],
    is_root: bool | None,
    auto_reshard: bool | None,
    forward_prefetch: dict[str, Any],
    backward_prefetch: dict[str, Any],
) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    mesh_info = getattr(group, "mesh_info", None)
    shard_size = getattr(mesh_info, "shard_mesh_size", None)
    replicate_size = getattr(mesh_info, "replicate_mesh_size", None)
    post_forward = getattr(group, "post_forward_mesh_info", "missing")
    if post_forward == "missing":
        reshard: bool | int | None = None
    elif post_forward is None:
        reshard = False
    else:
        post_size = getattr(post_forward, "shard_mesh_size", None)
        reshard = True if post_size == shard_size else post_size

    numel = 0
    padded_sharded_numel = 0
    params = []
    for fsdp_param in getattr(group, "fsdp_params", []):
        orig_size = getattr(fsdp_param, "_orig_size", None)
        p_numel = int(_prod(orig_size)) if orig_size is not None else None
        padded = getattr(fsdp_param, "padded_sharded_param_size", None)
        p_padded = int(_prod(padded)) if padded is not None else None
        numel += p_numel or 0
        padded_sharded_numel += p_padded or 0
        params.append(
            {
                "fqn": getattr(fsdp_param, "_param_fqn", None),
                "shape": list(orig_size) if orig_size is not None else None,
                "dtype": _dtype_name(getattr(fsdp_param, "orig_dtype", None)),
            }
        )

    mp = getattr(group, "mp_policy", None)
    offload = getattr(group, "offload_policy", None)
    fqn = getattr(group, "_module_fqn", None)
    if not isinstance(fqn, str):
        fqn = default_fqn
    return {
        "fqn": fqn,
        "modules": module_fqns,
        "is_root": is_root,
        "mesh_kind": type(mesh_info).__name__ if mesh_info is not None else None,
        "shard_world_size": shard_size,
        "replicate_world_size": replicate_size,
        "reshard_after_forward": reshard,
        # True when reshard_after_forward was not passed (FSDP2 then uses True, except for the
        # root, which it sets to False at lazy initialisation).
        "reshard_after_forward_auto": auto_reshard,
        "num_params": len(params),
        "numel": numel,
        # Every parameter is chunked on dim 0 into shard_world_size pieces and each shard is
        # padded to the size of chunk 0 (ceil(dim0 / world) rows); one all-gather moves the
        # concatenated padded shards, so its output is padded_sharded_numel * shard_world_size.
        "padded_sharded_numel": padded_sharded_numel,
        "all_gather_numel": padded_sharded_numel * shard_size if shard_size else None,
        "params": params,
        "mixed_precision": _mp_dict(
            mp,
            param_dtype=getattr(mp, "param_dtype", None),
            reduce_dtype=getattr(mp, "reduce_dtype", None),
            output_dtype=getattr(mp, "output_dtype", None),
            cast_forward_inputs=getattr(mp, "cast_forward_inputs", None),
        ),
        "cpu_offload": None
        if offload is None
        else (
            {"pin_memory": bool(getattr(offload, "pin_memory", False))}
            if isinstance(offload, CPUOffloadPolicy)
            else False
        ),
        "forward_prefetch": forward_prefetch,
        "backward_prefetch": backward_prefetch,
    }


def _mp_dict(policy: Any, **fields: Any) -> dict[str, Any] | None:
    """Mixed-precision settings as plain data; None when no dtype is set (policy is a no-op)."""
    if policy is None:
        return None
    out = {}
    for key, value in fields.items():
        out[key] = _dtype_name(value) if key.endswith("_dtype") else value
    if all(out[k] is None for k in out if k.endswith("_dtype")):
        return None
    return out


def _prod(shape: Any) -> int:
    out = 1
    for dim in shape:
        out *= int(dim)
    return out


def _fsdp2_summary(units: list[dict[str, Any]]) -> dict[str, Any]:
    non_root = [u for u in units if not u.get("is_root")]
    if non_root:
        reshard = _summarise([u["reshard_after_forward"] for u in non_root])
    else:
        # Only a root unit (e.g. fully_shard(model) alone): FSDP2 never reshards a root whose
        # reshard_after_forward was left to default, so report the policy the user chose (the
        # default is True) rather than the root exemption.
        reshard = _summarise(
            [True if u.get("reshard_after_forward_auto") else u["reshard_after_forward"] for u in units]
        )
    kinds = {u["mesh_kind"] for u in units}
    if "HSDPMeshInfo" in kinds:
        strategy = "HYBRID_SHARD" if reshard is True else "_HYBRID_SHARD_ZERO2"
        if reshard == "mixed" or len(kinds) > 1:
            strategy = "mixed"
    elif kinds == {"DDPMeshInfo"}:
        strategy = "NO_SHARD"
    elif reshard is True or isinstance(reshard, int) and not isinstance(reshard, bool):
        strategy = "FULL_SHARD"
    elif reshard is False:
        strategy = "SHARD_GRAD_OP"
    else:
        strategy = "mixed" if units else None

    def _prefetch(key: str) -> str | None:
        modes = []
        for unit in units:
            pf = unit[key]
            if pf["mode"] == "implicit":
                modes.append("implicit")
            else:
                modes.append("explicit" if pf["targets"] else "none")
        if not modes:
            return None
        if all(m == "implicit" for m in modes):
            return "implicit"
        if all(m == "none" for m in modes):
            return "none"
        if "implicit" in modes:
            return "mixed"
        return "explicit"

    mps = [u["mixed_precision"] for u in units]
    offloads = [u["cpu_offload"] for u in units]
    return {
        "sharding_strategy": strategy,
        "reshard_after_forward": reshard,
        "backward_prefetch": _prefetch("backward_prefetch"),
        "forward_prefetch": _prefetch("forward_prefetch"),
        "cpu_offload": _summarise(offloads),
        "mixed_precision": _summarise(mps),
    }


def _fsdp1_units(model: Any) -> list[dict[str, Any]]:
    """Describe every FSDP1 ``FullyShardedDataParallel`` instance in ``model`` (pre-order)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDP):
            continue
        handle = getattr(module, "_handle", None)
        flat_param = getattr(handle, "flat_param", None) if handle is not None else None
        mp = getattr(module, "mixed_precision", None)
        cpu_offload = getattr(module, "cpu_offload", None)
        world = getattr(module, "world_size", None)
        unpadded = getattr(flat_param, "_unpadded_unsharded_size", None)
        padded = getattr(flat_param, "_padded_unsharded_size", None)
        fqn = _clean_fqn(name)
        rel_fqns = [_clean_fqn(f) for f in (getattr(flat_param, "_fqns", ()) or ())]
        units.append(
            {
                "fqn": fqn,
                "is_root": getattr(module, "_is_root", None),
                "shard_world_size": world,
                "sharding_strategy": _enum_name(getattr(module, "sharding_strategy", None)),
                "backward_prefetch": _enum_name(getattr(module, "backward_prefetch", None)),
                "forward_prefetch": getattr(module, "forward_prefetch", None),
                "limit_all_gathers": getattr(module, "limit_all_gathers", None),
                "use_orig_params": getattr(module, "_use_orig_params", None),
                "cpu_offload": None
                if cpu_offload is None
                else bool(getattr(cpu_offload, "offload_params", False)),
                "mixed_precision": _mp_dict(
                    mp,
                    param_dtype=getattr(mp, "param_dtype", None),
                    reduce_dtype=getattr(mp, "reduce_dtype", None),
                    buffer_dtype=getattr(mp, "buffer_dtype", None),
                    cast_forward_inputs=getattr(mp, "cast_forward_inputs", None),
                    cast_root_forward_inputs=getattr(mp, "cast_root_forward_inputs", None),
                ),
                "num_params": len(rel_fqns),
                # flat_param._fqns are relative to the unit's module; stored here as model FQNs.
                "param_fqns": [f"{fqn}.{f}" if fqn else f for f in rel_fqns],
                "numel": int(_prod(unpadded)) if unpadded is not None else None,
                # The flat parameter is padded to a multiple of the world size (plus 16-byte
                # alignment padding between params when use_orig_params=True); one all-gather
                # outputs the whole padded flat parameter.
                "all_gather_numel": int(_prod(padded)) if padded is not None else None,
            }
        )
    return units


def _fsdp1_summary(units: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in (
        "sharding_strategy",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "use_orig_params",
        "cpu_offload",
        "mixed_precision",
    ):
        out[key] = _summarise([u[key] for u in units])
    strategy = out["sharding_strategy"]
    out["reshard_after_forward"] = (
        None if strategy in (None, "mixed") else strategy in ("FULL_SHARD", "HYBRID_SHARD")
    )
    return out


def describe_model(model: Any, wrap_policy: str | None = None) -> dict[str, Any]:
    """Describe how ``model`` is parallelised, for the sidecar.

    Works on FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``) and DDP models;
    anything else (or ``None``) gives ``parallelism: None``. Call it after the first forward
    for FSDP2: the root unit and every unit's FQN are fixed at lazy initialisation (the root's
    ``reshard_after_forward`` defaults to False only from then on). :class:`Capture` calls it
    when the first trace is written and when the ``with`` block ends.

    Returns a dict with:

    ``parallelism``
        ``"fsdp2"``, ``"fsdp1"``, ``"ddp"`` or ``None``.
    ``fsdp_version``
        2, 1 or ``None``.
    ``sharding_strategy``
        FSDP1: the ``ShardingStrategy`` name. FSDP2, in the same vocabulary: ``FULL_SHARD``
        when non-root units reshard after forward (``reshard_after_forward=True`` or an int),
        ``SHARD_GRAD_OP`` when they do not, ``HYBRID_SHARD``/``_HYBRID_SHARD_ZERO2`` on a 2-D
        (replicate, shard) mesh, ``"mixed"`` when units disagree.
    ``reshard_after_forward``
        FSDP2: the common value over non-root units (True, False, an int, or ``"mixed"``); with
        a root unit only, the value the user chose (True when left to default, although FSDP2
        exempts the root itself). FSDP1: whether the strategy reshards after forward.
    ``backward_prefetch``, ``forward_prefetch``
        FSDP1: ``BACKWARD_PRE``/``BACKWARD_POST``/``None`` and a bool. FSDP2: ``"implicit"``
        (no ``set_modules_to_*_prefetch`` list: FSDP2's default one-unit-ahead prefetch, which
        for forward means the all-gather is issued in the unit's own pre-forward),
        ``"explicit"`` (lists set), ``"none"`` (every unit has a non-empty list that targets
        no parameter group: implicit prefetch is then off and nothing is prefetched), or
        ``"mixed"``.
    ``cpu_offload``
        FSDP1: ``offload_params``. FSDP2: ``False`` or ``{"pin_memory": bool}``.
    ``mixed_precision``
        A dict of dtype names (``"bfloat16"``...; a dtype left unset is ``None``) plus the
        cast flags, or ``None`` when no dtype is set at all (the policy is a no-op);
        ``"mixed"`` when units differ.
    ``units``
        One entry per FSDP unit (FSDP2: parameter group; FSDP1: FSDP instance), in module
        pre-order. ``fqn`` is the module FQN as FSDP2 prints it in its labels
        (``FSDP::pre_forward (layers.0)``; the root unit's FQN is ``""`` and its labels carry no
        suffix). ``numel`` is the unpadded parameter count and ``all_gather_numel`` the element
        count one all-gather of the unit outputs (padding included).
    ``ddp``
        For DDP: ``bucket_cap_bytes``, ``first_bucket_cap_bytes``, ``find_unused_parameters``,
        ``gradient_as_bucket_view``, ``static_graph``, ``num_params``, ``numel``.
    ``wrap_policy``
        The ``wrap_policy`` argument (free text describing how units were chosen).
    """
    desc = _empty_description()
    desc["wrap_policy"] = wrap_policy
    if model is None:
        return desc
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError:  # pragma: no cover
        return desc

    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:  # pragma: no cover
        DDP = None  # type: ignore[assignment]

    inner = model
    if DDP is not None and isinstance(model, DDP):
        params = [p for p in model.module.parameters() if p.requires_grad]
        desc["parallelism"] = "ddp"
        desc["ddp"] = {
            "bucket_cap_bytes": getattr(model, "bucket_bytes_cap", None),
            "first_bucket_cap_bytes": _ddp_first_bucket_bytes(),
            "find_unused_parameters": getattr(model, "find_unused_parameters", None),
            "gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
            "static_graph": getattr(model, "static_graph", None),
            "num_params": len(params),
            "numel": sum(p.numel() for p in params),
        }
        inner = model.module

    for version, find_units, summarize in ((2, _fsdp2_units, _fsdp2_summary), (1, _fsdp1_units, _fsdp1_summary)):
        try:
            units = find_units(inner)
        except ImportError:  # pragma: no cover
            units = []
        if units:
            desc.update(summarize(units))
            desc["fsdp_version"] = version
            desc["parallelism"] = f"fsdp{version}" if desc["parallelism"] is None else f"ddp+fsdp{version}"
            desc["units"] = units
            break
    return desc


def _ddp_first_bucket_bytes() -> int | None:
    try:
        import torch.distributed as dist

        return int(dist._DEFAULT_FIRST_BUCKET_BYTES)
    except Exception:  # pragma: no cover
        return None


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "nccl": None,
        "python": platform.python_version(),
    }
    try:
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    return out


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:  # pragma: no cover
        initialized = False
    if rank is None:
        rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = (
            dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1"))
        )
    return rank, world_size


def _backend() -> str | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:  # pragma: no cover
        pass
    return None


# ----------------------------------------------------------------------------------------------
# The capture context
# ----------------------------------------------------------------------------------------------


class Capture:
    """A ``torch.profiler.profile`` set up for fsdpdoctor, plus the sidecar and memory snapshot.

    Prefer the :func:`capture` factory. Use as a context manager and call :meth:`step` once at
    the end of every training step. Every rank must create its own ``Capture`` with the same
    arguments.

    Args:
        out_dir: directory for the traces, snapshots and sidecar (created if missing).
        model: the wrapped model (FSDP2/FSDP1/DDP); inspected by :func:`describe_model` for the
            sidecar. May be None.
        wait, warmup, active, repeat, skip_first: passed to ``torch.profiler.schedule``. The
            profiled steps are ``skip_first + wait + warmup`` ... ``+ active - 1`` (0-based
            ``step()`` count) for the first cycle. Keep ``wait + warmup >= 1`` so that lazy
            initialisation and the first-iteration work stay out of the trace.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
            ``with_stack`` adds ``python_function`` events and makes traces much larger.
        memory_history: record CUDA allocator history from ``__enter__`` and dump one snapshot
            per rank at ``__exit__``. Ignored (and noted in the sidecar) without CUDA.
        memory_history_max_entries: ``max_entries`` for ``_record_memory_history``.
        memory_history_options: further keyword arguments for
            ``torch.cuda.memory._record_memory_history`` (e.g. ``{"stacks": "python"}`` to
            skip C++ stacks, or ``{"global_record_annotations": True}`` to tag allocations
            with the enclosing ``record_function`` labels such as ``FSDP::all_gather``).
        wrap_policy: free-text description of how FSDP units were chosen, for the sidecar
            (e.g. ``"fully_shard(block) for block in model.layers; fully_shard(model)"``).
        extra: JSON-serialisable dict stored under ``extra`` in the sidecar.
        rank, world_size: override the values read from ``torch.distributed`` (or the
            ``RANK``/``WORLD_SIZE`` environment variables when it is not initialised).
        activities: override the profiler activities (default: CPU, plus CUDA if available).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        model: Any = None,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = False,
        memory_history: bool = False,
        memory_history_max_entries: int = 100_000,
        memory_history_options: dict[str, Any] | None = None,
        wrap_policy: str | None = None,
        extra: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        activities: Any = None,
    ) -> None:
        if active < 1:
            raise ValueError("active must be >= 1")
        if min(wait, warmup, skip_first) < 0 or repeat < 0:
            raise ValueError("wait, warmup, skip_first and repeat must be >= 0")
        self.out_dir = Path(out_dir)
        self.model = model
        self.wait = wait
        self.warmup = warmup
        self.active = active
        self.repeat = repeat
        self.skip_first = skip_first
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.memory_history_requested = memory_history
        self.memory_history_max_entries = memory_history_max_entries
        self.memory_history_options = dict(memory_history_options or {})
        self.wrap_policy = wrap_policy
        self.extra = dict(extra or {})
        self._rank_override = rank
        self._world_override = world_size
        self._activities = activities
        self.rank = 0
        self.world_size = 1
        self.profiler: Any = None
        self.trace_paths: list[Path] = []
        self.memory_snapshot_path: Path | None = None
        self.steps_done = 0
        self._profiled_steps: list[list[int]] = []
        self._memory_history_on = False
        self._started_at: float | None = None

    # -- public ---------------------------------------------------------------------------

    @property
    def meta_path(self) -> Path:
        """Path of the sidecar (written by rank 0 only)."""
        return self.out_dir / META_FILENAME

    @property
    def cuda(self) -> bool:
        """Whether CUDA activity is being profiled."""
        import torch

        return bool(torch.cuda.is_available())

    def profiled_steps(self, cycle: int = 0) -> list[int]:
        """0-based step indices (the ``N`` of ``ProfilerStep#N``) that ``cycle`` records."""
        start = self.skip_first + cycle * (self.wait + self.warmup + self.active)
        first = start + self.wait + self.warmup
        return list(range(first, first + self.active))

    def step(self) -> None:
        """Mark the end of a training step (advances the profiler schedule)."""
        self.steps_done += 1
        if self.profiler is not None:
            self.profiler.step()

    def __enter__(self) -> "Capture":
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, self.world_size = _rank_and_world(self._rank_override, self._world_override)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._started_at = time.time()
        activities = self._activities
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
        self._activity_names = [getattr(a, "name", str(a)) for a in activities]

        if self.memory_history_requested and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(
                max_entries=self.memory_history_max_entries, **self.memory_history_options
            )
            self._memory_history_on = True

        self.profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
                skip_first=self.skip_first,
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self.profiler.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self.profiler is not None:
                self.profiler.__exit__(exc_type, exc, tb)
        finally:
            self.profiler = None
            if self._memory_history_on:
                import torch

                try:
                    path = self.out_dir / memory_snapshot_filename(self.rank)
                    torch.cuda.memory._dump_snapshot(str(path))
                    self.memory_snapshot_path = path
                finally:
                    torch.cuda.memory._record_memory_history(enabled=None)
                    self._memory_history_on = False
            if self.rank == 0:
                self.write_meta(complete=exc_type is None)

    # -- sidecar --------------------------------------------------------------------------

    def meta(self, complete: bool = True) -> dict[str, Any]:
        """The sidecar content (see the module docstring and :func:`describe_model`)."""
        import torch

        cycles = len(self._profiled_steps)
        meta: dict[str, Any] = {
            "schema": META_SCHEMA,
            "complete": complete,
            "created_by": "fsdpdoctor.capture",
            "created_unix": self._started_at,
            "host": socket.gethostname(),
            "world_size": self.world_size,
            "backend": _backend(),
            "device_type": "cuda" if torch.cuda.is_available() else "cpu",
            "versions": _versions(),
            "capture": {
                "wait": self.wait,
                "warmup": self.warmup,
                "active": self.active,
                "repeat": self.repeat,
                "skip_first": self.skip_first,
                "record_shapes": self.record_shapes,
                "profile_memory": self.profile_memory,
                "with_stack": self.with_stack,
                "activities": getattr(self, "_activity_names", None),
                "memory_history": self.memory_history_requested and torch.cuda.is_available(),
                "steps_run_by_rank0": self.steps_done,
                "profiled_steps": [list(s) for s in self._profiled_steps],
            },
            "trace_files": [
                trace_filename(r, c) for c in range(cycles) for r in range(self.world_size)
            ],
            "memory_snapshot_files": (
                [memory_snapshot_filename(r) for r in range(self.world_size)]
                if self.memory_history_requested and torch.cuda.is_available()
                else []
            ),
        }
        try:
            meta.update(describe_model(self.model, wrap_policy=self.wrap_policy))
        except Exception as exc:  # never lose the traces over an inspection problem
            meta.update(_empty_description())
            meta["wrap_policy"] = self.wrap_policy
            meta["describe_error"] = f"{type(exc).__name__}: {exc}"
        meta["extra"] = self.extra
        return meta

    def write_meta(self, complete: bool = True) -> Path:
        """Write the sidecar now (rank 0 calls this itself; other ranks need not)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.meta(complete), indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.meta_path)
        return self.meta_path

    # -- internals ------------------------------------------------------------------------

    def _on_trace_ready(self, prof: Any) -> None:
        cycle = len(self._profiled_steps)
        path = self.out_dir / trace_filename(self.rank, cycle)
        # torch.profiler.profile.export_chrome_trace writes through a temporary .json file and
        # gzips it when the path ends in ".gz"; the content is byte-for-byte Kineto's JSON.
        prof.export_chrome_trace(str(path))
        self.trace_paths.append(path)
        self._profiled_steps.append(self.profiled_steps(cycle))
        if self.rank == 0:
            self.write_meta(complete=False)


def capture(
    out_dir: str | os.PathLike[str],
    model: Any = None,
    **kwargs: Any,
) -> Capture:
    """Return a :class:`Capture` context manager (see there for the arguments).

    Example::

        with capture("traces/", model=model, wait=1, warmup=1, active=3) as cap:
            for batch in loader:
                train_step(batch)
                cap.step()
    """
    return Capture(out_dir, model, **kwargs)
