"""fsdpdoctor: diagnose PyTorch FSDP training runs from profiler traces and memory snapshots.

>>> import fsdpdoctor
>>> report = fsdpdoctor.analyze(["traces/"])
>>> print(report.to_markdown())
"""

__version__ = "0.1.0"

__all__ = ["Report", "analyze", "__version__"]


def __getattr__(name: str):
    # The API (and the numpy/pandas it needs) loads on first use, so CLI commands that need
    # neither (``rules``, ``explain``, ``--help``) start fast.
    if name in ("Report", "analyze", "api"):
        import importlib

        api = importlib.import_module(f"{__name__}.api")
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
