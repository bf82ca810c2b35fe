"""The input checks of ``FastWeightsForCausalLM.forward``: what a call asks, checked once.

``check_call`` reads the keywords that shape a forward (the cache, the flags, the mask, the
positions) and returns a ``Call``; a keyword the model cannot honour is refused here with an
error naming it, before any computation. Packed documents are ``packing.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._checks import is_int
from .cache import FastWeightsCache
from .config import FastWeightsConfig


@dataclass
class Call:
    """A checked forward call on ``input_ids`` [B, T]: the cache it continues (``past`` tokens
    seen; a fresh one when none was passed), the output it asks for (``use_cache``,
    ``return_dict``, the time index ``keep`` of the logits returned, the hidden states kept) and
    every row's left and right pad lengths ([B] long, on the CPU)."""

    B: int
    T: int
    cache: FastWeightsCache
    past: int
    use_cache: bool
    asked_cache: bool | None  # use_cache as passed (None: the config's), for messages
    config_use_cache: bool
    carries_cache: bool  # a cache was passed in
    return_dict: bool
    keep: slice | torch.Tensor
    hidden_keep: bool | set[int] | None
    pads: torch.Tensor
    right: torch.Tensor


def check_call(config: FastWeightsConfig, input_ids: Any, cache: Any, *,
               attention_mask: Any, position_ids: Any, inputs_embeds: Any, use_cache: Any,
               output_attentions: Any, output_hidden_states: Any, return_dict: Any,
               cache_position: Any, logits_to_keep: Any) -> Call:
    """The checked ``Call`` of a forward (see ``FastWeightsForCausalLM.forward``)."""
    if inputs_embeds is not None:
        raise ValueError("inputs_embeds is not supported; pass input_ids")
    # unset output_* flags take the config's, as transformers' models do
    if output_attentions is None:
        output_attentions = getattr(config, "output_attentions", False)
    if output_hidden_states is None:
        output_hidden_states = getattr(config, "output_hidden_states", False)
    if output_attentions:
        raise ValueError("output_attentions=True is not supported: fastweights mixers keep "
                         "no attention weights to return")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, T] tensor, got {describe(input_ids)}")
    B, T = input_ids.shape
    keep = _check_logits_to_keep(logits_to_keep, T)
    hidden_keep = _hidden_selection(output_hidden_states, config.num_hidden_layers + 1)
    if cache is not None and not isinstance(cache, FastWeightsCache):
        raise TypeError(
            "cache (past_key_values) must be a FastWeightsCache (as returned by this model), "
            f"got {type(cache).__name__}")
    carries_cache = cache is not None
    cache = cache if carries_cache else FastWeightsCache()
    past = cache.get_seq_length()
    if cache.groups and cache.batch_size != B:
        raise ValueError(f"input_ids has batch {B} but the cache holds {cache.batch_size} rows")
    if cache_position is not None and not (
            isinstance(cache_position, torch.Tensor) and cache_position.shape == (T,)
            and torch.equal(cache_position.cpu(), torch.arange(past, past + T))):
        raise ValueError(f"cache_position must be arange({past}, {past + T}) (the positions "
                         f"after the {past} the cache has seen), got {describe(cache_position)}")
    pads, right = _check_mask(attention_mask, B, T, past)
    if position_ids is not None and (
            not isinstance(position_ids, torch.Tensor) or position_ids.shape != (B, T)
            or position_ids.dtype.is_floating_point):
        raise ValueError(f"position_ids must be an integer tensor [B, T] = [{B}, {T}], "
                         f"got {describe(position_ids)}")
    return Call(B, T, cache, past, config.use_cache if use_cache is None else use_cache,
                use_cache, config.use_cache, carries_cache,
                config.return_dict if return_dict is None else return_dict, keep, hidden_keep,
                pads, right)


def _check_mask(attention_mask: Any, B: int, T: int, past: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's left and right pad lengths ([B] long, CPU; zeros without a mask)."""
    if attention_mask is None:
        zeros = torch.zeros(B, dtype=torch.long)
        return zeros, zeros
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, past + T):
        raise ValueError(f"attention_mask must have shape [B, past + T] = [{B}, {past + T}], "
                         f"got {describe(attention_mask)}")
    pads, right = (p.cpu() for p in _pad_lengths(attention_mask, T))
    if past and (pads.any() or right.any()):
        raise ValueError("attention_mask pads a position after the prefill; only left "
                         "padding of the first forward is supported")
    return pads, right


def _pad_lengths(attention_mask: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left and right pad lengths of every row ([B] each, of the last T positions), after
    checking that the mask is 0/1 with the tokens of each row contiguous (no hole)."""
    m = attention_mask
    if not ((m == 0) | (m == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    m = m.long()
    runs = (m[:, 1:] > m[:, :-1]).sum(dim=1) + m[:, 0]  # runs of ones per row
    if (runs > 1).any():
        raise ValueError("attention_mask has a 0 between two 1s: only left padding (and right "
                         "padding in forwards without a cache) is supported")
    m = m[:, -T:]
    if (m.sum(dim=1) == 0).any():
        raise ValueError("attention_mask has a row with no token (all padding)")
    left = m.cumsum(dim=1).eq(0).sum(dim=1)
    right = m.flip(1).cumsum(dim=1).eq(0).sum(dim=1)
    return left, right


def _check_logits_to_keep(logits_to_keep: Any, T: int) -> slice | torch.Tensor:
    """The time index of the logits returned: the last ``n`` (0 = all) or the given positions."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1 \
            and not logits_to_keep.dtype.is_floating_point:
        return logits_to_keep
    if not is_int(logits_to_keep) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be an int >= 0 (0 = all) or a 1-D tensor of "
                         f"positions, got {logits_to_keep!r}")
    return slice(-logits_to_keep if logits_to_keep else 0, None)


def _hidden_selection(output_hidden_states: Any, n: int) -> bool | set[int] | None:
    """None (no hidden states), True (all ``n``) or the indices selected by an int or a list
    of ints (negative ones count from the end), as transformers 5 reads the argument."""
    if output_hidden_states is None or output_hidden_states is False:
        return None
    if output_hidden_states is True:
        return True
    chosen = [output_hidden_states] if isinstance(output_hidden_states, int) else output_hidden_states
    if not isinstance(chosen, (list, tuple)) or any(
            not is_int(i) or not -n <= i < n for i in chosen):
        raise ValueError(f"output_hidden_states must be a bool, or an int or list of ints in "
                         f"[-{n}, {n}) selecting hidden states, got {output_hidden_states!r}")
    return {i % n for i in chosen}


def describe(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
