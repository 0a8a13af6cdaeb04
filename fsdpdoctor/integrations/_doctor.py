"""The trainer-independent part of the callbacks: one :class:`fsdpdoctor.capture.Capture` over a
steady-state window, the Flight Recorder dump, the analysis on rank 0 when the window closes,
the lines it prints, the scalars it logs, and the decision to stop early.

A callback calls :meth:`Doctor.begin` when training starts, :meth:`Doctor.step` after every
optimizer step (it returns True at the step that closes the window), and :meth:`Doctor.end` when
training ends. torch is imported lazily, fsdpdoctor's analysis only on rank 0 at the window's end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fsdpdoctor.capture import Capture, dump_flight_recorder

#: What ``stop_on`` accepts: "hang" (a hang pattern in the Flight Recorder dumps at the window's
#: end, or no step finished within ``hang_timeout_s``), "oom" (the window ran out of memory or
#: came within the memory-pressure threshold of it).
STOP_ON = ("hang", "oom")


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def headline_lines(report: Any, out_dir: Path | str, elapsed_s: float | None = None) -> list[str]:
    """What rank 0 prints when the window closes: the ticket's headline (the lines
    ``fsdpdoctor analyze`` opens with), the first finding with its saving, and the command that
    prints the whole ticket."""
    from fsdpdoctor.report.sections import saving_text, ticket_headline

    f = report.facts
    took = f" (analysed in {elapsed_s:.1f} s)" if elapsed_s is not None else ""
    lines = [f"fsdpdoctor: profiled window written to {out_dir}{took}"]
    for key, text in ticket_headline(f):
        lines.append(f"  {key:<8} {text}")
    shown = [x for x in report.findings if x.folded_into is None] or list(report.findings)
    if shown:
        fd = shown[0]
        saving = saving_text(fd, f)
        more = f" (+{len(shown) - 1} more)" if len(shown) > 1 else ""
        lines.append(
            f"  {'Finding':<8} {fd.severity}[{fd.code}] {fd.slug}: {fd.summary}"
            + (f" ({saving})" if saving else "")
            + more
        )
    else:
        lines.append(f"  {'Finding':<8} none: no rule found a problem in this window")
    lines.append(f"  the whole ticket: fsdpdoctor analyze {out_dir}")
    return lines


def scalars(report: Any) -> dict[str, float]:
    """The figures a trainer's logger gets, each only where the analysis established it (a CPU-only
    trace has no MFU, waterfall or exposed communication: those keys are absent, never 0):

    ``fsdpdoctor/step_ms`` the step time; ``fsdpdoctor/steps`` steps analysed per rank;
    ``fsdpdoctor/mfu_pct``; ``fsdpdoctor/waterfall/<part>_ms`` the efficiency waterfall's parts
    (they sum to the step); ``fsdpdoctor/exposed_comm_ms`` exposed communication per step and
    ``fsdpdoctor/overlap_pct``; ``fsdpdoctor/phase/<forward|backward|optimizer>_ms`` the CPU time
    of each phase per step (mean over ranks and steps); ``fsdpdoctor/findings``."""
    f = report.facts
    out: dict[str, float] = {}
    if f.step_clock_ms:
        out["fsdpdoctor/step_ms"] = float(f.step_clock_ms)
        out["fsdpdoctor/steps"] = float(f.steps.count)
    if f.compute is not None and f.compute.mfu_pct is not None:
        out["fsdpdoctor/mfu_pct"] = float(f.compute.mfu_pct)
    if f.efficiency is not None and f.efficiency.step_ms:
        for part, v in f.efficiency.parts_ms.items():
            out[f"fsdpdoctor/waterfall/{part}_ms"] = float(v)
    if f.exposed_comm.mean_ms_per_step is not None:
        out["fsdpdoctor/exposed_comm_ms"] = float(f.exposed_comm.mean_ms_per_step)
    if f.overlap.pct is not None:
        out["fsdpdoctor/overlap_pct"] = float(f.overlap.pct)
    sums: dict[str, float] = {}
    n = 0
    for r in f.all_ranks():
        for s in r.steps:
            n += 1
            for phase, v in s.phase_ms.items():
                sums[phase] = sums.get(phase, 0.0) + v
    for phase, v in sorted(sums.items()):
        out[f"fsdpdoctor/phase/{phase}_ms"] = v / n
    out["fsdpdoctor/findings"] = float(len([x for x in report.findings if x.folded_into is None]))
    return out


def stop_reason(report: Any, stop_on: Iterable[str]) -> str | None:
    """Why training should stop now, from the window's analysis, or None."""
    f = report.facts
    stop_on = set(stop_on)
    if "hang" in stop_on and f.hang is not None and f.hang.kind != "none":
        return f"hang pattern in the Flight Recorder dumps: {f.hang.summary}"
    if "oom" in stop_on and f.memory_pressure is not None and f.memory_pressure.under_pressure:
        p = f.memory_pressure
        used = f"{p.used_pct:.1f}% of the {p.capacity_source} capacity" if p.used_pct is not None else "capacity"
        what = "ran out of memory" if p.level == "oom" else f"peak reserved memory at {used}"
        return f"memory: the window {what} (threshold {p.threshold_pct:.0f}%)"
    return None


class Doctor:
    """One profiled window of a training run, analysed on rank 0 when it closes.

    Args:
        out_dir: where the traces, the sidecar, snapshots and dumps go (``analyze`` reads it);
            None: the callback's default (under the trainer's output folder).
        wait, warmup, active, skip_first: the window, in optimizer steps, as for
            :class:`fsdpdoctor.capture.Capture` (steps ``skip_first + wait + warmup`` ... ``+ active - 1``).
        memory_history: record the CUDA allocator's history and dump a snapshot per rank at the
            window's end (CUDA only).
        flight_recorder: dump every rank's Flight Recorder buffer at the window's end (and on a hang).
        stop_on: ``"hang"`` and/or ``"oom"`` (:data:`STOP_ON`): stop training when the window's
            analysis shows that pattern; with ``"hang"`` a watchdog also dumps the Flight Recorder
            and ends the process when no step finishes within ``hang_timeout_s``.
        hang_timeout_s: the watchdog's limit (seconds without a finished step); None: no watchdog.
        analyze: run the analysis on rank 0 when the window closes (False: only write the files).
        printer: where rank 0's lines go (default: ``print`` to stdout).
        capture_kwargs: further :class:`~fsdpdoctor.capture.Capture` arguments (``with_stack``,
            ``profile_memory``, ``wrap_policy``, ``extra``...).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str] | None = None,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        skip_first: int = 0,
        memory_history: bool = False,
        flight_recorder: bool = False,
        stop_on: Iterable[str] = (),
        hang_timeout_s: float | None = None,
        analyze: bool = True,
        printer: Callable[[str], None] | None = None,
        **capture_kwargs: Any,
    ) -> None:
        stop_on = tuple(stop_on)
        bad = [s for s in stop_on if s not in STOP_ON]
        if bad:
            raise ValueError(f"stop_on accepts {STOP_ON}, not {bad}")
        if "repeat" in capture_kwargs:
            raise ValueError("a callback profiles one window: repeat is not an option")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.window = {"wait": wait, "warmup": warmup, "active": active, "skip_first": skip_first}
        self.memory_history = memory_history
        self.flight_recorder = flight_recorder or "hang" in stop_on
        self.stop_on = stop_on
        self.hang_timeout_s = hang_timeout_s if hang_timeout_s is not None else None
        self.analyze = analyze
        self.printer = printer or (lambda line: print(line, flush=True))
        self.capture_kwargs = capture_kwargs
        self.capture: Capture | None = None
        self.report: Any = None  # rank 0: the fsdpdoctor Report of the window
        self.lines: list[str] = []  # rank 0: what it printed
        self.scalars: dict[str, float] = {}  # rank 0: what it logged
        self.stop_reason: str | None = None  # every rank: why training stops (stop_on), else None
        self.closed = False
        self._watchdog: _Watchdog | None = None
        if self.flight_recorder:  # before the process group's first collective, where it is not yet set
            from fsdpdoctor.capture import FR_BUFFER_SIZE

            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))

    @property
    def last_step(self) -> int:
        """The number of optimizer steps after which the window closes."""
        w = self.window
        return w["skip_first"] + w["wait"] + w["warmup"] + w["active"]

    def begin(self, model: Any, default_out: str | os.PathLike[str]) -> None:
        """Start the profiler (the window's schedule counts from here)."""
        if self.capture is not None or self.closed:
            return
        if self.out_dir is None:
            self.out_dir = Path(default_out)
        self.capture = Capture(
            self.out_dir,
            model,
            repeat=1,
            memory_history=self.memory_history,
            flight_recorder=self.flight_recorder,
            **self.window,
            **self.capture_kwargs,
        )
        self.capture.__enter__()
        if "hang" in self.stop_on and self.hang_timeout_s:
            self._watchdog = _Watchdog(self, self.hang_timeout_s)
            self._watchdog.start()

    def beat(self) -> None:
        """Progress other than a training step (an evaluation batch, a checkpoint saved): the hang
        watchdog's clock starts again."""
        if self._watchdog is not None:
            self._watchdog.beat()

    def step(self) -> bool:
        """One optimizer step done; True when it closed the window (then :attr:`report`,
        :attr:`scalars` and :attr:`stop_reason` are set)."""
        if self._watchdog is not None:
            self._watchdog.beat()
        if self.capture is None or self.closed:
            return False
        self.capture.step()
        if self.capture.steps_done >= self.last_step:
            self.close()
            return True
        return False

    def end(self) -> None:
        """Training ended: close a window still open (fewer steps than the window: its traces
        were never written, which the printed line says) and stop the watchdog."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.capture is not None and not self.closed:
            self.close()

    def close(self) -> None:
        cap = self.capture
        assert cap is not None and self.out_dir is not None
        self.closed = True
        if self._watchdog is not None:  # rank 0's analysis is not a hang (the others wait for it)
            self._watchdog.pause()
        try:
            self._close(cap)
        finally:
            if self._watchdog is not None:
                self._watchdog.resume()

    def _close(self, cap: Capture) -> None:
        assert self.out_dir is not None
        complete = cap.steps_done >= self.last_step
        cap.__exit__(None, None, None)
        dist = _dist()
        if dist is not None and cap.world_size > 1:
            dist.barrier()  # every rank's trace (and dump) is on disk before rank 0 reads them
        reason = None
        if cap.rank == 0:
            if not complete:
                self.lines = [
                    f"fsdpdoctor: training ended after {cap.steps_done} steps, before the profiled window "
                    f"(steps {cap.profiled_steps()[0]}-{cap.profiled_steps()[-1]}) closed: no traces written "
                    f"to {self.out_dir}; lower wait/warmup/active or train longer"
                ]
            elif self.analyze:
                reason = self._analyze()
            for line in self.lines:
                self.printer(line)
        if self.stop_on and dist is not None and cap.world_size > 1:
            box = [reason]
            dist.broadcast_object_list(box, src=0)
            reason = box[0]
        self.stop_reason = reason
        if reason is not None and cap.rank == 0:
            self.printer(f"fsdpdoctor: stopping training (stop_on={list(self.stop_on)}): {reason}")

    def _analyze(self) -> str | None:
        import fsdpdoctor
        from fsdpdoctor.errors import InputError

        t0 = time.perf_counter()
        try:
            report = fsdpdoctor.analyze(self.out_dir, jobs=1)
        except InputError as exc:
            self.lines = [f"fsdpdoctor: the window in {self.out_dir} could not be analysed: {exc}"]
            return None
        self.report = report
        self.lines = headline_lines(report, self.out_dir, time.perf_counter() - t0)
        self.scalars = scalars(report)
        return stop_reason(report, self.stop_on)


class _Watchdog(threading.Thread):
    """Ends a hung process early: when no optimizer step finishes within ``timeout_s``, this rank
    dumps its Flight Recorder buffer; rank 0 waits up to ``grace_s`` for the others' dumps, prints
    the hang diagnosis from them and marks them read; every rank exits with status 3 (the others
    once rank 0 has read the dumps, or after a bounded wait) instead of waiting for the
    collective's own timeout. The ranks must share the output folder (one host, or a shared
    file system)."""

    EXIT_STATUS = 3

    def __init__(self, doctor: Doctor, timeout_s: float, grace_s: float = 10.0) -> None:
        super().__init__(name="fsdpdoctor-hang-watchdog", daemon=True)
        self.doctor = doctor
        self.timeout_s = float(timeout_s)
        self.grace_s = grace_s
        self._last = time.monotonic()
        self._paused = False
        self._stop = threading.Event()

    def beat(self) -> None:
        self._last = time.monotonic()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._last = time.monotonic()
        self._paused = False

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if not self._paused and time.monotonic() - self._last > self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        d = self.doctor
        cap = d.capture
        rank = cap.rank if cap is not None else int(os.environ.get("RANK", "0"))
        world = cap.world_size if cap is not None else int(os.environ.get("WORLD_SIZE", "1"))
        out = d.out_dir or Path(".")
        path = dump_flight_recorder(out, rank)
        print(
            f"fsdpdoctor: rank {rank}: no training step finished in {self.timeout_s:.0f} s; "
            f"Flight Recorder dumped to {path}",
            file=sys.stderr,
            flush=True,
        )
        done = out / "comm_traces" / ".fsdpdoctor-analysed"  # rank 0 has read the dumps: the others may go
        if rank != 0:
            deadline = time.monotonic() + 3 * self.grace_s + 60
            while time.monotonic() < deadline and not done.exists():
                time.sleep(0.2)
        else:
            from fsdpdoctor.capture import flight_recorder_filename

            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline:
                if all((out / flight_recorder_filename(r)).exists() for r in range(world)):
                    break
                time.sleep(0.2)
            try:
                from fsdpdoctor.api import analyze
                from fsdpdoctor.report.sections import hang_headline

                report = analyze(out / "comm_traces", jobs=1)
                for key, text in hang_headline(report.facts):
                    d.printer(f"fsdpdoctor: {key:<8} {text}")
            except Exception as exc:  # the exit below matters more than the diagnosis
                d.printer(f"fsdpdoctor: the Flight Recorder dumps in {out} could not be analysed: {exc}")
            d.printer(f"fsdpdoctor: stopping the hung job (stop_on='hang'); see fsdpdoctor analyze {out}")
            done.touch()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.EXIT_STATUS)
