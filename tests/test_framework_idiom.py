"""The framework a run was driven by (fsdpdoctor.analysis.framework) and fixes written in its
idiom (rules/_idiom.py), on real inputs: what drove each is known independently (the recording
script, the folder's README, the public trace's PROVENANCE), and the block class a fix names is
read from the raw trace's ``nn.Module: <Class>_<i>`` annotations with the standard library.

The HF Trainer and Lightning runs are checked in tests/test_integrations_hf.py and
tests/test_integrations_lightning.py, which record them.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

import fsdpdoctor
from conftest import PUBLIC_TRACES

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
AC_TEMPLATE = """from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
"""


def _idiom():
    from fsdpdoctor.rules import _idiom

    return _idiom


def _module_instances(path: Path) -> dict[str, set[int]]:
    """Class → instance numbers of the raw trace's ``nn.Module: <Class>_<i>`` events (stdlib)."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as fh:
        events = json.load(fh)["traceEvents"]
    out: dict[str, set[int]] = defaultdict(set)
    for e in events:
        m = re.fullmatch(r"nn\.Module: (\w+?)_(\d+)", str(e.get("name", "")))
        if e.get("ph") == "X" and m:
            out[m[1]].add(int(m[2]))
    return out


def test_a_trace_file_is_placed_by_its_own_folders_not_its_surroundings(tmp_path, monkeypatch):
    """One rank's file of torchtitan's folder is still torchtitan's (its iteration folder names the
    series); a trace anywhere else costs no reading of the folders around it (the old search read
    two levels below each of five ancestors: thousands of folders in a home or /tmp)."""
    from fsdpdoctor.analysis.framework import _layout
    from fsdpdoctor.ingest import layouts

    one = RECORDED / "torchtitan-cpu-debugmodel" / "profiling" / "traces" / "iteration_4" / "rank0_trace.json.gz"
    assert _layout([str(one)]) == "torchtitan"
    seen: list[Path] = []
    real = layouts.dump_folder
    monkeypatch.setattr(layouts, "dump_folder", lambda p, it=None: seen.append(Path(p)) or real(p, it))
    elsewhere = tmp_path / "a" / "b" / "rank0_trace.json.gz"
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_bytes(one.read_bytes())
    for i in range(3):
        (tmp_path / "a" / f"iteration_{i}").mkdir()  # beside the file, not above it: not its series
    assert _layout([str(elsewhere)]) is None
    assert seen == []
    assert fsdpdoctor.analyze(elsewhere, jobs=1).facts.framework.name != "torchtitan"


def _ac_code(facts) -> str:
    return "\n".join(_idiom().idiom_fix(facts, "activation_checkpointing", {"any": AC_TEMPLATE}).values())


def test_torchtitan_dump_folder_gets_torchtitan_config():
    """The folder torchtitan 0.3.0 wrote (its README) is torchtitan's: fixes are its own config,
    0.3's command line (the flags fixtures/record_torchtitan.py itself passed to torchtitan
    0.3.0, so known to parse) and 0.2's TOML keys."""
    from fixtures.record_torchtitan import TORCHTITAN_ARGS

    rep = fsdpdoctor.analyze(RECORDED / "torchtitan-cpu-debugmodel", jobs=1)
    fw = rep.facts.framework
    assert fw.name == "torchtitan" and fw.trainer == "torchtitan.train"
    assert any("torchtitan dump folder" in e for e in fw.evidence)
    ac = _ac_code(rep.facts)
    assert "activation_checkpoint=FullAC.Config()" in ac and '[activation_checkpoint]\nmode = "full"' in ac
    mp = _idiom().render(rep.facts, "mixed_precision")
    assert "--training.mixed-precision-param" in TORCHTITAN_ARGS
    assert "--training.mixed-precision-param bfloat16" in mp
    assert '[training]\nmixed_precision_param = "bfloat16"' in mp
    assert "--compile.no-enable" in TORCHTITAN_ARGS  # tyro's boolean pair: --compile.enable turns it on
    assert "--compile.enable" in _idiom().render(rep.facts, "compile")
    # the run's fp32 collectives finding (FSD011) is written in torchtitan's config, not fully_shard code
    f = next(x for x in rep.findings if x.slug == "no-mixed-precision-collectives")
    assert set(f.fix) == {"torchtitan"} and "mixed-precision-param" in f.fix["torchtitan"]
    # the debugmodel's selective checkpointing recomputes (FSD019): recompute less
    f = next(x for x in rep.findings if x.slug == "activation-recompute")
    assert set(f.fix) == {"torchtitan"} and "SelectiveAC.Config()" in f.fix["torchtitan"]


@pytest.mark.parametrize("variant,container", [("per-block", "layers"), ("fsdp1", "layers"), ("ddp", None)])
def test_plain_pytorch_recordings_keep_pytorch_code_with_their_blocks(variant, container):
    """record_cpu.py drives torch directly: plain PyTorch. Its FSDP units are ``layers.0..3``
    (fixtures/recorded/README.md); DDP has no units, and nothing in its trace names the block
    class: the fix says so instead of assuming ``TransformerBlock``."""
    rep = fsdpdoctor.analyze(RECORDED / variant, jobs=1)
    fw = rep.facts.framework
    assert fw.name == "pytorch" and fw.block_class is None
    assert _idiom().render(rep.facts, "activation_checkpointing") is None
    code = _ac_code(rep.facts)
    assert "TransformerBlock" not in code
    if container:
        assert f"isinstance(m, type(model.{container}[0]))" in code
    else:
        assert "isinstance(m, MyBlock)" in code and "names none" in code


@pytest.mark.skipif(not PUBLIC_TRACES.is_dir(), reason="../shared/traces/public not present")
@pytest.mark.parametrize(
    "folder,framework,block,instances",
    [
        # PROVENANCE: vLLM inference (gpt-oss: 36 TransformerBlocks in the trace's annotations)
        ("tracelens-b200-vllm", "vllm", "TransformerBlock", 36),
        # PROVENANCE: DDP ResNet with activation checkpointing, plain PyTorch (torchvision's model)
        ("tracelens-mi300-ddp", "pytorch", "BasicBlock", 8),
        # PROVENANCE: xDiT Flux.1 diffusion inference (diffusers pipeline, T5 text encoder)
        ("tracelens-mi300x-xdit-flux-graphs", "diffusers", "T5Block", 24),
    ],
)
def test_public_traces_name_their_framework_and_block(folder, framework, block, instances):
    files = sorted((PUBLIC_TRACES / folder).glob("*.json.gz"))
    path = files[-1]  # xDiT: the profile (replay) trace
    rep = fsdpdoctor.analyze(path, jobs=1)
    fw = rep.facts.framework
    assert fw.name == framework
    raw = _module_instances(path)
    assert raw[block] == set(range(instances))  # the class the trace itself names, every instance
    assert fw.block_class == block and fw.block_count == instances
    assert fw.block_class_source == "trace module annotations"
    code = _ac_code(rep.facts)
    assert f"isinstance(m, {block})" in code
    if block != "TransformerBlock":
        assert "TransformerBlock" not in code


def _record(tmp: Path, model, steps: int = 3) -> Path:
    """A real CPU trace of ``model`` training ``steps`` steps, with Python frames (with_stack)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    x, adj = torch.randn(64, 16), torch.rand(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp / "rank0.json"
    sched = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=sched,
        with_stack=True,
        with_modules=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(out)),
    ) as prof:
        for _ in range(steps + 1):
            model(x, adj).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return out


def test_repeated_method_is_named_and_wrapped(tmp_path):
    """A GCN whose layers are a method called in a loop, not modules: the fix says to wrap that
    method's call (a module-level check_fn reaches nothing)."""
    import torch
    from torch import nn

    class GCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(torch.randn(16, 16) * 0.1) for _ in range(3))

        def propagate(self, h, adj, w):
            return torch.relu(adj @ (h @ w))

        def forward(self, x, adj):
            h = x
            for w in self.weights:
                h = self.propagate(h, adj, w)
            return h

    path = _record(tmp_path, GCN())
    with open(path) as fh:
        names = [e["name"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "python_function"]
    calls = sum(1 for n in names if n.endswith(": propagate"))
    rep = fsdpdoctor.analyze(path, jobs=1)
    fw = rep.facts.framework
    assert fw.name == "pytorch" and fw.block_class is None
    assert fw.repeated_method is not None and fw.repeated_method.endswith(": propagate")
    steps = len(rep.facts.rank_facts[0].steps)
    assert fw.repeated_method_calls == pytest.approx(calls / steps)  # 3 layers a step
    code = _ac_code(rep.facts)
    assert "checkpoint(propagate, h, *args, use_reentrant=False)" in code
    assert "TransformerBlock" not in code and "isinstance(" not in code


def test_repeated_module_class_is_named_from_a_fresh_trace(tmp_path):
    import torch
    from torch import nn

    class GCNLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, h, adj):
            return torch.relu(adj @ self.lin(h))

    class GCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(GCNLayer() for _ in range(3))

        def forward(self, x, adj):
            for layer in self.layers:
                x = layer(x, adj)
            return x

    path = _record(tmp_path, GCN())
    raw = _module_instances(path)
    assert raw["GCNLayer"] == {0, 1, 2}
    rep = fsdpdoctor.analyze(path, jobs=1)
    fw = rep.facts.framework
    assert fw.block_class == "GCNLayer" and fw.block_count == 3 and fw.repeated_method is None
    assert "isinstance(m, GCNLayer)" in _ac_code(rep.facts)


@pytest.mark.skipif(not PUBLIC_TRACES.is_dir(), reason="../shared not present")
def test_a_snapshot_alone_names_its_library_from_the_allocation_sites():
    """PROVENANCE: a Stable Diffusion evaluation with diffusers + LoRA; the snapshot's stacks (no
    trace) are all there is."""
    from fsdpdoctor.api import analyze_memory_only

    path = (
        PUBLIC_TRACES.parents[1]
        / "snapshots"
        / "public"
        / "layoutediting-diffusers-cuda1-2024"
        / "dump_snapshot.pickle"
    )
    fw = analyze_memory_only(path).facts.framework
    assert fw.name == "diffusers" and fw.idiom == "pytorch"
    assert any(e.startswith("memory snapshot:") and "diffusers/" in e for e in fw.evidence)


def test_an_hf_model_in_a_plain_loop_is_named_from_its_frames(tmp_path):
    """A tiny GPT-2 (built from its config, never downloaded) trained in the user's own loop,
    profiled with Python frames: the frames run in transformers/ (no Trainer), the module
    annotations name GPT2Block (GPT2Config.n_layer instances); the fix is HF's own switch."""
    pytest.importorskip("transformers")
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer = 2
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16))
    out = tmp_path / "rank0.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
        with_stack=True,
        with_modules=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(out)),
    ) as prof:
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert _module_instances(out)["GPT2Block"] == set(range(n_layer))
    rep = fsdpdoctor.analyze(out, jobs=1)
    fw = rep.facts.framework
    assert fw.name == "transformers" and fw.trainer is None
    assert fw.block_class == "GPT2Block" and fw.block_count == n_layer
    code = _ac_code(rep.facts)
    assert code.startswith("model.gradient_checkpointing_enable(") and "# every GPT2Block" in code
    assert "TrainingArguments" not in code
    assert _idiom().render(rep.facts, "mixed_precision") is None  # no Trainer: plain PyTorch's autocast
