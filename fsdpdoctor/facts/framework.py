"""Which framework drove the run, and the model's repeated block by its own class name
(:mod:`fsdpdoctor.analysis.framework`): what the rules need to write a fix the way that user
would (``rules/_idiom.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: the frameworks whose idiom a fix is written in; any other run gets plain PyTorch's
IDIOMS = ("transformers", "lightning", "accelerate", "torchtitan", "pytorch")


@dataclass(slots=True)
class ModuleClassStats:
    """One ``nn.Module`` class as the trace's module annotations (``nn.Module: <Class>_<i>``,
    recorded with ``with_stack`` / ``with_modules``) show it, over the whole trace."""

    name: str  # the class, as ``type(module).__name__`` (FSDP2's ``FSDP<Class>`` swap undone)
    instances: int  # distinct ``_<i>`` suffixes
    calls: int
    total_ms: float


@dataclass(slots=True)
class PythonFrames:
    """What one rank's Python frames (``python_function`` events) say: the libraries their
    files lie in, by frame count, and the module classes; the user functions called repeatedly
    (file(line): name, calls, ms), for a repeated method that is no module."""

    libraries: dict[str, int] = field(default_factory=dict)  # package → python_function events in its files
    library_files: dict[str, str] = field(default_factory=dict)  # package → its longest frame (its entry point)
    modules: list[ModuleClassStats] = field(default_factory=list)  # the largest classes by time, at most 40
    functions: list[tuple[str, int, float]] = field(default_factory=list)  # user code: (frame, calls, ms), top 20
    events: int = 0  # python_function events in the trace


@dataclass(slots=True)
class FrameworkFacts:
    """The framework of the run (``name``, one of :data:`IDIOMS`, or another library that is no
    training framework with an idiom of its own: ``vllm``, ``diffusers``... whose fixes are plain
    PyTorch's), with what said so.

    ``evidence`` lists each source: Python frames of the traces (``python_function``), the
    capture sidecar (``framework``, the units' classes), the folder layout (torchtitan's dump
    folder), the memory snapshot's allocation stacks. ``block_class`` is the model's repeated
    block as the run names it (the trace's module annotations, else the sidecar's unit classes),
    None when nothing names it; ``block_container`` where the model keeps it (the FSDP units'
    FQNs). ``repeated_method``: where the repeated work is a function called once per layer and
    no module class repeats around it, that function (``file(line): name``)."""

    name: str = "pytorch"
    version: str | None = None
    evidence: list[str] = field(default_factory=list)
    libraries: dict[str, int] = field(default_factory=dict)  # every library seen, by weight of evidence
    trainer: str | None = None  # the training loop: "Trainer" (HF), "Lightning Trainer", "torchtitan.train"
    peft: bool = False  # PEFT adapters (peft/ frames or snapshot stacks)
    block_class: str | None = None
    block_class_source: str = ""  # "trace module annotations" / "sidecar" / ""
    block_count: int | None = None  # instances of block_class (one forward pass)
    block_container: str | None = None
    repeated_method: str | None = None
    repeated_method_calls: float | None = None  # calls per step

    @property
    def idiom(self) -> str:
        """The idiom fixes are written in: ``name`` when it has one, else plain PyTorch."""
        return self.name if self.name in IDIOMS else "pytorch"
