"""A fix in the run's own idiom: the one place where a lever (activation checkpointing, bf16
mixed precision, a fused optimizer…) becomes the code that user would write, for the framework
that drove the run (``facts.framework``, :mod:`fsdpdoctor.analysis.framework`): HF Transformers'
``TrainingArguments`` / ``gradient_checkpointing_enable()``, Lightning's ``Trainer`` /
``FSDPStrategy``, Accelerate's ``FullyShardedDataParallelPlugin``, torchtitan's config keys (0.3's command line and config function, 0.2's TOML). Plain
PyTorch keeps the rule's own FSDP1 / FSDP2 / DDP snippet, with the model's blocks named as the
run names them (:func:`name_blocks`). Reads RunFacts only.
"""

from __future__ import annotations

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.facts.framework import FrameworkFacts

#: the levers rules ask for; a framework without a line for one gets the plain PyTorch code
LEVERS = (
    "activation_checkpointing",
    "activation_checkpointing_less",  # recompute less: fewer blocks, selectively, or none
    "mixed_precision",
    "mixed_precision_fp16",  # GPUs without bf16 (V100): fp16 with loss scaling
    "fused_optimizer",
    "dataloader",
    "pin_memory",  # input batches in pinned host memory
    "compile",
    "wrap_policy",
    "prefetch",
    "reshard_after_forward",
    "cpu_offload_off",
)

#: what a fix calls the block when nothing in the run names it
UNNAMED = "MyBlock"
UNNAMED_NOTE = (
    "# MyBlock: your model's repeated block class; the trace names none (profile with "
    "with_stack=True, or capture with fsdpdoctor, to have it named)\n"
)


def framework(facts: RunFacts) -> FrameworkFacts:
    return facts.framework if facts.framework is not None else FrameworkFacts()


def block_class(facts: RunFacts) -> str | None:
    """The repeated block's class as the run names it, else an expression reaching it through
    the units' container (``type(model.transformer.h[0])``), else None."""
    fw = framework(facts)
    if fw.block_class:
        return fw.block_class
    where = facts.fsdp.block_container or fw.block_container
    return f"type(model.{where}[0])" if where else None


def name_blocks(facts: RunFacts, code: str) -> str:
    """``code`` with the templates' ``model.layers`` and ``TransformerBlock`` replaced by where
    this model keeps its blocks (``FsdpFacts.block_container``) and their class as the run names
    it (the trace's module annotations, the sidecar), never an assumed ``TransformerBlock``: a
    block nothing names is ``MyBlock``, with a line saying so."""
    where = facts.fsdp.block_container
    if where:
        code = code.replace("model.layers", f"model.{where}")
    if "TransformerBlock" not in code:
        return code
    cls = block_class(facts)
    if cls is None:
        return UNNAMED_NOTE + code.replace("TransformerBlock", UNNAMED)
    return code.replace("TransformerBlock", cls)


def blocks_text(facts: RunFacts) -> str:
    """The model's blocks in prose: ``GPT2Block blocks``, ``blocks of model.transformer.h``, ``blocks``."""
    fw = framework(facts)
    where = facts.fsdp.block_container or fw.block_container
    if fw.block_class:
        return f"{fw.block_class} blocks"
    return f"blocks of model.{where}" if where else "blocks"


def _cls(facts: RunFacts) -> str:
    return block_class(facts) or UNNAMED


def _cls_note(facts: RunFacts) -> str:
    return "" if block_class(facts) else UNNAMED_NOTE


def _method_ac(fw: FrameworkFacts) -> str:
    """Checkpointing where the repeated work is a function, not a module."""
    frame = fw.repeated_method or ""
    func = frame.rsplit(": ", 1)[-1] if ": " in frame else frame
    calls = f"{fw.repeated_method_calls:g} times a step" if fw.repeated_method_calls else "once per layer"
    return (
        f"# the repeated work is {frame}: a function called {calls}, not a module, so no\n"
        f"# module-level check_fn reaches it. Wrap each call in a checkpoint:\n"
        "from torch.utils.checkpoint import checkpoint\n\n"
        f"h = checkpoint({func}, h, *args, use_reentrant=False)   # was: h = {func}(h, *args)\n"
    )


def _transformers(facts: RunFacts, lever: str, fw: FrameworkFacts, dtype: str) -> str | None:
    fsdp = facts.fsdp.version in (1, 2)
    trainer = fw.trainer == "Trainer"
    cls = block_class(facts)
    if lever == "activation_checkpointing":
        if fsdp and trainer:
            return (
                "# with FSDP, FSDP's own checkpointing (gradient_checkpointing=True would re-gather each block)\n"
                'args = TrainingArguments(..., fsdp="full_shard auto_wrap",\n'
                f'                         fsdp_config={{"transformer_layer_cls_to_wrap": ["{cls or UNNAMED}"],\n'
                '                                      "activation_checkpointing": True})\n'
            )
        lines = 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
        lines += f"  # every {cls}\n" if cls and not cls.startswith("type(") else "\n"
        if fw.peft:
            lines = (
                "from peft import prepare_model_for_kbit_training\n\n"
                "# PEFT on a k-bit base: enables checkpointing and input gradients\n"
                "model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)\n"
                "# PEFT on a full-precision base instead:\n" + lines + "model.enable_input_require_grads()\n"
            )
        if trainer:
            lines += "# or, with the Trainer:\nargs = TrainingArguments(..., gradient_checkpointing=True)\n"
        return lines
    if not trainer:
        return None  # an HF model in the user's own loop: the plain PyTorch levers apply
    if lever == "activation_checkpointing_less":
        key = 'fsdp_config={..., "activation_checkpointing": False}' if fsdp else "gradient_checkpointing=False"
        return (
            "# the saving above is dropping checkpointing, where the peak fits without it (analyze --memory)\n"
            f"args = TrainingArguments(..., {key})\n"
        )
    if lever == "mixed_precision":
        return f"args = TrainingArguments(..., {'fp16' if dtype == 'float16' else 'bf16'}=True)\n"
    if lever == "fused_optimizer":
        return 'args = TrainingArguments(..., optim="adamw_torch_fused")\n'
    if lever == "dataloader":
        return (
            "args = TrainingArguments(..., dataloader_num_workers=8, dataloader_pin_memory=True,\n"
            "                         dataloader_persistent_workers=True)\n"
        )
    if lever == "pin_memory":
        return "args = TrainingArguments(..., dataloader_pin_memory=True)   # the default: check nothing turns it off\n"
    if lever == "compile":
        return "args = TrainingArguments(..., torch_compile=True)\n"
    if lever == "wrap_policy":
        return (
            'args = TrainingArguments(..., fsdp="full_shard auto_wrap",\n'
            f'                         fsdp_config={{"transformer_layer_cls_to_wrap": ["{cls or UNNAMED}"]}})\n'
        )
    if lever == "prefetch":
        return (
            'args = TrainingArguments(..., fsdp_config={..., "backward_prefetch": "backward_pre",'
            ' "forward_prefetch": True})\n'
        )
    if lever == "reshard_after_forward":
        key = '"reshard_after_forward": True' if facts.fsdp.version == 2 else '"sharding_strategy": "FULL_SHARD"'
        return f'args = TrainingArguments(..., fsdp="full_shard auto_wrap", fsdp_config={{..., {key}}})\n'
    if lever == "cpu_offload_off":
        return 'args = TrainingArguments(..., fsdp="full_shard auto_wrap")   # without "offload"\n'
    return None


def _lightning(facts: RunFacts, lever: str, dtype: str) -> str | None:
    cls = _cls(facts)
    note = _cls_note(facts)
    if lever == "activation_checkpointing":
        return (
            note + "from lightning.pytorch.strategies import FSDPStrategy\n\n"
            f"trainer = Trainer(..., strategy=FSDPStrategy(auto_wrap_policy={{{cls}}},\n"
            f"                                              activation_checkpointing_policy={{{cls}}}))\n"
        )
    if lever == "mixed_precision":
        prec = "16-mixed" if dtype == "float16" else "bf16-mixed"
        strat = ", strategy=FSDPStrategy(...)" if facts.fsdp.version in (1, 2) else ""
        return f'trainer = Trainer(..., precision="{prec}"{strat})\n'
    if lever == "fused_optimizer":
        return (
            "def configure_optimizers(self):   # in your LightningModule\n"
            "    return torch.optim.AdamW(self.parameters(), lr=lr, fused=True)\n"
        )
    if lever == "dataloader":
        return (
            "def train_dataloader(self):   # in your LightningModule / LightningDataModule\n"
            "    return DataLoader(ds, batch_size=bs, num_workers=8, pin_memory=True, persistent_workers=True)\n"
        )
    if lever == "pin_memory":
        return (
            "def train_dataloader(self):   # in your LightningModule / LightningDataModule\n"
            "    return DataLoader(ds, batch_size=bs, pin_memory=True)   # batches in pinned memory\n"
        )
    if lever == "compile":
        return (
            "model = torch.compile(model)   # your LightningModule, before trainer.fit(model, ...)\n"
            "trainer.fit(model, ...)\n"
        )
    if lever == "wrap_policy":
        return note + f"trainer = Trainer(..., strategy=FSDPStrategy(auto_wrap_policy={{{cls}}}))\n"
    if lever == "prefetch":
        return (
            "from torch.distributed.fsdp import BackwardPrefetch\n\n"
            "trainer = Trainer(..., strategy=FSDPStrategy(backward_prefetch=BackwardPrefetch.BACKWARD_PRE,"
            " forward_prefetch=True))\n"
        )
    if lever == "reshard_after_forward":
        return 'trainer = Trainer(..., strategy=FSDPStrategy(sharding_strategy="FULL_SHARD"))\n'
    if lever == "cpu_offload_off":
        return "trainer = Trainer(..., strategy=FSDPStrategy(cpu_offload=False))\n"
    return None


#: torchtitan 0.3 builds the job from a Python config function (``--module llama3 --config
#: llama3_8b``: ``torchtitan/models/<model>/config_registry.py``) overridden on the command line
#: (tyro: ``--section.key value``, booleans ``--section.key`` / ``--section.no-key``); up to 0.2 the
#: same sections and keys were a TOML file (``--job.config_file``). Names read from torchtitan
#: 0.3.0: ``config/configs.py`` (TrainingConfig, ParallelismConfig, CompileConfig),
#: ``components/optimizer/optimizer.py`` (``implementation``), ``distributed/activation_checkpoint.py``
#: (``FullAC`` / ``SelectiveAC`` / ``MemoryBudgetAC``, tyro subcommands full / selective /
#: memory-budget / none; SelectiveAC is the default).
_TT_SCALAR = {
    "mixed_precision": ("training", "mixed_precision_param", '"bfloat16"', "bfloat16"),
    "compile": ("compile", "enable", "true", None),
    "fused_optimizer": ("optimizer", "implementation", '"fused"', "fused"),
    "reshard_after_forward": ("parallelism", "fsdp_reshard_after_forward", '"always"', "always"),
}
_TT_AC = {
    "activation_checkpointing": ("FullAC", "full", '"full"'),
    "activation_checkpointing_less": ("SelectiveAC", "selective", '"selective"'),
}


def _torchtitan(facts: RunFacts, lever: str) -> str | None:
    if lever in _TT_SCALAR:
        section, key, toml, value = _TT_SCALAR[lever]
        flag = f"--{section}.{key.replace('_', '-')}" + (f" {value}" if value else "")
        extra = '\ncomponents = ["model", "loss"]' if lever == "compile" else ""
        return (
            f"# torchtitan >= 0.3: on the command line (or in your config function)\n"
            f"torchrun ... -m torchtitan.train --module <model> --config <config> {flag}\n"
            f"# torchtitan <= 0.2: the job's TOML file\n"
            f"[{section}]\n{key} = {toml}{extra}\n"
        )
    if lever in _TT_AC:
        cls, sub, mode = _TT_AC[lever]
        head = (
            "# the saving above is no checkpointing (activation-checkpoint:none), where the peak fits\n"
            "# without it; selective (keep matmul outputs, recompute the cheap ops) is the middle way\n"
            if lever == "activation_checkpointing_less"
            else ""
        )
        return (
            f"{head}# torchtitan >= 0.3: in your config function (torchtitan/models/<model>/config_registry.py)\n"
            f"from torchtitan.distributed.activation_checkpoint import {cls}\n"
            f"activation_checkpoint={cls}.Config(),   # command line: activation-checkpoint:{sub}\n"
            "# torchtitan <= 0.2: the job's TOML file\n"
            f"[activation_checkpoint]\nmode = {mode}\n"
        )
    return None


def _accelerate(facts: RunFacts, lever: str, dtype: str) -> str | None:
    cls = _cls(facts)
    plugin = "from accelerate import Accelerator, FullyShardedDataParallelPlugin\n\n"
    if lever == "activation_checkpointing":
        return (
            plugin + "plugin = FullyShardedDataParallelPlugin(..., activation_checkpointing=True)\n"
            "accelerator = Accelerator(fsdp_plugin=plugin)   # accelerate config: fsdp_activation_checkpointing: true\n"
        )
    if lever == "mixed_precision":
        return (
            "from accelerate import Accelerator\n\n"
            f'accelerator = Accelerator(mixed_precision="{"fp16" if dtype == "float16" else "bf16"}")\n'
        )
    if lever == "compile":
        return 'from accelerate import Accelerator\n\naccelerator = Accelerator(dynamo_backend="inductor")   # compiles in prepare()\n'
    if lever == "wrap_policy":
        return _cls_note(facts) + (
            plugin + 'plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap",\n'
            f'                                        transformer_cls_names_to_wrap=["{cls}"])\n'
        )
    if lever == "prefetch":
        return (
            plugin
            + 'plugin = FullyShardedDataParallelPlugin(backward_prefetch="BACKWARD_PRE", forward_prefetch=True)\n'
        )
    if lever == "reshard_after_forward":
        return plugin + "plugin = FullyShardedDataParallelPlugin(reshard_after_forward=True)\n"
    if lever == "cpu_offload_off":
        return plugin + "plugin = FullyShardedDataParallelPlugin(cpu_offload=False)\n"
    return None


def render(facts: RunFacts, lever: str, dtype: str = "bfloat16") -> str | None:
    """The code of ``lever`` in the run's idiom; None where that is plain PyTorch (or the
    framework has no setting of its own for it): the rule's own snippet then applies."""
    if lever not in LEVERS:
        raise ValueError(f"unknown lever {lever!r}; one of {LEVERS}")
    fw = framework(facts)
    if lever == "mixed_precision_fp16":
        lever, dtype = "mixed_precision", "float16"
    if lever == "activation_checkpointing" and fw.repeated_method and not fw.block_class:
        return _method_ac(fw)
    idiom = fw.idiom
    if idiom == "transformers":
        return _transformers(facts, lever, fw, dtype)
    if idiom == "lightning":
        return _lightning(facts, lever, dtype)
    if idiom == "torchtitan":
        return _torchtitan(facts, lever)
    if idiom == "accelerate":
        return _accelerate(facts, lever, dtype)
    return None


def idiom_fix(
    facts: RunFacts, lever: str | tuple[str, ...], plain: dict[str, str], dtype: str = "bfloat16"
) -> dict[str, str]:
    """A finding's fixes: ``{idiom: code}`` where the run's framework has its own way to pull
    ``lever`` (training runs; several levers: every one of them), else ``plain`` (the rule's
    keyed snippets) with the blocks named (:func:`name_blocks`)."""
    levers = (lever,) if isinstance(lever, str) else lever
    codes = [render(facts, x, dtype) for x in levers]
    code = "\n".join(codes) if codes and all(c is not None for c in codes) else None
    if facts.workload != "inference" and code is not None:
        idiom = framework(facts).idiom
        return {idiom if idiom != "pytorch" else "any": name_blocks(facts, code)}
    return {k: name_blocks(facts, v) for k, v in plain.items()}


def idiom_parts(facts: RunFacts, parts: list[tuple[str | None, str]], plain: dict[str, str]) -> dict[str, str]:
    """A fix that mixes levers with advice no framework setting carries: in a training run driven
    by a framework with its own setting for at least one of the levers, each part in turn as that
    framework writes it (``render``), else the part's own text (an explanation, or code the user
    writes whatever the framework); a part whose text is empty is dropped where it does not
    render. Otherwise ``plain`` (the rule's keyed snippets), the blocks named (:func:`name_blocks`)."""
    idiom = framework(facts).idiom
    if facts.workload != "inference" and idiom != "pytorch":
        codes = [(render(facts, lever) if lever else None, text) for lever, text in parts]
        if any(c is not None for c, _ in codes):
            return {idiom: name_blocks(facts, "".join(c if c is not None else text for c, text in codes))}
    return {k: name_blocks(facts, v) for k, v in plain.items()}


def batch_line(facts: RunFacts, k: int, grow: float) -> str:
    """A k× larger per-GPU batch, as the run's framework sets it."""
    why = f"# activations could grow ~{grow:.0f}x before 80% of memory; grow in steps\n"
    idiom = framework(facts).idiom if facts.workload != "inference" else "pytorch"
    if idiom == "transformers" and framework(facts).trainer == "Trainer":
        return why + f"args = TrainingArguments(..., per_device_train_batch_size=bs * {k})\n"
    if idiom == "torchtitan":
        return why + f"torchrun ... -m torchtitan.train ... --training.local-batch-size <{k}x yours>\n"
    return f"batch_size = bs * {k}  " + why
