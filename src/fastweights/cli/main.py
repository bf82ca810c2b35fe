"""``main``: the parser of every subcommand, one-line errors and exit codes, signals.

Every subcommand is a module of this package with the same four names: ``NAME``,
``DESCRIPTION`` (its own ``--help``), ``add_arguments(parser)`` and ``run(args) -> exit code``,
and a line in ``COMMANDS`` (its line in ``fastweights --help``). A subcommand's module imports
nothing heavy at module level (its work's modules inside the functions that need them), so that
every ``--help`` answers without importing torch. A ``UserError`` raised anywhere becomes one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from .. import reproduce
from .._commands import HelpFormatter, LazyParser, Parser, UserError

# The subcommands, in the order ``fastweights --help`` lists them, with its line for each. Each
# is the module of this package of that name, defining ``NAME``, ``DESCRIPTION``,
# ``add_arguments(parser)`` and ``run(args) -> exit code``, imported only when it is used.
COMMANDS = {
    "mixers": "list the registered mixers, their options and state sizes",
    "bench": "time, memory and FLOP rate of every mixer (and op) vs T; or one focused benchmark",
    "recall": "memory capacity / update experiment on synthetic retrieval (docs/maths.md 1.8)",
    "reproduce": f"reproduce a paper's claims ({', '.join(reproduce.NAMES)})",
    "train": "train a language model on a corpus (bytes, or token ids)",
    "eval": "validation perplexity of a checkpoint",
    "generate": "continue a text prompt with a checkpoint",
    "export": "torch.export (.pt2) / ONNX program of a checkpoint",
}


def _fill_command(name: str, parser: argparse.ArgumentParser) -> None:
    """A subcommand's parser, from its module (imported now)."""
    module = importlib.import_module(f"{__package__}.{name}")
    parser.description = module.DESCRIPTION
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    """The ``fastweights`` parser: the subcommands are listed, and a subcommand's module (and so
    torch, if it needs it) is imported only when it parses (``LazyParser``), so that
    ``fastweights --help`` and ``fastweights COMMAND --help`` answer at once."""
    parser = Parser(
        prog="fastweights", description="Linear-complexity sequence mixers: experiments and tools.",
        formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=LazyParser)
    for name, help_line in COMMANDS.items():
        sub.add_parser(name, help=help_line, formatter_class=HelpFormatter,
                       fill=functools.partial(_fill_command, name))
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that it unwinds the same way (finally
    blocks run, nothing half-written is left) and ends the command with one line, exit 143."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _quit_now(signum: int, frame: object) -> None:
    """Start-up (importing torch): exit at once with one line. An exception raised here could be
    swallowed by an extension's import (torch probes numpy and clears any error), leaving a
    half-imported module behind, and nothing is written yet that a clean unwind would protect."""
    word = b"terminated" if signum == signal.SIGTERM else b"interrupted"
    os.write(sys.stderr.fileno(), b"fastweights: " + word + b"\n")
    os._exit(128 + signum)


def _handle_signals(on_int: Callable | int, on_term: Callable | int) -> None:
    """Set the SIGINT and SIGTERM handlers (only the main thread can; elsewhere nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_int)
        signal.signal(signal.SIGTERM, on_term)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; its exit code. Ctrl-C (SIGINT) ends it with one line and exit code 130,
    SIGTERM with 143 (``train`` saves a checkpoint first, see fastweights.train.trainer). The
    caller's signal handlers are restored on return."""
    previous = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    try:
        return _main(argv)
    finally:
        _handle_signals(*(signal.SIG_DFL if h is None else h for h in previous))


def _main(argv: Sequence[str] | None) -> int:
    prog = "fastweights"  # then "fastweights COMMAND" in messages once the command is known
    _handle_signals(_quit_now, _quit_now)
    try:
        # Parsing imports the subcommand named (and --help ends here, without torch); then
        # torch, which every command's work needs (seconds), still under the quit-now handler.
        args = build_parser().parse_args(argv)
        prog = f"fastweights {args.command}"
        importlib.import_module("torch")
        # From here a signal unwinds as an exception (finally blocks run), and the default
        # SIGTERM, which would kill silently, ends the command as Ctrl-C does.
        _handle_signals(signal.default_int_handler, _raise_terminated)
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (Terminated), before any work to save
        terminated = isinstance(err, Terminated)
        print(f"{prog}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:  # e.g. `fastweights mixers | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0
