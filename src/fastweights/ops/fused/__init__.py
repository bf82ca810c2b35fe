"""The elementwise work a layer does around its recurrent op, fused (docs/kernels.md, "The
gated-delta layer's fused elementwise kernels"): ``short_conv_silu``, the causal depthwise short
convolution with SiLU and the L2 norm of its leading heads (Gated DeltaNet's q, k, v), and
``rms_norm_gated``, the gated RMSNorm of the output. Their PyTorch forms are ``forms.py``;
on CUDA, for float16 and bfloat16, the Triton kernels of ``triton.py`` (backend "triton",
ops/backend.py; float32 and float64 keep the PyTorch forms).

Dimension legend: B batch, T tokens, C channels, W taps, D the normalised size.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..._checks import check_choice, check_int, check_tensor, is_number
from .._autocast import float32_compute
from ..backend import Kernel, choose_backend, optional_module, register
from .forms import l2_normalize, rms_norm_gated_torch, short_conv_silu_torch

__all__ = ["GATE_ACTIVATIONS", "L2_EPS", "fused_kernels_run", "l2_normalize", "rms_norm_gated",
           "short_conv_silu"]

GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")  # "swish" is fla's name for SiLU
L2_EPS = 1e-6  # inside the square root, as fla's l2norm kernel and transformers' l2norm
MODE = "fused"  # the one form both ops have (the registry's ``mode``)


def _triton() -> ModuleType:
    from . import triton

    return triton


triton_kernels = optional_module(_triton)


INT32_SPAN = 2 ** 31  # the kernels' offsets along time (and the norm's row count) are int32


def _refusal(q: torch.Tensor, facts: dict) -> str | None:
    """What of a call the kernels cannot take: an L2-normalised head wider than MAX_GROUP,
    offsets past 32 bits (``span``: T times the row stride, or the norm's rows)."""
    from .triton import MAX_GROUP

    if facts.get("head_dim", 0) > MAX_GROUP:
        return (f"head_dim={facts['head_dim']}: the kernel holds an L2-normalised head whole, "
                f"head_dim <= {MAX_GROUP}")
    if facts.get("span", 0) >= INT32_SPAN:
        return f"{facts['span']} rows or elements along time: the kernels' offsets are int32"
    return None


_HALF = (torch.float16, torch.bfloat16)
_REFUSED = "float32 runs the PyTorch forms (the layers' reference path)"
for _op in ("short_conv_silu", "rms_norm_gated"):
    # one kernel for every T, decoding steps included
    register(_op, triton=tuple(
        Kernel(mode=MODE, dtypes=_HALF, refused=_REFUSED, kernels=triton_kernels,
               one_token=one, refuse=_refusal) for one in (False, True)), auxiliary=True)


def _choose(op: str, x: torch.Tensor, backend: str | None, facts: dict | None = None) -> str:
    """The backend of a fused op on x [B, T, ...] (the registry's q: [B, T, ..., 1], a view)."""
    return choose_backend(op, x[..., None] if x.dim() >= 2 else x[None, None, :, None],
                          backend, MODE, 1, facts=facts)


def fused_kernels_run(x: torch.Tensor, backend: str | None = None) -> bool:
    """Whether ``short_conv_silu`` on x [B, T, C] would run its Triton kernels under
    ``backend`` (the automatic choice: float16/bfloat16 CUDA inputs), so that a layer whose own
    PyTorch path is cheaper per call on the CPU (a decoding step's three short convolutions)
    takes the fused op only where its kernels run."""
    return _choose("short_conv_silu", x, backend) == "triton"


@float32_compute
def short_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    initial_state: torch.Tensor | None = None, norm_heads: int = 0, head_dim: int = 1,
    eps: float = L2_EPS, output_final_state: bool = False, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SiLU of the causal depthwise convolution of x over time, the first ``norm_heads`` heads
    of ``head_dim`` channels then L2-normalised:

        a[t, c] = bias[c] + sum_j weight[c, j] full[t + j, c]    full = [past, x], W - 1 + T rows
        s = silu(a);  y[t, head] = s[t, head] / sqrt(|s[t, head]|^2 + eps) for the first heads

    x [B, T, C] (any strides; the layer's slice of its projections), weight [C, 1, W] (nn.Conv1d's
    depthwise layout) or [C, W], bias [C] or None, ``initial_state`` [B, C, W - 1] the carried
    inputs (None: zeros). Returns (y [B, T, C] in x's dtype, computed in float32, float64 for
    float64 inputs; with ``output_final_state`` the last W - 1 rows of full [B, C, W - 1] in
    the dtype holding both x's and the state's values, else None).

    ``backend``: "triton", "torch" or None (automatic; ops/backend.py): the Triton kernels for
    float16/bfloat16 CUDA inputs with ``head_dim`` <= 256, the PyTorch form otherwise."""
    check_tensor("x", x, 3, "[B, T, C]")
    B, T, C = x.shape
    check_tensor("weight", weight)
    if weight.dim() == 3 and weight.shape[1] == 1:
        W = weight.shape[2]
    elif weight.dim() == 2:
        W = weight.shape[1]
    else:
        W = 0
    if weight.shape[0] != C or W < 1:
        raise ValueError(f"weight must have shape [C, 1, W] or [C, W] with C = {C} (x's "
                         f"channels), got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, "[C]")
        if bias.shape[0] != C:
            raise ValueError(f"bias must have shape [C] = [{C}], got {tuple(bias.shape)}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, 3, "[B, C, W - 1]")
        if tuple(initial_state.shape) != (B, C, W - 1):
            raise ValueError(f"initial_state must have shape [B, C, W - 1] = {[B, C, W - 1]}, "
                             f"got {tuple(initial_state.shape)}")
    check_int("norm_heads", norm_heads, 0)
    check_int("head_dim", head_dim, 1)
    if norm_heads * head_dim > C:
        raise ValueError(f"norm_heads * head_dim ({norm_heads} * {head_dim}) must be at most "
                         f"C = {C}, the channels of x")
    if not is_number(eps) or not 0 < eps < 1:
        raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
    for name, t in (("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    n = norm_heads * head_dim
    facts = {"head_dim": head_dim if n else 0, "span": T * max(x.stride(1), C)}
    if _choose("short_conv_silu", x, backend, facts) == "triton":
        y = triton_kernels().short_conv_silu_triton(x, weight, bias, initial_state, n,
                                                    head_dim, float(eps))
    else:
        y = short_conv_silu_torch(x, weight, bias, initial_state, n, head_dim, float(eps))
    if not output_final_state:
        return y, None
    past = (x.new_zeros(B, C, W - 1) if initial_state is None
            else initial_state.to(torch.promote_types(initial_state.dtype, x.dtype)))
    full = torch.cat([past, x[:, max(0, T - (W - 1)):].transpose(1, 2).to(past.dtype)], dim=2)
    return y, full[:, :, full.shape[2] - (W - 1):]


@float32_compute
def rms_norm_gated(
    x: torch.Tensor, weight: torch.Tensor | None = None, gate: torch.Tensor | None = None, *,
    eps: float = 1e-6, activation: str = "swish", out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim times the gate's activation (norm before gate: fla's
    FusedRMSNormGated, transformers' Qwen3.5 RMSNormGated):

        y = x / sqrt(mean(x^2) + eps) * weight * act(gate)

    x [..., D], weight [D] or None (a gain of 1), gate [..., D] or None (no gate); ``act``
    SiLU (``activation`` "swish" or "silu") or the sigmoid. Computed in float32 (float64 for
    float64 inputs), rounded once to ``out_dtype`` (None: x's dtype).

    ``backend``: "triton", "torch" or None (automatic; ops/backend.py): the Triton kernels for
    float16/bfloat16 CUDA inputs (x and gate read in place: the dims before the next-to-last
    must flatten to one stride, as a [B, T, H, D] view of a wider [B, T, .] tensor does), the
    PyTorch form otherwise."""
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape [..., D] with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    if weight is not None:
        check_tensor("weight", weight, 1, "[D]")
        if weight.shape[0] != D:
            raise ValueError(f"weight must have shape [D] = [{D}], got {tuple(weight.shape)}")
    if gate is not None:
        check_tensor("gate", gate)
        if gate.shape != x.shape:
            raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got "
                             f"{tuple(gate.shape)}")
    for name, t in (("weight", weight), ("gate", gate)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if not is_number(eps) or not 0 < eps < 1:
        raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
    check_choice("activation", activation, GATE_ACTIVATIONS)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating-point torch.dtype or None, got "
                        f"{out_dtype!r}")
    if _choose("rms_norm_gated", x, backend, {"span": x.numel() // D}) == "triton":
        return triton_kernels().rms_norm_gated_triton(x, weight, gate, float(eps), activation,
                                                      out_dtype)
    return rms_norm_gated_torch(x, weight, gate, float(eps), activation == "sigmoid",
                                out_dtype)
