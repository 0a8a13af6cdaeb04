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
