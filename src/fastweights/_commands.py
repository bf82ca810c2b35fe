"""What every command shares, the ``fastweights`` subcommands (cli/) and the benchmarks
(bench/): user errors (one line, exit 2), the parser and help format, number and
mixer-specification parsing, and output-folder handling.

Imports no torch: ``main`` imports this module before it can handle a Ctrl-C during start-up.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

CACHE_FOLDER = ".fastweights-cache"  # --token-cache's default folder name (train, eval)


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 2."""


@contextmanager
def user_errors(kinds: tuple[type[Exception], ...] = (ValueError,), prefix: str = "") -> Iterator[None]:
    """Inside, an exception of ``kinds`` (raised by the library for a bad setting or file)
    becomes a UserError with the same message after ``prefix``."""
    try:
        yield
    except kinds as err:
        raise UserError(f"{prefix}{err}") from None


class Parser(argparse.ArgumentParser):
    """argparse's own errors (bad int, unknown choice) become a UserError too, so they are one
    line on stderr and exit code 2 rather than the usage block and SystemExit."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


class LazyParser(Parser):
    """A subcommand's parser whose arguments are added by ``fill(parser)`` the first time it
    parses or formats its help: building the command line imports no subcommand, and running
    one imports only that one."""

    def __init__(self, *args: Any, fill: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fill = fill

    def filled(self) -> LazyParser:
        """This parser with its arguments added (now, the first time)."""
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill(self)
        return self

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return super(LazyParser, self.filled()).parse_known_args(args, namespace)

    def format_help(self) -> str:
        return super(LazyParser, self.filled()).format_help()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: ...)`` after every option's help, except where the default is None (the
    option's help says what leaving it out means) or False (a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    # Names such as long-context stay whole: textwrap would break them at the hyphen.
    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def positive_int(text: str) -> int:
    """argparse ``type`` of an option that takes a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type`` of an option that takes a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def parse_int_list(flag: str, text: str) -> list[int]:
    """``"20,40,60"`` -> [20, 40, 60], every item a positive int; else a UserError naming
    ``flag``."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} must be comma-separated positive integers, got {text!r}")
    return values


def parse_name_list(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``"fwd,step"`` -> ("fwd", "step"), every item one of ``allowed``; else a UserError naming
    ``flag`` and the allowed names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in allowed for n in names):
        raise UserError(f"{flag} must be some of {', '.join(allowed)}, got {text!r}")
    return names


def _option_value(text: str) -> Any:
    """A mixer option's value as written in a spec: ``true``/``false``/``none`` (any case),
    ints, floats, else the string itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_mixer_spec(flag: str, spec: str) -> tuple[str, dict[str, Any]]:
    """A mixer specification, ``name`` or ``name:opt=value:opt=value``: ``"dpfp:nu=2"`` ->
    ``("dpfp", {"nu": 2})``; a malformed one is a UserError naming ``flag``. Names and options
    are checked by ``build_mixer``/``check_mixer``, not here."""
    name, *opts = spec.strip().split(":")
    if not name:
        raise UserError(f"{flag}: empty mixer name in {spec!r}")
    options: dict[str, Any] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or not key:
            raise UserError(f"{flag}: mixer option {opt!r} in {spec!r} must look like name=value")
        options[key.strip()] = _option_value(value.strip())
    return name, options


def parse_mixer_list(flag: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """Comma-separated mixer specifications (``dpfp:nu=2,favor:m=128``), in order."""
    specs = [s for s in text.split(",") if s.strip()]
    if not specs:
        raise UserError(f"{flag}: no mixer given in {text!r}")
    return [parse_mixer_spec(flag, s) for s in specs]


def recorded_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's own settings, in its options' order, as its results record them (paths as
    strings)."""
    return {k: str(v) if isinstance(v, Path) else v
            for k, v in ((k, getattr(args, k)) for k in args.settings)}


def command_line(prefix: list[str], args: argparse.Namespace) -> str:
    """The command that repeats a benchmark's run: ``prefix`` and every setting given a value
    (``--flag`` for a flag that is on), shell-quoted."""
    parts = list(prefix)
    for key, value in recorded_settings(args).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not None and value is not False:
            parts += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return " ".join(shlex.quote(p) for p in parts)


def make_folder(path: Path, flag: str = "--out") -> None:
    """Create the output folder ``path`` (and its parents) or raise a UserError naming ``flag``
    and the reason (a parent that is a file, no permission, a read-only file system)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserError(f"{flag} {path}: cannot create this folder ({reason})") from None


@contextmanager
def new_folder(path: Path, flag: str = "--out") -> Iterator[None]:
    """Make folder ``path`` (``make_folder``) for the body to write into; if the body fails,
    remove the folders this made, deepest first and only while empty: a refused or failed
    command leaves no folder behind, and nothing written there is deleted."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    make_folder(path, flag)
    try:
        yield
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): keep it and its parents
                break
        raise


def check_creatable(path: Path, flag: str = "--out") -> None:
    """Refuse, with a UserError naming ``flag`` and the reason, a folder ``path`` that cannot be
    created or written: an existing file, or a nearest existing parent that is a file, not
    writable or on a read-only file system. Creates nothing: a command checks its output folder
    with this before its other checks and the work, and makes it (``make_folder``) only when it
    writes."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} exists and is not a folder")
    parent = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    reason = None
    if not parent.is_dir():
        reason = "Not a directory"
    elif hasattr(os, "statvfs") and os.statvfs(parent).f_flag & os.ST_RDONLY:
        reason = "Read-only file system"
    elif not os.access(parent, os.W_OK | os.X_OK):
        reason = "Permission denied"
    if reason is not None:
        what = "write into" if parent == path.absolute() else "create"
        raise UserError(f"{flag} {path}: cannot {what} this folder ({reason})")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, or a non-empty folder unless ``overwrite``; changes
    nothing."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} already holds results of an earlier run; "
                        "pass --overwrite or choose another folder")


def prepare_out(out: Path, overwrite: bool, outputs: tuple[str, ...]) -> None:
    """Create ``out`` (``check_out`` first); with ``overwrite`` an earlier run's ``outputs``
    (the files and folders the command writes) are deleted, never anything else a mistyped
    ``--out`` might hold. Call it once everything else is validated."""
    check_out(out, overwrite)
    for name in outputs if overwrite else ():
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    make_folder(out)
