"""Which framework drove the run, and the model's repeated block by its own name
(:class:`fsdpdoctor.facts.framework.FrameworkFacts`), so that a fix is written the way that user
would write it (``rules/_idiom.py``).

The evidence, strongest first, each named in ``evidence``:

- the Python frames of the traces (``python_function`` events, ``with_stack=True``): the files
  they run in (``transformers/trainer.py``, ``peft/tuners/…``, ``lightning/pytorch/…``,
  ``accelerate/…``, ``torchtitan/…``, ``vllm/…``), and the module annotations
  ``nn.Module: <Class>_<i>`` (``with_stack`` / ``with_modules``), which name the model's classes;
- the capture sidecar: the integration that wrote it (``framework.name``: the HF ``Trainer``
  callback, the Lightning callback), the framework packages imported in the process, and the
  class of each FSDP unit's module;
- the folder layout: torchtitan's dump folder (:mod:`fsdpdoctor.ingest.layouts`);
- the memory snapshot's allocation stacks (PEFT adapters).

Nothing found: plain PyTorch. The repeated block is the module class, repeated at least twice,
that takes the most time in the trace's module annotations, containers (``Sequential``,
``ModuleList``), wrappers (``CheckpointWrapper``, ``FullyShardedDataParallel``) and ``torch.nn``'s
own layers (``Linear``, ``LayerNorm``…) left out: the block contains its attention and MLP, so it
outlasts them. Without module annotations, the most common class of the sidecar's non-root FSDP
units. Where no module class repeats but a function of the user's code is called at least twice
a step and outlasts every repeated module (a GCN's ``propagate`` called once per layer), that
function is the repeated work to wrap (``repeated_method``).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.facts.framework import FrameworkFacts, ModuleClassStats, PythonFrames

#: packages recognised in a frame's file path (``<pkg>/…``), as they are imported
PACKAGES = (
    "transformers",
    "peft",
    "trl",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "torchtitan",
    "vllm",
    "sglang",
    "diffusers",
    "xfuser",
    "megatron",
    "deepspeed",
    "torchrec",
    "torch_geometric",
    "dgl",
    "timm",
    "torchvision",
    "bitsandbytes",
)
_PKG = re.compile(r"(?:^|[/\\( ])(" + "|".join(PACKAGES) + r")[/\\]")  # "…/pkg/", "forward (pkg/…)"
_FRAME = re.compile(r"^(?P<path>.+?\.py)\((?P<line>\d+)\): (?P<func>.+)$")
_MODULE = re.compile(r"^nn\.Module: (?P<cls>.+?)(?:_(?P<i>\d+))?$")
#: module classes that are no model block: containers, wrappers and torch.nn's own layers
NOT_BLOCKS = frozenset(
    {
        "Sequential",
        "ModuleList",
        "ModuleDict",
        "CheckpointWrapper",
        "OffloadWrapper",
        "ActivationWrapper",
        "FullyShardedDataParallel",
        "DistributedDataParallel",
        "DataParallel",
        "OptimizedModule",
        "Linear",
        "NonDynamicallyQuantizableLinear",
        "Bilinear",
        "Identity",
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
        "LayerNorm",
        "GroupNorm",
        "RMSNorm",
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "Embedding",
        "EmbeddingBag",
        "Dropout",
        "Dropout1d",
        "Dropout2d",
        "ReLU",
        "ReLU6",
        "GELU",
        "SiLU",
        "Mish",
        "Tanh",
        "Sigmoid",
        "Softmax",
        "LogSoftmax",
        "LeakyReLU",
        "Hardswish",
        "Flatten",
        "Unflatten",
        "MaxPool1d",
        "MaxPool2d",
        "AvgPool1d",
        "AvgPool2d",
        "AdaptiveAvgPool1d",
        "AdaptiveAvgPool2d",
        "Upsample",
        "MultiheadAttention",
    }
)
#: top-level packages whose frames are never the user's model code
NOT_USER = frozenset(
    {"torch", "functorch", "numpy", "triton", "tqdm", "wandb", "tensorboard", "threading", "concurrent", "tokenizers"}
)
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))
MAX_MODULES = 40
MAX_FUNCTIONS = 20


def _module_class(name: str) -> str:
    """``FSDPGPT2Block`` (fully_shard's class swap) → ``GPT2Block``."""
    if name.startswith("FSDP") and len(name) > 4 and name[4].isupper() and name != "FSDPModule":
        return name[4:]
    return name


def _user_frame(path: str) -> bool:
    """A frame of the user's own code: not torch, not a known package, not the standard library."""
    p = path.replace("\\", "/")
    if "site-packages/" in p or "dist-packages/" in p or _PKG.search(p):
        return False
    top = p.lstrip("/").split("/")[0]
    if top in NOT_USER or "/torch/" in p:
        return False
    return top.removesuffix(".py") not in _STDLIB


def python_frames(frames: dict[str, list]) -> PythonFrames | None:
    """What one rank's Python frames say (``RankTrace.python_frames``: name → [events, ns]);
    None for a trace without them."""
    if not frames:
        return None
    libs: Counter = Counter()
    lib_files: dict[str, str] = {}
    longest: dict[str, float] = {}
    classes: dict[str, list] = {}  # class → [instances set, calls, µs]
    funcs: list[tuple[str, int, float]] = []
    events = 0
    for name, (calls, ns) in frames.items():
        us = ns / 1e3
        events += calls
        if m := _MODULE.match(name):
            c = classes.setdefault(_module_class(m["cls"]), [set(), 0, 0.0])
            c[0].add(m["i"])
            c[1] += calls
            c[2] += us
            continue
        if (f := _FRAME.match(name)) is None:
            continue
        path = f["path"]
        if p := _PKG.search(path):
            libs[p.group(1)] += calls
            if us > longest.get(p.group(1), -1.0):  # the library's outermost frame: its entry point
                longest[p.group(1)] = us
                lib_files[p.group(1)] = name
        elif _user_frame(path):
            funcs.append((name, calls, us / 1e3))
    mods = sorted(
        (ModuleClassStats(k, len(v[0]), v[1], round(v[2] / 1e3, 3)) for k, v in classes.items()),
        key=lambda m: -m.total_ms,
    )[:MAX_MODULES]
    # called more than once, and inside the model where module annotations show it (the frames of
    # the stack the profiler started under, a test runner's or a training loop's, outlast it)
    root_ms = max((m.total_ms for m in mods), default=None)
    funcs = [f for f in funcs if f[1] >= 2 and (root_ms is None or f[2] <= root_ms)]
    funcs = sorted(funcs, key=lambda f: -f[2])[:MAX_FUNCTIONS]
    return PythonFrames(
        libraries=dict(libs.most_common()),
        library_files={k: lib_files[k] for k in libs},
        modules=mods,
        functions=[(n, c, round(ms, 3)) for n, c, ms in funcs],
        events=events,
    )


def repeated_block(mods: list[ModuleClassStats]) -> ModuleClassStats | None:
    """The model's repeated block among the module classes (see the module docstring)."""
    cands = [m for m in mods if m.instances >= 2 and m.name not in NOT_BLOCKS]
    return max(cands, key=lambda m: (m.total_ms, -m.instances), default=None)


def repeated_method(py: PythonFrames, block: ModuleClassStats | None, steps: int) -> tuple[str, float] | None:
    """(frame, calls per step) of a user function called at least twice a step that outlasts
    every repeated module (there is none, or it runs inside none of them); None otherwise."""
    steps = max(steps, 1)
    # a function that outlasts the whole model (a progress bar's thread, the training loop) is no layer
    root_ms = max((m.total_ms for m in py.modules), default=None)
    for name, calls, ms in py.functions:
        func = name.rsplit(": ", 1)[-1]
        if func in ("forward", "__call__", "_call_impl", "<module>", "main", "run") or calls < 2 * steps:
            continue
        if root_ms is not None and ms > root_ms:
            continue
        if block is not None and ms <= block.total_ms:
            return None
        return name, calls / steps
    return None


def _layout(paths: list[str]) -> str | None:
    """The dump-folder layout a trace lies in (torchtitan's), from its own position."""
    from fsdpdoctor.ingest.layouts import containing_dump_folder

    for path in paths[:1]:
        if Path(path).is_file() and (found := containing_dump_folder(path)) is not None:
            return found.layout
    return None


def _sidecar_block(side: dict[str, Any]) -> tuple[str, int] | None:
    """(class, units) of the most common class of the sidecar's non-root FSDP units (2 or more)."""
    counts: Counter = Counter()
    for u in side.get("units") or []:
        if not isinstance(u, dict) or u.get("is_root") or u.get("fqn") == "":
            continue
        for c in u.get("module_classes") or []:
            if isinstance(c, str) and c:
                counts[c] += 1
    if not counts:
        return None
    cls, n = counts.most_common(1)[0]
    return (cls, n) if n >= 2 else None


def detect(facts: RunFacts, side: dict[str, Any] | None = None) -> FrameworkFacts:
    """The run's :class:`FrameworkFacts` from its ranks' Python frames, the sidecar, the folder
    layout of its traces and its memory snapshot."""
    out = FrameworkFacts()
    ev = out.evidence
    libs: Counter = Counter()
    py = next((r.python for r in facts.rank_facts if r.python is not None), None)
    if py is not None:
        libs.update(py.libraries)
        files = py.library_files
        for lib, n in py.libraries.items():
            ev.append(f"trace: {n} Python frames in {lib}/ (e.g. {files.get(lib, '')})")
    # the Trainer's train() is the outermost transformers frame, so the longest one
    hf_trainer = py is not None and "transformers/trainer" in py.library_files.get("transformers", "").replace(
        "\\", "/"
    )
    fw = (side or {}).get("framework") if isinstance(side, dict) else None
    named = fw.get("name") if isinstance(fw, dict) else None
    loaded = fw.get("loaded") if isinstance(fw, dict) and isinstance(fw.get("loaded"), dict) else {}
    if named:
        ev.append(f"sidecar: written by the {named} integration ({fw.get('trainer') or 'callback'})")
    if loaded:
        ev.append("sidecar: imported in the process: " + ", ".join(f"{k} {v or ''}".strip() for k, v in loaded.items()))
    layout = _layout([i.path for i in facts.inputs] or [r.path for r in facts.rank_facts])
    if layout:
        ev.append(f"folder: the traces lie in a {layout} dump folder")
    mem = facts.memory
    if mem is not None and any("peft" in k for k in mem.stack_libraries):
        out.peft = True
        ev.append("memory snapshot: allocation stacks pass through peft/")
    if mem is not None and py is None:  # no frames in the traces: the snapshot's top allocation sites
        sites: Counter = Counter(p.group(1) for site, _ in mem.top_sites if (p := _PKG.search(str(site))))
        for lib, n in sites.most_common():
            ev.append(f"memory snapshot: {n} of the top allocation sites in {lib}/")
        libs.update(sites)
    if libs.get("peft"):
        out.peft = True

    def has(lib: str) -> bool:
        return bool(libs.get(lib))

    if layout == "torchtitan" or has("torchtitan") or named == "torchtitan":
        out.name, out.trainer = "torchtitan", "torchtitan.train"
    elif named == "lightning" or has("lightning") or has("pytorch_lightning"):
        out.name, out.trainer = "lightning", "Lightning Trainer"
    elif named == "transformers" or hf_trainer:
        out.name, out.trainer = "transformers", "Trainer"
    elif named == "accelerate" or (  # the user drives an Accelerator (not helpers other libraries import)
        py is not None and "accelerate/accelerator" in py.library_files.get("accelerate", "").replace("\\", "/")
    ):
        out.name = "accelerate"
    else:
        models = {k: v for k, v in libs.items() if k not in ("peft", "bitsandbytes", "torchvision", "timm")}
        if models:
            out.name = max(models, key=lambda k: models[k])
        elif out.peft:  # PEFT adapts Hugging Face models: its users write HF's code
            out.name = "transformers"
        else:
            out.name = "pytorch"
    out.libraries = dict(libs.most_common()) | {k: 0 for k in loaded if k not in libs}
    if out.name in loaded:
        out.version = loaded[out.name]
    elif isinstance(fw, dict) and fw.get("version"):
        out.version = str(fw["version"])
    # the repeated block, by its own class
    block = repeated_block(py.modules) if py is not None else None
    if block is not None:
        out.block_class, out.block_count = block.name, block.instances
        out.block_class_source = "trace module annotations"
        ev.append(f"trace: nn.Module: {block.name}_0 … _{block.instances - 1} ({block.total_ms:.1f} ms in all)")
    elif isinstance(side, dict) and (sb := _sidecar_block(side)) is not None:
        out.block_class, out.block_count = sb
        out.block_class_source = "sidecar"
        ev.append(f"sidecar: {sb[1]} FSDP units wrap a {sb[0]}")
    out.block_container = facts.fsdp.block_container
    if py is not None:
        steps = max((len(r.steps) for r in facts.rank_facts if r.python is py), default=1)
        rm = repeated_method(py, block, steps)
        if rm is not None:
            out.repeated_method, out.repeated_method_calls = rm[0], round(rm[1], 2)
            ev.append(f"trace: {rm[0]} runs {rm[1]:.1f} times a step and no module class repeats around it")
    if not ev:
        ev.append("no framework's frames, sidecar or folder layout: plain PyTorch")
    return out
