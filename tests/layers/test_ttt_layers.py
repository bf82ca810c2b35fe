"""TTTLinear / TTTMLP layers: every option streams, the modes agree, the forward follows
docs/maths.md 2.1, 2.3, 2.5 step by step, and the options are validated."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fastweights import build_mixer
from fastweights.layers import TTTMLP, TTTLinear
from fastweights.layers.positional import apply_rotary
from fastweights.ops import ttt_linear, ttt_mlp
from tests.helpers import assert_close64

LAYERS = {"linear": TTTLinear, "mlp": TTTMLP}
D_MODEL, N_HEADS, T = 12, 3, 11


def make(kind: str, **options) -> TTTLinear | TTTMLP:
    torch.manual_seed(0)
    layer = LAYERS[kind](D_MODEL, N_HEADS, **options).double().eval()
    with torch.no_grad():  # non-trivial values everywhere (zero-initialised offsets, biases, ...)
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def inputs(B: int = 2, T: int = T) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


COMBOS = list(itertools.product(["linear", "mlp"], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize(
    "kind,mamba,rope,norm_res", COMBOS,
    ids=[f"{k}-{'mamba' if m else 'transformer'}-{'rope' if r else 'norope'}-"
         f"{'ln-res' if n else 'bare'}" for k, m, r, n in COMBOS])
def test_every_configuration_streams_and_modes_agree(kind, mamba, rope, norm_res):
    layer = make(kind, mini_batch_size=3, mamba_backbone=mamba, rope=rope, inner_norm=norm_res,
                 residual=norm_res)
    x = inputs()
    whole, _ = layer(x)
    for splits in [(2, 7), tuple(range(1, T))]:
        outs, state, start = [], None, 0
        for stop in [*splits, T]:
            y, state = layer(x[:, start:stop], state)
            outs.append(y)
            start = stop
        assert_close64(torch.cat(outs, 1), whole, what=str(splits))
    for mode in ("primal", "naive"):
        other = LAYERS[kind](D_MODEL, N_HEADS, mini_batch_size=3, mamba_backbone=mamba, rope=rope,
                             inner_norm=norm_res, residual=norm_res, mode=mode).double().eval()
        other.load_state_dict(layer.state_dict())
        assert_close64(other(x)[0], whole, what=mode)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("mamba", [False, True], ids=["transformer", "mamba"])
def test_forward_follows_the_spec(kind, mamba):
    """Rebuild the layer's output from its parameters: projections (with the causal convs), RoPE
    at positions t mod b, eta = eta_base sigmoid(x w + b) / d, tau = max(0, 1/i + delta), the op
    in naive mode, post-LayerNorm, (gate,) output projection."""
    b, H, D = 4, N_HEADS, D_MODEL // N_HEADS
    layer = make(kind, mini_batch_size=b, mamba_backbone=mamba)
    x = inputs()
    y, _ = layer(x)
    proj = x @ layer.qkv.weight.T
    if mamba:
        qk, v = proj.chunk(2, -1)
        padded = F.pad(qk, (0, 0, 3, 0))  # three zero inputs before the start

        def conv(c):
            w = c.weight[:, 0]  # [C, 4]
            return sum(padded[:, j:j + T] * w[:, j] for j in range(4)) + c.bias

        q, k = conv(layer.conv_q), conv(layer.conv_k)
    else:
        q, k, v = proj.chunk(3, -1)
    q, k, v = (t.reshape(2, T, H, D) for t in (q, k, v))
    positions = torch.arange(T) % b
    q, k = apply_rotary(q, positions, layer.inv_freq), apply_rotary(k, positions, layer.inv_freq)
    eta = layer.eta_base * torch.sigmoid(x @ layer.lr.weight.T + layer.lr.bias) / D
    tau = (1.0 / torch.arange(1, b + 1, dtype=torch.float64) + layer.token_offset).clamp_min(0)
    names = ["W", "b"] if kind == "linear" else ["W1", "b1", "W2", "b2"]
    init = tuple(getattr(layer, f"init_{n}")[None] for n in names)
    op = ttt_linear if kind == "linear" else ttt_mlp
    o, _ = op(q, k, v, eta, initial_state=init, ln_weight=layer.ln_weight, ln_bias=layer.ln_bias,
              residual=True, mini_batch_size=b, token_scale=tau, mode="naive")
    z = F.layer_norm(o.reshape(2, T, H * D), (H * D,), layer.post_norm.weight, layer.post_norm.bias,
                     eps=1e-6)
    if mamba:
        z = z * F.gelu(x @ layer.gate.weight.T, approximate="tanh")
    assert_close64(y, z @ layer.out.weight.T)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fixed_inner_learning_rate(kind):
    """learn_eta=False: no w_lr, b_lr; the layer equals the learned-gate layer whose gate is
    sigmoid(0) everywhere (w_lr = 0, b_lr = 0), and still streams."""
    fixed = make(kind, mini_batch_size=3, learn_eta=False)
    assert fixed.lr is None and not any(n.startswith("lr.") for n, _ in fixed.named_parameters())
    learned = LAYERS[kind](D_MODEL, N_HEADS, mini_batch_size=3).double().eval()
    state = dict(fixed.state_dict(), **{"lr.weight": torch.zeros(N_HEADS, D_MODEL, dtype=torch.float64),
                                        "lr.bias": torch.zeros(N_HEADS, dtype=torch.float64)})
    learned.load_state_dict(state)
    x = inputs()
    whole, _ = fixed(x)
    assert_close64(whole, learned(x)[0])
    a, s = fixed(x[:, :5])
    b, _ = fixed(x[:, 5:], s)
    assert_close64(torch.cat([a, b], 1), whole)
    with pytest.raises(TypeError, match="learn_eta must be a bool"):
        TTTLinear(12, 2, learn_eta=1)


def test_defaults_follow_spec_2_6():
    lin, mlp = build_mixer("ttt-linear", 64, 4), build_mixer("ttt-mlp", 64, 4)
    assert lin.mini_batch_size == mlp.mini_batch_size == 16
    assert lin.eta_base == 1.0 and mlp.eta_base == 0.1
    assert lin.rope and lin.inner_norm and lin.residual and not lin.mamba_backbone
    assert lin.mode == "dual"
    assert torch.equal(lin.token_offset, torch.zeros(16))
    assert torch.equal(lin.ln_weight, torch.ones(4, 16)) and torch.equal(lin.ln_bias, torch.zeros(4, 16))
    assert torch.equal(lin.init_b, torch.zeros(4, 16)) and torch.equal(lin.lr.bias, torch.zeros(4))
    assert 0.015 < lin.init_W.std().item() < 0.025
    assert 0.015 < mlp.init_W1.std().item() < 0.025 and mlp.init_W1.shape == (4, 16, 64)
    assert tuple(mlp.init_W2.shape) == (4, 64, 16)
    assert 0.015 < lin.qkv.weight.std().item() < 0.025


def test_state_size_counts_carried_floats():
    H, D, b = 2, 8, 4
    lin = TTTLinear(H * D, H, mini_batch_size=b)
    # start weights and the rows of b - 1 tokens (2 D per head for TTT-Linear, 10 D for TTT-MLP)
    assert lin.state_size() == lin.state_size(1000) == H * (D * D + D) + (b - 1) * H * 2 * D
    mlp = TTTMLP(H * D, H, mini_batch_size=b, mamba_backbone=True)
    assert mlp.state_size() == H * (8 * D * D + 5 * D) + (b - 1) * H * 10 * D + 3 * H * D
    assert TTTLinear(H * D, H, mini_batch_size=1).state_size() == H * (D * D + D)

    # the floats the fullest states really hold (b - 1 = 3 tokens into a mini-batch), fed whole
    # or token by token
    def floats(state):
        return sum(t.numel() for t in torch.utils._pytree.tree_leaves(state[2])
                   if isinstance(t, torch.Tensor))

    for kind in ("linear", "mlp"):
        layer, x = make(kind, mini_batch_size=4), inputs(B=1, T=7)
        _, whole = layer(x)
        state = None
        for t in range(7):
            _, state = layer(x[:, t:t + 1], state)
        assert floats(whole) == floats(state) == layer.state_size(), kind


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_backward_reaches_every_parameter_mamba(kind):
    layer = make(kind, mini_batch_size=3, mamba_backbone=True).train()
    y, _ = layer(inputs())
    y.square().sum().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"


def test_token_scale_is_clamped_at_zero():
    layer = TTTLinear(8, 2, mini_batch_size=3)
    with torch.no_grad():
        layer.token_offset.copy_(torch.tensor([0.5, -1.0, 0.0]))
    assert torch.allclose(layer.token_scale(), torch.tensor([1.5, 0.0, 1 / 3]))


@pytest.mark.parametrize("options,exc,words", [
    ({"mini_batch_size": 0}, ValueError, "mini_batch_size must be >= 1"),
    ({"mode": "chunk"}, ValueError, "mode must be one of"),
    ({"eta_base": -1.0}, ValueError, "eta_base"),
    ({"mamba_backbone": "yes"}, TypeError, "mamba_backbone must be a bool"),
    ({"head_dim": 3}, ValueError, "even head dim"),
], ids=["mini-batch-0", "mode", "eta-negative", "mamba-not-bool", "rope-odd-head-dim"])
def test_bad_options(options, exc, words):
    with pytest.raises(exc, match=words):
        TTTLinear(12, 2, **options)


def test_bad_state_is_rejected():
    layer = TTTLinear(12, 2)
    with pytest.raises(TypeError, match="state must be None or the"):
        layer(inputs()[..., :12], state=(0, None))


def test_mamba_conv_cache_batch_is_checked_and_a_batch_of_one_broadcasts():
    from fastweights import build_mixer

    torch.manual_seed(0)
    layer = build_mixer("ttt-linear", 12, 3, mamba_backbone=True).double()
    x = torch.randn(1, 5, 12, dtype=torch.float64)
    _, state = layer(x)
    nxt = torch.randn(1, 3, 12, dtype=torch.float64).expand(2, 3, 12)
    y, _ = layer(nxt, state)  # the batch-1 state broadcasts over both rows
    ref, _ = layer(nxt[:1], state)
    assert torch.allclose(y, ref.expand(2, 3, 12), atol=1e-12)
    _, state3 = layer(torch.randn(3, 5, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="conv_cache"):
        layer(nxt, state3)


@pytest.mark.parametrize("name", ["ttt-linear", "ttt-mlp"])
def test_layer_checkpoint_group_changes_nothing_but_memory(name):
    torch.manual_seed(0)
    plain = build_mixer(name, 16, 2, mini_batch_size=4).double()
    grouped = build_mixer(name, 16, 2, mini_batch_size=4, checkpoint_group=2).double()
    grouped.load_state_dict(plain.state_dict())
    x = torch.randn(2, 23, 16, dtype=torch.float64, requires_grad=True)
    outs = []
    for layer in (plain, grouped):
        y, _ = layer(x)
        outs.append((y, torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("options", [{}, {"rope": False, "inner_norm": False, "residual": False},
                                     {"learn_eta": False}], ids=["default", "bare", "fixed-eta"])
def test_lean_decoding_steps_equal_whole(kind, options, monkeypatch):
    """Without gradients, one-token calls continuing the layer's own state take the lean step
    (``_step``, checked by counting) and give the whole sequence's outputs and state (float64):
    a prefill ending inside a mini-batch (b = 4), then 9 steps across two boundaries; with the
    inner LayerNorm those steps use its group-norm form."""
    layer = make(kind, mini_batch_size=4, **options)
    x = inputs(B=2, T=14)
    calls = []
    lean = layer._step
    monkeypatch.setattr(layer, "_step", lambda *a: calls.append(1) or lean(*a))
    with torch.no_grad():
        whole, whole_state = layer(x)
        y, state = layer(x[:, :5])
        ys = [y]
        for t in range(5, 14):
            y, state = layer(x[:, t:t + 1], state)
            ys.append(y)
    assert len(calls) == 9
    assert_close64(torch.cat(ys, 1), whole, what="outputs")
    for a, b in zip(torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(whole_state)):
        if isinstance(a, torch.Tensor):
            assert_close64(a, b, what="state")
        else:
            assert a == b


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_calls_without_gradients_read_the_current_token_offset(kind):
    """Calls without gradients use token_offset's current values, as a layer given them by an
    ordinary in-place update does: a forward after a write into its memory that leaves its
    version counter where it was (FSDP2 refills its unsharded parameters so; here through a
    second tensor on the same storage), and a decoding step after token_offset is replaced by
    another tensor on the same memory at the same version (FSDP2's unsharded parameter where
    the original one was freed)."""
    layer, reference = make(kind, mini_batch_size=4), make(kind, mini_batch_size=4)
    x = inputs(B=2, T=7)
    offsets = layer.token_offset.detach() + 0.05 * torch.arange(1, 5, dtype=torch.float64)

    def on_its_memory(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, t.shape)

    def prompt(model: TTTLinear | TTTMLP) -> Any:
        return model(x[:, :5])[1]

    with torch.no_grad():
        layer(x), layer(x[:, 5:6], prompt(layer))  # calls without gradients before the writes
        version = layer.token_offset._version
        on_its_memory(layer.token_offset).copy_(offsets)
        assert layer.token_offset._version == version and torch.equal(layer.token_offset, offsets)
        reference.token_offset.copy_(offsets)
        assert torch.equal(layer(x)[0], reference(x)[0])
        state, reference_state = prompt(layer), prompt(reference)  # a decoding step's tau kept
        swapped = torch.nn.Parameter(on_its_memory(layer.token_offset))
        on_its_memory(swapped).copy_(offsets + 0.01)
        while swapped._version < layer.token_offset._version:
            swapped.add_(0.0)  # the old tensor's version, which the kept copy was made at
        assert swapped._version == layer.token_offset._version
        assert swapped.data_ptr() == layer.token_offset.data_ptr()
        layer.token_offset = swapped
        reference.token_offset.copy_(offsets + 0.01)
        assert torch.equal(layer(x[:, 5:6], state)[0], reference(x[:, 5:6], reference_state)[0])
