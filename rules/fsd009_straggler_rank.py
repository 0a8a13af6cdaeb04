"""What it detects
    One rank computing slower than the others, so that every other rank waits for it inside
    collectives.

Why it hurts
    Collectives complete only when the slowest rank arrives: the whole job runs at the speed of
    its slowest GPU (thermal throttling, a bad host, data imbalance, a noisy neighbour).

How it shows in a trace
    Compare ranks: the straggler computes longest per step *and* waits least at collectives (it
    arrives last, so its collectives complete as soon as it gets there), while the others wait
    for it. A rank that arrives last at most matched collectives and waits least while its GPU
    computes like the others is a straggler too: what delays it is its host or its input (a
    TorchRec rank reaching its all-to-all late), and in its own trace its step looks the
    shortest, since it waits least. Both must hold: a rank that computes longest but also waits longest is not what the
    others wait for (the wait comes from elsewhere: its host, its network), and no finding is
    drawn. Waits come from the cross-rank arrival times of matched collectives
    (``facts.cross_rank``), else from each rank's collective kernel time. Traces of different
    runs (``--allow-mixed-runs``) are never compared. With every rank's trace, the evidence says
    how much of the collectives' kernel time moves data once the last rank has arrived (the pure
    transfer time, docs/metrics.md): the rest is the wait.

Fix
    Find out why that rank is slow: GPU clocks and temperature (``nvidia-smi -q -d
    PERFORMANCE``), host load, the data it receives (sequence lengths), then replace or
    rebalance.

Known problems
    Ranks are compared among the files given (the public 128-rank job's two sampled files: two
    ranks), and the arrival times of ranks on different hosts are compared on each host's own
    clock, so an offset between hosts adds to the skew. The late-arrival saving is the others' mean
    extra wait, a heuristic (±50%) that assumes no other rank would be last in its place; on the
    public DLRM trace it rests on 8 matched collectives of one step (rank 7: 4.94 ms per step). The
    slow-compute saving is the what-if replay with the rank at the median's speed: on the generated
    slow-rank twin 24.79 ms predicted, 25.52 ms measured. Without matched collectives, waits fall
    back to collective kernel time, which counts the transfer as well as the wait.
"""

import statistics

from fsdpdoctor.fmt import ms, pct

from ._util import ALL_COMM, finding, replayed_saving

CODE = "FSD009"
SLUG = "straggler-rank"
TITLE = "One rank is slower than the rest"
SEVERITY = "warning"
REPLAY_FIX = "straggler"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("straggler_pct",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("compute", None), *ALL_COMM], "cpu": []}
CLAIM_PRIORITY = 20  # specific findings claim before the general ones that they explain


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def waits(facts, ranks) -> tuple[dict[int, float], str]:
    """(ms per step each rank waits at collectives, where that comes from)."""
    cr = facts.cross_rank
    if cr is not None and cr.collectives_matched and {w.rank for w in cr.ranks} >= {r.rank for r in ranks}:
        return {w.rank: w.wait_ms_per_step for w in cr.ranks}, f"arrival at matched collectives ({cr.arrival})"
    return {r.rank: _mean([s.comm_ms for s in r.steps]) for r in ranks}, "collective kernel time"


def transfer_line(facts) -> str | None:
    """How little of the collectives' kernel time moves data once the last rank has arrived (the
    rest is waiting), from the collectives matched across every rank; None without it."""
    timed = [c for c in facts.collectives if c.transfer_ms_per_step is not None]
    gpu = sum(c.gpu_ms_per_step for c in timed)
    moved = sum(c.transfer_ms_per_step for c in timed)
    if not timed or gpu <= 0:
        return None
    return (
        f"of the collectives' {ms(gpu)} kernel time per step, {ms(moved)} moves data once the last rank has "
        f"arrived ({pct(100 * moved / gpu)}); the rest is waiting"
    )


def check(facts, cfg):
    if facts.mixed_runs:
        return []  # traces of different runs: their ranks are not comparable
    ranks = [r for r in facts.all_ranks() if r.gpu_present and r.steps]  # per-rank means: summaries do
    if len(ranks) < 2:
        return []
    compute = {r.rank: _mean([s.compute_ms for s in r.steps]) for r in ranks}
    med = statistics.median(compute.values())
    slow = max(compute, key=compute.get)
    if med <= 0 or 100 * (compute[slow] - med) / med < cfg["straggler_pct"]:
        return _late_arrival(facts, ranks, compute, cfg)
    wait, source = waits(facts, ranks)
    if min(wait, key=wait.get) != slow:
        return []  # the slowest-computing rank is not the one the others wait for
    others = _mean([wait[r] for r in wait if r != slow])
    evidence = [
        f"rank {slow} computes {ms(compute[slow])} per step vs a median of {ms(med)} (+{pct(100 * (compute[slow] - med) / med)})",
        f"rank {slow} waits {ms(wait[slow])} per step at collectives, the least of {len(wait)} ranks; the others wait "
        f"{ms(others)} on average (from {source})",
    ]
    if facts.world_size and len(ranks) < facts.world_size:
        evidence.append(f"only {len(ranks)} of the job's {facts.world_size} ranks were given: compared among these")
    cr = facts.cross_rank
    last = next((w.last_arrivals for w in cr.ranks if w.rank == slow), None) if cr is not None else None
    if last:
        evidence.append(f"rank {slow} arrives last at {last} of {cr.collectives_matched} matched collectives")
    if line := transfer_line(facts):
        evidence.append(line)
    # the others gain at most what they wait beyond the straggler, and no more than its extra compute
    saving = min(compute[slow] - med, max(others - wait[slow], 0.0))
    replayed = replayed_saving(facts, "straggler")
    if replayed is not None:
        saving = replayed
        evidence.append(
            f"what-if replay: {facts.whatif.evidence.get('straggler', '')}; the slowest rank sets the step "
            f"(the unchanged replay reproduces the measured steps within {facts.whatif.error_pct:.2f}%)"
        )
    if saving < 0.01 * (facts.step_clock_ms or 0.0):
        return []  # nobody waits for it enough to matter: a slower rank, not a straggler
    return [
        finding(
            __name__,
            f"Rank {slow} is a straggler: it computes {pct(100 * (compute[slow] - med) / med)} longer than the median rank "
            "and the others wait for it.",
            evidence=evidence,
            cause="a slow GPU or host, or more work on that rank",
            fix={"any": "# on the straggler's host\nnvidia-smi -q -d PERFORMANCE,TEMPERATURE,CLOCK"},
            confidence=0.7,
            est_saving_ms=saving,
            where={"rank": slow},
        )
    ]


def _late_arrival(facts, ranks, compute: dict[int, float], cfg) -> list:
    """A straggler whose GPU computes like the others: it arrives last at most matched collectives
    and waits least, while the others wait for it. What delays it is before its GPU work (its
    host, its input), and in its own trace its step looks the shortest (it waits least)."""
    cr = facts.cross_rank
    if cr is None or not cr.collectives_matched or len(cr.ranks) < 2:
        return []
    late = cr.ranks[0]  # the one the others wait for: least waiting
    if late.last_arrivals * 2 < cr.collectives_matched:
        return []
    others = [w.wait_ms_per_step for w in cr.ranks[1:]]
    extra = _mean(others) - late.wait_ms_per_step
    step = facts.step_clock_ms
    if not step or 100 * extra / step < cfg["straggler_pct"] / 2:
        return []
    med = statistics.median(compute.values())
    steps = {r.rank: _mean([s.step_ms for s in r.steps]) for r in ranks}
    evidence = [
        f"rank {late.rank} arrives last at {late.last_arrivals} of {cr.collectives_matched} matched collectives "
        f"({cr.arrival}); it waits {ms(late.wait_ms_per_step)} per step there, the other {len(others)} ranks "
        f"{ms(_mean(others))} on average",
        f"its GPU computes like the others: {ms(compute.get(late.rank))} per step against a median of {ms(med)}",
        f"in its own trace its step is the shortest, {ms(steps.get(late.rank))} against a median of "
        f"{ms(statistics.median(steps.values()))}: it waits least because the others wait for it",
    ]
    mine = [k for k in cr.top_skew if k.last_rank == late.rank]
    if mine:
        k = mine[0]
        evidence.append(
            f"the largest skew it causes: {k.kind.replace('_', '-')} #{k.index} in {k.phase} of step {k.step}, "
            f"{ms(k.skew_ms)} from the first rank's arrival to its own"
        )
    if line := transfer_line(facts):
        evidence.append(line)
    return [
        finding(
            __name__,
            f"Rank {late.rank} is a straggler: the others wait {ms(extra)} per step for it at collectives, although its "
            "GPU computes no longer than theirs (its host or input is late).",
            evidence=evidence,
            cause="the rank reaches its collectives late: its CPU work, data loading or input distribution takes longer",
            fix={
                "any": f"# on rank {late.rank}'s host: what runs before its collectives (the CPU timeline of its trace)\n"
                "py-spy dump --pid <its pid>   # or profile that rank's data loader and input pipeline\n"
                "nvidia-smi -q -d PERFORMANCE,CLOCK"
            },
            confidence=0.6,
            est_saving_ms=extra,
            saving_basis="heuristic",  # the others' extra wait, not the replay of faster compute
            where={"rank": late.rank},
        )
    ]
