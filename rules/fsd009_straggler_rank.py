"""What it detects
    One rank computing slower than the others, so that every other rank waits for it inside
    collectives.

Why it hurts
    Collectives complete only when the slowest rank arrives: the whole job runs at the speed of
    its slowest GPU (thermal throttling, a bad host, data imbalance, a noisy neighbour).

How it shows in a trace
    Compare ranks: the straggler's compute time per step is higher and its collectives are the
    shortest (it arrives last and never waits), while the other ranks' collectives stretch.

Fix
    Find out why that rank is slow: GPU clocks and temperature (``nvidia-smi -q -d
    PERFORMANCE``), host load, the data it receives (sequence lengths), then replace or
    rebalance.
"""

import statistics

from fsdpdoctor.fmt import ms, pct

from ._util import ALL_COMM, finding, replayed_saving

CODE = "FSD009"
SLUG = "straggler-rank"
TITLE = "One rank is slower than the rest"
SEVERITY = "warning"
THRESHOLDS = ("straggler_pct",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("compute", None), *ALL_COMM], "cpu": []}
CLAIM_PRIORITY = 20  # specific findings claim before the general ones that they explain



def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def check(facts, cfg):
    ranks = [r for r in facts.rank_facts if r.gpu_present and r.steps]
    if len(ranks) < 2:
        return []
    compute = {r.rank: _mean([s.compute_ms for s in r.steps]) for r in ranks}
    comm = {r.rank: _mean([s.comm_ms for s in r.steps]) for r in ranks}
    med = statistics.median(compute.values())
    slow = max(compute, key=compute.get)
    if med <= 0 or 100 * (compute[slow] - med) / med < cfg["straggler_pct"]:
        return []
    others = [comm[r] for r in comm if r != slow]
    evidence = [
        f"rank {slow} computes {ms(compute[slow])} per step vs a median of {ms(med)} (+{pct(100 * (compute[slow] - med) / med)})",
        f"rank {slow} spends {ms(comm[slow])} in collectives per step, the others {ms(_mean(others))} on average (they wait for it)",
    ]
    saving = compute[slow] - med
    replayed = replayed_saving(facts, "straggler")
    if replayed is not None:
        saving = replayed
        evidence.append(f"what-if replay: {facts.whatif.evidence.get('straggler', '')}; the slowest rank sets the step "
                        f"(unchanged replay within {facts.whatif.error_pct:.2f}% of the measured step)")
    return [
        finding(
            __name__,
            f"Rank {slow} is a straggler: it computes {pct(100 * (compute[slow] - med) / med)} longer than the median rank and the others wait for it.",
            evidence=evidence,
            cause="a slow GPU or host, or more work on that rank",
            fix={"any": "# on the straggler's host\nnvidia-smi -q -d PERFORMANCE,TEMPERATURE,CLOCK"},
            confidence=0.7,
            est_saving_ms=saving,
            where={"rank": slow},
        )
    ]
