"""infini_attention: every form against the naive oracle and the equivalences of
docs/maths.md 5.5."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops import infini_attention, linear_attn, softmax_attention
from tests.helpers import assert_close64

SHAPES = [(2, 37, 3, 5, 7), (1, 1, 1, 4, 4), (3, 16, 2, 8, 3), (1, 65, 2, 6, 6)]
IDS = [f"B{b}-T{t}-H{h}-Dk{dk}-Dv{dv}" for b, t, h, dk, dv in SHAPES]
UPDATES = ["linear", "delta"]
F64 = torch.float64


def make(B, T, H, Dk, Dv, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k, qm, km = (torch.randn(B, T, H, Dk, generator=g, dtype=dtype) for _ in range(4))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    gate = torch.randn(H, generator=g, dtype=dtype)
    return q, k, v, qm, km, gate


def memory(B, H, Dk, Dv, seed=1):
    """A non-empty memory such as the op builds: z > 0."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, Dk, Dv, generator=g, dtype=F64), 1.0 + torch.rand(B, H, Dk, generator=g, dtype=F64)


def sigma(x):
    return F.elu(x) + 1.0


def seg_ids(T, N):
    return torch.arange(T) // N


def block_causal_mem(qm, km, v, N):
    """A_mem[i] = sum_{seg(j) < seg(i)} (s(q_i).s(k_j)) v_j / sum_{seg(j) < seg(i)} s(q_i).s(k_j),
    0 where no earlier segment exists (docs/maths.md 5.2)."""
    T = qm.shape[1]
    s = seg_ids(T, N)
    mask = (s[None, :] < s[:, None]).to(F64)  # [T(i), T(j)]
    w = torch.einsum("bihd,bjhd->bhij", sigma(qm), sigma(km)) * mask
    num = torch.einsum("bhij,bjhe->bihe", w, v)
    den = w.sum(-1).transpose(1, 2).unsqueeze(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def block_local_softmax(q, k, v, N, scale=None):
    """Causal softmax attention restricted to each segment (block-diagonal mask)."""
    T, Dk = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    s = seg_ids(T, N)
    allowed = (s[None, :] == s[:, None]) & torch.ones(T, T, dtype=torch.bool).tril()
    scores = scale * torch.einsum("bihd,bjhd->bhij", q, k)
    attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhe->bihe", attn, v)


# --- naive == chunk == recurrent ---------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("N", [1, 4, 8, 70], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("update", UPDATES)
def test_forms_agree(shape, N, update):
    q, k, v, qm, km, gate = make(*shape)
    B, _, H, Dk, Dv = shape
    opts = {"segment_len": N, "update": update, "q_mem": qm, "k_mem": km, "scale": 0.8,
            "initial_state": memory(B, H, Dk, Dv), "output_final_state": True}
    ref, sref = infini_attention(q, k, v, gate, mode="naive", **opts)
    for mode in ("chunk", "recurrent"):
        o, s = infini_attention(q, k, v, gate, mode=mode, **opts)
        assert_close64(o, ref, what=f"{mode} o")
        assert len(s) == 2 and len(s.open_segment) == 5
        for i, (a, b) in enumerate(zip((*s, *s.open_segment), (*sref, *sref.open_segment))):
            assert_close64(a, b, what=f"{mode} state[{i}]")


@pytest.mark.parametrize("update", UPDATES)
def test_gradients_agree_across_forms(update):
    q, k, v, qm, km, gate = make(2, 23, 2, 5, 6, seed=2)
    M0, z0 = memory(2, 2, 5, 6)
    grads = {}
    for mode in ("naive", "chunk", "recurrent"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, qm, km, gate, M0, z0)]
        o, (M, z) = infini_attention(*xs[:3], xs[5], segment_len=5, update=update, q_mem=xs[3],
                                         k_mem=xs[4], initial_state=(xs[6], xs[7]),
                                         output_final_state=True, mode=mode)
        (o.square().sum() + M.sin().sum() + z.sum()).backward()
        grads[mode] = [x.grad for x in xs]
    for mode in ("chunk", "recurrent"):
        for i, (a, b) in enumerate(zip(grads[mode], grads["naive"])):
            assert_close64(a, b, what=f"{mode} grad {i}")


@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("update", UPDATES)
def test_gradcheck(mode, update):
    q, k, v, _, km, gate = make(1, 9, 2, 3, 4, seed=3)
    M0, z0 = memory(1, 2, 3, 4)
    g = torch.Generator().manual_seed(4)
    cache = [torch.randn(1, 2, 2, d, generator=g, dtype=F64) for d in (3, 4, 3)]  # 2 open tokens
    args = [x.requires_grad_() for x in (q, k, v, km, gate, M0, z0, *cache)]

    def f(q, k, v, km, gate, M0, z0, kc, vc, kmc):
        o, state = infini_attention(q, k, v, gate, segment_len=4, update=update, k_mem=km,
                                    initial_state=(M0, z0, kc, vc, kmc), output_final_state=True,
                                    mode=mode)
        return (o, *state)

    assert torch.autograd.gradcheck(f, args)


# --- streaming ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("splits", [(3,), (1, 2, 9, 10), (6, 18), tuple(range(1, 29))],
                         ids=["3", "1-2-9-10", "6-18", "token-by-token"])
def test_pieces_equal_whole(mode, update, splits):
    q, k, v, qm, km, gate = make(2, 29, 2, 5, 4, seed=5)
    opts = {"segment_len": 6, "update": update, "output_final_state": True, "mode": mode}
    whole, sw = infini_attention(q, k, v, gate, q_mem=qm, k_mem=km, **opts)
    outs, state, start = [], None, 0
    for stop in [*splits, 29]:
        sl = slice(start, stop)
        o, state = infini_attention(q[:, sl], k[:, sl], v[:, sl], gate, q_mem=qm[:, sl],
                                    k_mem=km[:, sl], initial_state=state, **opts)
        outs.append(o)
        start = stop
    assert_close64(torch.cat(outs, 1), whole)
    for a, b in zip(state, sw):
        assert_close64(a, b)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("update", UPDATES)
def test_token_by_token_equals_whole(mode, update):
    q, k, v, _, _, gate = make(1, 17, 3, 4, 5, seed=6)
    whole, sw = infini_attention(q, k, v, gate, segment_len=5, update=update, output_final_state=True)
    outs, state = [], None
    for t in range(17):
        o, state = infini_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gate, segment_len=5,
                                    update=update, initial_state=state, output_final_state=True,
                                    mode=mode)
        outs.append(o)
        assert state.open_segment[2].shape[1] == (t + 1) % 5  # open-segment cache length
    assert_close64(torch.cat(outs, 1), whole)
    for a, b in zip((*state, *state.open_segment), (*sw, *sw.open_segment)):
        assert_close64(a, b)


def test_two_item_state_means_no_open_segment():
    q, k, v, _, _, gate = make(2, 11, 2, 4, 3, seed=7)
    M0, z0 = memory(2, 2, 4, 3)
    a, sa = infini_attention(q, k, v, gate, segment_len=4, initial_state=(M0, z0), output_final_state=True)
    empty = [torch.zeros(2, 0, 2, d, dtype=F64) for d in (4, 3, 4)]
    b, sb = infini_attention(q, k, v, gate, segment_len=4, initial_state=(M0, z0, *empty),
                             output_final_state=True)
    assert_close64(a, b)
    for x, y in zip(sa, sb):
        assert_close64(x, y)


def _literal_memory(k_mem, v, N, update, M, z, eps=1e-6):
    """(M, z) after writing every segment of docs/maths.md 5.1 in turn, a short last one
    included."""
    for start in range(0, k_mem.shape[1], N):
        sk = torch.nn.functional.elu(k_mem[:, start:start + N]) + 1.0  # [B, n, H, Dk]
        w = v[:, start:start + N]
        if update == "delta":
            den = torch.einsum("bihd,bhd->bih", sk, z).clamp_min(eps)
            w = w - torch.einsum("bihd,bhde->bihe", sk, M) / den.unsqueeze(-1)
        M = M + torch.einsum("bihd,bihe->bhde", sk, w)
        z = z + sk.sum(dim=1)
    return M, z


@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("T", [12, 14, 3])
def test_final_state_is_the_pair_M_z_of_every_token_seen(mode, update, T):
    """docs/design.md, "Public ops": state = (M, z). The memory holds every segment written by
    docs/maths.md 5.1's rule, a trailing short segment included; continuing from the state stays
    exact (open_segment)."""
    q, k, v, qm, km, gate = make(2, 20, 2, 4, 3, seed=12)
    M0, z0 = memory(2, 2, 4, 3)
    opts = {"segment_len": 4, "update": update, "mode": mode, "output_final_state": True}
    o, state = infini_attention(q[:, :T], k[:, :T], v[:, :T], gate, q_mem=qm[:, :T],
                                k_mem=km[:, :T], initial_state=(M0, z0), **opts)
    M, z = state
    M_ref, z_ref = _literal_memory(km[:, :T], v[:, :T], 4, update, M0, z0)
    assert_close64(M, M_ref, what="M")
    assert_close64(z, z_ref, what="z")
    rest, _ = infini_attention(q[:, T:], k[:, T:], v[:, T:], gate, q_mem=qm[:, T:],
                               k_mem=km[:, T:], initial_state=state, **opts)
    whole, _ = infini_attention(q, k, v, gate, q_mem=qm, k_mem=km, initial_state=(M0, z0), **opts)
    assert_close64(torch.cat([o, rest], 1), whole, what="continued from the state")


def test_plain_pair_continues_as_a_new_segment_and_state_survives_copies():
    import copy
    import pickle

    q, k, v, _, _, gate = make(1, 10, 2, 4, 3, seed=13)
    _, state = infini_attention(q[:, :6], k[:, :6], v[:, :6], gate, segment_len=4,
                                output_final_state=True)
    # A bare (M, z) is a memory at a segment boundary: the rest starts a fresh segment.
    fresh, _ = infini_attention(q[:, 6:], k[:, 6:], v[:, 6:], gate, segment_len=4,
                                initial_state=tuple(state))
    M, z = state
    ref, _ = infini_attention(q[:, 6:], k[:, 6:], v[:, 6:], gate, segment_len=4,
                              initial_state=(M.clone(), z.clone()))
    assert_close64(fresh, ref)
    for other in (copy.copy(state), copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert len(other) == 2 and len(other.open_segment) == 5
        for a, b in zip((*other, *other.open_segment), (*state, *state.open_segment)):
            assert torch.equal(a, b)


def test_final_state_is_none_unless_asked():
    q, k, v, _, _, gate = make(1, 5, 1, 4, 4)
    assert infini_attention(q, k, v, gate, segment_len=2)[1] is None


# --- docs/maths.md 5.5 equivalences ---------------------------------------------------------------

@pytest.mark.parametrize("N", [13, 20], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
def test_one_segment_is_gated_softmax_attention(N, mode):
    """Memory empty throughout: A_mem = 0 exactly, and the gate still scales A_dot."""
    q, k, v, _, _, gate = make(2, 13, 3, 5, 4, seed=8)
    o, _ = infini_attention(q, k, v, gate, segment_len=N, mode=mode)
    ref = (1.0 - torch.sigmoid(gate))[:, None] * softmax_attention(q, k, v, causal=True)
    assert_close64(o, ref)


@pytest.mark.parametrize("N", [1, 3, 5, 8], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
def test_linear_memory_is_block_causal_linear_attention(N, mode):
    """sigmoid(beta) -> 1 leaves pure retrieval: block-causal normalised linear attention."""
    q, k, v, qm, km, _ = make(2, 19, 2, 4, 3, seed=9)
    gate = torch.full((2,), 60.0, dtype=F64)  # sigmoid(60) == 1.0 in float64
    o, _ = infini_attention(q, k, v, gate, segment_len=N, q_mem=qm, k_mem=km, mode=mode)
    assert_close64(o, block_causal_mem(qm, km, v, N))


def test_segment_len_one_is_strictly_causal_linear_attention():
    q, k, v, _, _, _ = make(2, 15, 2, 4, 3, seed=10)
    gate = torch.full((2,), 60.0, dtype=F64)
    o, _ = infini_attention(q, k, v, gate, segment_len=1)
    # Query t reads keys/values 0..t-1: shift the queries one step against linear_attn's
    # inclusive prefix, whose output t-1 is sigma(q_t) S_{t-1} / sigma(q_t) z_{t-1}.
    ref, _ = linear_attn(sigma(q[:, 1:]), sigma(k[:, :-1]), v[:, :-1], normalize=True, eps=0.0)
    assert_close64(o[:, 1:], ref)
    assert (o[:, 0] == 0).all()


@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
def test_gate_to_zero_is_segment_local_softmax(mode):
    q, k, v, qm, km, _ = make(2, 21, 3, 4, 5, seed=11)
    gate = torch.full((3,), -60.0, dtype=F64)
    o, _ = infini_attention(q, k, v, gate, segment_len=6, q_mem=qm, k_mem=km, scale=0.6, mode=mode)
    assert_close64(o, block_local_softmax(q, k, v, 6, scale=0.6))


@pytest.mark.parametrize("update", UPDATES)
def test_gate_mixes_memory_and_local_per_head(update):
    q, k, v, _, _, gate = make(1, 14, 3, 4, 4, seed=12)
    o, _ = infini_attention(q, k, v, gate, segment_len=4, update=update)
    a_mem, _ = infini_attention(q, k, v, torch.full_like(gate, 60.0), segment_len=4, update=update)
    g = torch.sigmoid(gate)[:, None]
    assert_close64(o, g * a_mem + (1 - g) * block_local_softmax(q, k, v, 4))


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
def test_retrieve_before_update(update, mode):
    """A_mem of segment s depends only on segments < s, whatever happens from s on."""
    N, s = 4, 2
    q, k, v, _, _, _ = make(1, 14, 2, 4, 3, seed=13)
    gate = torch.full((2,), 60.0, dtype=F64)

    def a_mem(k, v):
        return infini_attention(q, k, v, gate, segment_len=N, update=update, mode=mode)[0]

    base = a_mem(k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, s * N:] += 2.0
    v2[:, s * N:] -= 3.0
    assert_close64(a_mem(k2, v2)[:, :(s + 1) * N], base[:, :(s + 1) * N])
    k3 = k.clone()
    k3[:, s * N - 1] += 2.0  # the last token of segment s - 1 does reach segment s
    assert (a_mem(k3, v)[:, s * N:(s + 1) * N] - base[:, s * N:(s + 1) * N]).abs().max() > 1e-3


def test_delta_rule_does_not_store_a_pair_twice():
    """N = 1, the same (k, v) twice: delta retrieves v exactly and leaves M unchanged; the linear
    rule adds sigma(k)^T v again."""
    g = torch.Generator().manual_seed(14)
    k = torch.randn(1, 1, 1, 4, generator=g, dtype=F64).expand(1, 2, 1, 4)
    v = torch.randn(1, 1, 1, 3, generator=g, dtype=F64).expand(1, 2, 1, 3)
    gate = torch.full((1,), 60.0, dtype=F64)
    stored = sigma(k[0, 0, 0])[:, None] * v[0, 0, 0][None, :]  # sigma(k)^T v
    o, (M, z, *_) = infini_attention(k, k, v, gate, segment_len=1, update="delta", output_final_state=True)
    assert_close64(o[0, 1, 0], v[0, 1, 0])  # retrieval with the key returns v exactly
    assert_close64(M[0, 0], stored)
    _, (M_lin, z_lin, *_) = infini_attention(k, k, v, gate, segment_len=1, update="linear",
                                             output_final_state=True)
    assert_close64(M_lin[0, 0], 2 * stored)
    assert_close64(z, z_lin)  # z accumulates sigma(k) under both rules
    assert_close64(z[0, 0], 2 * sigma(k[0, 0, 0]))


@pytest.mark.parametrize("T", [5, 50])
def test_memory_size_is_independent_of_length(T):
    B, H, Dk, Dv = 2, 3, 4, 6
    q, k, v, _, _, gate = make(B, T, H, Dk, Dv)
    _, state = infini_attention(q, k, v, gate, segment_len=8, output_final_state=True)
    (M, z), (_, _, kc, vc, kmc) = state, state.open_segment
    assert M.shape == (B, H, Dk, Dv) and z.shape == (B, H, Dk)
    assert (M.numel() + z.numel()) // (B * H) == Dk * Dv + Dk
    assert kc.shape == kmc.shape == (B, T % 8, H, Dk) and vc.shape == (B, T % 8, H, Dv)


def test_default_scale_is_inverse_sqrt_dk():
    q, k, v, _, _, gate = make(1, 10, 2, 9, 3, seed=15)
    a, _ = infini_attention(q, k, v, gate, segment_len=4)
    b, _ = infini_attention(q, k, v, gate, segment_len=4, scale=1 / 3)
    c, _ = infini_attention(q, k, v, gate, segment_len=4, scale=1.0)
    assert_close64(a, b)
    assert (a - c).abs().max() > 1e-3


def test_heads_are_independent():
    q, k, v, _, _, gate = make(2, 13, 3, 4, 5, seed=16)
    perm = [2, 0, 1]
    o, _ = infini_attention(q, k, v, gate, segment_len=4, update="delta")
    op, _ = infini_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], gate[perm], segment_len=4,
                             update="delta")
    assert_close64(op, o[:, :, perm])


@pytest.mark.parametrize("mode", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("update", UPDATES)
def test_causal(mode, update):
    q, k, v, _, _, gate = make(1, 20, 2, 4, 4, seed=17)
    base, _ = infini_attention(q, k, v, gate, segment_len=3, update=update, mode=mode)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, 10:] += 2.0
    pert, _ = infini_attention(q2, k2, v2, gate, segment_len=3, update=update, mode=mode)
    assert_close64(pert[:, :10], base[:, :10])
    assert (pert[:, 10:] - base[:, 10:]).abs().max() > 1e-3


# --- precision ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_low_precision_close_to_float64(dtype, tol, update, mode):
    q, k, v, _, _, gate = make(2, 150, 2, 8, 8, seed=18)
    ref, sref = infini_attention(q, k, v, gate, segment_len=16, update=update, output_final_state=True)
    low, slow = infini_attention(*(x.to(dtype) for x in (q, k, v, gate)), segment_len=16,
                                 update=update, output_final_state=True, mode=mode)
    assert low.dtype == dtype
    assert all(s.dtype == torch.float32 for s in slow)
    assert torch.isfinite(low).all()
    assert (low.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)
    assert (slow[0].double() - sref[0]).abs().max().item() <= tol * sref[0].abs().max().item()
