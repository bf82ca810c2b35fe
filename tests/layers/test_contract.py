"""The layer contract (docs/design.md) for every registered mixer: pieces == whole, T = 1 steps ==
parallel, causality, state_size. New mixers are covered by registering them; give small
settings (block/segment/mini-batch sizes that do not divide the test length) in SMALL_OPTIONS."""

from __future__ import annotations

import inspect

import pytest
import torch

from fastweights import build_mixer, mixer_names
from fastweights.layers import Mixer
from fastweights.models.registry import MIXERS, mixer_option_specs
from tests.helpers import assert_close64

D_MODEL, N_HEADS, T = 16, 2, 13

# Options that make each mixer's internal block sizes small and not divide T.
SMALL_OPTIONS: dict[str, dict] = {
    "linear": {"chunk_size": 4},
    "dpfp": {"chunk_size": 4, "nu": 2},
    "favor": {"chunk_size": 4},
    "delta": {"chunk_size": 4},
    "infini": {"segment_len": 4},
    "norm": {"chunk_size": 4},
    "diag": {"block_size": 4},
    "aft-full": {"max_len": 32, "d_bias": 8, "chunk_size": 4},
    "aft-local": {"window": 4, "max_len": 32, "d_bias": 8, "chunk_size": 3},
    "aft-simple": {},
    "aft-conv": {"window": 4, "chunk_size": 3},
    "ttt-linear": {"mini_batch_size": 4},
    "ttt-mlp": {"mini_batch_size": 4},
    "gated-delta": {"chunk_size": 4, "num_v_heads": 4, "expand_v": 1.5},
    "fla-delta": {"chunk_size": 4, "use_gate": True, "conv_size": 3},
    "retnet": {"chunk_size": 4, "num_kv_heads": 1},
}

# Mixers whose state is a cache of every token (state_size grows linearly with the length).
GROWING_STATE = {"softmax", "aft-full"}


def make(name: str) -> Mixer:
    torch.manual_seed(0)
    layer = build_mixer(name, D_MODEL, N_HEADS, **SMALL_OPTIONS.get(name, {})).double().eval()
    # Re-initialise every parameter with non-trivial values so zero-initialised gates or
    # kernels cannot hide a broken path.
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def inputs(B: int = 2) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.fixture(params=mixer_names())
def name(request) -> str:
    return request.param


def test_registry_builds_a_mixer(name):
    layer = make(name)
    assert isinstance(layer, Mixer)
    y, _ = layer(inputs())
    assert y.shape == (2, T, D_MODEL) and y.dtype == torch.float64
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("splits", [(5,), (1, 7, 8), (12,)], ids=str)
def test_pieces_equal_whole(name, splits):
    layer = make(name)
    x = inputs()
    whole, _ = layer(x)
    outs, state, start = [], None, 0
    for stop in [*splits, T]:
        y, state = layer(x[:, start:stop], state)
        outs.append(y)
        start = stop
    assert_close64(torch.cat(outs, 1), whole, atol=1e-9, what=name)


def test_single_token_steps_equal_parallel(name):
    layer = make(name)
    x = inputs()
    whole, _ = layer(x)
    outs, state = [], None
    for t in range(T):
        y, state = layer(x[:, t:t + 1], state)
        outs.append(y)
    assert_close64(torch.cat(outs, 1), whole, atol=1e-9, what=name)


def test_causal(name):
    layer = make(name)
    x = inputs()
    y, _ = layer(x)
    x2 = x.clone()
    x2[:, 9:] += 3.0
    y2, _ = layer(x2)
    assert_close64(y2[:, :9], y[:, :9], atol=1e-9, what=name)


def test_batch_items_independent(name):
    layer = make(name)
    x = inputs(3)
    y, _ = layer(x)
    y_perm, _ = layer(x[[2, 0, 1]])
    assert_close64(y_perm, y[[2, 0, 1]], atol=1e-9, what=name)


def test_state_size_is_positive_int(name):
    layer = make(name)
    n = layer.state_size()
    assert isinstance(n, int) and n > 0
    if name not in GROWING_STATE:
        assert layer.state_size(10_000) == n  # recurrent mixers: constant in the context length
    else:
        assert layer.state_size(10_000) == 10_000 * layer.state_size(1)


def test_backward_reaches_every_parameter(name):
    layer = make(name).train()
    y, _ = layer(inputs())
    y.square().sum().backward()
    missing = [n for n, p in layer.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient for {missing}"


def test_wrong_input_shape_is_rejected(name):
    layer = make(name)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(2, 5, D_MODEL + 1, dtype=torch.float64))
    with pytest.raises((ValueError, TypeError), match="x must be"):
        layer(torch.randn(5, D_MODEL, dtype=torch.float64))


def test_float32_close_to_float64(name):
    layer = make(name)
    x = inputs()
    ref, _ = layer(x)
    y32, _ = layer.float()(x.float())
    assert y32.dtype == torch.float32
    assert (y32.double() - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_unknown_name_and_option():
    with pytest.raises(ValueError, match="unknown mixer"):
        build_mixer("not-a-mixer", 16, 2)
    with pytest.raises(ValueError, match="unknown option"):
        build_mixer("linear", 16, 2, colour="red")


def test_packed_documents_equal_separate(name):
    layer = make(name)
    x = inputs(1)
    cu = torch.tensor([0, 4, 5, T])
    y, states = layer(x, cu_seqlens=cu)
    assert isinstance(states, list) and len(states) == 3
    for a, b in [(0, 4), (4, 5), (5, T)]:
        y_doc, _ = layer(x[:, a:b])
        assert_close64(y[:, a:b], y_doc, atol=1e-9, what=name)
    # Continuing every document from its own state equals continuing it alone.
    nxt = torch.randn(1, 3, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y2, _ = layer(nxt, states[:1] + states[1:2], cu_seqlens=torch.tensor([0, 2, 3]))
    assert_close64(y2[:, :2], layer(nxt[:, :2], states[0])[0], atol=1e-9, what=name)
    assert_close64(y2[:, 2:], layer(nxt[:, 2:], states[1])[0], atol=1e-9, what=name)


def test_declared_options_are_the_constructor_defaults(name):
    """Passing every declared option at its declared default builds the same layer as passing
    none, so the declaration the registry validates and lists matches the constructor."""
    specs = mixer_option_specs(name)
    assert specs, name
    torch.manual_seed(0)
    plain = build_mixer(name, D_MODEL, N_HEADS)
    torch.manual_seed(0)
    explicit = build_mixer(name, D_MODEL, N_HEADS, **{k: o.default for k, o in specs.items()})
    assert repr(plain) == repr(explicit)
    a, b = plain.state_dict(), explicit.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(1, 5, D_MODEL)
    torch.testing.assert_close(plain.eval()(x)[0], explicit.eval()(x)[0], rtol=0, atol=0)
    for option in specs.values():
        if option.default is not None:
            assert isinstance(option.default, option.type), (name, option)


def test_every_constructor_option_is_declared(name):
    """A keyword option added to a constructor (the class's or a base's it forwards to) must be
    one of the class's ``options``, else build_mixer would reject it, unless the class pins it
    (``fixed_options``: base options it passes itself, which then are not its options)."""
    cls = MIXERS[name].cls
    pinned = set(cls.fixed_options)
    if pinned:  # options of the base class, not of this one
        base = next(b for b in cls.__mro__[1:] if issubclass(b, Mixer))
        assert pinned <= set(base.options) and not pinned & set(cls.options), (name, pinned)
    for klass in cls.__mro__:
        if issubclass(klass, Mixer) and klass is not Mixer and "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            kw_only = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
            missing = kw_only - pinned - set(cls.options)
            assert not missing, (name, klass.__name__, missing)
    if name == "delta":  # DeltaNet pins the update rule to the delta rule
        assert pinned == {"update"}


def test_options_are_read_off_the_constructor_signature():
    """A mixer writes its options once, as keyword-only constructor parameters; a ``**options``
    forwarding to the base adds the base's, less its ``fixed_options``, new defaults in place."""

    class Base(Mixer):
        def __init__(self, d_model: int, n_heads: int, *, width: int | None = None,
                     rule: str = "sum", eps: float = 1e-6) -> None:
            super().__init__(d_model, n_heads)

    class Child(Base):
        fixed_options = ("rule",)

        def __init__(self, d_model: int, n_heads: int, *, eps: float = 1e-3, extra: bool = True,
                     **options) -> None:
            super().__init__(d_model, n_heads, rule="delta", eps=eps, **options)

    assert dict(Base.options) == {"width": (int | None, None), "rule": (str, "sum"),
                                  "eps": (float, 1e-6)}
    assert list(Child.options.items()) == [("width", (int | None, None)), ("eps", (float, 1e-3)),
                                           ("extra", (bool, True))]
    with pytest.raises(TypeError, match="option 'size' needs a default"):
        class _NoDefault(Mixer):
            def __init__(self, d_model: int, n_heads: int, *, size: int) -> None:
                super().__init__(d_model, n_heads)
