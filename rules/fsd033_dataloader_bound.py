"""What it detects
    Steps that wait for the DataLoader: the CPU inside the loader's ``next()``
    (``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__`` or
    ``…#_MultiProcessingDataLoaderIter.__next__``) while the GPU runs nothing.

Why it hurts
    With ``num_workers=0`` the batch is read, decoded and collated in the training process, between
    two steps, and the GPU has nothing queued meanwhile; with workers that cannot keep up, ``next()``
    waits for the next ready batch. Either way the time is added to every step.

How it shows in a trace
    A loader range at the start of each ``ProfilerStep`` and no kernel, memcpy or memset on the GPU
    under it (``loader.gpu_idle_ms_per_step``; its CPU time ``loader.ms_per_step``; which iterator in
    ``loader.iterator``). Fires when that idle is ``loader_min_pct`` of the step.

Fix
    Load in worker processes and keep them: ``DataLoader(..., num_workers=N, pin_memory=True,
    persistent_workers=True, prefetch_factor=2..4)``, and copy the batch with
    ``.to(device, non_blocking=True)``; with workers already, more of them, or a cheaper decode
    (pre-tokenised / pre-decoded data).

Saving
    The GPU idle inside the loader's ranges per step: the time the step would lose if the next batch
    were ready when asked for.

Known problems
    A step that also waits on something else under the loader range (another stream's event) is
    counted as waiting for the loader. Worker processes take CPU cores and host memory
    (``prefetch_factor × num_workers`` batches in flight): on a host short of either the saving is
    less. A loader wrapped in another iterator (a prefetcher, ``accelerate``'s) records other range
    names and is not seen.
"""

from fsdpdoctor.fmt import ms

from ._idiom import idiom_fix
from ._util import finding, of_step, step_ms

CODE = "FSD033"
SLUG = "dataloader-bound"
TITLE = "The GPU waits for the DataLoader"
SEVERITY = "warning"
THRESHOLDS = ("loader_min_pct",)

EXPLAINS = {"gpu": [("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 93

FIX = """loader = torch.utils.data.DataLoader(
    dataset, batch_size=batch_size, shuffle=True,
    num_workers=8,            # load and collate in worker processes, not between steps
    pin_memory=True,          # page-locked batches: asynchronous host-to-device copies
    persistent_workers=True,  # keep the workers between epochs
    prefetch_factor=4,        # batches each worker keeps ready
)
for batch in loader:
    batch = batch.to(device, non_blocking=True)
"""


def check(facts, cfg):
    ld = facts.loader
    step = step_ms(facts)
    if ld is None or not facts.gpu_present or ld.gpu_idle_ms_per_step is None or not step:
        return []
    idle = ld.gpu_idle_ms_per_step
    if 100 * idle / step < cfg["loader_min_pct"]:
        return []
    single = ld.iterator == "_SingleProcessDataLoaderIter"
    how = (
        "in the training process (num_workers=0: _SingleProcessDataLoaderIter)"
        if single
        else "waiting for its worker processes (_MultiProcessingDataLoaderIter)"
    )
    evidence = [
        f"DataLoader next() {how}: {ld.calls_per_step:g} call(s) per step, {ms(ld.ms_per_step)} of CPU per step, "
        f"the longest {ms(ld.longest_ms)}",
        f"the GPU ran nothing for {ms(idle)} of it per step = {of_step(facts, idle)}"
        + (f" (mean over {ld.ranks} ranks)" if ld.ranks > 1 else ""),
    ]
    fix = (
        FIX
        if single
        else FIX.replace("num_workers=8,  ", "num_workers=16, ").replace(
            "# load and collate in worker processes, not between steps", "# more workers: they do not keep up"
        )
    )
    return [
        finding(
            __name__,
            f"The GPU waits {ms(idle)} per step ({of_step(facts, idle)}) for the DataLoader's next batch.",
            evidence=evidence,
            cause="the batch is loaded and collated in the training process"
            if single
            else "the DataLoader's workers do not keep up with the steps",
            fix=idiom_fix(facts, "dataloader", {"any": FIX}) if single else {"any": fix},
            confidence=0.8,
            est_saving_ms=idle,
            where={"site": f"enumerate(DataLoader)#{ld.iterator}.__next__"},
        )
    ]
