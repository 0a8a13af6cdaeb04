"""What it detects
    A job that hangs in a collective, from the PyTorch Flight Recorder dumps of its ranks: the
    rank that never entered the collective the others wait in, the rank that ran a different
    collective (another op, other sizes or dtypes) at the same point, the rank that entered it
    long after the others, or ranks that left no dump, with the collective, its process group and
    sequence number, and what the stacks say (the FSDP operation, forward or backward, the step,
    the line of the training script).

Why it hurts
    The job makes no progress at all: every other rank waits inside the collective until the
    watchdog's timeout (10-30 minutes by default) kills the job, and its logs say only that a
    collective timed out. The cause is on one rank and invisible from any single rank's log.

How it shows in a trace
    One dump per rank (``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and
    ``TORCH_FR_DUMP_ON_TIMEOUT=1``; torchtitan writes them to ``comm_trace(s)/rank_<r>``), matched
    across ranks per process group (by its member ranks) and ``collective_seq_id``
    (``fsdpdoctor.analysis.hang``): a rank whose last collective is older than the others' never
    entered the next one (a rank that itself waits in another group is a victim, not a culprit);
    different signatures at one sequence number are a desync (the ranks outside the majority
    are the culprits); ``time_created_ns`` says who arrived late (``hang_late_s``).

Fix
    Every rank must call the same collectives in the same order. A metric reduced under
    ``if rank == 0`` (a collective on one rank only): reduce on every rank, print on one. A rank
    that left the loop early (uneven data): equal shards (``DistributedSampler(drop_last=True)``,
    ``DataLoader(drop_last=True)``), or stop when every rank agrees;
    ``torch.distributed.algorithms.Join`` covers DDP and ZeroRedundancyOptimizer, not FSDP. A
    model built differently on one rank: the sizes per rank are in the evidence; build it from
    the same config everywhere and check the parameter count across ranks before sharding. A
    late rank: what its stack was doing before the collective (data loading, a checkpoint write,
    logging) goes off the critical path, or the timeout goes up. Ranks without a dump: their
    logs (crash, OOM kill) say why.

Known problems
    The diagnosis is the first of mismatch, missing, late, no dump and stuck inside the collective
    that the dumps show: a job with two faults is told by the first. Lateness is read from
    ``time_created_ns`` on each host's own clock, so an offset between hosts near ``hang_late_s``
    can name the wrong rank. gloo's dumps record no completion: a hang inside the collective on
    every rank is told from NCCL dumps only, and from gloo dumps draws nothing. A rank that left no
    dump is named, not explained.
"""

from fsdpdoctor.fmt import rank_list, ranks_text, seconds

from ._util import finding

CODE = "FSD040"
SLUG = "collective-hang"
TITLE = "The job hangs in a collective"
SEVERITY = "critical"
THRESHOLDS = ("hang_late_s",)
CRASH = True  # the job stopped: the engine ranks this finding first

RANK_GUARD_FIX = """# Every rank must call the same collectives: reduce on all ranks, print on one.
metric = loss.detach().clone()
dist.all_reduce(metric, op=dist.ReduceOp.AVG)   # outside `if rank == 0:`
if dist.get_rank() == 0:
    print(f"loss {metric.item():.4f}")"""
UNEVEN_FIX = """# A rank ran out of data first and left the loop. Give every rank the same number of steps:
sampler = DistributedSampler(dataset, drop_last=True)            # equal shards
loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
# or stop only when every rank agrees (one small all_reduce per step, on every rank):
done = torch.tensor([0.0 if batch is not None else 1.0])
dist.all_reduce(done, op=dist.ReduceOp.MAX)
if done.item():
    break
# torch.distributed.algorithms.Join shadows missing collectives for DDP and
# ZeroRedundancyOptimizer (Joinable), not for FSDP."""
SKIPPED_FIX = """# The rank skipped a collective the others ran in the same step: a data-dependent branch around
# an FSDP-wrapped module or a collective (every rank must run the same units in the same order).
# Run the module on every rank (mask its output instead of skipping it), or decide the branch
# collectively:
flag = torch.tensor([float(use_branch)])
dist.all_reduce(flag, op=dist.ReduceOp.MAX)   # every rank takes the branch if any rank does"""
MODEL_FIX = """# The model differs across ranks (sizes or dtypes of its parameters). Build it from the same
# config on every rank, then check before sharding:
n = torch.tensor([sum(p.numel() for p in model.parameters())])
counts = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
dist.all_gather(counts, n)
assert len({int(c) for c in counts}) == 1, f"parameter counts differ by rank: {[int(c) for c in counts]}"
fully_shard(model)"""
ORDER_FIX = """# The ranks are at different points of the step (different ops at the same sequence number):
# every rank must call the same collectives in the same order (same modules, same branches,
# same number of micro-batches)."""
LATE_FIX = """# One rank arrived late: what it did before this collective stalls the others (see its stack).
# Take slow work off the critical path: DataLoader(num_workers=..., prefetch_factor=...),
# asynchronous checkpointing (torch.distributed.checkpoint.async_save), logging off the step;
# if the pause is expected (a checkpoint, an evaluation), raise the timeout:
dist.init_process_group(backend, timeout=datetime.timedelta(minutes=60))"""
NO_DUMP_FIX = """# Ranks without a dump crashed, were killed (OOM killer, SIGABRT) or failed to write it:
# their logs say which. Write dumps where every host can keep them:
export TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_ON_TIMEOUT=1
export TORCH_FR_DUMP_TEMP_FILE=/shared/fr_dumps/rank_"""
IN_COLLECTIVE_FIX = """# Every rank entered the collective and none completed it: the hang is inside the
# communication library or the network. Rerun with NCCL's logs and timing:
export NCCL_DEBUG=INFO TORCH_NCCL_ENABLE_TIMING=1
# NCCL >= 2.24: `ncclras` prints which ranks are missing or behind in a collective."""


def _fix(h, culprit) -> dict[str, str]:
    kind = h.kind
    if kind == "mismatch":
        c = next((x for x in h.mismatched_ranks if culprit is None or x.rank == culprit.rank), None)
        if culprit is not None and culprit.fsdp is None and culprit.phase in (None, "other"):
            return {"any": RANK_GUARD_FIX}
        if c is not None and c.op == h.op:
            return {"any": MODEL_FIX}
        return {"any": ORDER_FIX}
    if kind == "missing":
        steps = [o.step for o in h.ops if o.status == "entered" and o.step is not None]
        if culprit is not None and culprit.step is not None and steps and culprit.step == max(steps):
            return {"any": SKIPPED_FIX}  # same step: it skipped a collective the others ran
        return {"any": UNEVEN_FIX}
    if kind == "late":
        return {"any": LATE_FIX}
    if kind == "no_dump":
        return {"any": NO_DUMP_FIX}
    return {"any": IN_COLLECTIVE_FIX}


_WRAPPERS = {
    "wrapper",
    "decorate_context",
    "_fn",
    "inner",
    "_call_impl",
    "_wrapped_call_impl",
    "__call__",
    "apply",
    "_wrap",
    "run",
    "_bootstrap",
    "_main",
    "spawn_main",
    "<module>",
}


def _frames(stack: list[str], n: int = 6) -> list[str]:
    """The frames worth reading: torch's wrappers and the process start-up left out."""
    keep = [f for f in stack if f.split(" (", 1)[0] not in _WRAPPERS]
    return keep[:n] + ([f"… {len(keep) - n} more"] if len(keep) > n else [])


def _sizes(op) -> str:
    ins = "+".join(str(list(s)) for s in op.input_sizes) or "[]"
    return f"{op.op} {ins} {'/'.join(dict.fromkeys(op.input_dtypes))}".rstrip()


def check(facts, cfg):
    h = facts.hang
    if h is None or h.kind == "none" or h.process_group is None:
        return []
    pg = h.process_group
    culprits = h.culprits
    ev = [
        f"stuck collective: {h.op or '?'} #{h.seq_id}{' (p2p_seq_id)' if h.is_p2p else ''} of process group "
        f"{pg.desc or pg.name} (name {pg.name!r}, ranks {rank_list(pg.ranks)}, members from {pg.ranks_from})"
    ]
    if h.waiting_ranks:
        ev.append(f"{ranks_text(h.waiting_ranks)} entered it and wait{'s' if len(h.waiting_ranks) == 1 else ''}")
    for c in culprits[:8]:
        line = f"rank {c.rank} {c.what}"
        if c.last_op:
            line += f"; its last collective: {c.last_op}"
        if c.call_site:
            line += f"; called from {c.call_site}"
        ev.append(line)
        if c.stack:
            ev.append(f"rank {c.rank}'s stack (innermost first): " + " ← ".join(_frames(c.stack)))
    if len(culprits) > 8:
        ev.append(f"… {len(culprits) - 8} more culprit ranks")
    if h.kind == "mismatch" and h.mismatched_ranks and all(o.op == h.op for o in h.mismatched_ranks):
        others = [o for o in h.ops if o.status == "entered"]  # the same op: sizes or dtypes per rank
        if others:
            ev.append(f"{ranks_text([o.rank for o in others])} ran {_sizes(others[0])}")
        for o in h.mismatched_ranks[:8]:
            ev.append(f"rank {o.rank} ran {_sizes(o)}")
    for lr in h.late_ranks[:8]:
        gap = (
            f" ({seconds(lr.gap_s)} after its previous collective; the others {seconds(lr.others_gap_s)})"
            if lr.gap_s is not None
            else ""
        )
        ev.append(f"rank {lr.rank} entered {seconds(lr.late_s)} after the latest on-time rank{gap}")
    if h.ranks_without_dump:
        ev.append(f"no dump from {ranks_text(h.ranks_without_dump)} (of {h.world_size} ranks)")
    ev.extend(h.also_stuck)
    ev.append(
        f"{h.dumps} Flight Recorder dump{'s' if h.dumps != 1 else ''} ({h.backend}, version "
        f"{', '.join(h.versions)}; {' and '.join(h.forms)})"
    )
    cause = {
        "missing": "a rank never reached the collective the others wait in",
        "mismatch": "ranks called different collectives (or with different sizes or dtypes) at the same point",
        "late": "a rank reached the collective long after the others",
        "no_dump": "ranks left no dump; every rank with one entered the collective",
        "in_collective": "every rank entered the collective and it did not complete",
    }.get(h.kind, "")
    first = culprits[0] if culprits else None
    return [
        finding(
            __name__,
            h.summary,
            evidence=ev,
            cause=cause,
            fix=_fix(h, first),
            confidence=0.9 if culprits else 0.6,
            where={
                "ranks": h.culprit_ranks,
                "kind": h.kind,
                "process_group": pg.desc or pg.name,
                "seq_id": h.seq_id,
                "op": h.op,
            },
        )
    ]
