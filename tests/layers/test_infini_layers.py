"""InfiniAttention layer: positions, memory inputs, gate, streaming, options (docs/maths.md 5)."""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer
from fastweights.layers import InfiniAttention, SoftmaxAttention
from fastweights.layers.base import merge_heads, split_heads
from fastweights.layers.positional import apply_rotary
from fastweights.ops import infini_attention
from fastweights.ops.infini import InfiniState
from tests.helpers import assert_close64, steps_from

D_MODEL, H, T = 12, 3, 17
F64 = torch.float64


def make(**options) -> InfiniAttention:
    torch.manual_seed(0)
    layer = InfiniAttention(D_MODEL, H, **{"segment_len": 5, **options}).double().eval()
    with torch.no_grad():
        layer.gate.copy_(torch.tensor([-0.7, 0.3, 1.1]))
    return layer


def inputs(B: int = 2, T: int = T) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=F64)


def by_hand(layer: InfiniAttention, x: torch.Tensor, memory_rotated: bool) -> torch.Tensor:
    """The layer written out with *global* rotary positions on the dot-product path."""
    q, k, v = split_heads(layer.qkv(x), H).chunk(3, dim=-1)
    pos = torch.arange(x.shape[1])
    qr, kr = apply_rotary(q, pos, layer.inv_freq), apply_rotary(k, pos, layer.inv_freq)
    if memory_rotated:  # the layer rotates memory q, k with segment-local positions
        local = pos % layer.segment_len
        q, k = apply_rotary(q, local, layer.inv_freq), apply_rotary(k, local, layer.inv_freq)
    o, _ = infini_attention(qr, kr, v, layer.gate, segment_len=layer.segment_len,
                            update=layer.update, q_mem=q, k_mem=k)
    return layer.out(merge_heads(o))


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_memory_gets_unrotated_qk_and_local_positions_equal_global(update):
    layer = make(update=update)
    x = inputs()
    y, _ = layer(x)
    assert_close64(y, by_hand(layer, x, memory_rotated=False))
    assert (y - by_hand(layer, x, memory_rotated=True)).abs().max() > 1e-4


def test_rope_memory_flag_gives_memory_the_rotated_qk():
    layer = make(rope_memory=True)
    x = inputs()
    y, _ = layer(x)
    assert_close64(y, by_hand(layer, x, memory_rotated=True))


def softmax_twin(layer: InfiniAttention) -> SoftmaxAttention:
    sa = SoftmaxAttention(D_MODEL, H).double()
    sa.load_state_dict({"qkv.weight": layer.qkv.weight, "out.weight": layer.out.weight})
    return sa


def test_one_segment_with_gate_is_scaled_softmax_layer():
    """N >= T: memory stays empty, so y = W_O((1 - sigmoid(beta_h)) * softmax heads)."""
    layer = make(segment_len=T)
    x = inputs()
    sa = softmax_twin(layer)
    y_sa, _ = sa(x)
    with torch.no_grad():
        layer.gate.fill_(-60.0)
    assert_close64(layer(x)[0], y_sa)
    with torch.no_grad():
        layer.gate.fill_(0.0)
    assert_close64(layer(x)[0], 0.5 * y_sa)


def test_gate_to_zero_matches_softmax_on_each_segment():
    layer = make(segment_len=6)
    with torch.no_grad():
        layer.gate.fill_(-60.0)
    x = inputs(T=15)
    y, _ = layer(x)
    sa = softmax_twin(layer)
    for start in range(0, 15, 6):
        assert_close64(y[:, start:start + 6], sa(x[:, start:start + 6])[0])


OPTIONS = [
    {"update": "delta"},
    {"rope_memory": True},
    {"rope": False},
    {"mode": "naive", "update": "delta"},
    {"mode": "recurrent"},
    {"segment_len": 1},
]
OPTION_IDS = ["delta", "rope_memory", "no_rope", "naive-delta", "recurrent", "N1"]


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_pieces_and_single_steps_equal_whole(options):
    layer = make(**options)
    x = inputs()
    whole, sw = layer(x)
    outs, state, start = [], None, 0
    for stop in (3, 4, 11, T):
        y, state = layer(x[:, start:stop], state)
        outs.append(y)
        start = stop
    assert_close64(torch.cat(outs, 1), whole)
    for a, b in zip(state, sw):
        assert_close64(a, b)
    outs, state = [], None
    for t in range(T):
        y, state = layer(x[:, t:t + 1], state)
        outs.append(y)
    assert_close64(torch.cat(outs, 1), whole)


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_modes_agree(update):
    x = inputs()
    ref, _ = make(update=update, mode="naive")(x)
    for mode in ("chunk", "recurrent"):
        assert_close64(make(update=update, mode=mode)(x)[0], ref, what=mode)


def test_state_size_counts_the_compressive_memory():
    layer = make(head_dim=6)
    _, (M, z, *_) = layer(inputs(B=1))
    assert layer.state_size() == H * (6 * 6 + 6) == M.numel() + z.numel()
    assert layer.state_size(10_000) == layer.state_size(1)


def test_gate_init():
    assert torch.equal(InfiniAttention(D_MODEL, H).gate, torch.zeros(H))  # paper: half/half
    local = InfiniAttention(D_MODEL, H, gate_init=-10.0)  # lucidrains: start (almost) local
    assert torch.equal(local.gate, torch.full((H,), -10.0))


def test_registry_passes_options():
    layer = build_mixer("infini", 16, 2, segment_len=8, update="delta", rope_memory=True)
    assert isinstance(layer, InfiniAttention)
    assert (layer.segment_len, layer.update, layer.rope_memory) == (8, "delta", True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("update", ["linear", "delta"])
def test_low_precision(dtype, tol, update):
    layer = make(update=update, segment_len=16)
    x = inputs(T=100)
    ref, _ = layer(x)
    y, state = layer.to(dtype)(x.to(dtype))
    assert y.dtype == dtype and all(s.dtype == torch.float32 for s in state)
    assert (y.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)


BAD = [
    ("segment_len 0", {"segment_len": 0}, ValueError, "segment_len must be >= 1"),
    ("update", {"update": "sum"}, ValueError, "update must be one of"),
    ("rope_memory without rope", {"rope": False, "rope_memory": True}, ValueError, "rope_memory"),
    ("eps 0", {"eps": 0.0}, ValueError, "eps must be > 0"),
    ("odd head_dim", {"head_dim": 5}, ValueError, "even head_dim"),
    ("gate_init nan", {"gate_init": float("nan")}, ValueError, "gate_init"),
    ("mode", {"mode": "fast"}, ValueError, "mode must be one of"),
    ("rope not bool", {"rope": 1}, TypeError, "rope must be a bool"),
]


@pytest.mark.parametrize("options,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_options(options, exc, words):
    with pytest.raises(exc) as info:
        InfiniAttention(D_MODEL, H, **options)
    assert words in str(info.value)


def test_bad_state_is_rejected():
    layer = make()
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(M\)"):
        layer(inputs(), (torch.zeros(2, H, 3, 3), torch.zeros(2, H, 4)))


@pytest.mark.parametrize("options", [{}, {"update": "delta", "rope_memory": True}],
                         ids=["linear", "delta-rope_memory"])
def test_step_path_states_equal_whole(options):
    """One-token steps (the layer's own streaming path) from a state of every accepted form
    (None, the layer's 5-tuple, the op's InfiniState, a bare (M, z) at a segment boundary)
    end in the state of the whole sequence, across segment boundaries."""
    layer = make(**options)
    x = inputs(T=12)
    whole, sw = layer(x)
    _, s10 = layer(x[:, :10])  # 10 = two whole segments: the open segment is empty
    starts = {"layer": (0, None), "boundary pair": (10, (s10.M, s10.z)),
              "op state": (10, InfiniState(s10.M, s10.z, s10))}
    for what, (start, state) in starts.items():
        ys, state = steps_from(layer, x[:, start:], state=state)
        assert_close64(ys, whole[:, start:], what=what)
        for a, b in zip(state, sw):
            assert_close64(a, b, what=f"{what} state")


def test_bad_state_is_rejected_by_a_step():
    layer = make()
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(M\)"):
        layer(inputs(T=1), (torch.zeros(2, H, 3, 3), torch.zeros(2, H, 4)))
    with pytest.raises(ValueError, match="segment_len"):
        layer(inputs(T=1), (torch.zeros(2, H, 4, 4), torch.zeros(2, H, 4),
                            *[torch.zeros(2, 5, H, 4)] * 3))
