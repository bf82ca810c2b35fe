"""TransNormer layers (docs/maths.md 3.1-3.5, 3.7): NormAttention and DiagAttention against explicit
formulas built from their own weights, LRPE's relative property, SRMSNorm, GLU, options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastweights import build_mixer
from fastweights.layers import GLU, DiagAttention, NormAttention, SRMSNorm
from fastweights.layers.transnormer import LRPE, alibi_slopes
from tests.helpers import assert_close64, steps_from

D_MODEL, H = 12, 3


def perturbed(layer):
    """float64, eval, and every parameter moved off its init (zero biases hide bugs)."""
    torch.manual_seed(0)
    layer = layer.double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return layer


def x_in(B=2, T=17, seed=1, dtype=torch.float64):
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def lrpe_explicit(lrpe: LRPE, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE_theta(H x) with explicit matrices: H = I - 2 v v^T, R_t block-diagonal 2x2 rotations."""
    D = x.shape[-1]
    v = lrpe.householder.double()
    v = v / v.norm()
    Hm = torch.eye(D, dtype=torch.float64) - 2 * torch.outer(v, v)
    out = torch.empty_like(x)
    for t, p in enumerate(positions.tolist()):
        R = torch.eye(D, dtype=torch.float64)
        for i, th in enumerate(lrpe.theta.detach().double().tolist()):
            c, s = math.cos(p * th), math.sin(p * th)
            R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        out[:, t] = x[:, t] @ (R @ Hm).T
    return out


def heads(layer, x):
    q = layer.q_proj(x).unflatten(-1, (layer.n_heads, -1))
    k = layer.k_proj(x).unflatten(-1, (layer.n_heads, -1))
    v = layer.v_proj(x).unflatten(-1, (layer.n_heads, -1))
    return q, k, v


def srms(x):
    return x / (x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1]) + 1e-8)


# --- NormAttention -----------------------------------------------------------------------------

NORM_CASES = [("1+elu", True, False), ("elu", True, False), ("1+elu", False, False),
              ("1+elu", True, True), ("silu", False, True)]


@pytest.mark.parametrize("act,lrpe,decay", NORM_CASES,
                         ids=[f"{a}-lrpe{int(lrpe)}-decay{int(d)}" for a, lrpe, d in NORM_CASES])
def test_norm_attention_equals_explicit_formula(act, lrpe, decay):
    layer = perturbed(NormAttention(D_MODEL, H, activation=act, lrpe=lrpe, decay=decay,
                                    decay_scale=0.5, chunk_size=4))
    x = x_in()
    y, _ = layer(x)
    phi = {"1+elu": lambda z: F.elu(z) + 1, "elu": F.elu, "silu": F.silu}[act]
    q, k, v = heads(layer, x)
    q, k = phi(q), phi(k)
    T = x.shape[1]
    if lrpe:
        q, k = lrpe_explicit(layer.lrpe, q, torch.arange(T)), lrpe_explicit(layer.lrpe, k, torch.arange(T))
    i = torch.arange(T, dtype=torch.float64)
    if decay:
        lam = torch.exp(-0.5 * torch.tensor(alibi_slopes(H), dtype=torch.float64))
        Dm = lam.view(H, 1, 1) ** (i[:, None] - i[None, :]).clamp(min=0) * (i[:, None] >= i[None, :])
    else:
        Dm = (i[:, None] >= i[None, :]).double()
    o = torch.einsum("bhts,bshe->bthe", torch.einsum("bthd,bshd->bhts", q, k) * Dm, v)
    o = srms(o.flatten(-2))
    if decay:
        o = o * torch.sigmoid(layer.gate(x))
    assert_close64(y, layer.out(o), atol=1e-9)


@pytest.mark.parametrize("decay", [False, True], ids=["plain", "decay"])
def test_norm_attention_modes_agree(decay):
    ref = perturbed(NormAttention(D_MODEL, H, decay=decay, mode="naive"))
    x = x_in(T=21)
    y_ref, (S_ref, pos) = ref(x)
    assert pos == 21 and S_ref.shape == (2, H, 4, 4)
    for mode, chunk in [("recurrent", 64), ("chunk", 4), ("chunk", 64)]:
        layer = NormAttention(D_MODEL, H, decay=decay, mode=mode, chunk_size=chunk).double().eval()
        layer.load_state_dict(ref.state_dict())
        y, (S, _) = layer(x)
        assert_close64(y, y_ref, what=mode)
        assert_close64(S, S_ref, what=f"{mode} state")


@pytest.mark.parametrize("decay", [False, True], ids=["plain", "decay"])
def test_norm_attention_streams(decay):
    layer = perturbed(NormAttention(D_MODEL, H, decay=decay, chunk_size=4))
    x = x_in(T=19)
    whole, _ = layer(x)
    outs, state = [], None
    for a, b in [(0, 1), (1, 8), (8, 9), (9, 19)]:
        y, state = layer(x[:, a:b], state)
        outs.append(y)
    assert state[1] == 19
    assert_close64(torch.cat(outs, 1), whole, atol=1e-9)


STEP_CASES = [("1+elu", True, False), ("elu", True, True), ("silu", False, False),
              ("1+elu", False, True)]


@pytest.mark.parametrize("act,lrpe,decay", STEP_CASES,
                         ids=[f"{a}-lrpe{int(lrpe)}-decay{int(d)}" for a, lrpe, d in STEP_CASES])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_norm_attention_step_equals_oracle_path(act, lrpe, decay, mode):
    """The one-token step (its own path for mode chunk/recurrent) equals the general path of
    mode="naive" token by token from an empty state and from a carried one, outputs and
    states, for an odd head dim and a batch of 3."""
    ref = perturbed(NormAttention(15, 3, activation=act, lrpe=lrpe, decay=decay, decay_scale=0.5,
                                  mode="naive"))
    layer = NormAttention(15, 3, activation=act, lrpe=lrpe, decay=decay, decay_scale=0.5,
                          mode=mode).double().eval()
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(3, 6, 15, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s_ref = s = None
    for t in range(6):
        y_ref, s_ref = ref(x[:, t:t + 1], s_ref)
        y, s = layer(x[:, t:t + 1], s)
        assert_close64(y, y_ref, what=f"step {t}")
        assert_close64(s.S, s_ref.S, what=f"state {t}")
        assert s.pos == s_ref.pos == t + 1


def test_norm_attention_step_rows_equal_whole_sequences():
    """Rows at their own LRPE positions (stack_states), stepped together one token at a time,
    equal each stream's prefill and continuation fed as one whole sequence (general path)."""
    layer = perturbed(NormAttention(D_MODEL, H, decay=True, decay_scale=0.5, chunk_size=4))
    gen = torch.Generator().manual_seed(4)
    lengths, steps = (5, 1, 9), 4
    seqs = [torch.randn(1, n + steps, D_MODEL, generator=gen, dtype=torch.float64) for n in lengths]
    state = layer.stack_states([layer(s[:, :n])[1] for s, n in zip(seqs, lengths)])
    assert state.pos.tolist() == list(lengths)
    for t in range(steps):
        y, state = layer(torch.cat([s[:, n + t:n + t + 1] for s, n in zip(seqs, lengths)]), state)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            assert_close64(y[i], layer(s[:, :n + t + 1])[0][0, -1:], atol=1e-9, what=f"row {i}")
    assert state.pos.tolist() == [n + steps for n in lengths]


def test_norm_attention_step_checks_the_state():
    layer = NormAttention(8, 2)
    x = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match=r"state must have shape \[B, H, Dk, Dv\]"):
        layer(x, (torch.zeros(2, 2, 4, 3), 5))
    with pytest.raises(ValueError, match="device"):
        layer(x, (torch.zeros(2, 2, 4, 4, device="meta"), 5))
    _, (S, pos) = layer.double()(x.double(), (torch.zeros(2, 2, 4, 4), 5))  # float32 S upcast
    assert S.dtype == torch.float64 and pos == 6


def test_norm_attention_step_under_autocast_takes_the_op():
    """Under CPU autocast the step runs through the public op (float32 state and output norm)."""
    layer = NormAttention(8, 2).eval()
    x = torch.randn(1, 1, 8)
    _, state = layer(torch.randn(1, 5, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, (S, _) = layer(x, state)
    assert S.dtype == torch.float32
    assert (y.float() - layer(x, state)[0]).abs().max() < 5e-2


def test_decay_variant_uses_alibi_decays_and_gate():
    layer = NormAttention(32, 8, decay=True)
    expected = torch.exp(-2.0 ** -torch.arange(1, 9, dtype=torch.float64))
    assert_close64(torch.tensor(layer.decay_values, dtype=torch.float64), expected)
    assert layer.to(torch.bfloat16).decay_values == layer.decay_values  # not rounded by casts
    assert layer.gate.weight.shape == (32, 32)
    assert NormAttention(32, 8).decay_values is None and not hasattr(NormAttention(32, 8), "gate")


def test_alibi_slopes():
    assert alibi_slopes(4) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    # H = 6: the 4-head slopes, then slopes 1 and 3 of the 8-head list (2^-1, 2^-3).
    assert alibi_slopes(6) == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])
    assert alibi_slopes(1) == [2 ** -8]


def test_norm_attention_init():
    torch.manual_seed(0)
    layer = NormAttention(64, 4)
    bound = math.sqrt(6 / (64 + 64)) / math.sqrt(2)  # xavier_uniform, gain 1/sqrt(2)
    for lin in (layer.q_proj, layer.k_proj, layer.v_proj):
        assert lin.bias is not None
        assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.9 * bound
    assert torch.equal(layer.out.bias, torch.zeros(64))
    assert layer.state_size() == 4 * 16 * 16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_attention_half_precision_long_sequence(dtype):
    # Un-normalised o_t grows like t; it must stay in float32 until SRMSNorm (docs/maths.md 3.6).
    torch.manual_seed(0)
    layer = NormAttention(D_MODEL, H, lrpe=False)
    with torch.no_grad():
        layer.v_proj.bias.fill_(4.0)
        layer.q_proj.bias.fill_(2.0)
        layer.k_proj.bias.fill_(2.0)
    x = x_in(B=1, T=3000, dtype=torch.float32)
    ref, _ = layer(x)
    y, (S, _) = layer.to(dtype)(x.to(dtype))
    assert y.dtype == dtype and S.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-2


# --- LRPE --------------------------------------------------------------------------------------

@pytest.mark.parametrize("D", [6, 7], ids=["D6", "D7-odd"])
def test_lrpe_matches_explicit_and_is_relative(D):
    torch.manual_seed(0)
    lrpe = LRPE(D).double()
    with torch.no_grad():
        lrpe.theta.mul_(1 + 0.3 * torch.rand_like(lrpe.theta))  # learned values, not the init
    q = torch.randn(1, 1, 2, D, dtype=torch.float64)
    k = torch.randn(1, 1, 2, D, dtype=torch.float64)
    if D % 2 == 0:
        pos = torch.arange(5)
        qq = q.expand(1, 5, 2, D)
        assert_close64(lrpe(qq, pos), lrpe_explicit(lrpe, qq, pos))

    def score(i, j):
        return (lrpe(q, torch.tensor([i])) * lrpe(k, torch.tensor([j]))).sum(-1)

    for i, j in [(3, 1), (0, 0), (2, 9)]:
        for shift in (1, 17, 1000):
            assert_close64(score(i + shift, j + shift), score(i, j), atol=1e-9)
    assert (score(3, 1) - score(3, 2)).abs().max() > 1e-3  # positions do matter
    assert_close64(lrpe(q, torch.tensor([4])).norm(dim=-1), q.norm(dim=-1))  # orthogonal


def test_lrpe_int_positions_and_pair():
    """An int position p means p, p+1, ... for every row; ``pair`` equals two calls (one fused
    tensor at T = 1)."""
    torch.manual_seed(0)
    lrpe = LRPE(7).double()
    for T in (1, 4):
        q, k = torch.randn(2, 2, T, 3, 7, dtype=torch.float64).unbind(0)
        assert_close64(lrpe(q, 11), lrpe(q, torch.arange(11, 11 + T)))
        for pos in (11, torch.tensor([[3] * T, [8] * T]) + torch.arange(T)):
            qr, kr = lrpe.pair(q, k, pos)
            assert_close64(qr, lrpe(q, pos))
            assert_close64(kr, lrpe(k, pos))


def test_lrpe_frequencies_learn_and_householder_is_fixed():
    lrpe = LRPE(8)
    assert not lrpe.householder.requires_grad and "householder" in lrpe.state_dict()
    assert torch.allclose(lrpe.theta, 10000.0 ** (-torch.arange(0, 8, 2) / 8))
    lrpe(torch.randn(1, 4, 2, 8), torch.arange(4)).square().sum().backward()
    assert lrpe.theta.grad is not None and lrpe.theta.grad.abs().sum() > 0


# --- DiagAttention -----------------------------------------------------------------------------

def diag_explicit(layer, x):
    """Full T x T attention under a block-diagonal causal mask, LRPE positions restarting per block."""
    T, w = x.shape[1], layer.block_size
    q, k, v = heads(layer, x)
    if layer.lrpe is not None:
        pos = torch.arange(T) % w
        q, k = lrpe_explicit(layer.lrpe, q, pos), lrpe_explicit(layer.lrpe, k, pos)
    i = torch.arange(T)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] // w == i[None, :] // w)
    logits = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(layer.head_dim)
    if layer.kernel == "softmax":
        o = torch.einsum("bhts,bshe->bthe", logits.masked_fill(~mask, -1e8).softmax(-1), v).flatten(-2)
    else:
        o = srms(torch.einsum("bhts,bshe->bthe", logits.relu() * mask, v).flatten(-2))
    return layer.out(o)


DIAG_CASES = [(kern, lrpe, w) for kern in ("softmax", "relu") for lrpe in (True, False) for w in (1, 5, 64)]


@pytest.mark.parametrize("kernel,lrpe,block", DIAG_CASES,
                         ids=[f"{k}-lrpe{int(lrpe)}-w{w}" for k, lrpe, w in DIAG_CASES])
def test_diag_attention_equals_explicit_formula(kernel, lrpe, block):
    layer = perturbed(DiagAttention(D_MODEL, H, block_size=block, kernel=kernel, lrpe=lrpe))
    x = x_in(T=17)
    y, _ = layer(x)
    assert_close64(y, diag_explicit(layer, x), atol=1e-9)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_diag_attention_output_independent_of_other_blocks(kernel):
    layer = perturbed(DiagAttention(D_MODEL, H, block_size=4, kernel=kernel))
    x = x_in(T=15)
    y, _ = layer(x)
    for t in (0, 5, 11, 14):
        lo, hi = 4 * (t // 4), min(4 * (t // 4) + 4, 15)
        x2 = x.clone()
        x2[:, :lo] += 2.0
        x2[:, hi:] -= 2.0
        y2, _ = layer(x2)
        assert_close64(y2[:, t], y[:, t], atol=1e-9, what=f"token {t}")
    x3 = x.clone()
    x3[:, 4] += 2.0  # same block as token 6: it must matter
    assert (layer(x3)[0][:, 6] - y[:, 6]).abs().max() > 1e-3


@pytest.mark.parametrize("block", [1, 3, 4, 40], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("splits", [(1, 2, 3, 7), (6,), (4, 8, 12)], ids=str)
def test_diag_attention_streams(block, splits):
    layer = perturbed(DiagAttention(D_MODEL, H, block_size=block, kernel="relu"))
    x = x_in(T=14)
    whole, _ = layer(x)
    outs, state, start = [], None, 0
    for stop in [*splits, 14]:
        y, state = layer(x[:, start:stop], state)
        outs.append(y)
        start = stop
        assert state[0].shape[1] == stop % block and state[0].dtype == torch.float64
    assert_close64(torch.cat(outs, 1), whole, atol=1e-9)


STEP_DIAG = [(kern, lrpe, w) for kern in ("softmax", "relu") for lrpe, w in ((True, 1), (True, 4), (False, 5))]


@pytest.mark.parametrize("kernel,lrpe,block", STEP_DIAG,
                         ids=[f"{k}-lrpe{int(lrpe)}-w{w}" for k, lrpe, w in STEP_DIAG])
def test_diag_attention_one_token_steps_equal_whole(kernel, lrpe, block):
    """The one-token step (the query against the cached open block, no re-run) equals the
    whole sequence's block attention, outputs and final state, from None and from a state
    left by a longer piece."""
    layer = perturbed(DiagAttention(D_MODEL, H, block_size=block, kernel=kernel, lrpe=lrpe))
    x = x_in(T=11)
    whole, final = layer(x)
    for start in (0, 6):
        ys, state = steps_from(layer, x, start)
        assert_close64(ys, whole[:, start:], atol=1e-9, what=f"from {start}")
        for a, b in zip(state, final):
            assert_close64(a, b, what="state")


def test_diag_attention_half_steps_follow_the_float64_layer():
    layer = perturbed(DiagAttention(D_MODEL, H, block_size=3, kernel="relu"))
    x = x_in(T=7)
    ref, _ = layer(x)
    half = DiagAttention(D_MODEL, H, block_size=3, kernel="relu").bfloat16()
    half.load_state_dict(layer.state_dict())
    ys, state = [], None
    for t in range(7):
        y, state = half(x[:, t:t + 1].bfloat16(), state)
        ys.append(y)
    assert state[0].dtype == torch.float32
    assert (torch.cat(ys, 1).double() - ref).abs().max() < 0.1 * ref.abs().max()


def test_diag_attention_state_longer_than_a_block_is_rejected():
    layer = DiagAttention(8, 2, block_size=3)
    bad = (torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))
    for T in (1, 4):
        with pytest.raises(ValueError, match="r must be < block_size = 3"):
            layer(torch.randn(1, T, 8), bad)
    with pytest.raises(ValueError, match=r"state\[1\] \(v_open\) must have shape"):
        layer(torch.randn(1, 1, 8), (torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 2, 4)))


def test_diag_attention_state_size_and_float32_state_for_half():
    layer = DiagAttention(16, 2, block_size=8)
    assert layer.state_size() == 2 * 2 * 8 * 7 == layer.state_size(10_000)
    _, (k_open, v_open) = layer.bfloat16()(torch.randn(1, 11, 16, dtype=torch.bfloat16))
    assert k_open.shape == (1, 3, 2, 8) and k_open.dtype == v_open.dtype == torch.float32


# --- SRMSNorm and GLU --------------------------------------------------------------------------

def test_srms_norm_module():
    x = 50 * torch.randn(3, 5, 10, dtype=torch.float64)
    y = SRMSNorm(10)(x)
    assert (y.square().mean(-1).sqrt() - 1).abs().max() < 1e-9
    assert list(SRMSNorm().parameters()) == []
    with pytest.raises(ValueError, match=r"x must have shape \[..., 10\]"):
        SRMSNorm(10)(torch.randn(3, 9))


@pytest.mark.parametrize("activation", ["silu", "gelu", "identity"])
def test_glu_equals_formula(activation):
    torch.manual_seed(0)
    glu = GLU(D_MODEL, activation=activation).double()
    assert glu.hidden == int(8 / 3 * D_MODEL) == 32
    x = x_in()
    act = {"silu": F.silu, "gelu": F.gelu, "identity": lambda z: z}[activation]
    ref = (act(x @ glu.w1.weight.T + glu.w1.bias) * (x @ glu.w2.weight.T + glu.w2.bias)) @ glu.w3.weight.T + glu.w3.bias
    assert_close64(glu(x), ref)


def test_glu_options():
    glu = GLU(8, 20, bias=False)
    assert glu.w1.weight.shape == (20, 8) and glu.w3.weight.shape == (8, 20) and glu.w1.bias is None
    assert glu(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    assert GLU(512).hidden == 1365


# --- registry and bad options ------------------------------------------------------------------

def test_registry_builds_both_with_options():
    assert isinstance(build_mixer("norm", 16, 2, activation="elu", decay=True), NormAttention)
    layer = build_mixer("diag", 16, 2, kernel="relu", block_size=8, lrpe=False)
    assert isinstance(layer, DiagAttention) and layer.kernel == "relu" and layer.lrpe is None
    assert build_mixer("diag", 16, 2).block_size == 64


BAD = [
    ("diag block 0", lambda: DiagAttention(8, 2, block_size=0), ValueError, "block_size must be >= 1"),
    ("diag kernel", lambda: DiagAttention(8, 2, kernel="sigmoid"), ValueError, "kernel must be one of"),
    ("diag lrpe", lambda: DiagAttention(8, 2, lrpe="yes"), TypeError, "lrpe must be a bool"),
    ("diag state", lambda: DiagAttention(8, 2)(torch.randn(1, 3, 8), state=torch.zeros(3)), TypeError, "state must be None"),
    ("diag state shape", lambda: DiagAttention(8, 2)(torch.randn(1, 3, 8), state=(torch.zeros(1, 2, 2, 3), torch.zeros(1, 2, 2, 3))), ValueError, "state[0] (k_open) must have shape"),
    ("norm activation", lambda: NormAttention(8, 2, activation="tanh"), ValueError, "activation must be one of"),
    ("norm decay_scale", lambda: NormAttention(8, 2, decay=True, decay_scale=-1.0), ValueError, "decay_scale"),
    ("norm mode", lambda: NormAttention(8, 2, mode="fast"), ValueError, "mode must be one of"),
    ("norm chunk", lambda: NormAttention(8, 2, chunk_size=0), ValueError, "chunk_size must be >= 1"),
    ("norm state", lambda: NormAttention(8, 2)(torch.randn(1, 3, 8), state=(torch.zeros(1, 2, 4, 4),)), TypeError, "state must be None"),
    ("norm state S", lambda: NormAttention(8, 2)(torch.randn(1, 3, 8), state=([1.0], 0)), TypeError, "state[0] (S) must be a torch.Tensor"),
    ("norm position", lambda: NormAttention(8, 2)(torch.randn(1, 3, 8), state=(torch.zeros(1, 2, 4, 4), -1)), TypeError, "position"),
    ("norm state shape", lambda: NormAttention(8, 2)(torch.randn(1, 3, 8), state=(torch.zeros(1, 2, 4, 3), 0)), ValueError, "initial_state"),
    ("lrpe head_dim 1", lambda: NormAttention(4, 4), ValueError, "LRPE needs head_dim >= 2"),
    ("glu activation", lambda: GLU(8, activation="swish"), ValueError, "activation must be one of"),
    ("glu hidden", lambda: GLU(8, 0), ValueError, "hidden must be >= 1"),
    ("glu input", lambda: GLU(8)(torch.randn(2, 7)), ValueError, "x must have shape [..., d_model]"),
    ("srms dim", lambda: SRMSNorm(0), ValueError, "dim must be >= 1"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_options(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)
