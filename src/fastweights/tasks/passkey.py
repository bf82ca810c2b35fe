"""Passkey retrieval (docs/maths.md 5.6): a random 5-digit number hidden in repeated filler text at
a chosen depth, asked for at the end (text: tokenise with ``ByteTokenizer``, or word level with
``passkey_word_ids``); and ``token_passkey``, a synthetic single key-value needle among filler ids."""

from __future__ import annotations

import re

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


def token_passkey_vocab(n_filler: int = 32, n_keys: int = 64, n_values: int = 64) -> int:
    """The vocabulary size of ``token_passkey``: filler ids, then key ids, then value ids."""
    return n_filler + n_keys + n_values


def token_passkey(n_segments: int, segment_len: int, batch: int, generator: torch.Generator, *,
                  depth: float | None = None, n_filler: int = 32, n_keys: int = 64,
                  n_values: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A token-level passkey batch: ``(ids [batch, n_segments * segment_len], answers [batch])``.

    Each sequence is random filler ids (``0 .. n_filler-1``) with one needle, a key id then a
    value id, at the start of one of the segments before the last; its last token is the key
    again and the answer is the value (chance 1 / ``n_values``). The needle's segment is uniform
    over the earlier segments, or ``round(depth * (n_segments - 2))`` for a ``depth`` in [0, 1]
    (0: the first segment, 1: the one just before the last), so a model that sees only the
    current segment cannot answer."""
    for name, value, low in (("n_segments", n_segments, 2), ("segment_len", segment_len, 3),
                             ("batch", batch, 1), ("n_filler", n_filler, 1), ("n_keys", n_keys, 1),
                             ("n_values", n_values, 1)):
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if depth is not None and (not is_number(depth) or not 0.0 <= depth <= 1.0):
        raise ValueError(f"depth must be None or a number in [0, 1], got {depth!r}")
    T = n_segments * segment_len
    ids = torch.randint(0, n_filler, (batch, T), generator=generator)
    keys = torch.randint(n_filler, n_filler + n_keys, (batch,), generator=generator)
    answers = torch.randint(n_filler + n_keys, n_filler + n_keys + n_values, (batch,), generator=generator)
    if depth is None:
        segment = torch.randint(0, n_segments - 1, (batch,), generator=generator)
    else:
        segment = torch.full((batch,), round(depth * (n_segments - 2)))
    rows, at = torch.arange(batch), segment * segment_len
    ids[rows, at] = keys
    ids[rows, at + 1] = answers
    ids[:, -1] = keys
    return ids, answers


def _words(text: str) -> list[str]:
    """Words, single digits and the marks . and ? of the passkey text, in order."""
    return re.findall(r"[A-Za-z]+|[0-9]|[.?]", text)


# The word-level vocabulary of passkey_prompt's text: every word of the filler, the needle and
# the question, the ten digits, "." and "?".
PASSKEY_WORDS = tuple(sorted(set(_words(FILLER + QUESTION + "The pass key is . Remember it . is the "
                                        "pass key .") + [str(d) for d in range(10)])))


def passkey_word_ids(n_filler: int, depth: float, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """``passkey_prompt`` at word level: ``(prompt ids, answer ids)``, ids into
    ``PASSKEY_WORDS``; the 5 digits of the key are 5 tokens (of the answer too)."""
    prompt, answer = passkey_prompt(n_filler, depth, generator)
    index = {w: i for i, w in enumerate(PASSKEY_WORDS)}
    return [index[w] for w in _words(prompt)], [index[w] for w in answer]
