"""Long CPU calls of the chunked forms run in pieces along time (ops/_pieces.py): same outputs,
final states and gradients as one call, pieces that end on chunk / mini-batch bounds."""

from __future__ import annotations

import importlib

import pytest
import torch

from fastweights.ops import (
    _pieces,
    decay_linear_attn,
    delta_rule,
    gated_delta_rule,
    linear_attn,
    ttt_linear,
    ttt_mlp,
)
from tests.helpers import assert_close64

F64 = torch.float64
B, T, H, D = 2, 45, 3, 4  # T: 11 chunks of 4 and a short one; 5 mini-batches of 8 and a tail


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return scale * torch.randn(*s, generator=g, dtype=F64)

    k = torch.nn.functional.normalize(r(B, T, H, D), dim=-1)
    return {"q": r(B, T, H, D), "k": k, "v": r(B, T, H, D),
            "beta": torch.sigmoid(r(B, T, H)), "g": -torch.rand(B, T, H, generator=g, dtype=F64),
            "eta": (0.1 + torch.rand(B, T, H, generator=g, dtype=F64)) / (10 * D),
            "W": r(B, H, D, D, scale=0.3), "b": r(B, H, D, scale=0.3),
            "W1": r(B, H, D, 4 * D, scale=0.3), "b1": r(B, H, 4 * D, scale=0.3),
            "W2": r(B, H, 4 * D, D, scale=0.3), "b2": r(B, H, D, scale=0.3),
            "lw": 1 + r(H, D, scale=0.3), "lb": r(H, D, scale=0.3), "S": r(B, H, D, D)}


def _calls(x: dict[str, torch.Tensor]):
    """name -> (function of the time-major inputs and the state-bearing tensors, unit)."""
    ttt = {"ln_weight": x["lw"], "ln_bias": x["lb"], "residual": True, "mini_batch_size": 8,
           "output_final_state": True}
    return {
        "linear_attn": (lambda q, k, v, S: linear_attn(
            q, k, v, normalize=True, initial_state=(S, k[:, 0].abs() + 1), chunk_size=4,
            output_final_state=True), 4),
        "delta_rule": (lambda q, k, v, S: delta_rule(
            q, k, v, x["beta"], initial_state=S, chunk_size=4, output_final_state=True), 4),
        "gated_delta_rule": (lambda q, k, v, S: gated_delta_rule(
            q, k, v, x["beta"], x["g"], initial_state=S, chunk_size=4, output_final_state=True), 4),
        "decay_linear_attn": (lambda q, k, v, S: decay_linear_attn(
            q, k, v, torch.tensor([0.5, 0.9, 0.99], dtype=F64), initial_state=S, chunk_size=4,
            output_final_state=True), 4),
        "ttt_linear": (lambda q, k, v, S: ttt_linear(
            q, k, v, x["eta"], initial_state=(x["W"] + S, x["b"]), **ttt), 8),
        "ttt_mlp": (lambda q, k, v, S: ttt_mlp(
            q, k, v, x["eta"], initial_state=(x["W1"], x["b1"], x["W2"] + S, x["b2"]),
            checkpoint_group=2, **ttt), 8),
    }


def _flat(state) -> list[torch.Tensor]:
    out = []
    for s in (state if isinstance(state, (tuple, list)) else [state]):
        if isinstance(s, torch.Tensor):
            out.append(s)
        elif isinstance(s, (tuple, list)):
            out += _flat(s)
    return out


@pytest.mark.parametrize("name", ["linear_attn", "delta_rule", "gated_delta_rule",
                                  "decay_linear_attn", "ttt_linear", "ttt_mlp"])
def test_pieces_equal_one_call(name, monkeypatch):
    x = _inputs()
    fn, unit = _calls(x)[name]
    if name == "ttt_mlp":  # TTT-MLP's state S enters W2: [B, H, 4D, D]
        x["S"] = torch.randn(B, H, 4 * D, D, generator=torch.Generator().manual_seed(1),
                             dtype=F64) * 0.3
    elif name.startswith("ttt"):
        x["S"] = x["S"] * 0.3

    def run():
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "S")]
        o, state = fn(*leaves)
        tensors = [o, *_flat(state)]
        loss = sum((t * torch.randn(t.shape, generator=torch.Generator().manual_seed(i),
                                    dtype=F64)).sum() for i, t in enumerate(tensors))
        loss.backward()
        return [t.detach() for t in tensors], [leaf.grad for leaf in leaves]

    whole, whole_grads = run()
    seen = []
    real = _pieces.in_pieces

    def spy(run_piece, xs, state, piece, first=0):
        seen.append(piece)
        return real(run_piece, xs, state, piece, first)

    monkeypatch.setattr(_pieces, "in_pieces", spy)
    for module in ("delta_rule", "linear_attn", "gated_delta_rule", "transnormer.decay",
                   "ttt.inner_loop"):
        monkeypatch.setattr(importlib.import_module(f"fastweights.ops.{module}"), "in_pieces", spy)
    per_token = B * H * D * 8
    monkeypatch.setattr(_pieces, "PIECE_BYTES", 2 * unit * per_token + 5)  # 2 units per piece
    parts, part_grads = run()
    assert seen and seen[0] == 2 * unit, f"the call did not run in pieces: {seen}"
    for a, b_ in zip(parts, whole):
        assert_close64(a, b_, atol=1e-12, what=f"{name} output/state")
    for a, b_ in zip(part_grads, whole_grads):
        assert_close64(a, b_, atol=1e-12, what=f"{name} gradient")


def test_ttt_pieces_finish_an_open_mini_batch_first(monkeypatch):
    """A state that ends inside a mini-batch (pos 3 of 8): the first piece completes it, every
    later piece starts on a mini-batch bound; outputs and the final state equal one call."""
    x = _inputs(2)
    kw = {"ln_weight": x["lw"], "ln_bias": x["lb"], "mini_batch_size": 8,
          "output_final_state": True}
    args = [x[n] for n in ("q", "k", "v", "eta")]
    _, mid = ttt_linear(*(a[:, :3] for a in args), initial_state=(x["W"], x["b"]), **kw)
    whole, whole_state = ttt_linear(*(a[:, 3:] for a in args), initial_state=mid, **kw)
    lengths = []
    real = _pieces.in_pieces

    def spy(run_piece, xs, state, piece, first=0):
        def counted(*a):
            lengths.append(a[0].shape[1])
            return run_piece(*a)
        return real(counted, xs, state, piece, first)

    monkeypatch.setattr("fastweights.ops.ttt.inner_loop.in_pieces", spy)
    monkeypatch.setattr(_pieces, "PIECE_BYTES", 16 * B * H * D * 8)  # 16 tokens per piece
    parts, state = ttt_linear(*(a[:, 3:] for a in args), initial_state=mid, **kw)
    assert lengths == [13, 16, 13], lengths  # 42 tokens from place 3: 13 + 16 + 13
    assert_close64(parts, whole, atol=1e-12, what="output")
    for a, b_ in zip(_flat(state), _flat(whole_state)):
        assert_close64(a, b_, atol=1e-12, what="state")
    assert state[-1] == whole_state[-1]


def test_no_pieces_off_the_cpu_or_when_the_call_fits():
    x = torch.zeros(1, 64, 2, 4)
    assert _pieces.piece_length(x, 4, 16) is None  # 2 KiB: fits
    assert _pieces.piece_length(torch.zeros(1, 64, 2, 4, device="meta"), 4, 16) is None
    big = torch.empty(1, 2 ** 16, 8, 64)  # 128 MiB of float32
    n = _pieces.piece_length(big, 64, 64)
    assert n is not None and n % 64 == 0 and n * 8 * 64 * 4 <= _pieces.PIECE_BYTES
