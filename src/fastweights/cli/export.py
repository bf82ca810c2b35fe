"""``fastweights export``: a checkpoint's forward or one-token decoding step as a torch.export
program (.pt2), the step also as ONNX."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .._commands import UserError, check_creatable, new_folder, positive_int, user_errors
from .eval import own_tokenizer, run_record

NAME = "export"
DESCRIPTION = ("Export a checkpoint's forward (input_ids [B, T] -> logits, state tensors) or its "
               "one-token decoding step (input_ids [B, 1], state tensors -> logits, state tensors) "
               "with torch.export, saved by torch.export.save; the step also as ONNX. With "
               "--consolidate, write the checkpoint's model as one single-file checkpoint folder "
               "instead (a sharded --fsdp checkpoint included), which native_to_hf reads, carrying the "
               "tokenizer of a run on tokenized text for eval and generate.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder or a training run folder")
    p.add_argument("--out", default="model.pt2", help="the .pt2 file written")
    p.add_argument("--onnx", default=None, help="also write the decoding step as ONNX (with --step)")
    p.add_argument("--step", action="store_true",
                   help="export the decoding step from the state after --seq-len tokens")
    p.add_argument("--seq-len", type=positive_int, default=64,
                   help="T traced for the forward; prompt length before the step")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--dynamic", action="store_true",
                   help="dynamic T (forward) or dynamic cache lengths (step), where the mixer allows")
    p.add_argument("--multiple", type=positive_int, default=1,
                   help="with --dynamic forward: T is any multiple of this (diag: its block size)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--consolidate", action="store_true",
                   help="write the model as a single-file checkpoint folder --out (config.json, "
                   "model.safetensors, checksums.json), e.g. of a sharded --fsdp checkpoint")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="with --consolidate: the tokenizer the folder carries (tokenizer.json or "
                   "tokenizer/), which eval and generate then use (default: the run's, or the "
                   "one the checkpoint folder carries; a run's own must be this one)")


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import state_tree
    from ..models import export as ex
    from ..train.checkpoint import load_model

    out = Path(args.out)
    if args.consolidate:
        unused = [flag for flag, given in (("--step", args.step), ("--onnx", args.onnx),
                                           ("--dynamic", args.dynamic),
                                           ("--overwrite", args.overwrite)) if given]
        if unused:
            raise UserError(f"--consolidate writes a new checkpoint folder, not a program: "
                            f"{', '.join(unused)} does not apply")
        return _consolidate(args.checkpoint, out, args.tokenizer)
    if args.tokenizer is not None:
        raise UserError("--tokenizer is for --consolidate: a .pt2 program carries no tokenizer")
    onnx = Path(args.onnx) if args.onnx else None
    if onnx is not None and not args.step:
        raise UserError("--onnx is supported for the decoding step only: add --step")
    for flag, path in (("--out", out), ("--onnx", onnx)):
        if path is not None and path.exists() and not args.overwrite:
            raise UserError(f"{flag} {path} already exists (add --overwrite to replace it)")
        if path is not None:
            check_creatable(path.parent, flag)
    with user_errors():
        model = load_model(args.checkpoint)
    ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    meta = {"checkpoint": str(args.checkpoint), "step": args.step, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "dynamic": args.dynamic}
    try:
        if args.step:
            with torch.no_grad():
                _, state = model(ids)
            tensors, layout = state_tree.flatten(state)
            step = ex.export_step(model, state, ids[:, :1], dynamic=args.dynamic)
            program = step.program
            meta.update(json.loads(ex.layout_json(layout, tensors)), reusable=step.reusable)
        else:
            program = ex.export_forward(model, ids, dynamic=args.dynamic, multiple=args.multiple)
        if onnx is not None:
            with new_folder(onnx.parent, "--onnx"):
                ex.export_step_onnx(model, state, ids[:, :1], str(onnx), dynamic=args.dynamic)
    except ImportError as err:
        raise UserError(f"{err.name or err} is not installed (pip install onnx onnxscript)") from None
    except UserError:
        raise
    except Exception as err:  # torch.export raises many kinds: one line for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = " (try without --dynamic)" if args.dynamic else ""
        raise UserError(f"cannot export this model{hint}: {type(err).__name__}: {first}") from None
    with new_folder(out.parent):
        torch.export.save(program, str(out), extra_files={"fastweights.json": json.dumps(meta)})
    what = "decoding step" if args.step else "forward"
    print(f"wrote {out} ({what}, {'dynamic' if args.dynamic else 'static'} shapes)"
          + (f" and {onnx}" if onnx else "")
          + ("" if not args.step or meta["reusable"] else
             "; this mixer's state holds a position, so the program serves this position only"))
    return 0


def _consolidate(checkpoint: str, out: Path, tokenizer: str | None) -> int:
    """``--consolidate``: the checkpoint's model written whole into the new folder ``out``, with
    the tokenizer its ids come from (``own_tokenizer``), if any."""
    from ..train.checkpoint import consolidate_checkpoint

    if out.exists():
        raise UserError(f"--out {out} already exists: --consolidate writes a new folder")
    check_creatable(out.parent)
    tokenizer = own_tokenizer(checkpoint, run_record(checkpoint), tokenizer)
    with new_folder(out.parent), user_errors((ValueError, OSError)):
        consolidate_checkpoint(checkpoint, out, tokenizer)
    print(f"wrote {out} (single-file checkpoint of {checkpoint}"
          + (f", carrying tokenizer {tokenizer})" if tokenizer else ")"))
    return 0
