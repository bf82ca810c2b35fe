"""AFT ops: every fast and streaming form against the naive oracle, and the equivalences of
docs/maths.md 4.5 (AFT-full w=0 == AFT-simple, AFT-local s >= T == AFT-full, AFT-local w=0 ==
AFT-simple, AFT-conv == AFT-local with a Toeplitz bias, AFT-simple == per-channel linear
attention, AFT-full == per-channel softmax attention, key shifts change nothing), stability,
gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops import aft, aft_conv, aft_local, linear_attn
from fastweights.ops.aft.naive import aft_conv_naive, aft_local_naive, aft_naive
from tests.helpers import assert_close64

SHAPES = [(2, 37, 5), (1, 1, 3), (3, 16, 4)]  # (B, T, D)
SHAPE_IDS = [f"B{b}-T{t}-D{d}" for b, t, d in SHAPES]
CONV_SHAPES = [(2, 37, 3, 5), (1, 1, 2, 3), (3, 16, 2, 4)]  # (B, T, H, Dh)
CONV_IDS = [f"B{b}-T{t}-H{h}-Dh{d}" for b, t, h, d in CONV_SHAPES]
CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
MODES = pytest.mark.parametrize("mode", ["chunk", "recurrent", "naive"])
FORMS = pytest.mark.parametrize("mode", ["chunk", "naive"])  # every AFT op, causal or not


def make(B, T, D, seed=0, dtype=torch.float64, key_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(T + 3, T + 3, generator=g, dtype=torch.float64)  # larger than T x T
    return q.to(dtype), (key_scale * k).to(dtype), v.to(dtype), w.to(dtype)


def make_conv(B, T, H, Dh, s, seed=0, dtype=torch.float64, key_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, v = (torch.randn(B, T, H, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    k = key_scale * torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(H, s, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype)


def band_of(w, window, start, stop, causal=True):
    """The band aft_local takes, cut from the table w: causal [T, s] with [i, o] =
    w[start + i, start + i - o]; bidirectional (start 0) [T, 2s - 1] with [i, j] the bias at
    offset j - (s - 1), w[i, i - j + s - 1]. Entries outside the table are clamped: never read."""
    i = torch.arange(start, stop)[:, None]
    if causal:
        return w[i, (i - torch.arange(window)).clamp_min(0)]
    return w[i, (i - torch.arange(2 * window - 1) + window - 1).clamp(0, w.shape[1] - 1)]


def toeplitz(kernel, T, causal):
    """[T, T] bias with kernel[j] at t - t' = j (causal) or j - (s - 1) / 2 (centred)."""
    s = kernel.shape[0]
    j = torch.arange(T)[:, None] - torch.arange(T)[None, :] + (0 if causal else (s - 1) // 2)
    return kernel[j.clamp(0, s - 1)]  # entries outside the kernel lie outside the local window


def run_pieces(step, T, splits):
    """Run ``step(start, stop, state) -> (o, state)`` over the pieces split at ``splits``."""
    outs, state, start = [], None, 0
    for stop in [*splits, T]:
        o, state = step(start, stop, state)
        outs.append(o)
        start = stop
    return torch.cat(outs, dim=1), state


# ----------------------------------------------------------------------------- naive == fast

@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("chunk", [1, 4, 128], ids=lambda c: f"C{c}")
@CAUSAL
@FORMS
def test_full_matches_naive(shape, chunk, causal, mode):
    q, k, v, w = make(*shape)
    T = shape[1]
    assert_close64(aft(q, k, v, w, causal=causal, chunk_size=chunk, mode=mode)[0],
                   aft_naive(q, k, v, w[:T, :T], causal))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@CAUSAL
@FORMS
def test_simple_matches_naive(shape, causal, mode):
    q, k, v, _ = make(*shape)
    assert_close64(aft(q, k, v, causal=causal, mode=mode)[0], aft_naive(q, k, v, None, causal))


CHUNKS = pytest.mark.parametrize("chunk", [1, 5, 64], ids=lambda c: f"C{c}")


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("window", [1, 2, 5, 16, 40], ids=lambda s: f"s{s}")
@CHUNKS
@CAUSAL
def test_local_matches_naive(shape, window, chunk, causal):
    """The band against the oracle on the whole table: the band's layout is checked too."""
    q, k, v, w = make(*shape)
    band = band_of(w, window, 0, shape[1], causal)
    want = aft_local_naive(q, k, v, w, window, causal)
    assert_close64(aft_local(q, k, v, band, window=window, causal=causal, chunk_size=chunk)[0],
                   want)
    assert_close64(aft_local(q, k, v, band, window=window, causal=causal, mode="naive")[0], want)


CONV_KERNELS = [(s, True) for s in (1, 3, 4, 7, 41)] + [(s, False) for s in (1, 3, 7, 41)]


@pytest.mark.parametrize("shape", CONV_SHAPES, ids=CONV_IDS)
@pytest.mark.parametrize("s,causal", CONV_KERNELS,
                         ids=[f"s{s}-{'causal' if c else 'bidir'}" for s, c in CONV_KERNELS])
@CHUNKS
def test_conv_matches_naive(shape, s, causal, chunk):
    q, k, v, w = make_conv(*shape, s)
    assert_close64(aft_conv(q, k, v, w, causal=causal, chunk_size=chunk)[0],
                   aft_conv_naive(q, k, v, w, causal))


# ----------------------------------------------------------------------------- states

SPLITS = [(), (1, 2, 3), (5, 20, 21), (36,), tuple(range(1, 37))]
SPLIT_IDS = ["whole", "1-2-3", "5-20-21", "36", "token-by-token"]


@pytest.mark.parametrize("splits", SPLITS, ids=SPLIT_IDS)
@MODES
def test_simple_pieces(splits, mode):
    q, k, v, _ = make(2, 37, 5)
    o, (a, n, m) = run_pieces(lambda i, j, st: aft(
        q[:, i:j], k[:, i:j], v[:, i:j], initial_state=st, output_final_state=True, mode=mode),
        37, splits)
    assert_close64(o, aft_naive(q, k, v, None, True))
    # The state holds sum e^K V = e^a n and sum e^K = e^a m exactly.
    assert_close64(torch.exp(a) * m, torch.exp(k).sum(1))
    assert_close64(torch.exp(a) * n, (torch.exp(k) * v).sum(1))


@pytest.mark.parametrize("splits", SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize("window", [1, 4, 50], ids=lambda s: f"s{s}")
@MODES
def test_local_pieces(splits, window, mode):
    q, k, v, w = make(2, 37, 5)
    o, state = run_pieces(lambda i, j, st: aft_local(
        q[:, i:j], k[:, i:j], v[:, i:j], band_of(w, window, i, j), window=window,
        initial_state=st, output_final_state=True, mode=mode, chunk_size=6), 37, splits)
    assert_close64(o, aft_local_naive(q, k, v, w, window, True))
    assert state[-1] == 37 and state[3].shape == (2, min(37, window - 1), 5)


@pytest.mark.parametrize("splits", SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize("s", [1, 4, 50], ids=lambda s: f"s{s}")
@MODES
def test_conv_pieces(splits, s, mode):
    q, k, v, w = make_conv(2, 37, 3, 4, s)
    o, _ = run_pieces(lambda i, j, st: aft_conv(
        q[:, i:j], k[:, i:j], v[:, i:j], w, initial_state=st, output_final_state=True, mode=mode,
        chunk_size=6), 37, splits)
    assert_close64(o, aft_conv_naive(q, k, v, w, True))


@pytest.mark.parametrize("splits", SPLITS, ids=SPLIT_IDS)
def test_states_with_keys_spread_beyond_exp_range(splits):
    """Keys 1000 apart inside one block: the windows go position by position and the prefix
    through the doubling scan, in pieces too."""
    q, k, v, w = make(2, 37, 3)
    qc, kc, vc, wc = make_conv(2, 37, 3, 2, 4)
    drop = 1000.0 * (torch.arange(37) % 9 < 4).double()  # steps of 1000 every few tokens
    k, kc = k - drop[:, None], kc - drop[:, None]
    o, _ = run_pieces(lambda i, j, st: aft_local(
        q[:, i:j], k[:, i:j], v[:, i:j], band_of(w, 4, i, j), window=4, initial_state=st,
        output_final_state=True, chunk_size=6), 37, splits)
    assert_close64(o, aft_local_naive(q, k, v, w, 4, True), atol=1e-9)
    o, _ = run_pieces(lambda i, j, st: aft_conv(
        qc[:, i:j], kc[:, i:j], vc[:, i:j], wc, initial_state=st, output_final_state=True,
        chunk_size=6), 37, splits)
    assert_close64(o, aft_conv_naive(qc, kc, vc, wc, True), atol=1e-9)


@pytest.mark.parametrize("splits", SPLITS, ids=SPLIT_IDS)
@FORMS
def test_full_pieces(splits, mode):
    q, k, v, w = make(2, 37, 5)
    o, (kc, vc) = run_pieces(lambda i, j, st: aft(
        q[:, i:j], k[:, i:j], v[:, i:j], w[i:j, :j + 2], initial_state=st,
        output_final_state=True, mode=mode, chunk_size=3), 37, splits)
    assert_close64(o, aft_naive(q, k, v, w[:37, :37], True))
    assert kc.shape == (2, 37, 5) and torch.equal(vc, v)


def test_single_token_steps_mix_modes():
    """Every mode's states are interchangeable: cycle through them token by token."""
    q, k, v, w = make(2, 11, 4)
    qc, kc, vc, wc = make_conv(2, 11, 2, 3, 3)
    outs = {"simple": [], "local": [], "conv": []}
    st = {"simple": None, "local": None, "conv": None}
    for t in range(11):
        mode = ("chunk", "recurrent", "naive")[t % 3]
        sl = slice(t, t + 1)
        o, st["simple"] = aft(q[:, sl], k[:, sl], v[:, sl], initial_state=st["simple"],
                              output_final_state=True, mode=mode)
        outs["simple"].append(o)
        o, st["local"] = aft_local(q[:, sl], k[:, sl], v[:, sl], band_of(w, 3, t, t + 1),
                                   window=3, initial_state=st["local"],
                                   output_final_state=True, mode=mode)
        outs["local"].append(o)
        o, st["conv"] = aft_conv(qc[:, sl], kc[:, sl], vc[:, sl], wc, initial_state=st["conv"],
                                 output_final_state=True, mode=mode)
        outs["conv"].append(o)
    assert_close64(torch.cat(outs["simple"], 1), aft_naive(q, k, v, None, True))
    assert_close64(torch.cat(outs["local"], 1), aft_local_naive(q, k, v, w, 3, True))
    assert_close64(torch.cat(outs["conv"], 1), aft_conv_naive(qc, kc, vc, wc, True))


@MODES
def test_local_rows_at_their_own_positions_equal_each_row_alone(mode):
    """A state with per-row positions (pos a long tensor [B]) takes each row's own biases
    w [B, 1, s]: the same as every row alone at its int position, in every mode."""
    B, D, s = 3, 4, 3
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(B, 1, s, generator=g, dtype=torch.float64)
    a, n = (torch.randn(B, D, generator=g, dtype=torch.float64) for _ in range(2))
    m = torch.rand(B, D, generator=g, dtype=torch.float64) + 0.5
    caches = [torch.randn(B, s - 1, D, generator=g, dtype=torch.float64) for _ in range(2)]
    pos = [5, 2, 9]
    o, state = aft_local(q, k, v, w, window=s, initial_state=(a, n, m, *caches, torch.tensor(pos)),
                         output_final_state=True, mode=mode)
    for b in range(B):
        row = (a[b:b + 1], n[b:b + 1], m[b:b + 1], caches[0][b:b + 1], caches[1][b:b + 1], pos[b])
        o_b, state_b = aft_local(q[b:b + 1], k[b:b + 1], v[b:b + 1], w[b], window=s,
                                 initial_state=row, output_final_state=True, mode=mode)
        assert_close64(o[b:b + 1], o_b)
        assert_close64(state.k_cache[b:b + 1], state_b.k_cache)
    assert state.pos.tolist() == [p + 1 for p in pos]


def test_final_state_only_when_asked():
    q, k, v, w = make(1, 6, 3)
    assert aft(q, k, v)[1] is None
    assert aft(q, k, v, causal=False)[1] is None
    assert aft_local(q, k, v, band_of(w, 2, 0, 6), window=2)[1] is None
    assert aft(q, k, v, w[:6])[1] is None
    qc, kc, vc, wc = make_conv(1, 6, 2, 2, 3)
    assert aft_conv(qc, kc, vc, wc)[1] is None


# -------------------------------------------------------------------------------- docs/maths.md 4.5

@CAUSAL
@FORMS
def test_full_with_zero_bias_is_simple(causal, mode):
    q, k, v, w = make(2, 23, 4)
    assert_close64(aft(q, k, v, torch.zeros_like(w), causal=causal, chunk_size=5, mode=mode)[0],
                   aft(q, k, v, None, causal=causal, mode=mode)[0])


@CAUSAL
@pytest.mark.parametrize("window", [23, 24, 100], ids=lambda s: f"s{s}")
def test_local_with_wide_window_is_full(causal, window):
    q, k, v, w = make(2, 23, 4)
    assert_close64(aft_local(q, k, v, band_of(w, window, 0, 23, causal), window=window,
                             causal=causal)[0], aft(q, k, v, w, causal=causal)[0])


@CAUSAL
@pytest.mark.parametrize("window", [1, 3, 30], ids=lambda s: f"s{s}")
def test_local_with_zero_bias_is_simple(causal, window):
    q, k, v, _ = make(2, 23, 4)
    zeros = torch.zeros(23, window if causal else 2 * window - 1, dtype=q.dtype)
    assert_close64(aft_local(q, k, v, zeros, window=window, causal=causal)[0],
                   aft(q, k, v, None, causal=causal)[0])


@CAUSAL
@pytest.mark.parametrize("chunk", [4, 64])
def test_full_float32_is_exact_for_extreme_key_and_bias_spreads(causal, chunk):
    """Keys and biases spread over hundreds: separate maxima of K and w would underflow whole
    rows in float32 (a row's best K + w far below max K + max w); those rows are redone with
    the joint maximum, so float32 stays at float32 accuracy against a float64 oracle."""
    q, k, v, w = make(2, 29, 3, seed=31)
    k, w = 100 * k, 100 * w
    q[0, 0] = 0.0  # plus the hand case: k = [0, -120], w = -120 on the diagonal
    k[0, :2, 0], w[0, :2], w[1, :2] = torch.tensor([0.0, -120.0]), torch.tensor([-120.0, 0.0]), \
        torch.tensor([0.0, -120.0])
    ref = aft_naive(q, k, v, w, causal)
    got = aft(q.float(), k.float(), v.float(), w.float(), causal=causal, chunk_size=chunk)[0]
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


@CAUSAL
@pytest.mark.parametrize("s", [1, 3, 5], ids=lambda s: f"s{s}")
def test_conv_is_local_with_toeplitz_bias(causal, s):
    B, T, H, Dh = 2, 19, 3, 2
    q, k, v, w = make_conv(B, T, H, Dh, s)
    o = aft_conv(q, k, v, w, causal=causal)[0]
    window = s if causal else (s + 1) // 2
    for h in range(H):  # one key channel per head, broadcast over its Dh value channels
        kh = k[:, :, h, None].expand(B, T, Dh)
        band = band_of(toeplitz(w[h], T, causal), window, 0, T, causal)
        ref = aft_local(q[:, :, h], kh, v[:, :, h], band, window=window, causal=causal)[0]
        assert_close64(o[:, :, h], ref, what=f"head {h}")


def test_simple_is_per_channel_linear_attention():
    """phi(k) = exp(k), a constant query feature and attention normalisation, gated by sigmoid(q):
    D independent one-dimensional linear attentions (heads of size 1)."""
    q, k, v, _ = make(2, 29, 5)
    ones = torch.ones_like(q).unsqueeze(-1)
    la, _ = linear_attn(ones, torch.exp(k).unsqueeze(-1), v.unsqueeze(-1), normalize=True, eps=0.0,
                        chunk_size=8)
    assert_close64(aft(q, k, v)[0], torch.sigmoid(q) * la.squeeze(-1))


@CAUSAL
def test_full_is_per_channel_softmax_attention(causal):
    """Each channel is a softmax attention with logits K_t' + w_tt' (query 1, key K, bias w)."""
    q, k, v, w = make(2, 17, 3)
    T = 17
    bias = w[:T, :T].masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")) \
        if causal else w[:T, :T]
    qh = torch.ones(2, 3, T, 1, dtype=torch.float64)  # [B, D channels as heads, T, 1]
    o = F.scaled_dot_product_attention(qh, k.mT.unsqueeze(-1), v.mT.unsqueeze(-1), attn_mask=bias,
                                       scale=1.0)
    assert_close64(aft(q, k, v, w, causal=causal)[0], torch.sigmoid(q) * o.squeeze(-1).mT)


def per_channel_shift(k, value=80.0):
    return k + value + torch.linspace(-3, 3, k.shape[-1], dtype=k.dtype)


SHIFT_CASES = [(op, c) for op in ("full", "simple", "local", "conv") for c in (True, False)] + [
    ("simple-recurrent", True)]


@pytest.mark.parametrize("op,causal", SHIFT_CASES,
                         ids=[f"{op}-{'causal' if c else 'bidir'}" for op, c in SHIFT_CASES])
def test_key_shift_changes_nothing_float32(op, causal):
    """K ~ 80 in float32 overflows a plain exp; shifting keys per channel must not matter."""
    q, k, v, w = make(2, 37, 5, dtype=torch.float32)
    qc, kc, vc, wc = make_conv(2, 37, 5, 2, 5, dtype=torch.float32)
    run = {
        "full": lambda kk: aft(q, kk, v, w, causal=causal, chunk_size=8),
        "simple": lambda kk: aft(q, kk, v, causal=causal),
        "local": lambda kk: aft_local(q, kk, v, band_of(w, 6, 0, 37, causal), window=6,
                                      causal=causal),
        "conv": lambda kk: aft_conv(qc, kk, vc, wc, causal=causal),
        "simple-recurrent": lambda kk: aft(q, kk, v, mode="recurrent"),
    }[op]
    key = kc if op == "conv" else k
    ref, shifted = run(key)[0], run(per_channel_shift(key))[0]
    assert torch.isfinite(shifted).all()
    assert (shifted - ref).abs().max().item() < 2e-5


# ----------------------------------------------------------------------------- stability

def float32_and_bfloat16_cases():
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for keys in ("shift80", "scale40"):
            yield pytest.param(dtype, keys, tol, id=f"{keys}-{str(dtype)[6:]}")


def widen(k, keys):
    return k + 80.0 if keys == "shift80" else 40.0 * k  # scale40: spreads of ~250 per channel


@pytest.mark.parametrize("dtype,keys,tol", list(float32_and_bfloat16_cases()))
@CAUSAL
def test_large_keys_stay_close_to_float64(dtype, keys, tol, causal):
    """Rounded inputs, then every op in low precision against the float64 oracle on the very
    same rounded values: finite, and within the dtype's output rounding."""
    q, k, v, w = (x.to(dtype) for x in make(2, 37, 4))
    k = widen(k.double(), keys).to(dtype)
    qc, kc, vc, wc = (x.to(dtype) for x in make_conv(2, 37, 4, 2, 5))
    kc = widen(kc.double(), keys).to(dtype)
    def d(*xs):
        return [x.double() for x in xs]
    band = band_of(w, 6, 0, 37, causal)
    cases = [
        ("full", aft(q, k, v, w, causal=causal, chunk_size=8), aft_naive(*d(q, k, v, w[:37, :37]), causal)),
        ("simple", aft(q, k, v, causal=causal), aft_naive(*d(q, k, v), None, causal)),
        ("local", aft_local(q, k, v, band, window=6, causal=causal), aft_local_naive(*d(q, k, v, w), 6, causal)),
        ("conv", aft_conv(qc, kc, vc, wc, causal=causal), aft_conv_naive(*d(qc, kc, vc, wc), causal)),
    ]
    if causal:
        cases.append(("simple-recurrent", aft(q, k, v, mode="recurrent"), cases[1][2]))
    for name, (got, _), ref in cases:
        assert got.dtype == dtype, name
        assert torch.isfinite(got).all(), name
        err = (got.double() - ref).abs().max().item()
        assert err < tol, f"{name}: {err:.2e}"


@CAUSAL
def test_keys_spread_beyond_float64_exp_range(causal):
    """Keys spread over thousands (beyond what e^{K - max K} can hold even in float64) take the
    doubling scan; it must still equal the oracle."""
    q, k, v, w = make(2, 37, 4, key_scale=1500.0)
    qc, kc, vc, wc = make_conv(2, 37, 2, 3, 5, key_scale=1500.0)
    assert_close64(aft(q, k, v, causal=causal)[0], aft_naive(q, k, v, None, causal), atol=1e-9)
    assert_close64(aft_local(q, k, v, band_of(w, 4, 0, 37, causal), window=4, causal=causal)[0],
                   aft_local_naive(q, k, v, w, 4, causal), atol=1e-9)
    assert_close64(aft_conv(qc, kc, vc, wc, causal=causal)[0],
                   aft_conv_naive(qc, kc, vc, wc, causal), atol=1e-9)
    assert_close64(aft(q, k, v, w, causal=causal, chunk_size=8)[0],
                   aft_naive(q, k, v, w[:37, :37], causal), atol=1e-9)


@MODES
def test_state_dtype_is_float32_for_bfloat16(mode):
    q, k, v, w = (x.bfloat16() for x in make(2, 9, 3))
    o, state = aft(q, k, v, output_final_state=True, mode=mode)
    assert o.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in state)
    o, state = aft_local(q, k, v, band_of(w, 4, 0, 9), window=4, output_final_state=True,
                         mode=mode)
    assert o.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in state[:5])
    if mode != "recurrent":
        o, state = aft(q, k, v, w[:9], output_final_state=True, mode=mode)
        assert o.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in state)


def test_modes_that_do_not_exist_are_refused():
    """AFT-full has no recurrence; a bidirectional call carries no state and has no recurrence;
    the ablations of AFT-conv have the causal chunked form and the naive one."""
    q, k, v, w = make(1, 5, 2)
    qc, kc, vc, wc = make_conv(1, 5, 2, 2, 3)
    calls = [
        (lambda: aft(q, k, v, w, mode="recurrent"), "has no recurrent form"),
        (lambda: aft(q, k, v, causal=False, mode="recurrent"), "needs causal=True"),
        (lambda: aft_local(q, k, v, band_of(w, 2, 0, 5, False), window=2, causal=False,
                           mode="recurrent"), "needs causal=True"),
        (lambda: aft(q, k, v, causal=False, output_final_state=True), "carries no state"),
        (lambda: aft_conv(qc, kc, vc, wc, causal=False, initial_state=aft_conv(
            qc, kc, vc, wc, output_final_state=True)[1]), "carries no state"),
        (lambda: aft_conv(qc, kc, vc, wc, causal=False, signed=True), "causal chunk form"),
    ]
    for call, words in calls:
        with pytest.raises(ValueError, match=words):
            call()


# ----------------------------------------------------------------------------- causality, grads

@pytest.mark.parametrize("op", ["full", "simple", "local", "conv"])
def test_causal_outputs_ignore_the_future(op):
    q, k, v, w = make(2, 21, 4)
    qc, kc, vc, wc = make_conv(2, 21, 2, 2, 4)
    run = {
        "full": lambda x: aft(*x[:3], w),
        "simple": lambda x: aft(*x[:3]),
        "local": lambda x: aft_local(*x[:3], band_of(w, 5, 0, 21), window=5),
        "conv": lambda x: aft_conv(*x[:3], wc),
    }[op]
    xs = [qc, kc, vc] if op == "conv" else [q, k, v]
    ref = run(xs)[0]
    changed = [x.clone() for x in xs]
    for x in changed:
        x[:, 12:] += 5.0
    assert_close64(run(changed)[0][:, :12], ref[:, :12])


def gradcheck(fn, *inputs):
    inputs = [x.detach().requires_grad_() for x in inputs]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


@CAUSAL
def test_gradcheck_whole_sequence_ops(causal):
    q, k, v, w = make(1, 9, 3, key_scale=2.0)
    band = band_of(w, 3, 0, 9, causal)
    gradcheck(lambda q, k, v, w: aft(q, k, v, w, causal=causal, chunk_size=4)[0], q, k, v, w)
    gradcheck(lambda q, k, v: aft(q, k, v, causal=causal)[0], q, k, v)
    gradcheck(lambda q, k, v, w: aft_local(q, k, v, w, window=3, causal=causal)[0], q, k, v, band)
    qc, kc, vc, wc = make_conv(1, 9, 2, 2, 3)
    gradcheck(lambda q, k, v, w: aft_conv(q, k, v, w, causal=causal)[0], qc, kc, vc, wc)


def test_gradcheck_wide_key_path():
    """The doubling scan (keys spread too far for plain prefix sums) is differentiable too: the
    early keys sit 1000 below the late ones, so every prefix is informative yet the spread is
    beyond float64's exp range."""
    q, k, v, w = make(1, 9, 3)
    k = k - 1000.0 * (torch.arange(9) < 5).double()[:, None]
    gradcheck(lambda q, k, v: aft(q, k, v)[0], q, k, v)
    gradcheck(lambda q, k, v, w: aft_local(q, k, v, w, window=2)[0], q, k, v, band_of(w, 2, 0, 9))
    gradcheck(lambda q, k, v, w: aft_local(q, k, v, w, window=2, causal=False)[0], q, k, v,
              band_of(w, 2, 0, 9, False))


@MODES
def test_gradcheck_through_the_state(mode):
    """Gradients flow through a carried state into the first piece."""
    q, k, v, w = make(1, 8, 2)

    def simple(q, k, v):
        o1, st = aft(q[:, :3], k[:, :3], v[:, :3], output_final_state=True, mode=mode)
        o2, _ = aft(q[:, 3:], k[:, 3:], v[:, 3:], initial_state=st, mode=mode)
        return torch.cat([o1, o2], 1)

    def local(q, k, v, w):
        o1, st = aft_local(q[:, :5], k[:, :5], v[:, :5], band_of(w, 3, 0, 5), window=3,
                           output_final_state=True, mode=mode)
        o2, _ = aft_local(q[:, 5:], k[:, 5:], v[:, 5:], band_of(w, 3, 5, 8), window=3,
                          initial_state=st, mode=mode)
        return torch.cat([o1, o2], 1)

    gradcheck(simple, q, k, v)
    gradcheck(local, q, k, v, w)


@CAUSAL
def test_gradients_match_naive(causal):
    q, k, v, w = make(2, 13, 3)
    qc, kc, vc, wc = make_conv(2, 13, 2, 2, 3)
    pairs = [
        (lambda *x: aft(*x, causal=causal, chunk_size=4)[0],
         lambda *x: aft_naive(*x[:3], x[3][:13, :13], causal), (q, k, v, w)),
        (lambda *x: aft_local(*x[:3], band_of(x[3], 4, 0, 13, causal), window=4, causal=causal)[0],
         lambda *x: aft_local_naive(*x, 4, causal), (q, k, v, w)),
        (lambda *x: aft_conv(*x, causal=causal)[0], lambda *x: aft_conv_naive(*x, causal),
         (qc, kc, vc, wc)),
    ]
    for fast, slow, xs in pairs:
        g = torch.randn_like(fast(*xs))
        grads = []
        for fn in (fast, slow):
            leaves = [x.detach().requires_grad_() for x in xs]
            (fn(*leaves) * g).sum().backward()
            grads.append([x.grad for x in leaves])
        for a, b in zip(*grads):
            assert_close64(a, b)


# ------------------------------------------------------------- AFT-conv ablations (aft reproduce)

ABLATIONS = [{"global_context": False}, {"signed": True}, {"gating": False},
             {"global_context": False, "signed": True, "gating": False}]
ABLATION_IDS = ["local-only", "signed", "ungated", "all-three"]


@pytest.mark.parametrize("flags", ABLATIONS, ids=ABLATION_IDS)
@pytest.mark.parametrize("splits", SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize("s", [1, 4, 50], ids=lambda s: f"s{s}")
@FORMS
def test_conv_ablations_in_pieces_match_naive(flags, splits, s, mode):
    q, k, v, w = make_conv(2, 37, 3, 4, s, seed=3)
    if flags.get("signed"):
        w = w * 2 - 0.5  # weights of both signs
        assert (w < 0).any() and (w > 0).any()
    o, _ = run_pieces(lambda i, j, st: aft_conv(
        q[:, i:j], k[:, i:j], v[:, i:j], w, initial_state=st, output_final_state=True,
        chunk_size=6, mode=mode, **flags), 37, splits)
    assert_close64(o, aft_conv_naive(q, k, v, w, True, **flags))


def test_conv_ablations_reduce_to_their_definitions():
    q, k, v, w = make_conv(2, 23, 3, 4, 5, seed=4)
    plain = aft_conv(q, k, v, w)[0]
    # signed weights c = e^w are AFT-conv with biases w
    assert_close64(aft_conv(q, k, v, torch.exp(w), signed=True)[0], plain)
    # no gating: the output is the ratio, i.e. AFT-conv divided by sigmoid(Q)
    assert_close64(aft_conv(q, k, v, w, gating=False)[0], plain / torch.sigmoid(q))
    # local only: a kernel covering the whole sequence sees everything, as AFT-conv does
    wide = torch.cat([w, torch.zeros(3, 30, dtype=w.dtype)], dim=1)
    assert_close64(aft_conv(q, k, v, wide, global_context=False)[0], aft_conv(q, k, v, wide)[0])
    # ... while a short kernel ignores a change far outside it
    k2 = k.clone()
    k2[:, 0] += 5.0
    far = aft_conv(q, k2, v, w, global_context=False)[0][:, 10:]
    assert_close64(far, aft_conv(q, k, v, w, global_context=False)[0][:, 10:])
    assert not torch.allclose(aft_conv(q, k2, v, w)[0][:, 10:], plain[:, 10:])
    # a negative weight subtracts: one token, weight -1 at offset 0 gives -sigmoid(q) v
    o = aft_conv(q[:, :1], k[:, :1], v[:, :1], -torch.ones(3, 1, dtype=w.dtype), signed=True)[0]
    assert_close64(o, -torch.sigmoid(q[:, :1]) * v[:, :1])


def test_conv_ablations_refuse_recurrent_mode_and_bad_flags():
    q, k, v, w = make_conv(1, 5, 2, 2, 3)
    for flags in ({"global_context": False}, {"signed": True}):
        with pytest.raises(ValueError, match="causal chunk form and the naive one only"):
            aft_conv(q, k, v, w, mode="recurrent", **flags)
    with pytest.raises(TypeError, match="gating"):
        aft_conv(q, k, v, w, gating=1)
    # gating alone has every form
    assert_close64(aft_conv(q, k, v, w, mode="recurrent", gating=False)[0],
                   aft_conv(q, k, v, w, gating=False)[0])


def test_conv_ablations_bidirectional_naive():
    """The ablations of a centred kernel: the naive form only, against a literal loop."""
    q, k, v, w = make_conv(2, 9, 2, 3, 3, seed=6)
    w = w - 0.3
    o = aft_conv(q, k, v, w, causal=False, mode="naive", global_context=False, signed=True)[0]
    for t in range(9):
        num = den = 0.0
        for u in range(max(0, t - 1), min(9, t + 2)):  # the kernel: |t - u| <= 1
            c = w[:, t - u + 1]  # [H]
            e = torch.exp(k[:, u]) * c.abs()  # [B, H]
            num, den = num + (e * torch.sign(c)).unsqueeze(-1) * v[:, u], den + e
        assert_close64(o[:, t], torch.sigmoid(q[:, t]) * num / den.unsqueeze(-1))


def test_conv_ablation_gradients_match_naive():
    q, k, v, w = make_conv(1, 9, 2, 3, 4, seed=5)
    w = w - 0.3
    for flags in ABLATIONS:
        ins = [t.clone().requires_grad_() for t in (q, k, v, w)]
        ref = [t.clone().requires_grad_() for t in (q, k, v, w)]
        aft_conv(*ins, **flags)[0].square().sum().backward()
        aft_conv_naive(*ref, True, **flags).square().sum().backward()
        for a, b in zip(ins, ref):
            if a.grad is None:  # q when ungated: unused by both
                assert b.grad is None and not flags.get("gating", True)
                continue
            assert_close64(a.grad, b.grad)


# ------------------------------------------------------------- prefix sums off the CPU

def test_blocked_cumsum_is_cumsum():
    """The GPU's scan over time (blocks of tokens plus the running totals of the blocks) equals
    torch's cumsum, values and gradients, for lengths below, at and past a block."""
    import importlib

    chunk = importlib.import_module("fastweights.ops.aft.chunk")
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 37, 3, 2), (1, 8, 5), (3, 9, 4, 1), (2, 1, 3)]:
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        assert_close64(chunk.blocked_cumsum(x, 4), x.cumsum(1))
        assert torch.autograd.gradcheck(lambda x: chunk.blocked_cumsum(x, 4),
                                        (x.requires_grad_(),))


@CAUSAL
def test_ops_with_blocked_prefix_sums_match_naive(monkeypatch, causal):
    """AFT-simple, -local and -conv through the blocked scan (what runs on a GPU)."""
    import importlib

    chunk = importlib.import_module("fastweights.ops.aft.chunk")
    monkeypatch.setattr(chunk, "cumsum_time", lambda x: chunk.blocked_cumsum(x, 4))
    q, k, v, w = make(2, 37, 5)
    qc, kc, vc, wc = make_conv(2, 37, 3, 4, 5)
    assert_close64(aft(q, k, v, causal=causal)[0], aft_naive(q, k, v, None, causal))
    assert_close64(aft_local(q, k, v, band_of(w, 6, 0, 37, causal), window=6, causal=causal)[0],
                   aft_local_naive(q, k, v, w, 6, causal))
    assert_close64(aft_conv(qc, kc, vc, wc, causal=causal)[0], aft_conv_naive(qc, kc, vc, wc, causal))
