"""Memory facts from a CUDA allocator snapshot or a profiler memory timeline.

Method (see ``notes/memory-categorization.md``):

1. Per device, replay ``device_traces`` over a seed of blocks that were alive before recording
   started (live at the end with no event at their address, or freed without a recorded alloc).
   *Allocated* follows ``torch.cuda.memory_allocated()``: a block counts from ``alloc`` until
   ``free_requested``; from then until ``free_completed`` it is *pending* (freed by Python, still
   in use by another stream). *Reserved* replays ``segment_alloc/map`` − ``segment_free/unmap``
   backwards from the final segments.
2. Trace entries carry the *requested* size; the allocator hands out larger blocks (512-byte
   rounding, and large-pool blocks are not split when ≤ 1 MiB would remain). The block size is
   recovered from the address layout: a block starts at the beginning of a free run, which ends at
   the next live block or the segment end. Blocks still alive at the end use their exact size.
   Allocated bytes, categories and internal fragmentation are therefore in allocator (block) bytes.
3. The peak is the first maximum of allocated bytes. At the peak, reserved = requested +
   internal fragmentation (rounding) + pending frees + external fragmentation (cached free blocks).
4. Blocks live at the peak are categorised from their allocation stack (innermost matching
   frame wins; FSDP1, FSDP2 in ``_composable/fsdp`` (2.4) and ``_fully_shard`` (2.6+), torch.optim,
   activation checkpointing), then by lifetime relative to the forward / backward / optimizer
   phase they were allocated in: phases come from stack markers (and ``external_annotations``),
   frameless events inherit the phase before them (backward allocations on the autograd thread
   have no Python frames). Checkpoint recomputation (``checkpoint.py`` ``unpack_hook`` /
   ``recompute_fn``) is backward, and the frameless events after it too; ``zero_grad`` starts an
   idle phase (the next step's inputs are not optimizer memory), and so do main-thread frames
   without a marker after backward (the next micro-batch). When the recording stops inside
   forward (OOM, dump), a forward block alive at a later FSDP unit boundary is an activation;
   blocks allocated since the last boundary take the fate of the block at the same position and
   size in the previous unit. At an OOM, what the failing statement allocated from the user's own
   line (a cast such as ``logits.float()`` in the loss: no torch frame) is that statement's
   temporary, not an activation. FSDP1's per-parameter gradients are recognised by their
   concatenation into the flat gradient; an unsharded-size backward block that autograd frees
   before FSDP's next event is a gradient-accumulation temporary.
5. Blocks allocated before recording are reported as pre-existing and attributed by size where the
   trace shows parameter-shaped sizes (optimizer state created in the trace, FSDP unsharded sizes
   divided by the world size recovered from reduce-scatter input/output pairs, or long-lived
   gradients), split between parameters and optimizer state by multiplicity (Adam keeps two
   states per parameter; without an optimizer step in the trace, by the number of parameters
   per size that the first complete forward pass all-gathers). The rest goes to ``other``.
6. Two peaks: the allocated peak (``max_memory_allocated``: a block counts until
   ``free_requested``) names the instant of ``categories``; memory_viz's active peak (until
   ``free_completed``) has its own categories. The README's memory section has the semantics.

Non-FSDP runs: resident full parameters are counted as ``parameters_sharded`` (the persistent
parameter storage); ``parameters_unsharded`` is reserved for FSDP's transient all-gathered copies.

Modules, in pipeline order: :mod:`.allocator` (the allocator replay: block sizes, lifetimes,
reserved memory), :mod:`.stacks` (what a stack says: site, rule label, phase marker),
:mod:`.categorize` (phases per event, a category per block, blocks from before recording),
:mod:`.curve` (the downsampled curve), :mod:`.analyze` (the entry points) and
:mod:`.trace_events` (a Kineto trace's ``[memory]`` events, without a snapshot).
"""

from __future__ import annotations

from fsdpdoctor.facts import MEMORY_CATEGORIES as CATEGORIES
from fsdpdoctor.facts import MemoryFacts
from fsdpdoctor.analysis.memory.allocator import round_size
from fsdpdoctor.analysis.memory.analyze import analyze_memory, analyze_snapshot, analyze_timeline
from fsdpdoctor.analysis.memory.trace_events import memory_from_events

__all__ = [
    "CATEGORIES",
    "MemoryFacts",
    "analyze_memory",
    "analyze_snapshot",
    "analyze_timeline",
    "memory_from_events",
    "round_size",
]
