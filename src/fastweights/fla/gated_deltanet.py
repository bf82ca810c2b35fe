"""flash-linear-attention's GatedDeltaNet: its config ``FlaGatedDeltaNetConfig`` (fla 0.6's
``GatedDeltaNetConfig``; ``FLA_GATED_DELTANET_OPTIONS`` says what each field does here) and
``FlaGatedDeltaNetLM``, on the ``gated-delta`` layer (``fastweights.layers.GatedDeltaNet``),
which is fla's ``GatedDeltaNet`` layer with its parameter names (q_proj, k_proj, v_proj,
a_proj, b_proj, A_log, dt_bias, q_conv1d, k_conv1d, v_conv1d, g_proj, o_norm, o_proj) and
arithmetic (see that module for the maths). Float64 outputs equal fla's own model code run
with its PyTorch references (tests/fla/test_gated_deltanet_reference.py).

fla's layer arguments from the config: ``num_heads`` key heads of size ``head_dim``,
``num_v_heads`` value heads (default num_heads; grouped, a multiple of num_heads) of size
``head_dim * expand_v``, ``use_gate`` with ``output_gate_activation``, ``use_short_conv``
with ``conv_size`` (no convolution bias: fla's block does not pass one),
``allow_neg_eigval`` and ``norm_eps`` (the output norm's too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..layers.gated_delta import GatedDeltaNet
from .model import COMMON_FLA_OPTIONS, FlaConfig, FlaLM

MODEL_TYPE = "gated_deltanet"  # fla's model_type for GatedDeltaNet

# Every argument of fla 0.6's GatedDeltaNetConfig and what fastweights does with it.
FLA_GATED_DELTANET_OPTIONS: dict[str, str] = {
    **COMMON_FLA_OPTIONS,
    "head_dim": "supported (the query/key head size)",
    "num_v_heads": "supported: None (= num_heads) or a multiple of num_heads (grouped value "
                   "heads); refused otherwise",
    "expand_v": "supported (value head size = head_dim * expand_v, an integer)",
    "use_gate": "supported (g_proj and the gated output RMSNorm)",
    "output_gate_activation": "supported: 'swish', 'silu' (the same), 'sigmoid'",
    "use_short_conv": "supported (causal depthwise convolutions with SiLU, carried in the state)",
    "conv_size": "supported",
    "allow_neg_eigval": "supported (beta doubled)",
    "hidden_act": "supported: 'swish'; refused: 'powlu'",
    "attn_mode": "accepted, no effect: 'chunk' and 'fused_recurrent' pick fla's GPU kernel for "
                 "the same gated delta rule; other values refused (fla refuses them too)",
    "fuse_norm": "accepted, no effect: fused and unfused RMSNorm + residual are the same maths",
    "max_position_embeddings": "accepted, no effect: GatedDeltaNet layers have no positions",
}


@dataclass
class FlaGatedDeltaNetConfig(FlaConfig):
    """fla 0.6's ``GatedDeltaNetConfig`` fields with its defaults. ``FLA_GATED_DELTANET_OPTIONS``
    says what each field does here; refused values raise ValueError naming the field."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    FAMILY: ClassVar[str] = "GatedDeltaNet"
    OPTIONS: ClassVar[dict[str, str]] = FLA_GATED_DELTANET_OPTIONS
    BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        *FlaConfig.BOOL_FIELDS, "use_gate", "use_short_conv", "allow_neg_eigval")
    SIZE_FIELDS: ClassVar[tuple[str, ...]] = (*FlaConfig.SIZE_FIELDS, "conv_size", "head_dim")

    attn_mode: str = "chunk"
    expand_v: float = 2.0
    use_gate: bool = True
    use_short_conv: bool = True
    allow_neg_eigval: bool = False
    conv_size: int = 4
    head_dim: int = 256
    num_heads: int = 6
    num_v_heads: int | None = None
    hidden_ratio: int | float | None = 4
    num_hidden_layers: int = 21
    output_gate_activation: str = "swish"

    def __post_init__(self) -> None:
        self._check_common()
        name = type(self).__name__
        if self.attn_mode not in ("chunk", "fused_recurrent"):
            raise ValueError(
                f"{name}.attn_mode must be 'chunk' or 'fused_recurrent' (fla's kernel choice; "
                f"the maths is the same), got {self.attn_mode!r}")
        if self.num_v_heads is not None and (
                not isinstance(self.num_v_heads, int) or self.num_v_heads < 1
                or self.num_v_heads % self.num_heads):
            raise ValueError(f"{name}.num_v_heads must be None or a positive multiple of "
                             f"num_heads ({self.num_heads}), got {self.num_v_heads!r}")
        # The layer's own checks (expand_v, the gate activation), on the meta device.
        with torch.device("meta"):
            self.layer()

    def layer(self) -> GatedDeltaNet:
        """A fresh GatedDeltaNet layer of this config (fla's ``GatedDeltaNetBlock`` arguments)."""
        return GatedDeltaNet(
            self.hidden_size, self.num_heads, head_dim=self.head_dim,
            num_v_heads=self.num_v_heads, expand_v=self.expand_v, use_gate=self.use_gate,
            gate_activation=self.output_gate_activation, use_short_conv=self.use_short_conv,
            conv_size=self.conv_size, allow_neg_eigval=self.allow_neg_eigval,
            norm_eps=self.norm_eps)


class FlaGatedDeltaNetLM(FlaLM):
    """fla's GatedDeltaNetForCausalLM on fastweights' ops (``FlaLM`` of a
    ``FlaGatedDeltaNetConfig``)."""

    config_class = FlaGatedDeltaNetConfig

