"""Run fsdpdoctor CLI cases, one forked process each, and measure every one.

Usage: ``python tests/_fuzz_runner.py CASES.json RESULTS.json``. ``CASES.json`` is a list of
``{"id": ..., "argv": [...]}``, or ``{"warm": [argv, ...], "cases": [...]}``; each case runs
``fsdpdoctor <argv>`` in a child forked from this process after the CLI is imported (so a case
costs milliseconds of start-up, not a Python start). The ``warm`` commands (valid inputs of the
cases' kinds) run first in this process, output discarded: the modules an analysis imports on the
way and the rules' registry are then loaded once here, not again in every child (~0.1 s a case).
For each case the result holds the exit code (negative: killed by that signal), stdout and stderr,
the wall and CPU time, and the child's peak RSS as the kernel reports it to ``wait4`` (``ru_maxrss``,
children of the child included). The child runs under an address-space limit and an alarm, so a
case that runs away is killed rather than taking the machine with it; both show in the result.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time

AS_LIMIT = 6 << 30  # address space per case (virtual, so well above the RSS bound tests assert)
ALARM_S = 30


def run_case(argv: list[str], workdir: str) -> dict:
    out_path = os.path.join(workdir, "out")
    err_path = os.path.join(workdir, "err")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 99
        try:
            fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
            signal.alarm(ALARM_S)
            from fsdpdoctor.cli import main

            try:
                main.main(args=argv, prog_name="fsdpdoctor", standalone_mode=True)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # noqa: BLE001 - reported as a crash of the runner itself
            try:
                os.write(2, f"RUNNER: {type(exc).__name__}: {exc}\n".encode())
            except OSError:
                pass
            code = 98
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:  # noqa: BLE001
                pass
            os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    code = os.waitstatus_to_exitcode(status)
    with open(out_path, "rb") as f:
        stdout = f.read(1 << 20).decode("utf-8", "replace")
    with open(err_path, "rb") as f:
        stderr = f.read(1 << 20).decode("utf-8", "replace")
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "code": code,
        "stdout": stdout,
        "stderr": stderr,
        "wall_s": wall,
        "cpu_s": cpu,
        "maxrss_kb": usage.ru_maxrss,
    }


def _warm(argv: list[str]) -> None:
    """``fsdpdoctor <argv>`` in this process: a valid input, so exit 0 (or 1, a ``check`` gate)."""
    import contextlib
    import io

    from fsdpdoctor.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main.main(args=argv, prog_name="fsdpdoctor", standalone_mode=True)
        except SystemExit as exc:
            if exc.code not in (0, 1, None):
                raise RuntimeError(f"warm-up {argv} exited {exc.code}: {err.getvalue()}") from None


def main(cases_file: str, results_file: str) -> None:
    with open(cases_file) as f:
        cases = json.load(f)
    warm = cases.get("warm", []) if isinstance(cases, dict) else []
    cases = cases["cases"] if isinstance(cases, dict) else cases
    import fsdpdoctor.cli  # noqa: F401 - imported once, before forking
    import fsdpdoctor.api  # noqa: F401
    import fsdpdoctor.analysis.compare  # noqa: F401

    if os.environ.get("FSDPDOCTOR_CHECK_SCHEMA") == "1":  # (tests/conftest.py sets it)
        from fsdpdoctor.schema import _fast_validator, _validator

        _fast_validator()  # built once here, not in every case
        _validator()  # (the reference, for a document the fast one refuses): 1.3 s of CPU a case otherwise

    for argv in warm:
        _warm(argv)

    results = []
    with tempfile.TemporaryDirectory() as work:
        for case in cases:
            r = run_case(case["argv"], work)
            r["id"] = case["id"]
            results.append(r)
    with open(results_file, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
