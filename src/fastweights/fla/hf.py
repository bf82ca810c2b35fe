"""fla checkpoints (DeltaNet, GatedDeltaNet, RetNet) as ``transformers`` models on CPU (the optional ``[hf]`` extra).

- ``FlaDeltaNetHFConfig``, ``FlaRetNetHFConfig``: ``PreTrainedConfig`` classes with fla's
  model_type ("delta_net", "retnet") and exactly the fields of fla 0.6's ``DeltaNetConfig`` /
  ``RetNetConfig`` (``fastweights.fla.FlaDeltaNetConfig`` /
  ``fastweights.fla.FlaRetNetConfig`` validate them: unsupported options raise
  ValueError naming them), so fla's config.json reads and writes unchanged.
- ``FlaDeltaNetForCausalLM``, ``FlaRetNetForCausalLM``: the native ``FlaLM`` behind the model
  API of ``fastweights.hf.FastWeightsForCausalLM`` (its forward, left padding, loss,
  ``FastWeightsCache`` of recurrent states, greedy/sampling/beam ``generate()``), with fla's
  parameter names (``model.embeddings.weight``, ``model.layers.{i}.attn.q_proj.weight``, ...,
  ``lm_head.weight``), so ``from_pretrained`` loads an fla checkpoint folder (sharded or not,
  any dtype, tied or untied embeddings) and ``save_pretrained`` writes one.
- ``fla_model_class(model_type)``: the class of an fla model_type, for ``from_fla``.

Nothing is registered with ``AutoConfig``/``AutoModelForCausalLM``: fla registers its own classes
for its model types when imported, and either registration would silently replace the other.
Load with ``fastweights.fla.from_fla(folder)`` (or ``<Family>ForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..hf import FastWeightsForCausalLM
from .deltanet import FlaDeltaNetConfig, FlaDeltaNetLM
from .gated_deltanet import FlaGatedDeltaNetConfig, FlaGatedDeltaNetLM
from .model import FlaConfig, FlaLM
from .retnet import FlaRetNetConfig, FlaRetNetLM

__all__ = ["FlaDeltaNetForCausalLM", "FlaDeltaNetHFConfig", "FlaGatedDeltaNetForCausalLM",
           "FlaGatedDeltaNetHFConfig", "FlaRetNetForCausalLM", "FlaRetNetHFConfig",
           "fla_model_class"]

# Fields PreTrainedConfig itself takes (special tokens, embedding tying).
_BASE_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")


class _FlaHFConfig(PreTrainedConfig):
    """fla's config fields and defaults of the family ``native`` (a ``FlaConfig`` dataclass;
    see its ``OPTIONS``), validated on creation; ``to_native()`` gives the native config."""

    native: ClassVar[type[FlaConfig]]
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache", "past_key_values"]

    def __init__(self, **kwargs: Any) -> None:
        fields = self._fields()
        values = {name: kwargs.pop(name) for name in fields if name in kwargs}
        # Validation (and fla's defaults) by the native config; warns about foreign keys.
        native = self.native.from_dict(
            {**values, **{k: v for k, v in kwargs.items() if k != "model_type"}})
        for name in fields:
            if name not in _BASE_FIELDS:
                setattr(self, name, getattr(native, name))
        super().__init__(**{name: getattr(native, name) for name in _BASE_FIELDS}, **kwargs)

    @classmethod
    def _fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls.native))

    def to_native(self) -> Any:
        """The native config (``FlaDeltaNetConfig``, ``FlaRetNetConfig``) with the same values."""
        return self.native(**{name: getattr(self, name) for name in self._fields()})


class FlaDeltaNetHFConfig(_FlaHFConfig):
    """fla's DeltaNetConfig fields and defaults (see ``FlaDeltaNetConfig``/``FLA_OPTIONS``)."""

    model_type = FlaDeltaNetConfig.MODEL_TYPE
    native = FlaDeltaNetConfig

    def __init__(self, **kwargs: Any) -> None:
        # Defined here: PreTrainedConfig makes every subclass a dataclass, whose generated
        # __init__ would replace the inherited one.
        super().__init__(**kwargs)


class FlaGatedDeltaNetHFConfig(_FlaHFConfig):
    """fla's GatedDeltaNetConfig fields and defaults (see ``FlaGatedDeltaNetConfig`` /
    ``FLA_GATED_DELTANET_OPTIONS``)."""

    model_type = FlaGatedDeltaNetConfig.MODEL_TYPE
    native = FlaGatedDeltaNetConfig

    def __init__(self, **kwargs: Any) -> None:  # see FlaDeltaNetHFConfig.__init__
        super().__init__(**kwargs)


class FlaRetNetHFConfig(_FlaHFConfig):
    """fla's RetNetConfig fields and defaults (see ``FlaRetNetConfig``/``FLA_RETNET_OPTIONS``)."""

    model_type = FlaRetNetConfig.MODEL_TYPE
    native = FlaRetNetConfig

    def __init__(self, **kwargs: Any) -> None:
        # Defined here: PreTrainedConfig makes every subclass a dataclass, whose generated
        # __init__ would replace the inherited one.
        super().__init__(**kwargs)


class _FlaForCausalLM(FastWeightsForCausalLM):
    """An fla ``<Family>ForCausalLM`` on fastweights' ops (see the module docstring).

    ``forward`` and ``generate`` are ``FastWeightsForCausalLM``'s: logits [B, T, V], the loss with
    ``labels``, the cache a ``FastWeightsCache`` holding every layer's state (constant
    size per sequence). Subclasses set ``config_class`` and ``native_class``.
    """

    native_class: ClassVar[type[FlaLM]]
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules: ClassVar[list[str]] = ["FlaBlock"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: _FlaHFConfig) -> None:
        # PreTrainedModel's constructor, not FastWeightsForCausalLM's (which builds a
        # LanguageModel): this model's modules are fla's ``model`` and ``lm_head``.
        PreTrainedModel.__init__(self, config)
        native = self.native_class(config.to_native())
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
        cls.config_class.native.load(folder)
        kwargs.setdefault("local_files_only", True)
        return super().from_pretrained(folder, *args, **kwargs)

    def _hidden_and_state(self, input_ids: torch.Tensor, state: Any,
                          cu_seqlens: torch.Tensor | None = None,
                          collect: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        # fla's backbone has neither packed documents nor hidden-state capture here
        if cu_seqlens is not None:
            raise ValueError("packed documents (cu_seqlens, position_ids restarting at 0, ...) "
                             "are not supported by fla models")
        if collect is not None:
            raise ValueError("output_hidden_states is not supported by fla models")
        return self.model(input_ids, state)  # [b, t, d] after the final norm

    def _check_trainable(self) -> None:
        if self.config.use_l2warp:
            raise ValueError(
                "use_l2warp=True changes the training gradient (fla's L2Wrap penalty), which "
                "fastweights does not implement; set config.use_l2warp = False to train")


class FlaDeltaNetForCausalLM(_FlaForCausalLM):
    """fla's DeltaNetForCausalLM; each layer's cache entry is ``(conv_q, conv_k, conv_v, S)``
    (``(S,)`` without short convolutions)."""

    config_class = FlaDeltaNetHFConfig
    native_class = FlaDeltaNetLM


class FlaGatedDeltaNetForCausalLM(_FlaForCausalLM):
    """fla's GatedDeltaNetForCausalLM; each layer's cache entry is ``(conv, S)``, conv the last
    W - 1 q, k, v projections concatenated (``(S,)`` without short convolutions)."""

    config_class = FlaGatedDeltaNetHFConfig
    native_class = FlaGatedDeltaNetLM


class FlaRetNetForCausalLM(_FlaForCausalLM):
    """fla's RetNetForCausalLM; each layer's cache entry is ``(S, offset)`` (the retention
    state and the tokens each row has consumed, for the rotary positions)."""

    config_class = FlaRetNetHFConfig
    native_class = FlaRetNetLM


_MODELS: dict[str, type[_FlaForCausalLM]] = {
    cls.config_class.model_type: cls
    for cls in (FlaDeltaNetForCausalLM, FlaGatedDeltaNetForCausalLM, FlaRetNetForCausalLM)}


def fla_model_class(model_type: Any) -> type[_FlaForCausalLM]:
    """The fastweights class of fla's ``model_type``; ValueError naming the supported ones."""
    if not isinstance(model_type, str) or model_type not in _MODELS:
        raise ValueError(f"model_type {model_type!r} is not an fla family fastweights runs; "
                         f"supported: {sorted(_MODELS)}")
    return _MODELS[model_type]
