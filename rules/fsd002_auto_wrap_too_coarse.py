"""What it detects
    One FSDP unit holds most of the model's parameters (the root-only wrap, or a policy that
    missed the transformer blocks).

Why it hurts
    FSDP overlaps the all-gather of the *next* unit with the compute of the current one. With
    one giant unit there is no next unit: the whole model is gathered before the first layer can
    run, and its reduce-scatter starts only after the last gradient. Peak memory holds the full
    unsharded model at once.

How it shows in a trace
    Few ``FSDP::pre_forward`` / ``_pre_forward`` ranges per step; one all-gather whose
    ``Out msg nelems`` is most of the parameter count; that all-gather exposed at the start of
    forward and its reduce-scatter exposed at the end of backward.

Fix
    Wrap each transformer block as its own unit, then the root.

Known problems
    It is judged on unit sizes alone: a model whose root unit keeps a large embedding and an untied
    output layer, more than ``coarse_max_unit_share`` (half) of the parameters, fires even when
    every block is a unit of its own (the generated GPT-2 small with a 50,304-token vocabulary
    keeps 48% in its root, tests/test_whatif.py); its fix is then to wrap those layers as units
    too. Without FQNs in the trace (FSDP1, torch 2.4 FSDP2) the units are inferred from the
    pre-forward ranges in execution order. The saving is the what-if replay of a per-block split
    (or, without a replay that reproduces the step, the exposed time ×
    (1 − 1/``coarse_split_into``)), with no real GPU twin yet (±50%): on the generated too-coarse
    twin it predicted 11.69 ms where the per-block run was 10.52 ms faster. CPU-only traces get no
    saving, and there the real gloo twin went the other way: per-block wrapping made the step
    34.96 ms slower (FSDP's hooks cost more than they hide, docs/savings.md).
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._util import finding, fix_for, is_fsdp, replay_evidence, replayed_saving, tensor_parallel_degree

CODE = "FSD002"
SLUG = "auto-wrap-too-coarse"
TITLE = "FSDP wrapping too coarse: one unit holds most parameters"
SEVERITY = "warning"
REPLAY_FIX = "wrap"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("coarse_max_unit_share", "coarse_split_into")

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {
    "gpu": [("exposed_all_gather", None), ("exposed_reduce_scatter", None)],
    "cpu": [("cpu_fsdp_hooks", None), ("cpu_forward", None), ("cpu_backward", None)],
}
CONFIG_KEYS = ("unit_count",)  # a configuration finding: it explains a change only when these changed
CLAIM_PRIORITY = 60  # specific findings claim before the general ones that they explain


FIX_FSDP2 = """from torch.distributed.fsdp import fully_shard

for block in model.layers:          # each transformer block is its own unit
    fully_shard(block)
fully_shard(model)                  # the root keeps embeddings / head
"""
FIX_FSDP1 = """import functools
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
model = FSDP(model, auto_wrap_policy=policy)
"""


def check(facts, cfg):
    if not is_fsdp(facts):
        return []
    units = [u for u in facts.fsdp.units if u.unsharded_numel]
    # TP + FSDP: a tensor-parallel unit gathers its TP-local shard; judged at up to its full size
    tp = tensor_parallel_degree(facts)
    size = {u.fqn: u.unsharded_numel * tp.get(u.fqn, 1) for u in units}
    total = sum(size.values())
    if not total:
        return []
    big = max(units, key=lambda u: size[u.fqn])
    share = size[big.fqn] / total
    if share < cfg["coarse_max_unit_share"]:
        return []
    name = big.fqn or "(root)"
    evidence = [
        f"unit '{name}' gathers {big.unsharded_numel:,} elements = {pct(100 * share)} of all parameters",
        f"{len(facts.fsdp.units)} FSDP unit(s) in total ({facts.fsdp.unit_source})",
    ]
    if tp:
        evidence.append(f"{len(tp)} unit(s) tensor-parallel (x{max(tp.values())}), counted at up to their full size")
    if big.all_gather_bytes:
        evidence.append(f"its all-gathers move {mib(big.all_gather_bytes)} per step")
    saving = None
    exposed = big.all_gather_exposed_ms + big.reduce_scatter_exposed_ms
    if facts.gpu_present:
        evidence.append(
            f"its all-gather is exposed {ms(big.all_gather_exposed_ms)} and its reduce-scatter "
            f"{ms(big.reduce_scatter_exposed_ms)} per step (rank {facts.rank_facts[0].rank})"
        )
        k = max(int(cfg["coarse_split_into"]), 2)
        # with k units only the first all-gather and the last reduce-scatter (1/k each) stay exposed
        saving = exposed * (1 - 1 / k) if exposed > 0 else None
        replayed = replayed_saving(facts, "wrap")
        if replayed is not None:
            saving = replayed
            evidence.append(
                replay_evidence(facts, "wrap", "splitting its collectives into per-block ones that overlap compute")
            )
            if facts.whatif.evidence.get("wrap"):
                evidence.append(f"replayed with {facts.whatif.evidence['wrap']}")
    return [
        finding(
            __name__,
            f"FSDP unit '{name}' holds {pct(100 * share)} of the parameters, so its communication cannot overlap with compute.",
            evidence=evidence,
            cause="the auto-wrap policy (or fully_shard calls) did not make the transformer blocks units of their own",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="wrap_policy"),
            confidence=0.9 if share > 0.8 else 0.7,
            est_saving_ms=saving,
            where={"unit": big.fqn},
        )
    ]
