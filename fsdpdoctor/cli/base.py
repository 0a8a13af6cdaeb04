"""What every ``fsdpdoctor`` command shares: the click group, error handling (one stderr line,
exit codes), output, rule configuration and the scale / input-limit options. Command modules
(:mod:`.cli`, :mod:`.cli_compare`, :mod:`.cli_plan`) import from here, never from each other.

Exit codes: 0 success; 1 reserved for failed gates (``check``); 2 bad input or usage.
Bad input is one line on stderr naming the file and the problem, never a traceback
(set ``FSDPDOCTOR_DEBUG=1`` to see one for an internal error).
"""

from __future__ import annotations

import functools
import warnings
import os
import sys
from pathlib import Path

import click
from rich.console import Console

from fsdpdoctor import __version__
from fsdpdoctor.errors import AnalysisBug, InputError

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


def _fail(msg: str, code: int = EXIT_BAD_INPUT) -> None:
    click.echo(f"fsdpdoctor: error: {msg}", err=True)
    sys.exit(code)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings meant for users (a rule plugin that failed to load) as one stderr line each."""
    from fsdpdoctor.engine import PluginLoadWarning

    if issubclass(category, PluginLoadWarning):
        click.echo(f"fsdpdoctor: warning: {message}", err=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def guarded(fn):
    """Turn InputError into one stderr line + exit 2, and any other crash into one line + exit 3."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                return fn(*a, **kw)
        except InputError as exc:
            _fail(str(exc))
        except (click.exceptions.Exit, click.ClickException, SystemExit, KeyboardInterrupt):
            raise
        except BrokenPipeError:  # the reader went away (``fsdpdoctor rules | head``): not an error
            sys.stderr.close()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except MemoryError:
            _fail("out of memory while analysing the input", EXIT_INTERNAL)
        except AnalysisBug as exc:  # a bug met on one file: said as one, with the file named
            if os.environ.get("FSDPDOCTOR_DEBUG"):
                raise
            _fail(
                f"internal error while analysing {exc.path}: {exc.what} "
                "(a bug, not a problem with the file; set FSDPDOCTOR_DEBUG=1 for a traceback)",
                EXIT_INTERNAL,
            )
        except Exception as exc:  # noqa: BLE001 - the contract is: no tracebacks for users
            if os.environ.get("FSDPDOCTOR_DEBUG"):
                raise
            _fail(
                f"internal error: {type(exc).__name__}: {exc} (set FSDPDOCTOR_DEBUG=1 for a traceback)", EXIT_INTERNAL
            )

    return wrapper


def _set_input_limit(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    from fsdpdoctor.fmt import parse_size
    from fsdpdoctor.ingest._io import MAX_INPUT_ENV

    try:
        n = parse_size(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a size (e.g. 512M, 8G, 20000000)") from None
    os.environ[MAX_INPUT_ENV] = str(n)  # read by every reader, also in worker processes


def input_limit_option(fn):
    """``--max-input-bytes SIZE``: the cap on the bytes one input may produce (decompressed)."""
    return click.option(
        "--max-input-bytes",
        metavar="SIZE",
        expose_value=False,
        is_eager=True,
        callback=_set_input_limit,
        help="Refuse an input that holds (or gunzips to) more than SIZE bytes, e.g. 8G. Default: 64 GiB, "
        "and for .gz files also 100x the compressed size (gzip bombs).",
    )(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fsdpdoctor")
def main() -> None:
    """Diagnose PyTorch FSDP runs from profiler traces and CUDA memory snapshots."""


def _keep_peak(ctx, _param, value):
    if value is not None:
        ctx.meta["peak_tflops"] = value
    return value


def _keep_budget(ctx, _param, value):
    if value is not None:
        ctx.meta["memory_budget_gib"] = value
    return value


def memory_budget_option(fn):
    """--memory-budget GiB: what memory findings are judged against (analyze, compare, check, memory)."""
    return click.option(
        "--memory-budget",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        expose_value=False,
        callback=_keep_budget,
        metavar="GIB",
        help="Memory per GPU (GiB) the run must fit in; memory findings are warnings only when the peak reserved "
        "comes within 80% of it (default: the GPU's total memory from the traces) or the run ran out of memory.",
    )(fn)


def scale_options(fn):
    """--scheduler, --strict, --cycle, --allow-mixed-runs, --peak-tflops and --memory-budget,
    shared by analyze, compare and check."""
    fn = memory_budget_option(fn)
    fn = click.option(
        "--peak-tflops",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        expose_value=False,
        callback=_keep_peak,
        metavar="TFLOPS",
        help="Dense peak TFLOP/s MFU is measured against (default: the GPU's dense BF16 peak, from the built-in table by device name).",
    )(fn)
    fn = click.option(
        "--allow-mixed-runs",
        is_flag=True,
        help="Analyse traces together even when they look like different runs (world size, device, backend or "
        "NCCL version differ, or they start over an hour apart); by default such inputs are refused (exit 2).",
    )(fn)
    fn = click.option(
        "--cycle",
        type=click.IntRange(0),
        default=None,
        metavar="N",
        help="Profiling cycle to analyse where fsdpdoctor.capture(repeat>1) wrote several (rank0.cycleN.json.gz; default: the last).",
    )(fn)
    fn = click.option(
        "--strict",
        is_flag=True,
        help="Fail (exit 2) on the first rank file that cannot be read, instead of leaving the rank out.",
    )(fn)
    return click.option(
        "--scheduler",
        metavar="ADDRESS",
        default=None,
        help="Run the per-rank analysis on Dask: tcp://HOST:8786 (an existing cluster) or local[:N] "
        "(a LocalCluster of N worker processes). Default: this machine's process pool.",
    )(fn)


def warn_partial(facts) -> None:
    """One warning line on stderr when ranks were left out of the run."""
    if facts.inputs_excluded:
        from fsdpdoctor.analysis.ranks import partial_run_line

        click.echo(f"fsdpdoctor: warning: {partial_run_line(facts)}", err=True)


def _write(text: str | bytes, output: Path | None) -> None:
    """``text`` to ``output`` (stdout when None), ending in a newline."""
    if output is None:
        click.echo(text.decode() if isinstance(text, bytes) else text)  # stdout may be a text stream only
        return
    data = text if isinstance(text, bytes) else text.encode()
    try:
        with output.open("wb") as fh:
            fh.write(data)
            if not data.endswith(b"\n"):
                fh.write(b"\n")
    except OSError as exc:
        raise InputError(output, f"cannot write output ({exc.strerror or exc})") from None


def rule_config(settings: tuple[str, ...] = (), disable: tuple[str, ...] = ()) -> dict:
    """Thresholds from pyproject plus ``--set``, and the rules named by ``--disable``."""
    from fsdpdoctor.config import load_config

    cfg = load_config(list(settings))
    cfg["disable"] = list(cfg.get("disable", [])) + list(disable)
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.meta.get("peak_tflops"):
        cfg["peak_tflops"] = ctx.meta["peak_tflops"]
    if ctx is not None and ctx.meta.get("memory_budget_gib"):
        cfg["memory_budget_gib"] = ctx.meta["memory_budget_gib"]
    return cfg


def render_console(render, output: Path | None, width: int = 110) -> None:
    """Run ``render(console)`` to the terminal, or record it as plain text into ``output``."""
    if output is None:
        render(Console(highlight=False))
        return
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=width, file=sink, highlight=False)
        render(console)
        _write(console.export_text(), output)
