"""``fastweights mixers``: the registered mixers, their options and state sizes."""

from __future__ import annotations

import argparse

from .._commands import positive_int, user_errors

NAME = "mixers"
DESCRIPTION = ("One line per registered mixer: the floats of recurrent state it keeps per "
               "sequence after --seq-len tokens, and its options with their defaults.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=1024, help="context length for state_size")


def run(args: argparse.Namespace) -> int:
    from ..models.registry import build_mixer, mixer_names, mixer_options

    for name in mixer_names():
        with user_errors((TypeError, ValueError), prefix="--d-model/--n-heads: "):
            layer = build_mixer(name, args.d_model, args.n_heads)
        opts = ", ".join(f"{k}={v!r}" for k, v in mixer_options(name).items())
        print(f"{name:<11} state floats/seq {layer.state_size(args.seq_len):>9}  options: {opts}")
    return 0

