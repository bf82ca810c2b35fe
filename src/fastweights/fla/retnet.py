"""flash-linear-attention's RetNet: its config ``FlaRetNetConfig`` (fla 0.6's ``RetNetConfig``;
``FLA_RETNET_OPTIONS`` says what each field does here) and ``FlaRetNetLM``, on the ``retnet``
layer (``fastweights.layers.FlaMultiScaleRetention``, which keeps fla's parameter names; see
that module for the maths). Float64 outputs equal fla's own model code run with its PyTorch
references (tests/fla/test_retnet_reference.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..layers.fla_retnet import FEATURE_MAPS, FlaMultiScaleRetention
from .model import COMMON_FLA_OPTIONS, FlaConfig, FlaLM

RETNET_MODEL_TYPE = "retnet"  # fla's model_type for RetNet
ATTN_MODES = ("chunk", "fused_chunk", "parallel", "fused_recurrent")  # fla's retention kernels

# Every argument of fla 0.6's RetNetConfig and what fastweights does with it.
FLA_RETNET_OPTIONS: dict[str, str] = {
    **COMMON_FLA_OPTIONS,
    "num_kv_heads": "supported (grouped keys/values: each serves num_heads / num_kv_heads "
                    "consecutive query heads)",
    "expand_k": "supported (the key head dim must be even: rotary pairs)",
    "expand_v": "supported",
    "feature_map": "supported: None, " + ", ".join(repr(n) for n in FEATURE_MAPS)
                   + "; refused: transformers' other activations (parametrised, clipped or "
                     "variant GELU formulas)",
    "use_output_gate": "supported (g_proj and the SiLU-gated output RMSNorm)",
    "elementwise_affine": "supported (False or None: the output RMSNorm has no weight)",
    "hidden_act": "supported: 'swish' (the SwiGLU MLP and the output gate's SiLU); refused: "
                  "'powlu'",
    "attn_mode": "accepted, no effect: 'chunk', 'fused_chunk', 'parallel' and 'fused_recurrent' "
                 "pick fla's GPU kernel for the same retention; other values refused",
    "fuse_norm": "accepted, no effect on outputs: fused and unfused RMSNorm (+ residual, + gate) "
                 "are the same maths; it names the output norm as fla does (g_norm_swish_gate "
                 "when fused with the gate, else g_norm)",
    "use_short_conv": "accepted, no effect: fla 0.6's RetNetBlock does not pass it to its layer, "
                      "so fla's RetNet models have no short convolutions (warning when True)",
    "conv_size": "accepted, no effect (as use_short_conv)",
    "max_position_embeddings": "accepted, no effect: fla's rotary tables grow with the sequence",
}


@dataclass
class FlaRetNetConfig(FlaConfig):
    """fla 0.6's ``RetNetConfig`` fields with its defaults (a config.json that omits a key
    means fla's default). ``FLA_RETNET_OPTIONS`` says what each field does here; refused values
    raise ValueError naming the field."""

    MODEL_TYPE: ClassVar[str] = RETNET_MODEL_TYPE
    FAMILY: ClassVar[str] = "RetNet"
    OPTIONS: ClassVar[dict[str, str]] = FLA_RETNET_OPTIONS
    BOOL_FIELDS: ClassVar[tuple[str, ...]] = (*FlaConfig.BOOL_FIELDS, "use_short_conv",
                                              "use_output_gate")

    attn_mode: str = "chunk"
    expand_k: float = 1.0
    expand_v: float = 2.0
    hidden_ratio: int | float | None = 2
    num_heads: int = 8
    num_kv_heads: int | None = None
    feature_map: str | None = None
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_gate: bool = True
    elementwise_affine: bool | None = True

    def __post_init__(self) -> None:
        self._check_common()
        if self.attn_mode not in ATTN_MODES:
            raise ValueError(f"FlaRetNetConfig.attn_mode must be one of {ATTN_MODES} (fla's "
                             f"kernel choice; the maths is the same), got {self.attn_mode!r}")
        if self.elementwise_affine not in (True, False, None):
            raise TypeError(f"FlaRetNetConfig.elementwise_affine must be a bool or None, got "
                            f"{self.elementwise_affine!r}")
        if self.feature_map is not None and self.feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"FlaRetNetConfig.feature_map must be None or one of {sorted(FEATURE_MAPS)}, got "
                f"{self.feature_map!r} (transformers' parametrised, clipped and variant-GELU "
                "activations are not supported)")
        if self.use_short_conv:
            warnings.warn(
                "use_short_conv=True: fla 0.6's RetNetBlock does not pass this option to its "
                "layer, so fla's RetNet has no short convolutions (its checkpoints have no conv "
                "weights); fastweights does the same to stay equal to fla", stacklevel=3)
        # The layer's own checks (expand ratios, head split, kv heads), on the meta device.
        with torch.device("meta"):
            self.layer()

    def layer(self) -> FlaMultiScaleRetention:
        """A fresh retention layer of this config (fla's ``RetNetBlock`` arguments)."""
        return FlaMultiScaleRetention(
            self.hidden_size, self.num_heads, expand_k=self.expand_k, expand_v=self.expand_v,
            num_kv_heads=self.num_kv_heads, feature_map=self.feature_map,
            use_output_gate=self.use_output_gate,
            elementwise_affine=bool(self.elementwise_affine), norm_eps=self.norm_eps,
            fuse_norm=self.fuse_norm)


class FlaRetNetLM(FlaLM):
    """fla's RetNetForCausalLM on fastweights' ops (``FlaLM`` of a ``FlaRetNetConfig``)."""

    config_class = FlaRetNetConfig
