"""Hugging Face ``transformers`` integration (the optional ``[hf]`` extra, transformers 5).

Importing this module registers the model type ``"fastweights"`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so a folder written by ``FastWeightsForCausalLM.save_pretrained`` (or
by ``native_to_hf``) loads with ``AutoModelForCausalLM.from_pretrained(folder)``.

- ``FastWeightsConfig``: a ``PreTrainedConfig`` with exactly the fields of ``LMConfig``
  (generated from them, plus the usual ``use_cache`` and special token ids), validated by
  building the ``LMConfig``.
- ``FastWeightsForCausalLM``: ``PreTrainedModel`` + ``GenerationMixin`` around the native
  ``LanguageModel`` (held as ``self.model``, so every weight name is the native one prefixed by
  ``"model."``); ``forward`` returns ``CausalLMOutputWithPast`` with the loss when ``labels``
  are given and a ``FastWeightsCache`` when ``use_cache``.
- ``FastWeightsCache``: the cache object (``cache``; ``past_key_values`` before transformers
  5.24). It holds each layer's state exactly as
  the layer returns it (fast-weight matrices for recurrent mixers, the KV cache for softmax), so
  ``generate()`` feeds one new token per step, and the memory held per sequence is constant for
  recurrent mixers.
- ``native_to_hf`` / ``hf_to_native``: lossless conversion between the two checkpoint folders.

Left padding. A padded position would still write into a recurrent state, so pads cannot simply
be fed through the layers. With an ``attention_mask`` (zeros = left pads), the first forward
(prefill) runs the rows of each distinct pad length together, each row starting from its first
real token with a fresh state; the rows then carry exactly the state of their unpadded
sequence. If all those states have the same structure (recurrent mixers: same shapes), they are
concatenated and decoding runs the whole batch in one forward per token; otherwise (softmax KV
caches of different lengths) each pad-length group keeps its own state and is decoded by its own
forward. Logits at pad positions are zero and their labels are ignored by the loss.

Right padding and packed documents: forwards that carry no state (``use_cache=False`` and no
cache, as the ``Trainer`` runs them) also accept right padding (each row runs on
its tokens only; causal, so trailing pads could not have changed them anyway) and packed
documents in a batch of one, marked by ``cu_seqlens``, by FlashAttention's ``cu_seq_lens_q`` /
``cu_seq_lens_k`` (with ``max_length_q`` / ``max_length_k`` checked against them), by
``seq_idx``, or by ``position_ids`` restarting at 0 (what ``DataCollatorWithFlattening`` writes):
every layer restarts from a fresh state at each document, so the result equals running the
documents one by one, and no document's first token is a target of the previous one. Neither
state could be continued by a later forward, so with a cache they raise ValueError (generation
pads on the left). Packing needs a batch of one (a batch of several rows with position_ids
restarting inside a row is refused, not split); otherwise ``position_ids`` must be the
positions the model uses (0, 1, ... from each row's first token, continuing the cache).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, Field, field, fields, make_dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from . import state_tree
from ._checks import is_int
from ._files import CONFIG_FILE, WEIGHTS_FILE, resolve_checkpoint
from .models.config import LMConfig
from .models.lm import LanguageModel, LMState
from .ops._varlen import check_cu_seqlens

try:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationMixin,
        PreTrainedConfig,
        PreTrainedModel,
    )
    from transformers.cache_utils import Cache
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as err:  # the core library works without the extra; this module does not
    raise ImportError(
        "fastweights.hf needs transformers 5: pip install 'fastweights[hf]' "
        "(or pip install 'transformers>=5,<6')") from err

# transformers >= 5.24 names the cache ``cache`` (argument and output field, ``past_key_values``
# kept as a deprecated alias); earlier 5.x releases name it ``past_key_values``. Outputs are built
# with the installed release's field name so that no deprecation path is taken.
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} \
    else "past_key_values"
PREFIX = "model."  # FastWeightsForCausalLM keeps the native LanguageModel as ``self.model``
IGNORE_INDEX = -100

__all__ = [
    "FastWeightsCache",
    "FastWeightsConfig",
    "FastWeightsForCausalLM",
    "hf_to_native",
    "native_to_hf",
]


def _field_like(f: Field) -> Field:
    """A new dataclass field with ``f``'s default (or default factory)."""
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory)
    return field(default=f.default)


# LMConfig's fields (names, types, defaults) as a dataclass base of FastWeightsConfig, generated
# so the two configurations cannot drift apart.
_LMConfigFields = make_dataclass(
    "_LMConfigFields", [(f.name, f.type, _field_like(f)) for f in fields(LMConfig)], kw_only=True)


class FastWeightsConfig(PreTrainedConfig, _LMConfigFields):
    """The Hugging Face twin of ``LMConfig``: its fields are LMConfig's (same names, types and
    defaults; see ``LMConfig`` for their meaning), validated by building the ``LMConfig``.
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and ``tie_word_embeddings``
    are aliases of ``d_model``, ``n_layers``, ``n_heads`` and ``tie_embeddings``."""

    model_type = "fastweights"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache", "past_key_values"]
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "tie_word_embeddings": "tie_embeddings",
    }

    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.to_lm_config()  # LMConfig's validation, with its messages

    def to_lm_config(self) -> LMConfig:
        """The native ``LMConfig`` with the same values."""
        return LMConfig(**{f.name: getattr(self, f.name) for f in fields(LMConfig)})

    @classmethod
    def from_lm_config(cls, config: LMConfig, **kwargs: Any) -> FastWeightsConfig:
        """The Hugging Face config of ``config``; ``kwargs`` set the extra fields (token ids)."""
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
        values = config.to_dict()
        for name in ("mixer", "mixer_options"):  # JSON has no tuples
            if isinstance(values[name], tuple):
                values[name] = list(values[name])
        return cls(**values, **kwargs)


# ---------------------------------------------------------------------------------------------
# The cache: per-row-group layer states


def _take_rows(t: torch.Tensor, local: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``local`` of a group state tensor whose leading dim is the group's batch ``n``
    (tensors without that leading dim are shared by the rows and kept)."""
    return t.index_select(0, local.to(t.device)) if t.dim() and t.shape[0] == n else t


class FastWeightsCache(Cache):
    """The cache of ``FastWeightsForCausalLM`` (``cache=``, ``past_key_values=`` before
    transformers 5.24): the native per-layer states.

    The batch rows are split into groups (one per distinct left-pad length at prefill, merged
    into one group whenever their states have the same structure, see the module docstring);
    ``groups`` is a list of ``(rows [b] long, state)`` with ``state`` the ``LanguageModel``
    state list of those rows, in that order. ``get_seq_length()`` counts the positions consumed
    (pads included, as ``generate`` expects), ``state_bytes()`` the bytes of state held.
    """

    is_compileable = False  # the state is a Python structure; no static shapes to compile for

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.groups: list[tuple[torch.Tensor, LMState]] = []
        self.seen_tokens = 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(groups={len(self.groups)}, batch={self.batch_size}, "
                f"seen_tokens={self.seen_tokens}, state_bytes={self.state_bytes()})")

    @property
    def batch_size(self) -> int:
        return sum(len(rows) for rows, _ in self.groups) if self.groups else -1

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back

    @property
    def is_initialized(self) -> bool:
        return bool(self.groups)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def state_bytes(self) -> int:
        """Bytes of every tensor held (all layers, all rows)."""
        return sum(state_tree.nbytes(s) for _, s in self.groups)

    def reset(self) -> None:
        self.groups = []
        self.seen_tokens = 0

    def set_groups(self, groups: list[tuple[torch.Tensor, LMState]]) -> None:
        """Store the groups, concatenated into one when their states allow it."""
        if len(groups) > 1:
            try:
                state = state_tree.cat_rows([s for _, s in groups], "cache",
                                            [len(r) for r, _ in groups])
                groups = [(torch.cat([r for r, _ in groups]), state)]
            except ValueError:  # structures differ (softmax caches of other lengths)
                pass
        self.groups = groups

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (new row j is old row indices[j]); rows may repeat."""
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
        new_groups = []
        for rows, state in self.groups:
            rows = rows.cpu()
            hit = (indices[:, None] == rows[None, :])  # [new, b]
            new_rows = hit.any(dim=1).nonzero().flatten()
            if new_rows.numel() == 0:
                continue
            local = hit[new_rows].float().argmax(dim=1)  # position of each kept row in the group
            state = state_tree.map_tensors(partial(_take_rows, local=local, n=len(rows)), state)
            new_groups.append((new_rows, state))
        self.set_groups(new_groups)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        n = max(self.batch_size, 0)
        self.batch_select_indices(torch.arange(n).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a recurrent state cannot be cropped")


# ---------------------------------------------------------------------------------------------
# The model


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


def _packed_bounds(T: int, device: torch.device, **sources: Any) -> list[int] | None:
    """The document boundaries [0, ..., T] of a batch of one, from whichever of ``cu_seqlens``,
    ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``seq_idx`` (a [1, T] document index per token) and
    ``position_ids`` ([1, T], restarting at 0 at each document) are given; they must agree.
    None when none is given."""
    found: dict[str, list[int]] = {}
    for name in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k"):
        if sources.get(name) is not None:
            found[name] = check_cu_seqlens(sources[name], T, 1, device)
    seq_idx = sources.get("seq_idx")
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.shape != (1, T):
            raise ValueError(f"seq_idx must have shape [1, T] = [1, {T}], got {_describe(seq_idx)}")
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


class FastWeightsForCausalLM(PreTrainedModel, GenerationMixin):
    """A ``fastweights.LanguageModel`` behind the ``transformers`` model API.

    ``forward(input_ids [B, T], attention_mask=None [B, past + T], position_ids=None [B, T],
    cache=None, labels=None [B, T], use_cache=None, ...) -> CausalLMOutputWithPast``:
    logits [B, T, V] (zero at pad positions; only the last ``logits_to_keep`` ones, or those
    indexed, when it is given), ``loss`` the next-token cross-entropy over labels other than
    -100 and positions the mask keeps (their mean, or their sum divided by
    ``num_items_in_batch`` when the Trainer passes it, computed from all T positions whatever
    ``logits_to_keep``), the ``FastWeightsCache`` under the installed transformers' name for it
    (``cache`` from 5.24, where ``past_key_values`` reads it too; ``past_key_values`` before),
    and with
    ``output_hidden_states`` (True, or the indices to keep) ``n_layers + 1`` hidden states
    [B, T, d]: the embeddings' output, the input of every later block, and last the final
    norm's output (after the norm, as Llama returns it; zero at pads). ``input_ids`` holds only
    the positions the cache has not seen (``generate`` slices them so). The cache is passed as
    ``cache=`` (transformers >= 5.24) or ``past_key_values=`` (earlier releases and older
    code), not both. ``cache_position``, if
    given, must be those positions; ``inputs_embeds`` and ``output_attentions=True`` are refused.
    See the module docstring for padding and packed documents (``cu_seqlens``, ...).
    """

    config_class = FastWeightsConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # no rollback: assisted generation is refused by generate()
    # gradient_checkpointing_enable() switches LanguageModel.gradient_checkpointing (per block)
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    # forward takes num_items_in_batch (the Trainer then leaves the loss scaling to it)
    accepts_loss_kwargs = True
    _tied_weights_keys: ClassVar[dict[str, str]] = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: FastWeightsConfig) -> None:
        super().__init__(config)
        self.model = LanguageModel(config.to_lm_config())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # Fresh models keep LanguageModel's own initialisation (identical to the native model);
        # from_pretrained loads every weight (it refuses missing ones) and rebuilds buffers.
        pass

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward() creates its own FastWeightsCache

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.head = value

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.from_pretrained``, refusing checkpoints with missing or unexpected
        weights, and recomputing the layers' non-persistent buffers (rotary frequencies, ...),
        which transformers leaves uninitialised."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        bad = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys")}
        if any(bad.values()):
            raise ValueError(f"checkpoint does not match the model config: {bad}")
        model._rebuild_buffers()
        return (model, info) if want_info else model

    def _rebuild_buffers(self) -> None:
        named = [(n, b) for n, b in self.model.named_buffers() if not self._is_persistent(n)]
        if not named:
            return
        with torch.random.fork_rng(devices=[]):  # leave the caller's random stream untouched
            fresh = dict(LanguageModel(self.config.to_lm_config()).named_buffers())
        with torch.no_grad():
            for name, buf in named:
                owner, _, attr = name.rpartition(".")
                module = self.model.get_submodule(owner)
                module._buffers[attr] = fresh[name].to(device=buf.device, dtype=buf.dtype)

    def _is_persistent(self, name: str) -> bool:
        owner, _, attr = name.rpartition(".")
        return attr not in self.model.get_submodule(owner)._non_persistent_buffers_set

    def _hidden_and_state(self, input_ids: torch.Tensor, state: Any,
                          cu_seqlens: torch.Tensor | None = None,
                          collect: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        """The native model's final-norm output h [b, t, d] (the logits are
        ``get_output_embeddings()(h)``) and state for ``input_ids`` [b, t] from ``state``, with
        packed documents (``cu_seqlens``) and the hidden states appended to ``collect`` as
        ``LanguageModel.hidden`` does; models of another layout (``hf_fla``) override it."""
        return self.model.hidden(input_ids, state, cu_seqlens, collect=collect)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: FastWeightsCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | int | list[int] | None = None,
        return_dict: bool | None = None,
        cache_position: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
        past_key_values: FastWeightsCache | None = None,
    ) -> CausalLMOutputWithPast | tuple:
        """See the class docstring. Every keyword is honoured or refused with an error; there is
        no catch-all, so an unknown one is a TypeError naming it."""
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the cache as cache= or as past_key_values= (its name before "
                             "transformers 5.24), not both")
        user_cache = cache if cache is not None else past_key_values
        if labels is not None:
            self._check_trainable()
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported; pass input_ids")
        # unset output_* flags take the config's, as transformers' models do
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if output_attentions:
            raise ValueError("output_attentions=True is not supported: fastweights mixers keep "
                             "no attention weights to return")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [B, T] tensor, got {_describe(input_ids)}")
        B, T = input_ids.shape
        asked_cache = use_cache
        use_cache = self.config.use_cache if use_cache is None else use_cache
        return_dict = self.config.return_dict if return_dict is None else return_dict
        keep = _check_logits_to_keep(logits_to_keep, T)
        hidden_keep = _hidden_selection(output_hidden_states, self.config.num_hidden_layers + 1)
        if user_cache is not None and not isinstance(user_cache, FastWeightsCache):
            raise TypeError(
                "cache (past_key_values) must be a FastWeightsCache (as returned by this model), "
                f"got {type(user_cache).__name__}")
        cache = user_cache if user_cache is not None else FastWeightsCache()
        past = cache.get_seq_length()
        if cache.groups and cache.batch_size != B:
            raise ValueError(
                f"input_ids has batch {B} but the cache holds {cache.batch_size} rows")
        if cache_position is not None and not (
                isinstance(cache_position, torch.Tensor) and cache_position.shape == (T,)
                and torch.equal(cache_position.cpu(), torch.arange(past, past + T))):
            raise ValueError(f"cache_position must be arange({past}, {past + T}) (the positions "
                             f"after the {past} the cache has seen), got {_describe(cache_position)}")

        pads = right = torch.zeros(B, dtype=torch.long)
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, past + T):
                raise ValueError(
                    f"attention_mask must have shape [B, past + T] = [{B}, {past + T}], "
                    f"got {_describe(attention_mask)}")
            pads, right = (p.cpu() for p in _pad_lengths(attention_mask, T))
            if past and (pads.any() or right.any()):
                raise ValueError("attention_mask pads a position after the prefill; only left "
                                 "padding of the first forward is supported")
        if position_ids is not None and (
                not isinstance(position_ids, torch.Tensor) or position_ids.shape != (B, T)
                or position_ids.dtype.is_floating_point):
            raise ValueError(f"position_ids must be an integer tensor [B, T] = [{B}, {T}], "
                             f"got {_describe(position_ids)}")

        # Packed documents (a batch of one): from cu_seqlens & co, or position_ids restarting at 0
        packing = {"cu_seqlens": cu_seqlens, "cu_seq_lens_q": cu_seq_lens_q,
                   "cu_seq_lens_k": cu_seq_lens_k, "seq_idx": seq_idx}
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
            bounds = _packed_bounds(T, input_ids.device, position_ids=position_ids, **packing)
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
        stateless = (bounds is not None and len(bounds) > 2) or bool(right.any())
        if stateless and (use_cache or user_cache is not None):
            what = "packed documents" if bounds is not None and len(bounds) > 2 else \
                "right padding (a 0 after a 1 in attention_mask)"
            raise ValueError(
                f"{what}: only in forwards that carry no state (use_cache=False, no "
                f"cache, as in training; use_cache is {asked_cache}, config.use_cache "
                f"{self.config.use_cache}); for generation, only left padding is supported")

        if cache.groups:
            work = [(rows, (0, 0), state) for rows, state in cache.groups]
        else:  # prefill: rows sharing their pad lengths start together from a fresh state
            spans = torch.stack([pads, right], dim=1).unique(dim=0).tolist()
            work = [(((pads == p) & (right == r)).nonzero().flatten(), (p, r), None) for p, r in spans]
        packed = torch.tensor(bounds, device=input_ids.device) \
            if bounds is not None and len(bounds) > 2 else None
        h_all = None
        hidden: list[torch.Tensor] | None = [] if hidden_keep is not None else None
        new_groups = []
        for rows, (p, r), state in work:
            idx = rows.to(input_ids.device)
            collect = [] if hidden is not None else None
            h, state = self._hidden_and_state(input_ids[idx, p:T - r], state, packed,
                                              collect)  # [b, T - p - r, d]
            if h_all is None:
                h_all = h.new_zeros(B, T, h.shape[-1])
                if hidden is not None:
                    hidden.extend(h.new_zeros(B, T, h.shape[-1]) for _ in collect)
            h_all[idx, p:T - r] = h
            for full, part in zip(hidden or (), collect or ()):
                full[idx, p:T - r] = part
            new_groups.append((rows, state))
        # The bias-free head maps the zero rows at pads to zero logits.
        logits = self.get_output_embeddings()(h_all)  # [B, T, V]

        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, attention_mask, past, bounds, num_items_in_batch)

        if use_cache:
            cache.set_groups(new_groups)
            cache.seen_tokens = past + T
        hidden_states = None
        if hidden is not None:
            hidden_states = tuple(t if hidden_keep is True or i in hidden_keep else None
                                  for i, t in enumerate(hidden))
        out = CausalLMOutputWithPast(loss=loss, logits=logits[:, keep],
                                     hidden_states=hidden_states,
                                     **{CACHE_FIELD: cache if use_cache else None})
        return out if return_dict else out.to_tuple()

    def _check_trainable(self) -> None:
        """Raise if this model cannot compute a training loss (a subclass's refusal)."""

    def _loss(self, logits: torch.Tensor, labels: Any, attention_mask: torch.Tensor | None,
              past: int, bounds: list[int] | None,
              num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
        """Next-token cross-entropy: the mean over the targets kept, or their sum divided by
        ``num_items_in_batch`` (the Trainer's count over the accumulated batches)."""
        B, T = logits.shape[:2]
        if not isinstance(labels, torch.Tensor) or labels.shape != (B, T):
            raise ValueError(f"labels must have shape [{B}, {T}], got {_describe(labels)}")
        target = labels[:, 1:]
        if attention_mask is not None:  # nothing is predicted from a pad, and no pad is a target
            new = attention_mask[:, past:past + T] == 0
            target = target.masked_fill(new[:, :-1] | new[:, 1:], IGNORE_INDEX)
        if bounds is not None and len(bounds) > 2:
            # a document's first token is not predicted from the previous document
            starts = torch.tensor(bounds[1:-1], device=target.device) - 1
            target = target.index_fill(1, starts, IGNORE_INDEX)
        # float32 or wider for the log-softmax: bfloat16 logits lose the small probabilities
        flat = logits[:, :-1].flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
        if num_items_in_batch is None:
            return F.cross_entropy(flat, target.flatten(), ignore_index=IGNORE_INDEX)
        total = F.cross_entropy(flat, target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> torch.nn.Embedding:
        """``PreTrainedModel.resize_token_embeddings``, keeping the wrapped native model's
        ``LMConfig`` (its vocab_size bounds the ids forward accepts) in step with the config."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        if isinstance(self.model, LanguageModel):  # hf_fla's backbone keeps no config
            self.model.config = self.config.to_lm_config()
        return embeddings


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


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


# ---------------------------------------------------------------------------------------------
# Checkpoint conversion


def _empty_destination(dst_dir: str | Path) -> Path:
    dst = Path(dst_dir)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"dst_dir {dst} exists and is not an empty folder; refusing to overwrite")
    return dst


def _weights(src: Path, what: str) -> dict[str, torch.Tensor]:
    path = src / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"src_dir {src} is not a {what} checkpoint folder (no {WEIGHTS_FILE}; "
                         "sharded checkpoints are not supported)")
    return load_file(str(path))


def native_to_hf(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Convert a native checkpoint folder (``LanguageModel.save_pretrained``, a training
    checkpoint, or a training run folder, whose ``checkpoints/latest`` is taken as the CLI
    does) into a Hugging Face one loadable by ``AutoModelForCausalLM.from_pretrained``. A
    training checkpoint is verified against its manifest first. Tensors are copied unchanged
    (same dtype and values) under the names ``"model." + native name``; other files (optimizer,
    step) are not copied. Refuses a ``dst_dir`` that exists and is not empty. Returns dst_dir."""
    try:
        src = resolve_checkpoint(src_dir)
    except ValueError as err:
        raise ValueError(f"src_dir: {err}") from None
    if not (src / CONFIG_FILE).is_file():
        raise ValueError(f"src_dir {src} is not a native fastweights checkpoint (no {CONFIG_FILE})")
    dst = _empty_destination(dst_dir)
    config = FastWeightsConfig.from_lm_config(LMConfig.load(src / CONFIG_FILE))
    config.architectures = [FastWeightsForCausalLM.__name__]
    tensors = {PREFIX + k: v for k, v in _weights(src, "native").items()}
    dst.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dst)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    return dst


def hf_to_native(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Convert a Hugging Face folder (``FastWeightsForCausalLM.save_pretrained``) into a native
    checkpoint folder loadable by ``LanguageModel.from_pretrained`` without transformers.
    Tensors are copied unchanged with the ``"model."`` prefix removed. Refuses a ``dst_dir``
    that exists and is not empty. Returns dst_dir."""
    src = Path(src_dir)
    try:
        data = json.loads((src / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"src_dir {src}: cannot read {CONFIG_FILE}: {err}") from None
    if data.get("model_type") != FastWeightsConfig.model_type:
        raise ValueError(f"src_dir {src} holds model_type {data.get('model_type')!r}, "
                         f"expected {FastWeightsConfig.model_type!r}")
    dst = _empty_destination(dst_dir)
    lm_config = FastWeightsConfig.from_dict(data).to_lm_config()
    tensors = _weights(src, "Hugging Face")
    foreign = sorted(k for k in tensors if not k.startswith(PREFIX))
    if foreign:
        raise ValueError(f"src_dir {src} has weights outside {PREFIX!r}: {foreign[:5]}")
    dst.mkdir(parents=True, exist_ok=True)
    lm_config.save(dst / CONFIG_FILE)
    save_file({k[len(PREFIX):]: v for k, v in tensors.items()}, str(dst / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return dst


AutoConfig.register(FastWeightsConfig.model_type, FastWeightsConfig, exist_ok=True)
AutoModelForCausalLM.register(FastWeightsConfig, FastWeightsForCausalLM, exist_ok=True)
