"""``FastWeightsConfig``: the Hugging Face twin of ``LMConfig``."""

from __future__ import annotations

from dataclasses import MISSING, Field, field, fields, make_dataclass
from typing import Any, ClassVar

from transformers import PreTrainedConfig

from ..models.config import LMConfig


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
