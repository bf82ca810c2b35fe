"""Feature maps phi of the fast weight programmers (docs/maths.md 1.2) and sum normalisation (1.4).

Dimension legend: ``...`` any leading dims, ``d`` input feature size, ``m`` FAVOR+ random
features, ``nu`` DPFP roll count. All maps act on the last dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_device,
    check_int,
    check_nonneg_float,
    check_positive_int,
    check_tensor,
)
from ._autocast import float32_compute


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = ELU(x) + 1 (Katharopoulos et al.), elementwise and > 0. [..., d] -> [..., d]."""
    check_tensor("x", x)
    return F.elu(x) + 1.0


def relu(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = max(x, 0). [..., d] -> [..., d]."""
    check_tensor("x", x)
    return F.relu(x)


def dpfp(x: torch.Tensor, nu: int = 1) -> torch.Tensor:
    """Deterministic parameter-free projection DPFP-nu (docs/maths.md 1.2). [..., d] ->
    [..., 2*d*nu].

    With r = [relu(x), relu(-x)] in R^{2d}, phi(x) = concat_{j=1..nu} r * roll(r, j), where
    roll(r, j)_i = r_{(i - j) mod 2d}.
    """
    check_tensor("x", x)
    check_int("nu", nu, 1)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    # torch.roll(r, j)[i] = r[(i - j) mod 2d], exactly the paper's roll.
    return torch.cat([r * torch.roll(r, shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)


def sum_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / (sum_i x_i + eps) over the last dim (docs/maths.md 1.4). [..., d] -> [..., d].

    The papers divide without eps; we add ``eps`` (default 1e-6) so an all-zero feature vector
    (possible for DPFP at x = 0) maps to zero instead of NaN. Pass ``eps=0`` for the literal form.
    Meant for non-negative features.
    """
    check_tensor("x", x)
    check_nonneg_float("eps", eps)
    return x / (x.sum(dim=-1, keepdim=True) + eps)


def draw_favor_projection(
    m: int, d: int, *, orthogonal: bool = True, generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw the FAVOR+ random projection Omega^T (docs/maths.md 1.2). Returns ``[m, d]``.

    Rows are Gaussian directions; with ``orthogonal=True`` rows are orthogonal within blocks of
    d (QR of a Gaussian d x d matrix) and each row is rescaled to the norm of an independent
    d-dimensional standard Gaussian vector (chi_d), so every row is marginally N(0, I_d).
    """
    check_positive_int("m", m)
    check_positive_int("d", d)
    check_bool("orthogonal", orthogonal)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"dtype must be a floating-point dtype (float16/bfloat16/float32/float64), got {dtype}"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    gen_device = generator.device if generator is not None else "cpu"

    def gauss(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=gen_device, dtype=torch.float64)

    if not orthogonal:
        w = gauss(m, d)
    else:
        blocks = []
        for _ in range(math.ceil(m / d)):
            qmat, rmat = torch.linalg.qr(gauss(d, d))
            # Sign fix makes Q Haar-distributed rather than biased by the QR convention.
            qmat = qmat * torch.sign(torch.diagonal(rmat)).unsqueeze(0)
            blocks.append(qmat.T)  # rows orthonormal
        w = torch.cat(blocks, dim=0)[:m]
        w = w * gauss(m, d).norm(dim=-1, keepdim=True)
    return w.to(dtype=dtype, device=device if device is not None else gen_device)


@float32_compute
def favor_features(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Positive random features of FAVOR+ (docs/maths.md 1.2). x [..., d], projection [m, d] ->
    [..., 2m].

    phi(x) = (2m)^{-1/2} exp(-||x||^2/2) [exp(x Omega), exp(-x Omega)], evaluated as a single
    exponential of the summed log terms so large ||x|| does not overflow. E[phi(q).phi(k)] =
    exp(q.k); no temperature is applied inside. Computed in float32 or wider.
    """
    check_tensor("x", x)
    check_tensor("projection", projection, 2, "[m, d]")
    if projection.shape[1] != x.shape[-1]:
        raise ValueError(
            f"projection must have shape [m, d] with d = x.shape[-1] = {x.shape[-1]}, "
            f"got {tuple(projection.shape)}"
        )
    check_device("projection", projection, x, ref_name="x")
    m = projection.shape[0]
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(cdtype)
    proj = xc @ projection.to(cdtype).T  # [..., m]
    offset = -0.5 * (xc * xc).sum(dim=-1, keepdim=True) - 0.5 * math.log(2 * m)
    feats = torch.exp(torch.cat([proj + offset, -proj + offset], dim=-1))
    return feats.to(x.dtype)


FEATURE_MAPS = ("elu", "relu", "dpfp", "favor", "identity")


def feature_map(
    x: torch.Tensor, name: str, *, nu: int = 1, projection: torch.Tensor | None = None,
) -> torch.Tensor:
    """phi(x) by name: ``elu`` (ELU+1), ``relu``, ``dpfp`` (with ``nu``), ``favor`` (with
    ``projection`` [m, d], the same draw for queries and keys) or ``identity``. [..., d] -> [..., d_dot]."""
    if name == "elu":
        return elu_plus_one(x)
    if name == "relu":
        return relu(x)
    if name == "dpfp":
        return dpfp(x, nu)
    if name == "favor":
        if projection is None:
            raise ValueError("feature map 'favor' needs a projection [m, d] (draw_favor_projection)")
        return favor_features(x, projection)
    if name == "identity":
        check_tensor("x", x)
        return x
    raise ValueError(f"feature map must be one of {list(FEATURE_MAPS)}, got {name!r}")
