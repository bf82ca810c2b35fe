"""TransNormer ops (docs/maths.md 3.1, 3.2, 3.5, 3.7): NormAttention's un-normalised linear
attention, decay_linear_attn, block_attention and srms_norm, each against an explicit formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops import (
    block_attention,
    decay_linear_attn,
    elu_plus_one,
    linear_attn,
    softmax_attention,
)
from fastweights.ops.transnormer import srms_norm
from fastweights.ops.transnormer.naive import block_attention_naive
from tests.helpers import assert_close64, shape_id

SHAPES = [(2, 37, 3, 5, 7), (1, 1, 1, 4, 4), (3, 16, 2, 8, 3), (1, 65, 2, 6, 6)]
IDS = [shape_id(*s) for s in SHAPES]
CHUNKS = [1, 5, 16, 64]


def make(B, T, H, Dk, Dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dk, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, Dk, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    return q, k, v


def decays(H, seed=0, dtype=torch.float64):
    """Per-head decays in (0, 1], including exactly 1 (no decay) when H > 1."""
    lam = 0.3 + 0.7 * torch.rand(H, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    if H > 1:
        lam[-1] = 1.0
    return lam


def masked_quadratic(q, k, v, lam=None, S0=None):
    """O = (Q K^T ⊙ D) V [+ lambda^{i+1} Q S0] with D_ij = lambda^{i-j} for i >= j, by loops."""
    B, T, H, _ = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for h in range(H):
        lh = 1.0 if lam is None else lam[h].item()
        for i in range(T):
            for j in range(i + 1):
                w = (q[:, i, h] * k[:, j, h]).sum(-1, keepdim=True) * lh ** (i - j)
                o[:, i, h] += w * v[:, j, h]
            if S0 is not None:
                o[:, i, h] += lh ** (i + 1) * torch.einsum("bd,bde->be", q[:, i, h], S0[:, h])
    return o


# --- NormAttention core: un-normalised linear attention (docs/maths.md 3.1) -----------------------

@pytest.mark.parametrize("act", ["1+elu", "elu"])
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"C{c}")
def test_norm_attention_forms_equal_masked_quadratic(act, chunk):
    q, k, v = make(2, 37, 3, 5, 7)
    phi = elu_plus_one if act == "1+elu" else F.elu
    q, k = phi(q), phi(k)
    ref = masked_quadratic(q, k, v)
    for mode in ("naive", "recurrent", "chunk"):
        o, _ = linear_attn(q, k, v, normalize=False, mode=mode, chunk_size=chunk)
        assert_close64(o, ref, what=f"{act} {mode}")
    # lambda = 1 in the decay op is the same un-normalised attention
    o, _ = decay_linear_attn(q, k, v, torch.ones(3, dtype=torch.float64), chunk_size=chunk)
    assert_close64(o, ref, what="decay op with lambda 1")


# --- decay_linear_attn (docs/maths.md 3.5) --------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"C{c}")
def test_decay_forms_agree(shape, chunk):
    B, _, H, Dk, Dv = shape
    q, k, v = make(*shape)
    lam = decays(H)
    S0 = torch.randn(B, H, Dk, Dv, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref, Sr = decay_linear_attn(q, k, v, lam, scale=0.7, initial_state=S0, output_final_state=True,
                                mode="naive")
    for mode in ("recurrent", "chunk"):
        o, S = decay_linear_attn(q, k, v, lam, scale=0.7, initial_state=S0, output_final_state=True,
                                 mode=mode, chunk_size=chunk)
        assert_close64(o, ref, what=f"{mode} o")
        assert_close64(S, Sr, what=f"{mode} S")


def test_decay_naive_equals_explicit_loops():
    q, k, v = make(2, 11, 3, 4, 3, seed=1)
    lam = decays(3, seed=1)
    S0 = torch.randn(2, 3, 4, 3, dtype=torch.float64)
    o, S = decay_linear_attn(q, k, v, lam, initial_state=S0, output_final_state=True, mode="naive")
    assert_close64(o, masked_quadratic(q, k, v, lam, S0))
    S_ref = S0.clone()
    for t in range(11):
        S_ref = lam.view(1, 3, 1, 1) * S_ref + k[:, t, :, :, None] * v[:, t, :, None, :]
    assert_close64(S, S_ref)


def test_decay_extreme_values_stay_finite():
    # lambda^(C-1) underflows to 0 for tiny lambda; the chunk form must give 0, not NaN.
    q, k, v = make(1, 70, 2, 4, 4, seed=2)
    lam = torch.tensor([1e-30, 1.0], dtype=torch.float64)
    ref, Sr = decay_linear_attn(q, k, v, lam, output_final_state=True, mode="recurrent")
    o, S = decay_linear_attn(q, k, v, lam, output_final_state=True, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close64(o, ref)
    assert_close64(S, Sr)


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("splits", [(5,), (1, 2, 3), (20, 21)], ids=str)
def test_decay_pieces_equal_whole(mode, splits):
    q, k, v = make(2, 29, 2, 5, 4, seed=3)
    lam = decays(2, seed=3)
    whole, S_whole = decay_linear_attn(q, k, v, lam, output_final_state=True, mode=mode, chunk_size=4)
    outs, S, start = [], None, 0
    for stop in [*splits, 29]:
        o, S = decay_linear_attn(q[:, start:stop], k[:, start:stop], v[:, start:stop], lam,
                                 initial_state=S, output_final_state=True, mode=mode, chunk_size=4)
        outs.append(o)
        start = stop
    assert_close64(torch.cat(outs, 1), whole)
    assert_close64(S, S_whole)


@pytest.mark.parametrize("mode", ["naive", "recurrent", "chunk"])
def test_decay_gradcheck(mode):
    q, k, v = make(1, 9, 2, 4, 3, seed=4)
    lam = torch.tensor([0.8, 0.55], dtype=torch.float64)
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    args = [x.clone().requires_grad_() for x in (q, k, v, lam, S0)]

    def f(q, k, v, lam, S0):
        o, S = decay_linear_attn(q, k, v, lam, scale=0.9, initial_state=S0, output_final_state=True,
                                 mode=mode, chunk_size=4)
        return o, S

    assert torch.autograd.gradcheck(f, args)


def test_decay_chunk_gradients_match_naive():
    q, k, v = make(2, 23, 3, 5, 4, seed=6)
    lam = decays(3, seed=6)
    grads = {}
    for mode in ("naive", "chunk"):
        args = [x.clone().requires_grad_() for x in (q, k, v, lam)]
        o, S = decay_linear_attn(*args, output_final_state=True, mode=mode, chunk_size=8)
        (o.sin().sum() + S.square().sum()).backward()
        grads[mode] = [a.grad for a in args]
    for name, gn, gc in zip("qkvλ", grads["naive"], grads["chunk"]):
        assert_close64(gc, gn, atol=1e-9, what=f"grad {name}")


@pytest.mark.parametrize("chunk", [3, 7, 64], ids=lambda c: f"C{c}")
def test_decay_chunk_odd_sizes_strided_inputs_and_gradients(chunk):
    # Odd B, T, H, Dk != Dv, a chunk size that does not divide T, inputs that are strided views
    # (the chunk form reads heads in place), a constant decay (its in-place mask path under
    # autograd) and an initial state: outputs, state and input gradients equal the naive form.
    B, T, H, Dk, Dv = 3, 50, 3, 5, 6
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64).transpose(1, 2)
            for _ in range(2))
    v = torch.randn(B, T, H, 2 * Dv, generator=g, dtype=torch.float64)[..., ::2]
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    lam = torch.tensor([0.97, 0.4, 1.0], dtype=torch.float64)
    res = {}
    for mode in ("naive", "chunk"):
        args = [x.detach().clone().requires_grad_() for x in (q, k, v, S0)]
        o, S = decay_linear_attn(args[0], args[1], args[2], lam, scale=0.6, initial_state=args[3],
                                 output_final_state=True, mode=mode, chunk_size=chunk)
        (o.cos().sum() + (S * S.detach().sin()).sum()).backward()
        res[mode] = [o, S] + [a.grad for a in args]
    for name, a, b in zip(["o", "S", "dq", "dk", "dv", "dS0"], res["chunk"], res["naive"]):
        assert_close64(a, b, atol=1e-9, what=name)


def test_decay_keeps_float32_state_for_bfloat16():
    q, k, v = make(1, 10, 2, 4, 4, dtype=torch.bfloat16)
    o, S = decay_linear_attn(q, k, v, decays(2, dtype=torch.float32), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


@pytest.mark.parametrize("op", ["linear_attn", "decay_linear_attn"])
def test_bfloat16_long_sequence_does_not_overflow(op):
    # Un-normalised sums grow like T (docs/maths.md 3.6); the ops accumulate in float32.
    T = 4096
    g = torch.Generator().manual_seed(7)
    q = elu_plus_one(torch.randn(1, T, 1, 8, generator=g))
    k = elu_plus_one(torch.randn(1, T, 1, 8, generator=g))
    v = torch.randn(1, T, 1, 8, generator=g) + 2.0
    if op == "linear_attn":
        def run(*x): return linear_attn(*x, normalize=False)[0]
    else:
        def run(*x): return decay_linear_attn(*x, torch.tensor([0.999]))[0]
    ref = run(q, k, v)
    o = run(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert torch.isfinite(o).all()
    rel = ((o.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


# --- block_attention (docs/maths.md 3.2) ----------------------------------------------------------

def block_diagonal_reference(q, k, v, w, kernel, scale=None):
    """Explicit formula: full attention logits under a block-diagonal causal mask."""
    T, D = q.shape[1], q.shape[-1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    i = torch.arange(T)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] // w == i[None, :] // w)
    logits = scale * torch.einsum("bthd,bshd->bhts", q, k)
    if kernel == "softmax":
        p = torch.softmax(logits.masked_fill(~mask, -1e8), dim=-1)
    else:
        p = torch.relu(logits) * mask
    return torch.einsum("bhts,bshe->bthe", p, v)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("block", [1, 4, 16, 64], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_block_attention_equals_block_diagonal_mask(shape, block, kernel):
    q, k, v = make(*shape, seed=8)
    o = block_attention(q, k, v, block_size=block, kernel=kernel)
    ref = block_diagonal_reference(q, k, v, block, kernel)
    assert_close64(o, ref, what="op vs explicit mask")
    assert_close64(block_attention_naive(q, k, v, block, 1 / math.sqrt(shape[3]), kernel), ref,
                   what="naive vs explicit mask")


@pytest.mark.parametrize("T,block", [(13, 13), (13, 64), (1, 3)], ids=["w=T", "w>T", "T1"])
def test_block_attention_one_block_is_causal_softmax(T, block):
    q, k, v = make(2, T, 3, 5, 4, seed=9)
    assert_close64(block_attention(q, k, v, block_size=block, scale=0.3),
                   softmax_attention(q, k, v, causal=True, scale=0.3))


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_block_attention_no_information_crosses_blocks(kernel):
    q, k, v = make(2, 23, 2, 4, 4, seed=10)
    o = block_attention(q, k, v, block_size=5, kernel=kernel)
    for blk in range(5):
        lo, hi = 5 * blk, min(5 * blk + 5, 23)
        outside = torch.ones(23, dtype=torch.bool)
        outside[lo:hi] = False
        k2, v2 = k.clone(), v.clone()
        k2[:, outside] += 3.0
        v2[:, outside] -= 2.0
        o2 = block_attention(q, k2, v2, block_size=5, kernel=kernel)
        assert_close64(o2[:, lo:hi], o[:, lo:hi], what=f"block {blk}")
        assert (o2[:, outside] - o[:, outside]).abs().max() > 1e-3  # the perturbation did act


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_block_attention_gradcheck(kernel):
    q, k, v = make(1, 9, 2, 4, 3, seed=11)
    args = [x.clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: block_attention(q, k, v, block_size=4, kernel=kernel), args)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_block_attention_bfloat16_long_sequence(kernel):
    q, k, v = make(1, 4096, 2, 8, 8, seed=12, dtype=torch.float32)
    ref = block_attention(q, k, v, block_size=64, kernel=kernel)
    o = block_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), block_size=64, kernel=kernel)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert ((o.float() - ref).norm() / ref.norm()).item() < 2e-2


# --- srms_norm (docs/maths.md 3.1) ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_srms_norm_has_unit_rms(dtype):
    x = (300.0 * torch.randn(4, 7, 24, generator=torch.Generator().manual_seed(13))).to(dtype)
    y = srms_norm(x)
    assert y.dtype == dtype
    rms = y.double().square().mean(-1).sqrt()
    tol = 1e-10 if dtype == torch.float64 else 2e-3
    assert (rms - 1).abs().max().item() < tol
    xd = x.double()
    assert_close64(srms_norm(xd), xd / (xd.norm(dim=-1, keepdim=True) / math.sqrt(24) + 1e-8))


def test_srms_norm_of_zero_is_zero():
    assert torch.equal(srms_norm(torch.zeros(2, 6)), torch.zeros(2, 6))


# --- bad input ---------------------------------------------------------------------------------

q4 = torch.randn(2, 5, 3, 4)
v6 = torch.randn(2, 5, 3, 6)
lam3 = torch.full((3,), 0.9)
BAD = [
    ("block 0", lambda: block_attention(q4, q4, v6, block_size=0), ValueError, "block_size must be >= 1"),
    ("block float", lambda: block_attention(q4, q4, v6, block_size=2.0), TypeError, "block_size"),
    ("block missing", lambda: block_attention(q4, q4, v6), TypeError, "block_size"),
    ("block kernel", lambda: block_attention(q4, q4, v6, block_size=2, kernel="gelu"), ValueError, "kernel must be one of"),
    ("block q rank", lambda: block_attention(q4[0], q4[0], v6[0], block_size=2), ValueError, "q must be a 4-D"),
    ("block k shape", lambda: block_attention(q4, q4[:, :4], v6, block_size=2), ValueError, "k must have the same shape"),
    ("block v shape", lambda: block_attention(q4, q4, v6[:, :3], block_size=2), ValueError, "v must have shape"),
    ("block scale", lambda: block_attention(q4, q4, v6, block_size=2, scale=float("nan")), ValueError, "scale"),
    ("decay shape", lambda: decay_linear_attn(q4, q4, v6, torch.full((2,), 0.9)), ValueError, "decay must have shape"),
    ("decay rank", lambda: decay_linear_attn(q4, q4, v6, torch.full((1, 3), 0.9)), ValueError, "decay must be a 1-D"),
    ("decay zero", lambda: decay_linear_attn(q4, q4, v6, torch.tensor([0.5, 0.0, 1.0])), ValueError, "decay must lie in (0, 1]"),
    ("decay above 1", lambda: decay_linear_attn(q4, q4, v6, torch.tensor([0.5, 1.01, 1.0])), ValueError, "decay must lie in (0, 1]"),
    ("decay nan", lambda: decay_linear_attn(q4, q4, v6, torch.tensor([0.5, float("nan"), 1.0])), ValueError, "decay must lie in (0, 1]"),
    ("decay int", lambda: decay_linear_attn(q4, q4, v6, torch.ones(3, dtype=torch.long)), TypeError, "decay must be a floating-point"),
    ("decay list", lambda: decay_linear_attn(q4, q4, v6, [0.9, 0.9, 0.9]), TypeError, "decay must be a torch.Tensor"),
    ("decay mode", lambda: decay_linear_attn(q4, q4, v6, lam3, mode="fast"), ValueError, "mode must be one of"),
    ("decay chunk", lambda: decay_linear_attn(q4, q4, v6, lam3, chunk_size=0), ValueError, "chunk_size must be >= 1"),
    ("decay state", lambda: decay_linear_attn(q4, q4, v6, lam3, initial_state=torch.zeros(2, 3, 6, 4)), ValueError, "initial_state"),
    ("decay k shape", lambda: decay_linear_attn(q4, q4[..., :2], v6, lam3), ValueError, "k must have the same shape"),
    ("decay dtype mix", lambda: decay_linear_attn(q4, q4.double(), v6, lam3), TypeError, "dtype"),
    ("srms eps", lambda: srms_norm(q4, eps=-1.0), ValueError, "eps"),
    ("srms int", lambda: srms_norm(torch.ones(3, dtype=torch.long)), TypeError, "x must be a floating-point"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)
