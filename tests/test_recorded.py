"""fsdpdoctor on real FSDP runs that the suite records itself (torch on CPU, gloo, 2 ranks).

Expected values are computed from the recorder's model (parameter shapes and the wrapping each
variant applies), not read back from the traces.
"""

from __future__ import annotations

import math

import pytest


def _unit_numel(recorder, variant: str, pad) -> dict[str, int]:
    """All-gather elements per unit: each parameter belongs to its deepest wrapped ancestor."""
    model = recorder.build_model()
    units = recorder.unit_fqns(variant, model)
    out = {u: 0 for u in units}
    for name, p in model.named_parameters():
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        out[owner] += pad(tuple(p.shape))
    return out


def _fsdp2_numel(ws):
    # FSDP2 shards dim 0 and pads it to a multiple of the world size
    return lambda shape: math.ceil(shape[0] / ws) * ws * math.prod(shape[1:])


@pytest.fixture(scope="module")
def reports(recorded_report):
    return recorded_report


def _per_unit(rep, attr):
    return {u.fqn: getattr(u, attr) for u in rep.facts.fsdp.units}


FSDP2_VARIANTS = ["per-block", "root-only", "per-linear", "no-backward-prefetch", "no-reshard", "bf16-mp"]


@pytest.mark.parametrize("variant", FSDP2_VARIANTS)
def test_fsdp2_units_and_collectives_match_the_model(variant, reports, recorder, recorded_world_size):
    rep = reports(variant)
    f = rep.facts
    ws = recorded_world_size
    expected_units = recorder.unit_fqns(variant)
    assert f.fsdp.version == 2
    assert f.ranks == list(range(ws))
    assert f.steps.count == recorder.ACTIVE
    assert f.fsdp.unit_count == len(expected_units)
    assert [u.fqn for u in f.fsdp.units][0] == ""  # the root's pre_forward runs first
    assert sorted(u.fqn for u in f.fsdp.units) == sorted(expected_units)
    numel = _unit_numel(recorder, variant, _fsdp2_numel(ws))
    width = 2 if variant == "bf16-mp" else 4
    fwd = _per_unit(rep, "forward_all_gathers")
    bwd = _per_unit(rep, "backward_all_gathers")
    rs = _per_unit(rep, "reduce_scatters")
    for u in f.fsdp.units:
        assert u.unsharded_numel == numel[u.fqn], u.fqn
        assert fwd[u.fqn] == 1, u.fqn
        resharded = variant != "no-reshard" and u.fqn != ""  # the root keeps its params
        assert bwd[u.fqn] == (1 if resharded else 0), u.fqn
        assert rs[u.fqn] == 1, u.fqn
        assert u.all_gather_bytes == pytest.approx((fwd[u.fqn] + bwd[u.fqn]) * numel[u.fqn] * width)
        assert u.reduce_scatter_bytes == pytest.approx(numel[u.fqn] * width)
    stats = {c.kind: c for c in f.collectives}
    n_units = len(expected_units)
    n_bwd = sum(1 for u in expected_units if u != "") if variant != "no-reshard" else 0
    assert stats["all_gather"].count_per_step == n_units + n_bwd
    assert stats["reduce_scatter"].count_per_step == n_units
    # every collective was attributed to a unit and a phase
    for r in f.rank_facts:
        for c in r.collectives:
            assert c.unit is not None and c.step >= 0
            hooks = " ".join(c.fsdp_labels)
            if c.kind == "reduce_scatter" or "pre_backward" in hooks:
                assert c.phase == "backward"
            elif "FSDP::pre_forward" in hooks:
                assert c.phase == "forward"


def test_prefetch_modes_and_reshard(reports):
    assert reports("per-block").facts.fsdp.backward_prefetch == "BACKWARD_PRE"
    ev = reports("per-block").facts.fsdp.backward_prefetch_evidence
    assert ev.get("on_demand", 0) == 0 and ev["prefetched"] > 0
    nb = reports("no-backward-prefetch").facts.fsdp
    assert nb.backward_prefetch == "NONE" and nb.backward_prefetch_evidence.get("prefetched", 0) == 0
    assert reports("no-reshard").facts.fsdp.reshard_after_forward is False
    assert reports("per-block").facts.fsdp.reshard_after_forward is True
    # the root-only run gathers once in forward and never in backward: no prefetch to judge
    assert reports("root-only").facts.fsdp.backward_prefetch_evidence == {}


def test_mixed_precision_collectives(reports):
    mp = reports("bf16-mp").facts.fsdp
    assert mp.mixed_precision is True
    assert mp.collective_dtypes["all_gather"] == ["c10::BFloat16"]
    assert reports("per-block").facts.fsdp.mixed_precision is False


def test_phases_split_forward_backward_optimizer(reports):
    f = reports("per-block").facts
    for r in f.rank_facts:
        for s in r.steps:
            assert set(s.phase_ms) == {"forward", "backward", "optimizer"}
            assert all(v > 0 for v in s.phase_ms.values())
            assert sum(s.phase_ms.values()) <= s.cpu_span_ms + 1e-6


def test_fsdp1_units_named_from_sidecar(reports, recorder, recorded_world_size):
    rep = reports("fsdp1")
    fs = rep.facts.fsdp
    ws = recorded_world_size
    assert fs.version == 1 and fs.backward_prefetch == "BACKWARD_PRE"
    assert [u.fqn for u in fs.units] == recorder.unit_fqns("fsdp1")
    assert fs.sources["units"] == "sidecar" and fs.sources["backward_prefetch"] == "trace"
    # FSDP1 pads the flat parameter to a multiple of the world size
    flat = _unit_numel(recorder, "fsdp1", lambda shape: math.prod(shape))
    for u in fs.units:
        assert u.unsharded_numel == math.ceil(flat[u.fqn] / ws) * ws
        assert u.reduce_scatter_bytes == pytest.approx(u.unsharded_numel * 4)
    assert fs.sharding_strategy == "FULL_SHARD"
    assert all(u.named for u in fs.units)


def test_fsdp1_units_without_a_sidecar_have_placeholder_names(recorded_run, recorder, tmp_path):
    """FSDP1 labels name no module: without the sidecar the units are '<unit K>' in execution
    order, marked unnamed, a name no real module (even one called 'unit3') can have."""
    import shutil

    import fsdpdoctor

    for p in recorded_run("fsdp1").glob("rank*.json*"):
        shutil.copy(p, tmp_path / p.name)
    fs = fsdpdoctor.analyze(tmp_path).facts.fsdp
    n = len(recorder.unit_fqns("fsdp1"))
    assert [u.fqn for u in fs.units] == [f"<unit {k}>" for k in range(n)]
    assert not any(u.named for u in fs.units) and "units" not in fs.sources


def test_ddp_is_not_fsdp(reports, recorder):
    f = reports("ddp").facts
    assert f.fsdp.version is None and f.fsdp.unit_count == 0
    stats = {c.kind: c for c in f.collectives}
    assert stats["all_reduce"].count_per_step == 1  # one bucket for 232k parameters


def test_report_formats_on_a_real_run(reports):
    import json

    rep = reports("per-block")
    d = json.loads(rep.to_json())
    for key in ("schema_version", "ranks", "fsdp", "steps", "overlap", "exposed_comm", "findings"):
        assert key in d
    assert d["fsdp"]["version"] == 2 and d["fsdp"]["unit_count"] == 5
    assert [u["fqn"] for u in d["fsdp"]["units"]][1:] == [f"layers.{i}" for i in range(4)]
    assert d["steps"]["count"] >= 2 and d["steps"]["mean_ms"] > 0
    assert d["overlap"]["pct"] is None  # no GPU in a CPU run
    md = rep.to_markdown()
    assert "FSDP2" in md and "layers.3" in md
