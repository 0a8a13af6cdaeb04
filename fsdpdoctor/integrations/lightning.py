"""``FsdpDoctorCallback`` for Lightning's ``Trainer`` (``FSDPStrategy``, ``ModelParallelStrategy``,
DDP): ``pip install 'fsdpdoctor[lightning]'``.

::

    from fsdpdoctor.integrations.lightning import FsdpDoctorCallback

    trainer = L.Trainer(strategy=FSDPStrategy(...), callbacks=[FsdpDoctorCallback(wait=5, warmup=2, active=3)])
    trainer.fit(model, loader)

Every rank profiles optimizer steps (``trainer.global_step``) ``skip_first + wait + warmup`` to
``+ active - 1`` with :mod:`fsdpdoctor.capture`'s settings, into
``<default_root_dir>/fsdpdoctor/`` (the folder ``fsdpdoctor analyze`` reads). When the window
closes, rank 0 analyses it, prints the ticket's headline and first finding, and logs
:func:`fsdpdoctor.integrations._doctor.scalars` to every logger of the trainer
(``logger.log_metrics``: TensorBoard, W&B, CSV...) at that step. ``stop_on=("hang", "oom")`` sets
``trainer.should_stop`` when the window shows that pattern; on an out-of-memory error the window
is closed and its files written (the memory snapshot with ``memory_history=True``) before the
error goes on.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from fsdpdoctor.integrations._doctor import Doctor

__all__ = ["FsdpDoctorCallback"]


class FsdpDoctorCallback(Callback):
    """A Lightning ``Callback`` that profiles one steady-state window for fsdpdoctor (the arguments
    are :class:`fsdpdoctor.integrations._doctor.Doctor`'s).

    After the window, rank 0's :attr:`report` is the fsdpdoctor Report, :attr:`lines` what it
    printed and :attr:`scalars` what it logged; every rank's :attr:`stop_reason` says why it
    stopped training, if it did."""

    def __init__(self, out_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("framework", {"name": "lightning", "trainer": "Lightning Trainer"})
        self.doctor = Doctor(out_dir, **kwargs)
        self._global_step = -1

    report = property(lambda self: self.doctor.report)
    lines = property(lambda self: self.doctor.lines)
    scalars = property(lambda self: self.doctor.scalars)
    stop_reason = property(lambda self: self.doctor.stop_reason)
    out_dir = property(lambda self: self.doctor.out_dir)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        model = getattr(trainer.strategy, "model", None) or pl_module  # the wrapped model (FSDP1), else the module
        self.doctor.begin(model, os.path.join(trainer.default_root_dir, "fsdpdoctor"))
        self._global_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._global_step:  # a gradient-accumulation micro-batch
            return
        self._global_step = trainer.global_step
        if not self.doctor.step():
            return
        if self.doctor.scalars:
            for logger in trainer.loggers:
                logger.log_metrics(dict(self.doctor.scalars), step=trainer.global_step)
        if self.doctor.stop_reason is not None:
            trainer.should_stop = True

    # progress outside training steps: the hang watchdog's clock starts again
    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self.doctor.beat()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        self.doctor.beat()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.doctor.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.doctor.capture is None or self.doctor.closed:
            return
        try:
            import torch

            oom = isinstance(exception, torch.OutOfMemoryError)
        except (ImportError, AttributeError):  # pragma: no cover
            oom = False
        if oom and self.doctor.capture is not None:
            # the profiler and the memory history end here: the snapshot holds the failed allocation
            self.doctor.capture.__exit__(type(exception), exception, None)
            self.doctor.closed = True
            self.doctor.printer(
                f"fsdpdoctor: rank {self.doctor.capture.rank} ran out of memory; what the window recorded "
                f"is in {self.doctor.out_dir}: fsdpdoctor memory {self.doctor.out_dir}"
            )
