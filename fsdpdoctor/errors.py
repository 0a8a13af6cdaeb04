"""Errors that reach the user as one line on stderr (never a traceback)."""

from __future__ import annotations


class InputError(ValueError):
    """A user-supplied input cannot be read. ``str(err)`` is the one line we print."""

    def __init__(self, path: object, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):  # crosses process boundaries (parallel rank loading)
        return (type(self), (self.path, self.problem))


class AnalysisBug(RuntimeError):
    """A bug met while analysing one input: not the input's fault, so never an :class:`InputError`.
    The CLI reports it as an internal error naming the file (exit 3)."""

    def __init__(self, path: object, what: str):
        self.path = str(path)
        self.what = what
        super().__init__(f"{self.path}: {what}")

    @classmethod
    def of(cls, path: object, exc: BaseException) -> "AnalysisBug":
        msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return cls(path, f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__)

    def __reduce__(self):  # crosses process boundaries (process pool, Dask)
        return (type(self), (self.path, self.what))
