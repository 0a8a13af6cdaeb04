"""PyTorch's Flight Recorder analyzer run as a fresh ``python -m`` each time, without paying for
``import torch`` each time: a fork server.

``python -m torch.distributed.flight_recorder.fr_trace DUMPS`` costs ~1.6 CPU-s, nearly all of it
``import torch``; test_hang and test_flight_recorder run it 13 times. Here one server process per
test process imports torch once; each run is a ``fork()`` of it that points fds 1 and 2 at files
and runs the module as ``__main__`` (``runpy``, as ``-m`` does), with ``sys.argv`` as ``-m`` sets
it. An exception that ends the run is printed as the interpreter prints it (traceback on stderr,
exit 1); ``SystemExit`` gives its code. The analyzer and everything it imports beyond torch are
imported afresh in every fork.

:func:`run_fr_trace` is ``_fr_peer.run_fr_trace`` (its verdict parsing, unchanged) with the
subprocess it starts served by the fork server; ``FSDPDOCTOR_FR_SUBPROCESS=1`` runs the plain
subprocess instead.

Run as a script, this file is the server: one JSON request per line on stdin
(``{"argv": [...], "out": path, "err": path}``), one JSON reply per line on stdout (``{"rc": n}``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

MODULE = "torch.distributed.flight_recorder.fr_trace"


def _serve() -> None:
    import runpy
    import traceback

    import torch  # noqa: F401 - the point of the server: imported once, before every fork
    import torch.distributed  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the run: as `python -m MODULE *argv` with its output in the files
            code = 1
            try:
                out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, 1)
                os.dup2(err, 2)
                sys.stdin = open(os.devnull)
                sys.argv = [MODULE, *req["argv"]]
                try:
                    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if e.code is not None and not isinstance(e.code, int):
                        print(e.code, file=sys.stderr)
                except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught one
                    traceback.print_exc()
                    code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        sys.stdout.write(json.dumps({"rc": rc}) + "\n")
        sys.stdout.flush()


class _Server:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        import tempfile

        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen(
                    [sys.executable, __file__],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            with tempfile.TemporaryDirectory(prefix="fr-trace-") as tmp:
                out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
                self.proc.stdin.write(json.dumps({"argv": argv, "out": str(out), "err": str(err)}) + "\n")
                self.proc.stdin.flush()
                reply = _readline(self.proc, timeout)
                if reply is None:  # stuck or gone: stop it; the next run starts a new one
                    self.close()
                    raise subprocess.TimeoutExpired([MODULE, *argv], timeout)
                return json.loads(reply)["rc"], out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        return None
    line = proc.stdout.readline()
    return line or None


_SERVER = _Server()


def _run(cmd, capture_output=True, text=True, timeout=None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` for ``[python, -m, MODULE, *argv]`` through the fork server."""
    assert list(cmd[:3]) == [sys.executable, "-m", MODULE] and capture_output and text and not kw, cmd
    rc, out, err = _SERVER.run([str(a) for a in cmd[3:]], timeout or 120)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def run_fr_trace(dumps: Path, *args: str, timeout: float = 120):
    """``_fr_peer.run_fr_trace(dumps, *args)``, its ``python -m`` served by the fork server."""
    import _fr_peer

    if os.environ.get("FSDPDOCTOR_FR_SUBPROCESS") == "1":
        return _fr_peer.run_fr_trace(dumps, *args, timeout=timeout)
    fake = types.SimpleNamespace(run=_run)
    real = _fr_peer.subprocess
    _fr_peer.subprocess = fake  # only run_fr_trace's module sees it, only for this call
    try:
        return _fr_peer.run_fr_trace(dumps, *args, timeout=timeout)
    finally:
        _fr_peer.subprocess = real


if __name__ == "__main__":
    _serve()
