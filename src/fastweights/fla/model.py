"""What fla's language models share: ``FlaConfig`` (the fields every fla 0.6 causal-LM config
has, ``COMMON_FLA_OPTIONS``), and ``FlaLM``, fla's ``<Family>ForCausalLM`` on fastweights' ops
around the family's mixer (``config.layer()``), with fla's parameter names:

    embeddings -> num_hidden_layers x [x + mixer(RMSNorm(x)); x + SwiGLU(RMSNorm(x))]
               -> RMSNorm -> lm_head (tied to the embeddings with tie_word_embeddings)

SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases, intermediate_size (default: the
multiple of 256 at or above int(hidden_size * hidden_ratio * 2 / 3), fla's rule).

Each family (``deltanet.py``, ``retnet.py``) adds its config fields and its mixer.

Dimension legend: B batch, T tokens, V vocabulary, d hidden_size.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import check_positive_int, is_int, is_number
from ..layers.base import Mixer
from ..layers.norms import RMSNorm
from .modules import SwiGLU

# The options every fla 0.6 causal-LM config has, with the same meaning in every family, and
# what fastweights does with each (each family's dict adds its own).
COMMON_FLA_OPTIONS: dict[str, str] = {
    "hidden_size": "supported",
    "num_hidden_layers": "supported",
    "num_heads": "supported",
    "vocab_size": "supported",
    "hidden_ratio": "supported",
    "intermediate_size": "supported",
    "norm_eps": "supported (every RMSNorm of the model, the layers' output norm included)",
    "tie_word_embeddings": "supported",
    "pad_token_id": "supported (the embedding's padding_idx, as fla)",
    "bos_token_id": "supported (generation default)",
    "eos_token_id": "supported (generation default)",
    "use_cache": "supported (generate() decodes from the recurrent state)",
    "fuse_swiglu": "accepted, no effect: the fused SwiGLU + down projection is the same maths",
    "fuse_cross_entropy": "accepted, no effect: the same cross-entropy (fastweights computes it "
                          "in float32 or wider)",
    "fuse_linear_cross_entropy": "accepted, no effect: the same cross-entropy computed without "
                                 "materialising logits on GPU; fastweights returns the logits",
    "use_l2warp": "accepted for inference (it changes no forward value); refused in a forward "
                  "with labels, whose gradient it would change",
    "initializer_range": "accepted: initialisation of fresh models only",
    "attn": "refused unless None: hybrid softmax-attention layers are not implemented",
    "attnres_block_size": "refused unless None: attention residuals are not implemented",
}

# Keys every transformers config.json may hold besides the model's own fields (read, not used).
_GENERIC_KEYS = frozenset({
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype",
    "_name_or_path", "name_or_path", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "tokenizer_class", "task_specific_params", "auto_map", "_commit_hash",
    "_attn_implementation_autoset", "_attn_implementation", "tie_encoder_decoder",
    "keys_to_ignore_at_inference", "cross_attention_hidden_size", "add_cross_attention",
    "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id", "pruned_heads",
})


@dataclass
class FlaConfig:
    """What the fla model configs share: the fields every fla 0.6 causal-LM config has, with
    the defaults they have in every family (a config.json that omits a key means fla's
    default), their checks, the MLP width, reading config.json. Each family's dataclass adds
    its own fields (those whose defaults differ between families included) and sets
    ``MODEL_TYPE``, ``FAMILY`` (fla's name, as in ``<FAMILY>Config``), ``OPTIONS`` (every
    field: supported, accepted or refused), ``BOOL_FIELDS``, ``SIZE_FIELDS`` (positive ints)
    and ``layer()``; its ``__post_init__`` calls ``_check_common()``."""

    MODEL_TYPE: ClassVar[str]
    FAMILY: ClassVar[str]
    OPTIONS: ClassVar[dict[str, str]]
    BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        "tie_word_embeddings", "use_cache", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy",
        "fuse_linear_cross_entropy", "use_l2warp")
    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("hidden_size", "num_hidden_layers", "num_heads",
                                              "vocab_size")

    hidden_size: int = 2048
    num_hidden_layers: int = 24
    intermediate_size: int | None = None
    hidden_act: str = "swish"
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6
    attn: Any = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | list[int] | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    fuse_norm: bool = True
    fuse_swiglu: bool = True
    fuse_cross_entropy: bool = True
    fuse_linear_cross_entropy: bool = False
    use_l2warp: bool = False
    vocab_size: int = 32000
    attnres_block_size: int | None = None
    # Every family also has num_heads and hidden_ratio, with different defaults.

    def _check_common(self) -> None:
        """The checks of the fields every fla causal-LM config has; ValueError/TypeError naming
        the field."""
        name = type(self).__name__
        for field in self.SIZE_FIELDS:
            check_positive_int(f"{name}.{field}", getattr(self, field))
        if self.intermediate_size is not None:
            check_positive_int(f"{name}.intermediate_size", self.intermediate_size)
        if self.hidden_ratio is not None and not (is_number(self.hidden_ratio)
                                                  and self.hidden_ratio > 0):
            raise ValueError(f"{name}.hidden_ratio must be a positive number or None, "
                             f"got {self.hidden_ratio!r}")
        if self.attn is not None:
            raise ValueError(
                f"{name}.attn must be None: fla's hybrid softmax-attention layers "
                f"(attn={self.attn!r}) are not supported by fastweights")
        if self.attnres_block_size is not None:
            raise ValueError(
                f"{name}.attnres_block_size must be None: fla's attention residuals "
                f"(attnres_block_size={self.attnres_block_size!r}) are not supported by fastweights")
        if self.hidden_act != "swish":
            raise ValueError(f"{name}.hidden_act must be 'swish' (SwiGLU), got "
                             f"{self.hidden_act!r}; fla's 'powlu' MLP is not supported")
        for field in self.BOOL_FIELDS:
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{name}.{field} must be a bool, got {getattr(self, field)!r}")
        if self.fuse_cross_entropy and self.fuse_linear_cross_entropy:
            raise ValueError(f"{name}.fuse_cross_entropy and fuse_linear_cross_entropy "
                             "cannot both be True (fla refuses this too)")
        if not is_number(self.norm_eps) or not 0 < self.norm_eps < 1:
            raise ValueError(f"{name}.norm_eps must be a float in (0, 1), got {self.norm_eps!r}")
        if self.pad_token_id is not None and not (
                is_int(self.pad_token_id) and 0 <= self.pad_token_id < self.vocab_size):
            raise ValueError(f"{name}.pad_token_id must be None or an id in "
                             f"[0, {self.vocab_size}), got {self.pad_token_id!r}")

    def layer(self) -> Mixer:
        """A fresh mixer layer of this config (fla's ``<Family>Block`` arguments)."""
        raise NotImplementedError

    def mlp_hidden_size(self) -> int:
        """The SwiGLU width: ``intermediate_size``, else fla's rule from ``hidden_ratio``."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        ratio = 4 if self.hidden_ratio is None else self.hidden_ratio
        size = int(self.hidden_size * ratio * 2 / 3)
        return 256 * ((size + 255) // 256)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """From an fla config.json's contents. ``model_type`` must be ``MODEL_TYPE``;
        transformers' generic keys are skipped; keys that are not options of fla 0.6's config
        class are ignored with a warning naming them (fla ignores them too)."""
        if not isinstance(data, dict):
            raise TypeError(f"an fla config must be a dict, got {type(data).__name__}")
        if data.get("model_type", cls.MODEL_TYPE) != cls.MODEL_TYPE:
            raise ValueError(f"model_type must be {cls.MODEL_TYPE!r} (fla's {cls.FAMILY}), got "
                             f"{data.get('model_type')!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in known and k not in _GENERIC_KEYS)
        if unknown:
            warnings.warn(f"fla config keys {unknown} are not {cls.FAMILY}Config options of fla "
                          "0.6; ignored (fla ignores them too)", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, folder: str | Path) -> Any:
        """Read ``folder``/config.json; ValueError naming the file when it is missing or bad."""
        return cls.from_dict(read_config_json(folder))


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """The contents of ``folder``/config.json; ValueError naming the file when it is missing or
    not JSON."""
    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder} is not an fla checkpoint folder (no config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    return data


class FlaBlock(nn.Module):
    """fla's ``<Family>Block``: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)), ``attn`` the
    family's mixer (``config.layer()``).
    ``forward(x [B, T, d], state) -> (x [B, T, d], state)`` (state: the attn layer's)."""

    def __init__(self, config: FlaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = config.layer()
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.mlp_hidden_size())

    def forward(self, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        y, state = self.attn(self.attn_norm(x), state)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


class FlaModel(nn.Module):
    """fla's ``<Family>Model``: embeddings, layers, final norm.
    ``forward(input_ids [B, T], state=None) -> (hidden [B, T, d], state: list per layer)``."""

    def __init__(self, config: FlaConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                       padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(FlaBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: torch.Tensor, state: list[Any] | None = None
                ) -> tuple[torch.Tensor, list[Any]]:
        if state is None:
            state = [None] * len(self.layers)
        elif not isinstance(state, (list, tuple)) or len(state) != len(self.layers):
            raise ValueError(f"state must be None or a list of {len(self.layers)} layer states "
                             f"(as returned by forward), got {type(state).__name__}")
        x = self.embeddings(input_ids)  # [B, T, d]
        new_state = []
        for layer, s in zip(self.layers, state):
            x, s = layer(x, s)
            new_state.append(s)
        return self.norm(x), new_state


class FlaLM(nn.Module):
    """fla's ``<Family>ForCausalLM`` on fastweights' ops: ``model`` (FlaModel) and ``lm_head``;
    ``state_dict()`` keys are fla's checkpoint names. ``config_class`` is the family's config
    (FlaDeltaNetLM, FlaRetNetLM).

    ``forward(input_ids [B, T] long, state=None) -> (logits [B, T, V], state)``: feeding a
    sequence in pieces with the state carried gives the logits of feeding it whole.
    """

    config_class: ClassVar[type[FlaConfig]] = FlaConfig

    def __init__(self, config: FlaConfig) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}, got "
                            f"{type(config).__name__}")
        self.config = config
        self.model = FlaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def reset_parameters(self) -> None:
        """fla's initialisation of fresh models: normal(0, initializer_range) for every linear
        map and embedding, zero padding row, unit norm gains; convolutions keep nn.Conv1d's."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        if self.config.pad_token_id is not None:
            with torch.no_grad():
                self.model.embeddings.weight[self.config.pad_token_id].zero_()

    def forward(self, input_ids: torch.Tensor, state: list[Any] | None = None
                ) -> tuple[torch.Tensor, list[Any]]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long \
                or input_ids.dim() != 2 or min(input_ids.shape) < 1:
            raise ValueError("input_ids must be a [B, T] long tensor with B, T >= 1, got "
                             + (f"{input_ids.dtype} {tuple(input_ids.shape)}"
                                if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__))
        hidden, state = self.model(input_ids, state)
        return self.lm_head(hidden), state

    def num_parameters(self) -> int:
        """Parameters, counting tied weights once."""
        return sum(p.numel() for p in self.parameters())
