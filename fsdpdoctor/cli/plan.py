"""``fsdpdoctor plan``: the sharding-strategy table before any run exists, from arithmetic and
stated assumptions (every assumption is printed)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import msgspec
from rich.console import Console
from rich.table import Table

from fsdpdoctor.analysis.strategy import (
    DEFAULT_INTER_BUSBW,
    DEFAULT_INTRA_BUSBW,
    OPTIMIZER_STATE_BYTES,
    PlanInputs,
    advise,
)
from fsdpdoctor.cli.base import _write, guarded, main
from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest.shapes import PARAM_DTYPE_BYTES
from fsdpdoctor.fmt import mib, ms, parse_size


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*$", re.I)
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """A parameter count as model cards write it: 7B, 70B, 1.5T, 125M, 350k, or plain 7e9."""
    m = _COUNT.match(text)
    if not m:
        raise InputError(text, "not a parameter count (examples: 7B, 70B, 1.5T, 125M, 7e9)")
    return float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()]


def gpu_memory(text: str) -> float:
    """``--gpu-mem``: a size (:func:`fsdpdoctor.fmt.parse_size`: binary units, 80G = 80GiB)."""
    try:
        return float(parse_size(text))
    except ValueError:
        raise InputError(text, "not a size in bytes (examples: 80GiB, 80G, 8.6e10)") from None


def plan_inputs(
    params: float,
    gpus: int,
    nodes: int,
    gpu_mem: float,
    *,
    seq: int | None,
    batch: int | None,
    layers: int | None,
    hidden: int | None,
    optimizer: str,
    dtype: str,
    intra_bw: float,
    inter_bw: float,
    tflops: float,
    mfu: float,
    current: str | None,
) -> PlanInputs:
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise InputError(f"--gpus {gpus} --nodes {nodes}", "GPUs must be a positive multiple of nodes")
    src = {}
    inp = PlanInputs(params=params, world_size=gpus, gpus_per_node=gpus // nodes, gpu_memory_bytes=gpu_mem)
    for k in ("params", "world_size", "gpus_per_node", "gpu_memory_bytes"):
        src[k] = "given"
    b = PARAM_DTYPE_BYTES[dtype]
    inp.param_bytes = inp.grad_bytes = inp.comm_bytes = inp.reduce_bytes = float(b)
    inp.master_bytes = 4.0 if b < 4 else 0.0
    inp.optimizer_bytes = float(OPTIMIZER_STATE_BYTES[optimizer])
    src["param_bytes"] = f"{dtype} parameters and gradients" + (", fp32 master copy (master_bytes 4)" if b < 4 else "")
    src["optimizer_bytes"] = f"{optimizer}: {OPTIMIZER_STATE_BYTES[optimizer]} bytes per parameter"
    inp.largest_unit_params = params / layers if layers else params / 32
    src["largest_unit_params"] = "params / layers (one unit per block)" if layers else "assumed params / 32"
    if seq and batch and hidden and layers:
        # per layer, bf16 with flash attention and no recompute: s·b·h·34 bytes (Korthikanti et al.)
        inp.activation_bytes = layers * seq * batch * hidden * 34.0 * (b / 2)
        src["activation_bytes"] = "layers × seq × batch × hidden × 34 bytes (flash attention, no checkpointing)"
    else:
        src["activation_bytes"] = "not estimated (give --seq --batch --layers --hidden): 0"
    if seq and batch:
        flops = 6.0 * params * seq * batch  # forward + backward per GPU per step
        total = flops / (tflops * 1e12 * mfu) * 1e3
        inp.compute_forward_ms, inp.compute_backward_ms = total / 3, 2 * total / 3
        src["compute_forward_ms"] = src["compute_backward_ms"] = (
            f"6·P·tokens at {tflops:g} TFLOP/s × MFU {mfu:g}, 1/3 forward"
        )
    else:
        src["compute_forward_ms"] = src["compute_backward_ms"] = (
            "not estimated (give --seq --batch): 0, nothing hides communication"
        )
    inp.intra_busbw_gbps, inp.inter_busbw_gbps = intra_bw, inter_bw
    src["intra_busbw_gbps"] = f"bus bandwidth inside a node{' (default)' if intra_bw == DEFAULT_INTRA_BUSBW else ''}"
    src["inter_busbw_gbps"] = f"bus bandwidth across nodes{' (default)' if inter_bw == DEFAULT_INTER_BUSBW else ''}"
    inp.current = current
    inp.sources = src
    return inp


@main.command()
@click.option("--params", required=True, help="Parameter count: 7B, 70B, 1.5T, 125M or 7e9.")
@click.option("--gpus", type=int, required=True, help="Total GPUs (world size).")
@click.option(
    "--nodes", type=int, default=1, show_default=True, help="Nodes the GPUs are spread over (equal GPUs per node)."
)
@click.option(
    "--gpu-mem", default="80GiB", show_default=True, help="Memory per GPU, e.g. 80GiB (units are binary: 80G = 80GiB)."
)
@click.option("--seq", type=int, help="Sequence length (for activations and compute).")
@click.option("--batch", type=int, help="Micro-batch per GPU.")
@click.option("--layers", type=int, help="Transformer blocks (unit size, activations).")
@click.option("--hidden", type=int, help="Hidden size (activations).")
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATE_BYTES)),
    default="adamw",
    show_default=True,
    help="Optimizer (its state bytes per parameter).",
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(PARAM_DTYPE_BYTES)),
    default="bf16",
    show_default=True,
    help="Parameter / collective dtype.",
)
@click.option(
    "--intra-bw", type=float, default=DEFAULT_INTRA_BUSBW, show_default=True, help="Bus bandwidth inside a node, GB/s."
)
@click.option(
    "--inter-bw", type=float, default=DEFAULT_INTER_BUSBW, show_default=True, help="Bus bandwidth across nodes, GB/s."
)
@click.option("--tflops", type=float, default=400.0, show_default=True, help="Dense bf16 TFLOP/s per GPU.")
@click.option("--mfu", type=float, default=0.4, show_default=True, help="Model FLOPs utilisation assumed.")
@click.option(
    "--current",
    type=click.Choice(["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]),
    help="Strategy used today.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["terminal", "json"]),
    default="terminal",
    show_default=True,
    help="Table format.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the table to FILE.")
@guarded
def plan(
    params,
    gpus,
    nodes,
    gpu_mem,
    seq,
    batch,
    layers,
    hidden,
    optimizer,
    dtype,
    intra_bw,
    inter_bw,
    tflops,
    mfu,
    current,
    fmt,
    output,
):
    """Compare sharding strategies before a run exists (arithmetic + stated assumptions)."""
    inp = plan_inputs(
        parse_count(params),
        gpus,
        nodes,
        gpu_memory(gpu_mem),
        seq=seq,
        batch=batch,
        layers=layers,
        hidden=hidden,
        optimizer=optimizer,
        dtype=dtype,
        intra_bw=intra_bw,
        inter_bw=inter_bw,
        tflops=tflops,
        mfu=mfu,
        current=current,
    )
    st = advise(inp)
    if fmt == "json":
        _write(msgspec.json.format(msgspec.json.encode(st), indent=2).decode(), output)
        return
    console = Console(highlight=False, record=output is not None)
    t = Table(
        title=f"{inp.params:.3g} parameters on {gpus} GPUs ({nodes} node(s)), {mib(inp.gpu_memory_bytes)} each",
        title_justify="left",
    )
    for col in ("strategy", "memory/GPU", "fits", "comm/step", "exposed", "step"):
        t.add_column(col, justify="left" if col in ("strategy", "fits") else "right")
    for c in st.candidates:
        name = c.name + (" ← recommended" if c.name == st.recommended else "")
        t.add_row(name, mib(c.memory_bytes), "yes" if c.fits else "no", ms(c.comm_ms), ms(c.exposed_ms), ms(c.step_ms))
    console.print(t)
    console.print(st.reasoning)
    if st.fix:
        console.print("\nChange:")
        for flavour, code in st.fix.items():
            console.print(f"  {flavour}: {code}")
    console.print("\nAssumptions:")
    for a in st.assumptions:
        console.print(f"  - {a}")
    if output is not None:
        _write(console.export_text(), output)
