"""Passkey retrieval (SPEC.md 5.6): a random 5-digit number hidden in repeated filler text at a
chosen depth, asked for at the end. Text in, text out; tokenise with ``ByteTokenizer``."""

from __future__ import annotations

import torch

from .._checks import is_int, is_number

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is "


def passkey_prompt(n_filler: int, depth: float, generator: torch.Generator) -> tuple[str, str]:
    """``(prompt, answer)``: ``n_filler`` repetitions of the filler with the sentence
    "The pass key is NNNNN. Remember it. NNNNN is the pass key." inserted after
    ``round(depth * n_filler)`` of them (depth 0 = start, 1 = end), then the question.
    ``answer`` is the 5 digits."""
    if not is_int(n_filler) or n_filler < 0:
        raise ValueError(f"n_filler must be an int >= 0, got {n_filler!r}")
    if not is_number(depth) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    key = str(int(torch.randint(10000, 100000, (1,), generator=generator)))
    at = round(depth * n_filler)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    prompt = FILLER * at + needle + FILLER * (n_filler - at) + QUESTION
    return prompt, key
