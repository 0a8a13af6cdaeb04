"""fsdpdoctor on the levers' twins (``fixtures/recorded/gpu-h200-levers``: one H200, a Llama-shaped
model fsdpdoctor had not met, each lever of a finding recorded as a twin of the same run).

Truth: the model's arithmetic (parameter count, units), the raw traces read with plain ``json``
(FSDP hook labels, kernel and op names, input shapes) and the step times of the step-clock test's
independent reader (``raw_clock``); never fsdpdoctor's output.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

import pytest

from _suitepub_cache import report
from test_step_clock import raw_clock

SET = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu-h200-levers"
VARIANTS = sorted(p.name for p in SET.iterdir() if p.is_dir())
# the recorder's model (fixtures/record_gpu_levers.py: vocab, dim, FFN, layers), counted by hand:
# embedding + untied head, per layer 4 attention projections + 3 MLP projections + 2 RMSNorm weights, final norm
VOCAB, DIM, FFN, LAYERS, SEQ = 32000, 1024, 2816, 8, 512
PARAMETERS = 2 * VOCAB * DIM + LAYERS * (4 * DIM * DIM + 3 * DIM * FFN + 2 * DIM) + DIM


@lru_cache(maxsize=None)
def _events(variant: str) -> tuple[dict, ...]:
    with gzip.open(SET / variant / "rank0.json.gz", "rt") as fh:
        return tuple(json.load(fh)["traceEvents"])


def _step(variant: str) -> float:
    return raw_clock(SET / variant / "rank0.json.gz")["step_ms"]


def _saved(problem: str, fixed: str) -> float:
    return _step(problem) - _step(fixed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_run_is_the_model_and_the_lever_it_says(variant):
    """Units, optimizer, compile and batch as the tool reads them, against the model and a raw reading."""
    meta = json.loads((SET / variant / "fsdpdoctor_meta.json").read_text())
    assert meta["extra"]["model"]["parameters"] == PARAMETERS
    ev = _events(variant)
    names = {e.get("name", "") for e in ev}
    # one FSDP2 unit per block (per two blocks in the pairs variant) and the root (FQN "": a bare label)
    units = {n[len("FSDP::pre_forward (") : -1] for n in names if n.startswith("FSDP::pre_forward (")}
    units |= {""} if "FSDP::pre_forward" in names else set()
    assert len(units) == (LAYERS // 2 if "pairs" in variant else LAYERS) + 1
    fused = any("_fused_adamw" in n for n in names)
    foreach = any(n.startswith("aten::_foreach_") for n in names)
    assert (fused, foreach and not fused) == ("fused" in variant, "fused" not in variant)
    compiled = any(n.startswith("Torch-Compiled Region") for n in names)
    assert compiled == variant.endswith("compile")
    emb = [e for e in ev if e.get("name") == "aten::embedding" and e.get("args", {}).get("Input Dims")]
    batch = int(variant.split("-b")[-1].split("-")[0]) if "-b" in variant.replace("-bf16", "") else 4
    assert emb and {tuple(e["args"]["Input Dims"][1]) for e in emb} == {(batch, SEQ)}

    f = report(SET / variant).facts
    assert len(f.fsdp.units) == len(units)
    assert f.efficiency.optimizer == ("fused" if fused else "foreach")
    assert f.fsdp.compiled is compiled


def test_repeats_json_holds_the_committed_traces_call():
    """repeats.json's committed call's step times are the committed traces' (read again here)."""
    doc = json.loads((SET / "repeats.json").read_text())["variants"]
    assert {v for v, d in doc.items() if d["committed_call"] is not None} == set(VARIANTS)
    for v in VARIANTS:
        c = doc[v]["committed_call"]
        assert doc[v]["trace_step_ms"][c] == pytest.approx(_step(v), abs=0.002), v
        meta = json.loads((SET / v / "fsdpdoctor_meta.json").read_text())
        assert doc[v]["unprofiled_step_ms"][c] == meta["extra"]["run"]["unprofiled_step_ms"]


def test_the_fusion_lever_where_a_fused_optimizer_would_not_pay():
    """GPU-bound, foreach AdamW: a fused step saves ~3% (its twin), compiling the blocks 15 ms (18%).
    FSD017 prices the fusion lever, and its range holds what block.compile() saved (a regression test:
    the rule's fallback was made on this pair)."""
    rep = report(SET / "llama-bf16-b64")
    f = next(x for x in rep.findings if x.slug == "non-matmul-kernels")
    assert f.saving_kind == "non-matmul-kernels/fusion" and f.saving_basis == "heuristic"
    saved_fused, saved_compile = (
        _saved("llama-bf16-b64", "llama-bf16-b64-fused"),
        _saved("llama-bf16-b64", "llama-bf16-b64-compile"),
    )
    assert 0 < saved_fused < 0.05 * _step("llama-bf16-b64") < saved_compile
    lo, hi = f.saving_range_ms
    assert lo <= saved_compile <= hi
    assert abs(f.est_saving_ms / saved_compile - 1) < 0.25
    assert any("fused step would save only" in e for e in f.evidence)


def test_no_hook_finding_where_two_blocks_per_unit_saved_nothing():
    """GPU-bound: two blocks per unit changed the step by less than the two calls' spread (2.5 ms):
    FSD016 says nothing there, and it does fire on the CPU-bound batch-4 run."""
    assert abs(_saved("llama-bf16-b64", "llama-bf16-b64-pairs")) < 2.5
    assert not [x for x in report(SET / "llama-bf16-b64").findings if x.slug == "gpu-starved-by-hooks"]
    assert [x for x in report(SET / "llama-bf16").findings if x.slug == "gpu-starved-by-hooks"]


@pytest.mark.parametrize("problem, most", [("llama-fp32-b64", 1.10), ("llama-tf32-b64", 1.35)])
def test_the_bf16_replay_against_its_twin(problem, most):
    """FSD015's replay of bf16 on the GPU-bound fp32 / TF32 runs against what the bf16 twin saved
    (raw step clocks): 1.06x and 1.31x short today; 1.98x and 1.79x before the replay's blocked
    copies, the backlog's start and its GEMMs' factor and TF32's rate were mended on these pairs."""
    f = next(x for x in report(SET / problem).findings if x.slug == "matmul-wrong-engine")
    saved = _saved(problem, "llama-bf16-b64")
    assert 1.0 <= saved / f.est_saving_ms <= most, (problem, f.est_saving_ms, saved)
