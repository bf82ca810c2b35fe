"""Packed documents and right padding in ``FastWeightsForCausalLM.forward``.

Forwards that carry no state (``use_cache=False`` and no cache, as the ``Trainer`` runs them)
also accept right padding (each row runs on its tokens only; causal, so trailing pads could not
have changed them anyway) and packed documents in a batch of one, marked by ``cu_seqlens``, by
FlashAttention's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (with ``max_length_q`` / ``max_length_k``
checked against them), by ``seq_idx``, or by ``position_ids`` restarting at 0 (what
``DataCollatorWithFlattening`` writes): every layer restarts from a fresh state at each
document, so the result equals running the documents one by one, and no document's first token
is a target of the previous one. Neither state could be continued by a later forward, so with a
cache they raise ValueError (generation pads on the left). Packing needs a batch of one (a batch
of several rows with position_ids restarting inside a row is refused, not split); otherwise
``position_ids`` must be the positions the model uses (0, 1, ... from each row's first token,
continuing the cache).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch

from .._checks import check_documents
from .inputs import Call, describe


def document_bounds(call: Call, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                    attention_mask: torch.Tensor | None, max_length_q: Any, max_length_k: Any,
                    **packing: torch.Tensor | None) -> list[int] | None:
    """The document boundaries [0, ..., T] of a packed batch of one, from ``packing``
    (``cu_seqlens``, ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``seq_idx``) or ``position_ids``
    restarting at 0; None for a batch of unpacked rows (whose ``position_ids``, if given, are
    checked against the model's). Refuses packing or right padding in a forward that carries a
    state, and ``max_length_q`` / ``max_length_k`` other than the longest document."""
    B, T, past, pads, right = call.B, call.T, call.past, call.pads, call.right
    given = [name for name, v in packing.items() if v is not None]
    bounds = None
    restarts = (position_ids is not None and B == 1 and not past
                and bool((position_ids[0, 1:] == 0).any()))
    if given or restarts:
        if B != 1 or past or pads.any() or right.any():
            raise ValueError(
                f"packed documents ({', '.join(given) or 'position_ids restarting at 0'}) "
                "need a batch of one without padding or cache (as DataCollatorWithFlattening "
                f"makes), got batch {B}" + (", padding" if pads.any() or right.any() else "")
                + (", a cache" if past else ""))
        bounds = packed_bounds(T, input_ids.device, position_ids=position_ids, **packing)
    elif position_ids is not None:
        expected = (attention_mask.long().cumsum(dim=1) - 1)[:, past:] \
            if attention_mask is not None else torch.arange(past, past + T).expand(B, T)
        _check_positions(position_ids, expected.to(position_ids.device),
                         None if attention_mask is None else attention_mask[:, past:])
    longest = T if bounds is None else max(b - a for a, b in pairwise(bounds))
    for name, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        if value is not None and int(value) != longest:
            raise ValueError(f"{name} is {int(value)} but the longest document has {longest} tokens")

    # Forwards whose state cannot be continued (packed documents, right padding) keep none.
    packed = bounds is not None and len(bounds) > 2
    if (packed or bool(right.any())) and (call.use_cache or call.carries_cache):
        what = "packed documents" if packed else "right padding (a 0 after a 1 in attention_mask)"
        raise ValueError(
            f"{what}: only in forwards that carry no state (use_cache=False, no "
            f"cache, as in training; use_cache is {call.asked_cache}, config.use_cache "
            f"{call.config_use_cache}); for generation, only left padding is supported")
    return bounds


def packed_bounds(T: int, device: torch.device, **sources: Any) -> list[int] | None:
    """The document boundaries [0, ..., T] of a batch of one, from whichever of ``cu_seqlens``,
    ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``seq_idx`` (a [1, T] document index per token) and
    ``position_ids`` ([1, T], restarting at 0 at each document) are given; they must agree.
    None when none is given."""
    found: dict[str, list[int]] = {}
    for name in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k"):
        if sources.get(name) is not None:
            found[name] = list(check_documents(sources[name], T, 1, device).bounds)
    seq_idx = sources.get("seq_idx")
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.shape != (1, T):
            raise ValueError(f"seq_idx must have shape [1, T] = [1, {T}], got {describe(seq_idx)}")
        change = (seq_idx[0, 1:] != seq_idx[0, :-1]).nonzero().flatten() + 1
        found["seq_idx"] = [0, *change.tolist(), T]
    pos = sources.get("position_ids")
    if pos is not None:
        pos = pos[0]
        starts = (pos == 0).nonzero().flatten().tolist()
        bounds = [*starts, T]
        if not starts or starts[0] != 0 or any(
                not torch.equal(pos[a:b].cpu(), torch.arange(b - a)) for a, b in pairwise(bounds)):
            raise ValueError(
                "position_ids must count 0, 1, 2, ... within each document and restart at 0 where "
                "a packed document begins (as DataCollatorWithFlattening writes them)")
        found["position_ids"] = bounds
    if not found:
        return None
    (first, bounds), *rest = found.items()
    for name, other in rest:
        if other != bounds:
            raise ValueError(f"{name} marks documents {other} but {first} marks {bounds}")
    return bounds


def _check_positions(position_ids: torch.Tensor, expected: torch.Tensor,
                     mask: torch.Tensor | None) -> None:
    """position_ids [B, T] must be the positions the model uses (its tokens are numbered from
    the first real token of each row); pad positions are not compared."""
    same = position_ids.to(expected.device) == expected
    if mask is not None:
        same = same | (mask == 0)
    if not bool(same.all()):
        raise ValueError(
            "position_ids disagree with the positions the model uses (0, 1, 2, ... from each "
            "row's first token, continuing the cache); a restart at 0 marks packed documents, "
            "which need a batch of one without padding")
