"""Run shapes real users run, recorded by the suite with torch on CPU (gloo, 2 or 4 ranks):
gradient accumulation (FSDP2 with and without gradient sync, FSDP1 ``no_sync``), activation
checkpointing, compiled blocks, per-parameter meshes, HSDP 2x2 and TP + FSDP 2x2.

The shapes are recorded with a plain ``torch.profiler`` (no fsdpdoctor sidecar): everything
checked here comes from the traces alone. Expected values come from the recorder's model and
each shape's configuration (``fixtures/record_cpu.py``), never from the tool's output.
"""

from __future__ import annotations

import math

import pytest

import fsdpdoctor
from _recording import SHAPES

# findings about the run's configuration: none may fire on these healthy runs
CONFIG_SLUGS = {
    "fsdp-not-detected",
    "auto-wrap-too-coarse",
    "auto-wrap-too-fine",
    "missing-backward-prefetch",
    "sharding-strategy",
    "ddp-would-be-faster",
}
FSDP1_SHAPES = {"ga-fsdp1", "ga-fsdp1-sync", "ac-fsdp1", "no-shard-fsdp1"}
NO_SHARD = "no-shard-fsdp1"  # parameters replicated: no all-gather or reduce-scatter, gradients all-reduced


@pytest.fixture(scope="module")
def shape(recorded_report):
    return recorded_report


def _world_size(recorder, variant):
    return recorder.SHAPE_WORLD_SIZE.get(variant, 2)


def _mesh(recorder, variant):
    """(shard, replicate, tp) group sizes of the shape's configuration."""
    ws = _world_size(recorder, variant)
    if variant == "hsdp":
        replicate, shard = recorder.MESH_2D
        return shard, replicate, None
    if variant == "tp-fsdp":
        dp, tp = recorder.MESH_2D
        return dp, None, tp
    if variant == NO_SHARD:
        return None, None, None
    return ws, None, None


def _local_shape(recorder, variant, name, shape):
    """A parameter's shape on one rank before FSDP: tensor-parallel modules hold a shard."""
    if variant != "tp-fsdp":
        return shape
    tp = recorder.MESH_2D[1]
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for prefix, style in recorder.tp_plan().items():
        module = name.split(".", 2)[-1].rsplit(".", 1)[0]  # layers.<i>.<module>.<param>
        if module != prefix:
            continue
        if isinstance(style, ColwiseParallel):  # out_features split: weight dim 0 and bias
            return (shape[0] // tp, *shape[1:])
        if isinstance(style, RowwiseParallel) and len(shape) == 2:  # in_features split
            return (shape[0], shape[1] // tp)
    return shape


def _expected_units(recorder, variant):
    """Per unit (execution order): (unsharded all-gather elements, parameter groups)."""
    model = recorder.build_model()
    units = recorder.unit_fqns(variant, model)
    shard = _mesh(recorder, variant)[0] or _world_size(recorder, variant)
    numel = {u: 0 for u in units}
    groups = {u: 1 for u in units}
    flat = {u: 0 for u in units}
    for name, p in model.named_parameters():
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        shape = _local_shape(recorder, variant, name, tuple(p.shape))
        # FSDP2 pads dim 0 of each parameter to a multiple of the shard group size
        numel[owner] += math.ceil(shape[0] / shard) * shard * math.prod(shape[1:])
        flat[owner] += math.prod(shape)
    if variant in FSDP1_SHAPES:  # one flat parameter per unit, padded to the world size
        numel = {u: math.ceil(n / shard) * shard for u, n in flat.items()}
    if variant == "per-param-mesh":
        for u in units:
            if u.startswith("layers."):
                groups[u] = 2  # the block's own params + its MLP on the second mesh
    return [(u, numel[u], groups[u]) for u in units]


def _reduce_scatters_per_step(recorder, variant):
    k = recorder.microbatches(variant)
    return 1 if variant in ("ga-fsdp2", "ga-fsdp1") else k  # no_sync / sync off on all but the last


@pytest.mark.parametrize("variant", SHAPES)
def test_units_and_all_gathers_per_forward_pass(variant, shape, recorder):
    f = shape(variant).facts
    fs = f.fsdp
    k = recorder.microbatches(variant)
    expected = _expected_units(recorder, variant)
    assert fs.version == (1 if variant in FSDP1_SHAPES else 2)
    assert f.ranks == list(range(_world_size(recorder, variant)))
    assert f.steps.count == recorder.SHAPE_ACTIVE
    assert fs.microbatches_per_step == k
    assert fs.unit_count == len(expected)
    if variant not in FSDP1_SHAPES:  # FSDP1 labels carry no FQN (and these runs have no sidecar)
        assert [u.fqn for u in fs.units] == [u for u, _, _ in expected]
    rs = _reduce_scatters_per_step(recorder, variant)
    if variant == NO_SHARD:
        assert all(u.forward_all_gathers == u.backward_all_gathers == u.reduce_scatters == 0 for u in fs.units)
        return
    for u, (fqn, numel, groups) in zip(fs.units, expected):
        assert u.unsharded_numel == numel, fqn
        assert u.param_groups == groups, fqn
        assert u.forward_all_gathers == k * groups, fqn
        # the root keeps its parameters after forward (FSDP1 and FSDP2 default): no re-gather
        assert u.backward_all_gathers == (0 if fqn == "" else k * groups), fqn
        assert u.reduce_scatters == rs * groups, fqn


@pytest.mark.parametrize("variant", SHAPES)
def test_phase_of_each_collective_from_its_fsdp_hook(variant, shape, recorder):
    f = shape(variant).facts
    k = recorder.microbatches(variant)
    for r in f.rank_facts:
        assert all(s.microbatches == k for s in r.steps)
        for c in r.collectives:
            assert c.step >= 0 and 0 <= c.microbatch < k
            hooks = " ".join(c.fsdp_labels)
            if "backward" in hooks:
                assert c.phase == "backward", (c.kind, c.fsdp_labels)
            elif "pre_forward" in hooks:
                assert c.phase == "forward", (c.kind, c.fsdp_labels)
            if c.role == "fsdp_shard":
                assert c.unit is not None, c.fsdp_labels
        if k > 1:
            for s in r.steps:
                assert len(s.microbatch_phase_ms) == k
                assert all(mb["forward"] > 0 and mb["backward"] > 0 for mb in s.microbatch_phase_ms)
                for phase in ("forward", "backward"):
                    assert sum(mb[phase] for mb in s.microbatch_phase_ms) == pytest.approx(s.phase_ms[phase])


@pytest.mark.parametrize("variant", SHAPES)
def test_strategy_mesh_and_roles(variant, shape, recorder):
    rep = shape(variant)
    f = rep.facts
    shard, replicate, tp = _mesh(recorder, variant)
    want = {"hsdp": "HYBRID_SHARD", NO_SHARD: "NO_SHARD"}.get(variant, "FULL_SHARD")
    assert f.fsdp.sharding_strategy == want
    assert f.fsdp.sources["sharding_strategy"] == "trace"
    p = f.parallelism
    assert (p.shard_size, p.replicate_size, p.tp_size) == (shard, replicate, tp)
    # NO_SHARD all-reduces every gradient over the whole world, like DDP
    assert p.dp_size == (_world_size(recorder, variant) if variant == NO_SHARD else None)
    n_units = len(recorder.unit_fqns(variant))
    for r in f.rank_facts:
        by_role: dict[str, list] = {}
        for c in r.collectives:
            by_role.setdefault(c.role, []).append(c)
            if c.kind in ("all_gather", "reduce_scatter"):
                assert c.role == "fsdp_shard" and c.group_size == shard
        if variant == NO_SHARD:
            assert set(by_role) == {"data_parallel"}
            assert len(by_role["data_parallel"]) == n_units * len(r.steps)  # one per unit (flat parameter)
            assert all(c.kind == "all_reduce" and c.phase == "backward" for c in by_role["data_parallel"])
            continue
        assert set(by_role) <= {"fsdp_shard", "hsdp_replicate", "tensor_parallel"}
        steps = len(r.steps)
        if variant == "hsdp":
            # one replica all-reduce of each unit's reduced shard per step
            ar = by_role["hsdp_replicate"]
            assert len(ar) == n_units * steps
            assert all(c.kind == "all_reduce" and c.group_size == replicate and c.phase == "backward" for c in ar)
            numel = {u: n for u, n, _ in _expected_units(recorder, variant)}
            assert sorted(c.bytes for c in ar[:n_units]) == sorted(n // shard * 4 for n in numel.values())
        else:
            assert "hsdp_replicate" not in by_role
        if variant == "tp-fsdp":
            # each block: the row-wise fc2 all-reduces its output in forward, the column-wise
            # fc1 all-reduces its input gradient in backward
            tpc = by_role["tensor_parallel"]
            n_layers = recorder.N_LAYERS
            assert len(tpc) == 2 * n_layers * steps
            assert all(c.kind == "all_reduce" and c.group_size == tp for c in tpc)
            assert sum(c.phase == "forward" for c in tpc) == n_layers * steps
            assert sum(c.phase == "backward" for c in tpc) == n_layers * steps
        else:
            assert "tensor_parallel" not in by_role
    d = rep.to_dict()
    assert d["parallelism"]["tp_size"] == tp and d["parallelism"]["replicate_size"] == replicate
    assert d["fsdp"]["microbatches_per_step"] == recorder.microbatches(variant)
    for c in d["collectives"]:
        assert c["group_size"] in (shard, replicate, tp, p.dp_size) and c["role"]
    assert "role" in d["rank_facts"][0]["collectives"][0]


@pytest.mark.parametrize("variant", SHAPES)
def test_checkpointing_and_compile_named(variant, shape):
    fs = shape(variant).facts.fsdp
    assert fs.activation_checkpointing is (variant in ("ac", "ac-fsdp1"))
    assert fs.compiled is variant.startswith("compiled")
    if fs.activation_checkpointing:
        assert fs.recompute_cpu_ms_per_step > 0
        assert "aten::scaled_dot_product_attention" in fs.activation_checkpointing_evidence


@pytest.mark.parametrize("variant", SHAPES)
def test_no_configuration_finding_on_healthy_shapes(variant, shape):
    fired = {f.slug for f in shape(variant).findings}
    assert not fired & CONFIG_SLUGS, fired


@pytest.mark.parametrize("variant", ["ga-fsdp2-sync", "ga-fsdp1-sync"])
def test_gradient_sync_on_every_microbatch_is_reported(variant, shape, recorder):
    k = recorder.microbatches(variant)
    f = next(f for f in shape(variant).findings if f.slug == "reduce-scatter-every-microbatch")
    assert f"{k} micro-batches" in f.summary
    silent = variant.replace("-sync", "")  # the same run with sync off on all but the last
    assert not [f for f in shape(silent).findings if f.slug == "reduce-scatter-every-microbatch"]


# ----------------------------------------------------------------------------------------------
# generated GPU timelines of the same shapes (exact truth: truth.json)
# ----------------------------------------------------------------------------------------------

GENERATED = ["ga-fsdp2", "ga-fsdp2-sync", "ac-fsdp2", "hsdp", "tp-fsdp"]


@pytest.fixture(scope="module")
def generated(analyzed_run):
    from fixtures.scenarios import generator as gen

    def get(name):
        return (gen.PRESETS[name], *analyzed_run(gen.PRESETS[name]))  # shared: read only

    return get


@pytest.mark.parametrize("name", GENERATED)
def test_generated_exposed_comm_by_phase_and_role_match_truth(name, generated):
    cfg, rep, truth = generated(name)
    f = rep.facts
    for rf in f.rank_facts:
        tr = truth["ranks"][str(rf.rank)]
        for mine, want in zip(rf.steps, tr["steps"], strict=True):
            for phase, v in want["exposed_by_phase_ms"].items():  # within 1 µs per step
                assert mine.exposed_by_phase.get(phase, 0.0) == pytest.approx(v, abs=1e-3), (rf.rank, phase)
            assert set(mine.exposed_by_role) <= set(want["exposed_by_role_ms"]) | {"other"}
            for role, v in want["exposed_by_role_ms"].items():
                assert mine.exposed_by_role.get(role, 0.0) == pytest.approx(v, abs=1e-3), (rf.rank, role)
    for role, v in truth["summary"]["exposed_by_role_ms_per_step_mean"].items():
        assert f.exposed_comm.by_role[role] == pytest.approx(v, abs=1e-3), role


@pytest.mark.parametrize("name", GENERATED)
def test_generated_shape_is_named(name, generated):
    cfg, rep, _ = generated(name)
    f = rep.facts
    assert f.fsdp.microbatches_per_step == cfg.microbatches
    assert f.fsdp.sharding_strategy == ("HYBRID_SHARD" if cfg.replicate_size > 1 else "FULL_SHARD")
    p = f.parallelism
    assert p.shard_size == cfg.world_size // (cfg.replicate_size * cfg.tp_size)
    assert p.replicate_size == (cfg.replicate_size if cfg.replicate_size > 1 else None)
    assert p.tp_size == (cfg.tp_size if cfg.tp_size > 1 else None)
    rs = 1 if not cfg.grad_sync_every_microbatch else cfg.microbatches
    for u in f.fsdp.units:
        assert u.forward_all_gathers == cfg.microbatches
        assert u.backward_all_gathers == (0 if u.fqn == "" else cfg.microbatches)
        assert u.reduce_scatters == rs
    for rf in f.rank_facts:
        steps = len(rf.steps)
        roles = {}
        for c in rf.collectives:
            roles[c.role] = roles.get(c.role, 0) + 1
            # bus bandwidth of each collective uses its own group's size
            if c.role == "fsdp_shard":
                assert c.group_size == p.shard_size
            elif c.role == "hsdp_replicate":
                assert c.group_size == cfg.replicate_size
                # nccl-tests bus bandwidth over the replicate group, not the world
                r = cfg.replicate_size
                algbw = c.bytes / (c.gpu_dur_us * 1e-6) / 1e9
                assert c.busbw_gbps == pytest.approx(algbw * 2 * (r - 1) / r)
            elif c.role == "tensor_parallel":
                assert c.group_size == cfg.tp_size
        if cfg.replicate_size > 1:
            assert roles["hsdp_replicate"] == len(f.fsdp.units) * steps
        if cfg.tp_size > 1:  # 2 row-parallel outputs (forward) + 2 column-parallel inputs (backward) per block
            assert roles["tensor_parallel"] == 4 * cfg.num_layers * steps


# ----------------------------------------------------------------------------------------------
# public traces (not used to build the detectors)
# ----------------------------------------------------------------------------------------------


def test_checkpointing_found_in_the_public_resnet_act_checkpoint_trace():
    """TraceLens' MI300X DDP ResNet run with activation checkpointing (its file name and
    shared/traces/public/PROVENANCE.md say so): the recompute shows as conv/batch-norm forward
    ops inside backward nodes."""
    from conftest import PUBLIC_TRACES

    path = PUBLIC_TRACES / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz"
    if not path.exists():
        pytest.skip("../shared/traces/public is absent")
    fs = fsdpdoctor.analyze(path).facts.fsdp
    assert fs.version is None and fs.activation_checkpointing is True
    assert "aten::conv2d" in fs.activation_checkpointing_evidence


def test_public_traces_keep_one_forward_pass_per_step_and_group_sizes(public_report):
    """No public trace runs gradient accumulation; every collective's group size is the
    ``Group size`` its record_param_comms recorded (none of them exceeds the world size)."""
    from conftest import public_trace_files

    files = public_trace_files()
    if not files:
        pytest.skip("../shared/traces/public is absent")
    for f in files:
        rep = public_report(f)  # (conftest: analysed once per process)
        assert rep.facts.fsdp.microbatches_per_step == 1, f
        for r in rep.facts.rank_facts:
            for c in r.collectives:
                assert c.group_size is None or r.world_size is None or c.group_size <= r.world_size, (f, c.kind)


# ----------------------------------------------------------------------------------------------
# label forms, torch 2.1 .. 2.13 (names from the torch sources: FSDP1 _runtime_utils.py,
# FSDP2 _fsdp_param_group.py / _fsdp_state.py; see shared/notes/fsdp-trace-signatures.md)
# ----------------------------------------------------------------------------------------------

F1 = "FullyShardedDataParallel."


@pytest.mark.parametrize(
    "chain,phase",
    [
        ([F1 + "forward", F1 + "_pre_forward"], "forward"),
        ([F1 + "forward", F1 + "_pre_forward", F1 + "_pre_forward_prefetch"], "forward"),
        ([F1 + "_root_pre_forward"], "forward"),
        ([F1 + "_pre_backward_hook"], "backward"),
        ([F1 + "_pre_backward_hook", F1 + "_pre_backward_prefetch"], "backward"),
        ([F1 + "_post_backward_hook"], "backward"),
        ([F1 + "_post_backward_hook", F1 + "_post_backward_prefetch"], "backward"),
        (["FSDP::pre_forward"], "forward"),  # 2.4: no FQN
        (["FSDP::backward_prefetch"], "backward"),
        (["FSDP::pre_forward (layers.0)", "FSDP::all_gather (layers.0)"], "forward"),  # 2.5+
        (["FSDP::pre_backward (layers.0)", "FSDP::all_gather (layers.0)"], "backward"),
        (["FSDP::backward_prefetch for layers.2", "FSDP::all_gather (layers.2)"], "backward"),
        (["FSDP::forward_prefetch for layers.2", "FSDP::all_gather (layers.2)"], "forward"),
        (["FSDP::post_backward_reduce (layers.1)"], "backward"),
        (["FSDP::root_post_backward_callback", "FSDP::post_backward_reduce"], "backward"),
        (["FSDP::pre_forward (strata.0) [pg=4]", "FSDP::all_gather (strata.0) [pg=4]"], "forward"),  # 2.13
        (["FSDP::pre_backward (strata.0) [pg=4]", "FSDP::all_gather (strata.0) [pg=4]"], "backward"),
        (["FSDP::all_gather (layers.0)"], None),  # says no pass by itself
        (["ProfilerStep#3", "DistributedDataParallel.forward"], None),
    ],
)
def test_phase_from_every_label_form(chain, phase):
    from fsdpdoctor.analysis.labels import phase_from_labels

    assert phase_from_labels(chain) == phase


@pytest.mark.parametrize(
    "label,fqn",
    [
        ("FSDP::pre_forward", ""),
        ("FSDP::pre_forward (layers.0)", "layers.0"),
        ("FSDP::pre_forward (strata.0) [pg=4]", "strata.0"),
        ("FSDP::pre_forward [pg=2]", ""),
        ("FSDP::all_gather (layers.0.attn.qkv) [pg=2]", "layers.0.attn.qkv"),
        ("FSDP::backward_prefetch for layers.3", "layers.3"),
        ("FSDP::post_backward_rs_wait (layers.1)", "layers.1"),
    ],
)
def test_unit_fqn_from_every_fsdp2_label_form(label, fqn):
    from fsdpdoctor.analysis.fsdp import _fqn_of

    assert _fqn_of(label) == fqn


def test_generated_checkpointing_recompute_time(generated):
    """Activation checkpointing on a generated GPU timeline: the recompute is found, and its GPU
    time is the whole re-run forward's (the waterfall's recompute part, the figure FSD019 and the
    headline quote), more than the kernels of the forward-only ops alone."""
    cfg, rep, truth = generated("ac-fsdp2")
    assert cfg.activation_checkpointing
    for rf in rep.facts.rank_facts:
        fs = rf.fsdp
        assert fs.activation_checkpointing is True
        steps = truth["ranks"][str(rf.rank)]["steps"]
        want = sum(s["recompute_forward_only_ops_ms"] for s in steps) / len(steps)
        whole = sum(s["recompute_ms"] for s in steps) / len(steps)
        assert want < fs.recompute_gpu_ms_per_step
        assert fs.recompute_gpu_ms_per_step == pytest.approx(whole, rel=0.05)
        assert fs.recompute_gpu_ms_per_step == pytest.approx(rf.efficiency.parts_ms["recompute"], rel=1e-9)
