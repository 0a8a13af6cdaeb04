"""What ``fsdpdoctor.capture`` writes about the model into the sidecar: its FSDP2 / FSDP1 units,
parameter groups, mixed precision, offload and sharding, or its DDP buckets, read from the live
objects (:func:`describe_model`). The names and shapes the trace cannot carry."""

from __future__ import annotations

from typing import Any

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


def module_class(module: Any) -> str:
    """The class the user wrote: ``fully_shard``'s ``FSDP<Class>`` swap, FSDP1's and
    checkpoint_wrapper's wrappers and ``torch.compile``'s ``OptimizedModule`` looked through."""
    for attr in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"):
        inner = getattr(module, "__dict__", {}).get("_modules", {}).get(attr)
        if inner is not None:
            return module_class(inner)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return type(module).__name__
    return next((c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule)), type(module).__name__)


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


def empty_description() -> dict[str, Any]:
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
        modules = getattr(state, "_modules", (module,))
        module_fqns = [_clean_fqn(names.get(id(m), name)) for m in modules]
        module_classes = [module_class(m) for m in modules]
        for group in groups:
            units.append(
                _fsdp2_group_description(
                    group,
                    names=names,
                    default_fqn=_clean_fqn(name),
                    module_fqns=module_fqns,
                    module_classes=module_classes,
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
    module_classes: list[str],
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
        "module_classes": module_classes,
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
                "module_classes": [module_class(module)],
                "is_root": getattr(module, "_is_root", None),
                "shard_world_size": world,
                "sharding_strategy": _enum_name(getattr(module, "sharding_strategy", None)),
                "backward_prefetch": _enum_name(getattr(module, "backward_prefetch", None)),
                "forward_prefetch": getattr(module, "forward_prefetch", None),
                "limit_all_gathers": getattr(module, "limit_all_gathers", None),
                "use_orig_params": getattr(module, "_use_orig_params", None),
                "cpu_offload": None if cpu_offload is None else bool(getattr(cpu_offload, "offload_params", False)),
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
    out["reshard_after_forward"] = None if strategy in (None, "mixed") else strategy in ("FULL_SHARD", "HYBRID_SHARD")
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
    desc = empty_description()
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
    desc["model_class"] = module_class(model.module if DDP is not None and isinstance(model, DDP) else model)
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
