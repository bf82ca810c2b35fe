"""The ``fastweights`` command (also ``python -m fastweights``).

Each subcommand lives in a function ``_cmd_<name>`` registered in ``COMMANDS``; a ``UserError``
raised anywhere becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 2."""


def make_folder(path: Path, flag: str = "--out") -> None:
    """Create the output folder ``path`` (and its parents) or raise a UserError naming ``flag``
    and the reason (a parent that is a file, no permission, a read-only file system)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserError(f"{flag} {path}: cannot create this folder ({reason})") from None


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (bad int, unknown choice) become a UserError too, so they are one
    line on stderr and exit code 2 rather than the usage block and SystemExit."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def _cmd_mixers(args: argparse.Namespace) -> int:
    from .models.registry import build_mixer, mixer_names, mixer_options

    if args.seq_len < 1:
        raise UserError(f"--seq-len must be >= 1, got {args.seq_len}")
    for name in mixer_names():
        try:
            layer = build_mixer(name, args.d_model, args.n_heads)
        except (TypeError, ValueError) as err:
            raise UserError(f"--d-model/--n-heads: {err}") from None
        opts = ", ".join(f"{k}={v!r}" for k, v in mixer_options(name).items())
        print(f"{name:<11} state floats/seq {layer.state_size(args.seq_len):>9}  options: {opts}")
    return 0


def _add_mixers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mixers", help="list the registered mixers, their options and state sizes")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024, help="context length for state_size")
    p.set_defaults(func=_cmd_mixers)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench.command import add_arguments, run

    p = sub.add_parser("bench", help="time, memory and FLOP rate of every mixer (and op) vs T")
    add_arguments(p)
    p.set_defaults(func=run)


def _cmd_recall(args: argparse.Namespace) -> int:
    from .train.commands import cmd_recall

    return cmd_recall(args)


def _add_recall(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "recall", help="memory capacity / update experiment on synthetic retrieval (SPEC 1.8)",
        description="Train one model per (task, mixer, size) on the fast weight paper's synthetic "
        "retrieval (capacity = setting 1, update = setting 2) or on MQAR, and write results.csv "
        "and results.png (final eval loss vs size). The defaults show the paper's headline in a "
        "few minutes on a laptop CPU: sum-rule linear attention fails once the number of keys "
        "exceeds its feature size d_key, DPFP doubles that, and only the delta rule keeps the "
        "latest value when keys are re-assigned.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", default="capacity,update",
                   help="comma-separated: capacity, update (retrieval model) and/or mqar (small LM)")
    p.add_argument("--mixers", default=None,
                   help="comma-separated; capacity/update: linear, dpfp, favor, delta, softmax; mqar: "
                   "registered mixer names; options as name:opt=value, e.g. dpfp:nu=2, favor:m=128, "
                   "delta:feature_map=dpfp (default per task: capacity linear,dpfp; update "
                   "linear,delta; mqar softmax,linear,delta)")
    p.add_argument("--sizes", default="8,16,32", help="numbers of keys S (mqar: key-value pairs)")
    p.add_argument("--d-key", type=int, default=16, help="key size of the memory (mqar: d_model)")
    p.add_argument("--steps", type=int, default=1500, help="maximum training steps per model")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="runs/recall", help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_recall)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from .reproduce import ReproduceError
    from .reproduce.command import run

    try:
        return run(args)
    except ReproduceError as err:
        raise UserError(str(err)) from None


def _add_reproduce(sub: argparse._SubParsersAction) -> None:
    from .reproduce.command import add_arguments

    p = sub.add_parser(
        "reproduce", help="reproduce a paper's claims (fwp-recall, fwp-lm, ttt-ablation, long-context)",
        description="Train the small models an experiment needs and write results.csv, results.md "
        "(each claim: the paper, ours as mean +- sd over seeds, a verdict) and PNG plots into "
        "--out. Rerunning the same command continues an interrupted reproduction.")
    add_arguments(p)
    p.set_defaults(func=_cmd_reproduce)


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.commands import cmd_train

    return cmd_train(args)


class _SettingsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: ...)`` for every option except the run settings, whose argparse default is
    None (they write their own, see ``_setting``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


# Options of `train` that may differ when a run is resumed (applied and recorded in run.json);
# every other setting is the run's own and an option contradicting it is refused. The same
# list as fastweights.train.trainer.RESUMABLE (a test checks), kept here so that building the
# parser imports no torch.
TRAIN_RESUMABLE = ("steps", "eval_every", "save_every", "keep_last", "patience", "anomaly_guard")


def _setting(p: argparse.ArgumentParser, flag: str, default: object, text: str,
             shown: str | None = None, **kw) -> None:
    """A run setting: its argparse default is None so that ``train --resume`` can tell an option
    given on the command line from one left out (which then comes from run.json); ``default``,
    the value of a new run, is kept in the parser's ``setting_defaults`` and shown in --help
    (as ``shown`` when given)."""
    shown = str(default) if shown is None else shown
    action = p.add_argument(flag, default=None, help=f"{text} (default: {shown})".lstrip(), **kw)
    p.get_default("setting_defaults")[action.dest] = default


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a byte-level language model on a corpus",
        description="Train a LanguageModel on bytes of --data (default: this Python's standard "
        "library source). Writes run.json (every setting of the run), metrics.csv and atomic "
        "checkpoints (checkpoints/step-N, checkpoints/latest) into --out. Under torchrun, "
        "--batch-size is the global batch, split across processes. With --resume every setting "
        "comes from the run's run.json (its data included); of the options, only "
        + ", ".join("--" + d.replace("_", "-") for d in TRAIN_RESUMABLE) + " may change on "
        "resume (the new values are recorded); any other option that contradicts the run is "
        "refused. The learning-rate schedule is a function of the step and --steps, so a run "
        "extended with a larger --steps continues on the schedule of the new total. Ctrl-C "
        "(SIGINT) or SIGTERM saves a checkpoint of the last finished step and exits with 130 or "
        "143; a second signal quits without waiting.",
        formatter_class=_SettingsHelp)
    p.set_defaults(func=_cmd_train, setting_defaults={})
    _setting(p, "--mixer", "delta",
             "one registered mixer for every layer, or a comma-separated list with one per layer; "
             "options as name:opt=value (e.g. delta:chunk_size=32)")
    _setting(p, "--data", "stdlib", "'stdlib' or a text file or folder")
    _setting(p, "--steps", 300, "optimiser steps (with --resume: the run's own unless given)",
             type=int)
    _setting(p, "--seq-len", 128, "", type=int)
    _setting(p, "--batch-size", 16, "global batch size", type=int)
    _setting(p, "--d-model", 128, "", type=int)
    _setting(p, "--n-layers", 2, "", type=int)
    _setting(p, "--n-heads", 4, "", type=int)
    _setting(p, "--ffn", "mlp", "", choices=["mlp", "glu", "none"])
    _setting(p, "--glu-activation", "silu",
             "the GLU's activation with --ffn glu (identity: TransNormer's published models)",
             choices=["silu", "gelu", "identity"])
    _setting(p, "--norm", "rmsnorm", "pre-norm of every block (srmsnorm: TransNormer's, no gain)",
             choices=["rmsnorm", "layernorm", "srmsnorm"])
    _setting(p, "--dropout", 0.0, "", type=float)
    _setting(p, "--max-seq-len", None,
             "longest sequence the model accepts (mixers with absolute position tables)",
             shown="no limit", type=int)
    _setting(p, "--lr", 2e-3, "peak AdamW learning rate", type=float)
    _setting(p, "--warmup", 30, "linear warm-up steps before cosine decay", type=int)
    _setting(p, "--eval-every", 100, "validation period in steps", type=int)
    _setting(p, "--eval-windows", 64, "validation windows of --seq-len", type=int)
    _setting(p, "--save-every", 0, "checkpoint period (0: only at the end)", type=int)
    _setting(p, "--keep-last", None,
             "checkpoint retention: after each save, delete the checkpoints older than the K "
             "newest complete ones (the one checkpoints/latest names is always kept)",
             shown="keep every checkpoint", type=int, metavar="K")
    _setting(p, "--patience", 0, "stop after this many validations without a new best (0: never)",
             type=int)
    _setting(p, "--bf16", False, "bfloat16 autocast", action="store_true")
    _setting(p, "--anomaly-guard", False,
             "stop with an error when the loss or gradient norm becomes NaN or inf, before that "
             "step changes the weights (the last good checkpoint is kept)", action="store_true")
    _setting(p, "--pack", False,
             "pack each batch into one row with the state reset at document (file) boundaries "
             "(cu_seqlens), no padding and no prediction across documents", action="store_true")
    _setting(p, "--recompute", False,
             "gradient checkpointing: keep only each block's input and recompute its activations "
             "in the backward pass (less memory, about one more forward)", action="store_true")
    _setting(p, "--seed", 0, "", type=int)
    p.add_argument("--out", default="runs/train", help="run folder")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint (the newest older one "
                   "that verifies if it is damaged; step 0 if none was saved yet), with the run's "
                   "own settings")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's outputs in --out (only once the new run is "
                   "checked and about to write)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _cmd_eval(args: argparse.Namespace) -> int:
    from .train.commands import cmd_eval

    return cmd_eval(args)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="validation perplexity of a checkpoint",
        description="Next-byte loss, perplexity and bits per byte of a checkpoint on the validation "
        "split of --data (by default the data of the run the checkpoint belongs to), printed as "
        "one JSON line.",
        formatter_class=_SettingsHelp)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--data", default=None,
                   help="'stdlib' or a text file or folder (default: the data run.json of the "
                   "checkpoint's training run names; 'stdlib' for a folder outside a run)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--windows", type=int, default=64, help="number of --seq-len windows evaluated")
    p.add_argument("--carry-state", action="store_true",
                   help="read the windows as one stream, carrying the recurrent state across them")
    p.set_defaults(func=_cmd_eval)


def _cmd_generate(args: argparse.Namespace) -> int:
    from .train.commands import cmd_generate

    return cmd_generate(args)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="continue a text prompt with a checkpoint",
        description="Prefill the prompt, then decode one byte per step from the recurrent state.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_generate)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_mixers, _add_bench, _add_recall, _add_reproduce, _add_train, _add_eval, _add_generate,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fastweights", description="Linear-complexity sequence mixers: experiments and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
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
        parser = build_parser()  # imports torch (seconds)
        # From here a signal unwinds as an exception (finally blocks run), and the default
        # SIGTERM, which would kill silently, ends the command as Ctrl-C does.
        _handle_signals(signal.default_int_handler, _raise_terminated)
        try:
            args = parser.parse_args(argv)
        except UserError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        prog = f"fastweights {args.command}"
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
