"""The ``fastweights`` command (also ``python -m fastweights``).

Each subcommand lives in a function ``_cmd_<name>`` registered in ``COMMANDS``; a ``UserError``
raised anywhere becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
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


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.commands import cmd_train

    return cmd_train(args)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a byte-level language model on a corpus",
        description="Train a LanguageModel on bytes of --data (default: this Python's standard "
        "library source). Writes run.json, metrics.csv and atomic checkpoints "
        "(checkpoints/step-N, checkpoints/latest) into --out. Under torchrun, --batch-size is the "
        "global batch, split across processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mixer", default="delta",
                   help="one registered mixer for every layer, or a comma-separated list with one per "
                   "layer; options as name:opt=value (e.g. delta:chunk_size=32)")
    p.add_argument("--data", default="stdlib", help="'stdlib' or a text file or folder")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default 300; with "
                   "--resume, the saved run's unless given)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--ffn", default="mlp", choices=["mlp", "glu", "none"])
    p.add_argument("--glu-activation", default="silu", choices=["silu", "gelu", "identity"],
                   help="the GLU's activation with --ffn glu (identity: TransNormer's published models)")
    p.add_argument("--norm", default="rmsnorm", choices=["rmsnorm", "layernorm", "srmsnorm"],
                   help="pre-norm of every block (srmsnorm: TransNormer's, no gain)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest sequence the model accepts (mixers with absolute position tables)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps before cosine decay")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows of --seq-len")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint period (0: only at the end)")
    p.add_argument("--patience", type=int, default=0,
                   help="stop after this many validations without a new best (0: never)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--anomaly-guard", action="store_true",
                   help="stop with an error when the loss or gradient norm becomes NaN or inf, "
                   "before that step changes the weights (the last good checkpoint is kept)")
    p.add_argument("--pack", action="store_true",
                   help="pack each batch into one row with the state reset at document (file) "
                        "boundaries (cu_seqlens), no padding and no prediction across documents")
    p.add_argument("--recompute", action="store_true",
                   help="gradient checkpointing: keep only each block's input and recompute its "
                        "activations in the backward pass (less memory, about one more forward)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train", help="run folder")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint (the newest older one "
                   "that verifies if it is damaged; step 0 if none was saved yet)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train)


def _cmd_eval(args: argparse.Namespace) -> int:
    from .train.commands import cmd_eval

    return cmd_eval(args)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="validation perplexity of a checkpoint",
        description="Next-byte loss, perplexity and bits per byte of a checkpoint on the validation "
        "split of --data, printed as one JSON line.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--data", default="stdlib", help="'stdlib' or a text file or folder")
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


def _cmd_export(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from .models import export as ex
    from .train.checkpoint import load_model

    out = Path(args.out)
    onnx = Path(args.onnx) if args.onnx else None
    if args.seq_len < 1 or args.batch_size < 1:
        raise UserError("--seq-len and --batch-size must be >= 1")
    if args.multiple < 1:
        raise UserError(f"--multiple must be >= 1, got {args.multiple}")
    if onnx is not None and not args.step:
        raise UserError("--onnx is supported for the decoding step only: add --step")
    for flag, path in (("--out", out), ("--onnx", onnx)):
        if path is not None and path.exists() and not args.overwrite:
            raise UserError(f"{flag} {path} already exists (add --overwrite to replace it)")
    try:
        model = load_model(args.checkpoint)
    except ValueError as err:
        raise UserError(str(err)) from None
    ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    meta = {"checkpoint": str(args.checkpoint), "step": args.step, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "dynamic": args.dynamic}
    try:
        if args.step:
            with torch.no_grad():
                _, state = model(ids)
            tensors, layout = ex.flatten_state(state)
            step = ex.export_step(model, state, ids[:, :1], dynamic=args.dynamic)
            program = step.program
            meta.update(json.loads(ex.layout_json(layout, tensors)), reusable=step.reusable)
        else:
            program = ex.export_forward(model, ids, dynamic=args.dynamic, multiple=args.multiple)
        if onnx is not None:
            make_folder(onnx.parent, "--onnx")
            ex.export_step_onnx(model, state, ids[:, :1], str(onnx), dynamic=args.dynamic)
    except ImportError as err:
        raise UserError(f"{err.name or err} is not installed (pip install onnx onnxscript)") from None
    except Exception as err:  # noqa: BLE001 - torch.export raises many kinds; one line for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = " (try without --dynamic)" if args.dynamic else ""
        raise UserError(f"cannot export this model{hint}: {type(err).__name__}: {first}") from None
    make_folder(out.parent)
    torch.export.save(program, str(out), extra_files={"fastweights.json": json.dumps(meta)})
    what = "decoding step" if args.step else "forward"
    print(f"wrote {out} ({what}, {'dynamic' if args.dynamic else 'static'} shapes)"
          + (f" and {onnx}" if onnx else "")
          + ("" if not args.step or meta["reusable"] else
             "; this mixer's state holds a position, so the program serves this position only"))
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="torch.export (.pt2) / ONNX program of a checkpoint",
        description="Export a checkpoint's forward (input_ids [B, T] -> logits, state tensors) or "
        "its one-token decoding step (input_ids [B, 1], state tensors -> logits, state tensors) "
        "with torch.export, saved by torch.export.save; the step also as ONNX.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder or a training run folder")
    p.add_argument("--out", default="model.pt2", help="the .pt2 file written")
    p.add_argument("--onnx", default=None, help="also write the decoding step as ONNX (with --step)")
    p.add_argument("--step", action="store_true",
                   help="export the decoding step from the state after --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=64,
                   help="T traced for the forward; prompt length before the step")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dynamic", action="store_true",
                   help="dynamic T (forward) or dynamic cache lengths (step), where the mixer allows")
    p.add_argument("--multiple", type=int, default=1,
                   help="with --dynamic forward: T is any multiple of this (diag: its block size)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.set_defaults(func=_cmd_export)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_mixers, _add_bench, _add_recall, _add_train, _add_eval, _add_generate,
    _add_export,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fastweights", description="Linear-complexity sequence mixers: experiments and tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UserError as err:
        print(f"fastweights: error: {err}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"fastweights {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fastweights {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `fastweights mixers | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0
