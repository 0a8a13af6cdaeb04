"""The fixes of pageable-memcpy (FSD006), low-overlap (FSD008), host-bound (FSD010),
step-time-jitter (FSD013) and gpu-starved-by-hooks (FSD016) in the run's own idiom
(rules/_idiom.py), and the Run line naming the framework.

Every real input where these rules fire (the GPU recordings, the public traces) was driven by
plain PyTorch, and every framework run here is CPU-only (no GPU rule fires on it). So the
rules run on a real input's facts where they fire, with the framework that detection read from
a real framework run put in: torchtitan's dump folder (fixtures/recorded/torchtitan-cpu-debugmodel),
the sidecar that the HF / Lightning integrations write (``framework`` as in
fsdpdoctor/integrations/hf.py and lightning.py). The settings a fix names are checked against the
installed libraries' own signatures (TrainingArguments, Lightning's Trainer), and the block class
against the raw trace's ``nn.Module: <Class>_<i>`` events (stdlib json).
"""

from __future__ import annotations

import copy
import gzip
import inspect
import json
import re
from pathlib import Path

import pytest

import fsdpdoctor
from conftest import PUBLIC_TRACES
from fsdpdoctor.analysis.framework import detect
from fsdpdoctor.engine import run_rules

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
GPT2 = RECORDED / "gpu-h200" / "gpt2-bf16"  # H200, FSDP2, bf16: gpu-starved-by-hooks and pageable-memcpy fire
SIDECARS = {
    "transformers": {"name": "transformers", "trainer": "Trainer"},  # FsdpDoctorCallback (integrations/hf.py)
    "lightning": {"name": "lightning", "trainer": "Lightning Trainer"},  # integrations/lightning.py
}


@pytest.fixture(scope="module")
def gpt2():
    return fsdpdoctor.analyze(GPT2, jobs=1).facts


@pytest.fixture(scope="module")
def torchtitan_fw():
    return fsdpdoctor.analyze(RECORDED / "torchtitan-cpu-debugmodel", jobs=1).facts.framework


def _as(facts, fw):
    out = copy.copy(facts)
    out.framework = fw
    return out


def _fix(facts, slug: str) -> dict[str, str]:
    return next(f for f in run_rules(facts) if f.slug == slug).fix


def _kwargs(code: str, call: str) -> set[str]:
    """The keyword names passed to ``call(...)`` anywhere in ``code``."""
    out: set[str] = set()
    for m in re.finditer(re.escape(call) + r"\(([^()]*(?:\([^()]*\)[^()]*)*)\)", code):
        out |= set(re.findall(r"(\w+)=", m[1]))
    return out


def test_plain_pytorch_keeps_its_fully_shard_code(gpt2):
    assert gpt2.framework.idiom == "pytorch"  # record_gpu.py drives torch directly (its README)
    fix = _fix(gpt2, "gpu-starved-by-hooks")
    assert set(fix) == {"fsdp2"} and "fully_shard(blocks[i:i + 2])" in fix["fsdp2"]


def test_torchtitan_runs_get_its_config(gpt2, torchtitan_fw):
    from fixtures.record_torchtitan import TORCHTITAN_ARGS

    assert torchtitan_fw.name == "torchtitan"
    facts = _as(gpt2, torchtitan_fw)
    fix = _fix(facts, "gpu-starved-by-hooks")
    assert set(fix) == {"torchtitan"}
    code = fix["torchtitan"]
    assert "--compile.no-enable" in TORCHTITAN_ARGS  # tyro's boolean pair, so --compile.enable parses
    assert "--compile.enable" in code and "[compile]\nenable = true" in code
    assert "fully_shard(" not in code  # torchtitan wraps the units itself
    assert "two" in code and "micro-batch" in code  # the levers no setting carries, still said
    # torchtitan has no loader-pinning setting: the rule's torch code stays
    assert "pin_memory=True" in "".join(_fix(facts, "pageable-memcpy").values())


@pytest.mark.parametrize("name", ["transformers", "lightning"])
def test_hf_and_lightning_fixes_use_real_settings(gpt2, name):
    pytest.importorskip(name)
    fw = detect(gpt2, {"framework": SIDECARS[name]})
    assert fw.name == name
    facts = _as(gpt2, fw)
    hooks = _fix(facts, "gpu-starved-by-hooks")
    pinned = _fix(facts, "pageable-memcpy")
    assert set(hooks) == set(pinned) == {name}
    code = hooks[name] + pinned[name]
    assert "fully_shard(" not in code
    if name == "transformers":
        from transformers import TrainingArguments

        keys = _kwargs(code, "TrainingArguments")
        assert {"torch_compile", "dataloader_pin_memory"} <= keys
        assert keys <= set(inspect.signature(TrainingArguments).parameters)  # never an invented key
    else:
        assert "model = torch.compile(model)" in hooks[name] and "trainer.fit(" in hooks[name]
        assert "DataLoader(" in pinned[name] and "pin_memory=True" in pinned[name]
        assert "def train_dataloader(self)" in pinned[name]


def _module_classes(path: Path) -> set[str]:
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return {
        m[1]
        for e in events
        if e.get("ph") == "X" and (m := re.fullmatch(r"nn\.Module: (\w+?)_\d+", str(e.get("name", ""))))
    }


def test_the_hooks_fix_names_the_block_the_trace_names(gpt2):
    """The block class comes from the trace: the public MI300 DDP ResNet's ``BasicBlock`` (its raw
    module annotations), as detection reads it, in a Lightning run's hooks fix."""
    path = PUBLIC_TRACES / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz"
    if not path.exists():
        pytest.skip("../shared absent")
    classes = _module_classes(path)
    assert "BasicBlock" in classes and "TransformerBlock" not in classes
    fw = copy.copy(fsdpdoctor.analyze(path, jobs=1).facts.framework)
    fw.name, fw.trainer = "lightning", "Lightning Trainer"
    code = _fix(_as(gpt2, fw), "gpu-starved-by-hooks")["lightning"]
    assert "two BasicBlock blocks" in code and "TransformerBlock" not in code


def _cfg(**over):
    from fsdpdoctor.config import defaults

    return {**defaults(), **over}


def _lightning(facts):
    return _as(facts, detect(facts, {"framework": SIDECARS["lightning"]}))


def test_host_bound_loader_and_compile_in_lightning():
    """host-bound (FSD010) fires on the public 2021 V100 trace (ResNet-50, the DataLoader in the
    process, no torch.compile): in a Lightning run the loader's workers go into
    ``train_dataloader`` and compiling before ``trainer.fit``, not a bare ``DataLoader(...)``."""
    path = PUBLIC_TRACES / "kineto-tbplugin-2021-computeproperties" / "gpu_metrics_input.json"
    if not path.exists():
        pytest.skip("../shared absent")
    facts = fsdpdoctor.analyze(path, jobs=1).facts
    with open(path) as fh:
        names = {str(e.get("name", "")) for e in json.load(fh)["traceEvents"]}
    assert any("DataLoader" in n for n in names)  # the loader runs in the process (the raw trace)
    assert not any("Compiled" in n or "Torch-Compiled" in n for n in names)  # nothing compiled
    plain = _fix(facts, "host-bound")
    assert set(plain) == {"any"} and "loader = DataLoader(" in plain["any"]
    code = _fix(_lightning(facts), "host-bound")["lightning"]
    assert "def train_dataloader(self)" in code and "num_workers=8" in code
    assert "model = torch.compile(model)" in code and "trainer.fit(" in code
    assert "loader = DataLoader(" not in code


def test_jitter_loader_in_lightning_and_what_has_no_setting_stays():
    """step-time-jitter (FSD013) on the public HTA V100 trace (hta-df-index-v100, rank 1: five
    steps of 336-365 ms, the threshold lowered to 1%): the loader in Lightning's
    ``train_dataloader``, ``gc.freeze()`` kept. Its host-bound finding asks only for DDP's buckets
    (404 per-parameter all-reduces), which no framework setting carries: the torch code stays."""
    path = PUBLIC_TRACES / "hta-df-index-v100" / "rank-1.json.gz"
    if not path.exists():
        pytest.skip("../shared absent")
    with gzip.open(path, "rt") as fh:
        steps = [e for e in json.load(fh)["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert len(steps) == 5  # enough for the jitter rule to judge (jitter_min_steps 3)
    facts = fsdpdoctor.analyze(path, jobs=1).facts
    cfg = _cfg(jitter_cv_pct=1.0, disable=[])
    plain = {f.slug: f.fix for f in run_rules(facts, cfg)}
    pl = {f.slug: f.fix for f in run_rules(_lightning(facts), cfg)}
    assert set(plain["step-time-jitter"]) == {"any"} and set(pl["step-time-jitter"]) == {"lightning"}
    jitter = pl["step-time-jitter"]["lightning"]
    assert "gc.freeze()" in jitter and "def train_dataloader(self)" in jitter
    assert "num_workers=8" in jitter and "persistent_workers=True" in jitter
    assert pl["host-bound"] == plain["host-bound"] and "bucket_cap_mb" in plain["host-bound"]["any"]


def test_the_run_line_names_a_framework_found_in_evidence(gpt2):
    """torchtitan 0.3.0 wrote the folder (its README): the Run line says so and from what; a plain
    PyTorch run (record_gpu.py) names no framework."""
    from fsdpdoctor.report.sections import headline

    tt = fsdpdoctor.analyze(RECORDED / "torchtitan-cpu-debugmodel", jobs=1).facts
    run = dict(headline(tt))["Run"]
    assert "torchtitan (dump folder" in run
    assert dict(headline(gpt2))["Run"].endswith("NVIDIA H200")  # nothing after the device
    hf = dict(headline(_as(gpt2, detect(gpt2, {"framework": SIDECARS["transformers"]}))))["Run"]
    assert hf.endswith("· HF Transformers Trainer (sidecar)")
