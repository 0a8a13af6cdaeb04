"""What-if replay of one rank's measured timeline (in the spirit of Daydream, Zhu et al., ATC 2020).

From the trace we build the dependency graph of the profiled steps and replay it:

* nodes: every GPU activity (kernel, memcpy, memset) with its measured duration;
* each node starts no earlier than its CPU launch (the runtime/driver call with the same
  correlation id), after the previous node on its stream, after the previous collective of its
  communicator (process group, in issue order: NCCL serialises them), and after the nodes it
  waits on across streams: for every ``cudaStreamWaitEvent`` the next GPU activity the thread
  launches waits on the latest-finishing activity of another stream launched before the wait
  (the trace records that a wait was issued, not on which event; FSDP's waits are
  ``wait_stream`` calls on the last work of the other stream, see
  ``notes/fsdp-trace-signatures.md``);
* the CPU timeline keeps its measured gaps; a blocking call (``cuda*Synchronize``, a pageable
  ``cudaMemcpyAsync``) ends when the GPU activity it waited for ends, and every later CPU event
  moves with it.

Each constraint keeps its measured slack up to a small cap (launch latency, back-to-back gap),
so the unchanged replay reproduces the measured step only as well as the graph explains the
waits: its error is the model's *fidelity*, not the error of a saving (that comes from real
twins: ``fsdpdoctor/savings/__init__.py``).

A transformation edits the graph (move, drop or scale nodes, cut CPU time) and the replay gives
the step time with the fix. Only per-transformation step times and small evidence leave this
module (:class:`fsdpdoctor.facts.WhatIfFacts`), never the graph.

The package, one module per stage: :mod:`.graph` (the graph read from the trace), :mod:`.loop`
(the replay and its step clocks), :mod:`.fixes` (the transformations), :mod:`.plan` (planning
and running a rank's replays) and :mod:`.fold` (the run's figures over its ranks).
"""

from fsdpdoctor.analysis.whatif.fold import WhatIfFold, fold_whatif
from fsdpdoctor.analysis.whatif.plan import WhatIfPlan, analyze_whatif, plan_whatif, run_whatif

__all__ = ["WhatIfFold", "WhatIfPlan", "analyze_whatif", "fold_whatif", "plan_whatif", "run_whatif"]
