"""fla DeltaNet checkpoints as ``transformers`` models on CPU (the optional ``[hf]`` extra).

- ``FlaDeltaNetHFConfig``: a ``PreTrainedConfig`` with model_type "delta_net" and exactly the
  fields of fla 0.6's ``DeltaNetConfig`` (``fastweights.models.fla.FlaDeltaNetConfig`` validates
  them: unsupported options raise ValueError naming them), so fla's config.json reads and writes
  unchanged.
- ``FlaDeltaNetForCausalLM``: ``fastweights.models.fla.FlaDeltaNetLM`` behind the model API of
  ``fastweights.hf.FastWeightsForCausalLM`` (its forward, left padding, loss, ``FastWeightsCache``
  of recurrent states, greedy/sampling/beam ``generate()``), with fla's parameter names
  (``model.embeddings.weight``, ``model.layers.{i}.attn.q_proj.weight``, ..., ``lm_head.weight``),
  so ``from_pretrained`` loads an fla checkpoint folder (sharded or not, any dtype, tied or untied
  embeddings) and ``save_pretrained`` writes one.

Nothing is registered with ``AutoConfig``/``AutoModelForCausalLM``: fla registers its own classes
for "delta_net" when imported, and either registration would silently replace the other. Load
with ``fastweights.models.fla.from_fla(folder)`` (or ``FlaDeltaNetForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from .hf import FastWeightsForCausalLM
from .models.fla import MODEL_TYPE, FlaDeltaNetConfig, FlaDeltaNetLM

__all__ = ["FlaDeltaNetForCausalLM", "FlaDeltaNetHFConfig"]

_FIELDS = tuple(f.name for f in dataclasses.fields(FlaDeltaNetConfig))
# Fields PreTrainedConfig itself takes (special tokens, embedding tying).
_BASE_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")


class FlaDeltaNetHFConfig(PreTrainedConfig):
    """fla's DeltaNetConfig fields and defaults (see ``FlaDeltaNetConfig``/``FLA_OPTIONS``),
    validated on creation; ``to_native()`` gives the ``FlaDeltaNetConfig``."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(self, **kwargs: Any) -> None:
        values = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
        # Validation (and fla's defaults) by the native config; warns about foreign keys.
        native = FlaDeltaNetConfig.from_dict(
            {**values, **{k: v for k, v in kwargs.items() if k != "model_type"}})
        for name in _FIELDS:
            if name not in _BASE_FIELDS:
                setattr(self, name, getattr(native, name))
        super().__init__(**{name: getattr(native, name) for name in _BASE_FIELDS}, **kwargs)

    def to_native(self) -> FlaDeltaNetConfig:
        """The ``FlaDeltaNetConfig`` with the same values."""
        return FlaDeltaNetConfig(**{name: getattr(self, name) for name in _FIELDS})


class FlaDeltaNetForCausalLM(FastWeightsForCausalLM):
    """fla's DeltaNetForCausalLM on fastweights' ops (see the module docstring).

    ``forward`` and ``generate`` are ``FastWeightsForCausalLM``'s: logits [B, T, V], the loss with
    ``labels``, ``past_key_values`` a ``FastWeightsCache`` holding every layer's
    ``(conv_q, conv_k, conv_v, S)`` (constant size per sequence).
    """

    config_class = FlaDeltaNetHFConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules: ClassVar[list[str]] = ["FlaDeltaNetBlock"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: FlaDeltaNetHFConfig) -> None:
        # PreTrainedModel's constructor, not FastWeightsForCausalLM's (which builds a
        # LanguageModel): this model's modules are fla's ``model`` and ``lm_head``.
        PreTrainedModel.__init__(self, config)
        native = FlaDeltaNetLM(config.to_native())
        self.model = native.model
        self.lm_head = native.lm_head
        self.post_init()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embeddings

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.lm_head = value

    @classmethod
    def from_pretrained(cls, folder: str | Path, *args: Any, **kwargs: Any) -> Any:
        """Load a local fla checkpoint folder (refusing missing or unexpected weights); the
        config is read and checked first, so a foreign or unsupported one fails with a message
        naming the field before any weight is read."""
        if not isinstance(folder, (str, Path)) or not Path(folder).is_dir():
            raise ValueError(f"fla checkpoint folder {folder!r} does not exist")
        FlaDeltaNetConfig.load(folder)
        kwargs.setdefault("local_files_only", True)
        return super().from_pretrained(folder, *args, **kwargs)

    def _hidden_and_state(self, input_ids: torch.Tensor, state: Any,
                          cu_seqlens: torch.Tensor | None = None,
                          collect: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        # fla's backbone has neither packed documents nor hidden-state capture here
        if cu_seqlens is not None:
            raise ValueError("packed documents (cu_seqlens, position_ids restarting at 0, ...) "
                             "are not supported by FlaDeltaNetForCausalLM")
        if collect is not None:
            raise ValueError("output_hidden_states is not supported by FlaDeltaNetForCausalLM")
        return self.model(input_ids, state)  # [b, t, d] after the final norm

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("labels") is not None and self.config.use_l2warp:
            raise ValueError(
                "use_l2warp=True changes the training gradient (fla's L2Wrap penalty), which "
                "fastweights does not implement; set config.use_l2warp = False to train")
        return super().forward(input_ids, *args, **kwargs)
