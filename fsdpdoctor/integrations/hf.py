"""``FsdpDoctorCallback`` for the Hugging Face ``transformers.Trainer`` (and so for Accelerate's
FSDP through it): ``pip install 'fsdpdoctor[hf]'``.

::

    from fsdpdoctor.integrations.hf import FsdpDoctorCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(FsdpDoctorCallback(trainer=trainer, wait=5, warmup=2, active=3))
    trainer.train()

Every rank profiles optimizer steps ``skip_first + wait + warmup`` to ``+ active - 1`` with
:mod:`fsdpdoctor.capture`'s settings, into ``<output_dir>/fsdpdoctor/`` (``rank<R>.json.gz``,
the sidecar ``fsdpdoctor_meta.json``; ``rank<R>.memory.pickle`` with ``memory_history=True`` on
CUDA; ``comm_traces/rank_<R>`` with ``flight_recorder=True``): the folder ``fsdpdoctor
analyze`` reads. When the window closes, rank 0 analyses it, prints the ticket's headline and
first finding, and logs :func:`fsdpdoctor.integrations._doctor.scalars` through
``trainer.log`` (to ``state.log_history`` and every ``report_to`` integration: TensorBoard,
W&B...). Without ``trainer=`` the callback cannot reach ``Trainer.log``: the scalars go to
``state.log_history`` only. ``stop_on=("hang", "oom")`` stops training
(``control.should_training_stop``) when the window shows that pattern.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from fsdpdoctor.integrations._doctor import Doctor

__all__ = ["FsdpDoctorCallback"]


class FsdpDoctorCallback(TrainerCallback):
    """A ``TrainerCallback`` that profiles one steady-state window for fsdpdoctor (the arguments
    are :class:`fsdpdoctor.integrations._doctor.Doctor`'s, plus ``trainer`` for logging).

    After the window, rank 0's :attr:`report` is the fsdpdoctor Report, :attr:`lines` what it
    printed and :attr:`scalars` what it logged; every rank's :attr:`stop_reason` says why it
    stopped training, if it did."""

    def __init__(self, out_dir: str | os.PathLike[str] | None = None, *, trainer: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("framework", {"name": "transformers", "trainer": "Trainer"})
        self.doctor = Doctor(out_dir, **kwargs)
        self.trainer = trainer

    # what the window left, for the caller
    report = property(lambda self: self.doctor.report)
    lines = property(lambda self: self.doctor.lines)
    scalars = property(lambda self: self.doctor.scalars)
    stop_reason = property(lambda self: self.doctor.stop_reason)
    out_dir = property(lambda self: self.doctor.out_dir)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.doctor.begin(model, os.path.join(args.output_dir, "fsdpdoctor"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self.doctor.step():
            return None
        if self.doctor.scalars:
            if self.trainer is not None:
                # Trainer.log resets control.should_log; this step's own logging (a collective
                # every rank runs) must still happen on rank 0 as on the others
                should_log = control.should_log
                self.trainer.log(dict(self.doctor.scalars))
                control.should_log = should_log
            else:
                state.log_history.append({**self.doctor.scalars, "step": state.global_step})
        if self.doctor.stop_reason is not None:
            control.should_training_stop = True
        return control

    # progress outside training steps: the hang watchdog's clock starts again
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.doctor.beat()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.doctor.beat()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.doctor.beat()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.doctor.end()
