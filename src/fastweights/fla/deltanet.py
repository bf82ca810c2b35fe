"""flash-linear-attention's DeltaNet: its config ``FlaDeltaNetConfig`` (fla 0.6's
``DeltaNetConfig``; ``FLA_OPTIONS`` says what each field does here) and ``FlaDeltaNetLM``, on
the ``fla-delta`` layer (``fastweights.layers.FlaDeltaNet``, which keeps fla's parameter names;
see that module for the maths). Float64 outputs equal fla's own model code run with its
PyTorch references (tests/fla/test_deltanet_reference.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..layers.fla_deltanet import FlaDeltaNet
from .model import COMMON_FLA_OPTIONS, FlaConfig, FlaLM

MODEL_TYPE = "delta_net"  # fla's model_type for DeltaNet

# Every argument of fla 0.6's DeltaNetConfig and what fastweights does with it.
FLA_OPTIONS: dict[str, str] = {
    **COMMON_FLA_OPTIONS,
    "expand_k": "supported",
    "expand_v": "supported",
    "use_gate": "supported (g_proj and the SiLU-gated output RMSNorm)",
    "use_short_conv": "supported (causal depthwise convolutions with SiLU, carried in the state)",
    "conv_size": "supported",
    "use_beta": "supported (beta = 1 when False)",
    "allow_neg_eigval": "supported (beta doubled)",
    "qk_norm": "supported: 'l2', 'sum'",
    "qk_activation": "supported: 'silu', 'relu', 'elu' (ELU + 1), 'identity'",
    "hidden_act": "supported: 'swish'; refused: 'powlu'",
    "attn_mode": "accepted, no effect: 'chunk' and 'fused_recurrent' pick fla's GPU kernel for "
                 "the same delta rule; refused: 'fused_chunk' (fla refuses it too)",
    "fuse_norm": "accepted, no effect: fused and unfused RMSNorm + residual are the same maths",
    "use_output_norm": "accepted, no effect: fla 0.6's DeltaNet layer ignores it and always "
                       "applies its output RMSNorm, and so does fastweights (warning when False)",
    "max_position_embeddings": "accepted, no effect: DeltaNet layers have no positions",
}

@dataclass
class FlaDeltaNetConfig(FlaConfig):
    """fla 0.6's ``DeltaNetConfig`` fields with its defaults. ``FLA_OPTIONS`` says what each
    field does here; refused values raise ValueError naming the field."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    FAMILY: ClassVar[str] = "DeltaNet"
    OPTIONS: ClassVar[dict[str, str]] = FLA_OPTIONS
    BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        *FlaConfig.BOOL_FIELDS, "use_gate", "use_short_conv", "allow_neg_eigval", "use_beta",
        "use_output_norm")
    SIZE_FIELDS: ClassVar[tuple[str, ...]] = (*FlaConfig.SIZE_FIELDS, "conv_size")

    attn_mode: str = "chunk"
    expand_k: float = 1.0
    expand_v: float = 1.0
    use_gate: bool = False
    use_short_conv: bool = True
    allow_neg_eigval: bool = False
    conv_size: int = 4
    use_beta: bool = True
    use_output_norm: bool = True
    num_heads: int = 16
    qk_norm: str = "l2"
    qk_activation: str = "silu"
    hidden_ratio: int | float | None = 4

    def __post_init__(self) -> None:
        self._check_common()
        if self.attn_mode not in ("chunk", "fused_recurrent"):
            raise ValueError(
                f"FlaDeltaNetConfig.attn_mode must be 'chunk' or 'fused_recurrent' (fla's kernel "
                f"choice; the maths is the same), got {self.attn_mode!r}")
        if not self.use_output_norm:
            warnings.warn(
                "use_output_norm=False: fla 0.6's DeltaNet layer ignores this option and always "
                "applies its output RMSNorm (its checkpoints have o_norm weights); fastweights "
                "does the same to stay equal to fla", stacklevel=3)
        # The layer's own checks (qk options, expand ratios, head split), on the meta device.
        with torch.device("meta"):
            self.layer()

    def layer(self) -> FlaDeltaNet:
        """A fresh DeltaNet layer of this config (fla's ``DeltaNetBlock`` arguments)."""
        return FlaDeltaNet(
            self.hidden_size, self.num_heads, expand_k=self.expand_k, expand_v=self.expand_v,
            use_beta=self.use_beta, use_gate=self.use_gate, use_short_conv=self.use_short_conv,
            conv_size=self.conv_size, allow_neg_eigval=self.allow_neg_eigval,
            qk_activation=self.qk_activation, qk_norm=self.qk_norm, norm_eps=self.norm_eps)


class FlaDeltaNetLM(FlaLM):
    """fla's DeltaNetForCausalLM on fastweights' ops (``FlaLM`` of a ``FlaDeltaNetConfig``)."""

    config_class = FlaDeltaNetConfig
