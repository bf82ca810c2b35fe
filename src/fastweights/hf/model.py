"""``FastWeightsForCausalLM``: the native ``LanguageModel`` behind the ``transformers`` model API.

Its forward is four steps: the input checks (``inputs.check_call``), packed documents
(``packing.document_bounds``), the row groups (``cache.row_groups``) and the run loop
(``FastWeightsForCausalLM._run_groups``); then the head, the loss and the cache update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.lm import LanguageModel
from .cache import FastWeightsCache, row_groups
from .config import FastWeightsConfig
from .inputs import Call, check_call, describe
from .packing import document_bounds

# transformers >= 5.24 names the cache ``cache`` (argument and output field, ``past_key_values``
# kept as a deprecated alias); earlier 5.x releases name it ``past_key_values``. Outputs are built
# with the installed release's field name so that no deprecation path is taken.
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} \
    else "past_key_values"
IGNORE_INDEX = -100


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
    Left padding: ``cache.py``; right padding and packed documents (``cu_seqlens``, ...):
    ``packing.py``.
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
        ``LanguageModel.hidden`` does; models of another layout (``fastweights.fla.hf``) override it."""
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
        if labels is not None:
            self._check_trainable()
        call = check_call(
            self.config, input_ids, cache if cache is not None else past_key_values,
            attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict,
            cache_position=cache_position, logits_to_keep=logits_to_keep)
        bounds = document_bounds(call, input_ids, position_ids, attention_mask, max_length_q,
                                 max_length_k, cu_seqlens=cu_seqlens, cu_seq_lens_q=cu_seq_lens_q,
                                 cu_seq_lens_k=cu_seq_lens_k, seq_idx=seq_idx)
        h, hidden, groups = self._run_groups(input_ids, call, bounds)
        # The bias-free head maps the zero rows at pads to zero logits.
        logits = self.get_output_embeddings()(h)  # [B, T, V]
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, attention_mask, call.past, bounds,
                              num_items_in_batch)
        if call.use_cache:
            call.cache.set_groups(groups)
            call.cache.seen_tokens = call.past + call.T
        hidden_states = None
        if hidden is not None:
            hidden_states = tuple(t if call.hidden_keep is True or i in call.hidden_keep else None
                                  for i, t in enumerate(hidden))
        out = CausalLMOutputWithPast(loss=loss, logits=logits[:, call.keep],
                                     hidden_states=hidden_states,
                                     **{CACHE_FIELD: call.cache if call.use_cache else None})
        return out if call.return_dict else out.to_tuple()

    def _run_groups(self, input_ids: torch.Tensor, call: Call, bounds: list[int] | None
                    ) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[tuple[torch.Tensor, Any]]]:
        """The run loop: every row group (``row_groups``) from its state on its tokens only.
        Returns h [B, T, d] (zero at pads), the hidden states asked for (each [B, T, d]) or
        None, and each group's rows with its new state."""
        B, T = call.B, call.T
        packed = torch.tensor(bounds, device=input_ids.device) \
            if bounds is not None and len(bounds) > 2 else None
        h_all = None
        hidden: list[torch.Tensor] | None = [] if call.hidden_keep is not None else None
        new_groups = []
        for rows, (p, r), state in row_groups(call.cache, call.pads, call.right):
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
        return h_all, hidden, new_groups

    def _set_gradient_checkpointing(self, enable: bool = True,
                                    gradient_checkpointing_func: Callable[..., Any] | None = None,
                                    every_n_layers: int = 1) -> None:
        """transformers' hook behind ``activation_checkpointing_enable`` (and
        ``gradient_checkpointing_enable``) and their ``disable``: the native model recomputes
        blocks 0, n, 2n, ... (transformers' ``every_n_layers``) through
        ``gradient_checkpointing_func`` (which carries ``use_reentrant``, ``offload``, ...)."""
        self.model.set_gradient_checkpointing(enable, every_n_layers=every_n_layers)
        self.model._gradient_checkpointing_func = gradient_checkpointing_func if enable else None

    def _check_trainable(self) -> None:
        """Raise if this model cannot compute a training loss (a subclass's refusal)."""

    def _loss(self, logits: torch.Tensor, labels: Any, attention_mask: torch.Tensor | None,
              past: int, bounds: list[int] | None,
              num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
        """Next-token cross-entropy: the mean over the targets kept, or their sum divided by
        ``num_items_in_batch`` (the Trainer's count over the accumulated batches)."""
        B, T = logits.shape[:2]
        if not isinstance(labels, torch.Tensor) or labels.shape != (B, T):
            raise ValueError(f"labels must have shape [{B}, {T}], got {describe(labels)}")
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
        if isinstance(self.model, LanguageModel):  # fla models keep no LMConfig
            self.model.config = self.config.to_lm_config()
        return embeddings
