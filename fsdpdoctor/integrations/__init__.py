"""fsdpdoctor inside the trainers people already use: callbacks that record one steady-state
window the way :mod:`fsdpdoctor.capture` does, analyse it on rank 0 when it closes, print the
ticket's headline and first finding, and log the figures to the trainer's own logger.

``fsdpdoctor.integrations.hf``         ``FsdpDoctorCallback``, a ``transformers.TrainerCallback``
                                       (``pip install 'fsdpdoctor[hf]'``)
``fsdpdoctor.integrations.lightning``  ``FsdpDoctorCallback``, a Lightning ``Callback``
                                       (``pip install 'fsdpdoctor[lightning]'``)

Each module imports its trainer; this package and :mod:`._doctor` (the part they share) import
neither, and ``import fsdpdoctor`` imports none of them.
"""
