"""fsdpdoctor: diagnose PyTorch FSDP training runs from profiler traces and memory snapshots.

    >>> import fsdpdoctor
    >>> report = fsdpdoctor.analyze(["traces/"])
    >>> print(report.to_markdown())
"""

__version__ = "0.1.0"

from .api import Report, analyze  # noqa: E402

__all__ = ["Report", "analyze", "__version__"]
