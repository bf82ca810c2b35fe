"""Shared test helpers: float64 comparison and readable ids."""

from __future__ import annotations

import torch

ATOL64 = 1e-10


def assert_close64(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL64, what: str = "") -> None:
    """Max abs difference within atol (float64 oracle comparisons)."""
    assert a.shape == b.shape, f"{what} shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"{what} max abs diff {err:.3e} > {atol:.1e}"


def shape_id(B: int, T: int, H: int, Dk: int, Dv: int | None = None, dtype: torch.dtype = torch.float64) -> str:
    dv = "" if Dv is None else f"-Dv{Dv}"
    return f"B{B}-T{T}-H{H}-Dk{Dk}{dv}-{str(dtype).removeprefix('torch.')}"
