"""Streams at their own positions decoded together (``stack_states``): one batched step equals
every stream's own step, for every mixer, in float64."""

from __future__ import annotations

import typing

import pytest
import torch

from fastweights import build_mixer
from fastweights.layers.fla_deltanet import QK_ACTIVATIONS, QK_NORMS
from fastweights.layers.fwp import NORMALIZATIONS
from fastweights.layers.fwp import UPDATES as FWP_UPDATES
from fastweights.layers.norms import GATE_ACTIVATIONS
from fastweights.layers.transnormer import ACTIVATIONS
from fastweights.models import LanguageModel, LMConfig
from fastweights.models.registry import mixer_names, mixer_option_specs
from fastweights.ops._modes import RECURRENT_MODES, TTT_MODES
from fastweights.ops.feature_maps import FEATURE_MAPS
from fastweights.ops.infini import UPDATES as INFINI_UPDATES
from fastweights.ops.transnormer.block import KERNELS
from tests.helpers import assert_close64

# Small periods so that the streams sit at different places and cross boundaries while stepping.
OPTIONS = {
    "ttt-linear": {"mini_batch_size": 4}, "ttt-mlp": {"mini_batch_size": 4},
    "infini": {"segment_len": 4}, "diag": {"block_size": 4},
    "aft-local": {"window": 3, "max_len": 64}, "aft-conv": {"window": 3},
    "aft-full": {"max_len": 64},
}
STACKABLE = [m for m in mixer_names() if m != "aft-full"]
PREFILLS = (5, 8, 2, 7)  # stream lengths: every place of a period of 4, and >= window - 1
STEPS = 5


def _layer(name: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_mixer(name, 8, 2, **{**OPTIONS.get(name, {}), **extra}).double().eval()


def _streams(layer, prefills=PREFILLS, steps=STEPS, d=8):
    """Each stream prefilled on its own, then ``steps`` tokens decoded alone: (states after the
    prefills, step inputs [N, steps, d], outputs [N, steps, d])."""
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(len(prefills), steps, d, generator=gen, dtype=torch.float64)
    states, outs = [], []
    for i, n in enumerate(prefills):
        _, state = layer(torch.randn(1, n, d, generator=gen, dtype=torch.float64))
        states.append(state)
        ys = []
        for t in range(steps):
            y, state = layer(xs[i:i + 1, t:t + 1], state)
            ys.append(y)
        outs.append(torch.cat(ys, dim=1))
    return states, xs, torch.cat(outs)


@pytest.mark.parametrize("name", STACKABLE)
def test_batched_steps_equal_separate_streams(name):
    """N = 4 streams prefilled with 5, 8, 2, 7 tokens, stacked, then 5 batched one-token steps
    (crossing mini-batch / segment / block boundaries at different steps per row) equal each
    stream decoded alone."""
    _check_stacked(_layer(name), name)


def _check_stacked(layer, what: str, step=None) -> None:
    """The stacked streams' batched steps (by ``step``, default the layer itself) equal their
    separate steps."""
    step = layer if step is None else step
    with torch.no_grad():
        states, xs, ref = _streams(layer)
        state = layer.stack_states(states)
        ys = []
        for t in range(STEPS):
            y, state = step(xs[:, t:t + 1], state)
            ys.append(y)
    assert_close64(torch.cat(ys, dim=1), ref, atol=1e-10, what=what)


@pytest.mark.parametrize("name", ["ttt-linear", "ttt-mlp"])
def test_compiled_stacked_steps_equal_separate_streams(name):
    """Under torch.compile (dynamo with the eager backend: the tracing, not code generation) the
    stacked TTT steps still equal each stream alone; the commit of the rows that complete runs
    eagerly at a graph break, as in an uncompiled step."""
    layer = _layer(name)
    torch._dynamo.reset()
    _check_stacked(layer, name, torch.compile(layer, backend="eager"))


# The choices of every string-valued option of a stackable mixer. The per-row paths (what
# stack_states returns and the steps that continue it) are code of their own: Infini's
# InfiniRowsState, DiagAttention's and TTT's per-row windows and commits, TransNormer's per-row
# LRPE positions, AFT's windows. An option they mishandle (Infini's rows once could write a
# closed segment with the linear update under update="delta" and pass every test) shows only
# when the variant is stacked, so every value of every option is (test_stacked_variants).
_FWP = {"feature_map": FEATURE_MAPS, "normalize": NORMALIZATIONS, "mode": RECURRENT_MODES}
CHOICES: dict[str, dict[str, tuple]] = {
    **{name: {**_FWP, "update": FWP_UPDATES} for name in ("linear", "dpfp", "favor")},
    "delta": _FWP,
    "infini": {"update": INFINI_UPDATES, "mode": RECURRENT_MODES},
    "norm": {"activation": tuple(ACTIVATIONS), "mode": RECURRENT_MODES},
    "diag": {"kernel": KERNELS},
    **{name: {"mode": RECURRENT_MODES} for name in ("aft-local", "aft-simple", "aft-conv")},
    **{name: {"mode": TTT_MODES} for name in ("ttt-linear", "ttt-mlp")},
    "gated-delta": {"gate_activation": GATE_ACTIVATIONS, "mode": RECURRENT_MODES},
    "fla-delta": {"qk_activation": QK_ACTIVATIONS, "qk_norm": QK_NORMS, "mode": RECURRENT_MODES},
    # any fla feature map takes the same path (the map applied to q and k): two of them
    "retnet": {"feature_map": ("relu", "silu"), "mode": RECURRENT_MODES},
}
# String options not varied here, and why.
# (mixer, option) not varied here, with the reason; "*" stands for every mixer.
NOT_VARIED = {("*", "backend"): "the kernel backends need CUDA (on the CPU only torch runs); "
                                "each op's kernels have their own tests against torch"}


def _takes_str(spec) -> bool:
    return spec.type is str or str in typing.get_args(spec.type)


def _variants() -> list[tuple[str, str, object]]:
    """(mixer, option, value) for every bool option flipped and every other listed choice."""
    out = []
    for name in STACKABLE:
        for key, spec in mixer_option_specs(name).items():
            if spec.type is bool:
                values = [not spec.default]
            else:
                values = [c for c in CHOICES.get(name, {}).get(key, ()) if c != spec.default]
            out += [(name, key, value) for value in values]
    return out


VARIANTS = _variants()


def test_stacked_variants_cover_every_switch():
    """Every string-valued option of a stackable mixer has its choices listed (or a reason)."""
    missing = [(name, key) for name in STACKABLE for key, spec in mixer_option_specs(name).items()
               if _takes_str(spec) and key not in CHOICES.get(name, {})
               and (name, key) not in NOT_VARIED and ("*", key) not in NOT_VARIED]
    assert not missing, f"list the choices of these options in CHOICES: {missing}"


@pytest.mark.parametrize(("name", "key", "value"), VARIANTS,
                         ids=[f"{n}-{k}={v}" for n, k, v in VARIANTS])
def test_stacked_variants(name, key, value):
    """Each option value on the per-row paths, e.g. Infini's update="delta" (the segment a row
    closes written by the delta rule), TTT's Mamba backbone (convolution cache),
    DiagAttention's ReLU kernel, TransNormer without LRPE. TTT's per-row places continue only
    in mode "dual" (ops/ttt/inner_loop.py): the other modes refuse a stacked state clearly."""
    layer = _layer(name, **{key: value})
    if name.startswith("ttt") and key == "mode":
        with torch.no_grad(), pytest.raises(ValueError, match="mode='dual'"):
            _check_stacked(layer, name)
        return
    _check_stacked(layer, f"{name} {key}={value!r}")


def test_language_model_stacked_streams():
    """A model mixing per-row layers with sinusoidal absolute positions: the stacked step's
    logits equal each stream's own."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=17, d_model=8, n_layers=3, n_heads=2,
                      mixer=["softmax", "ttt-linear", "infini"], position="sinusoidal",
                      mixer_options=[{}, {"mini_batch_size": 4}, {"segment_len": 4}])
    model = LanguageModel(config).double().eval()
    gen = torch.Generator().manual_seed(2)
    nxt = torch.randint(0, 17, (3, STEPS), generator=gen)
    states, ref = [], []
    with torch.no_grad():
        for i, n in enumerate((6, 3, 9)):
            _, state = model(torch.randint(0, 17, (1, n), generator=gen))
            states.append(state)
            logits = []
            for t in range(STEPS):
                out, state = model(nxt[i:i + 1, t:t + 1], state)
                logits.append(out)
            ref.append(torch.cat(logits, dim=1))
        state = model.stack_states(states)
        got = []
        for t in range(STEPS):
            out, state = model(nxt[:, t:t + 1], state)
            got.append(out)
    assert_close64(torch.cat(got, dim=1), torch.cat(ref), atol=1e-10, what="logits")
    assert state[-1].tolist() == [6 + STEPS, 3 + STEPS, 9 + STEPS]


def test_stacking_refusals():
    """What cannot be stacked or continued per row says so: aft-full at different lengths,
    AFT windows not yet full, several tokens per call on a per-row state, no states."""
    with torch.no_grad():
        full = _layer("aft-full")
        states = [full(torch.randn(1, n, 8, dtype=torch.float64))[1] for n in (3, 4)]
        with pytest.raises(ValueError, match="different positions"):
            full.stack_states(states)
        local = _layer("aft-local")
        states = [local(torch.randn(1, n, 8, dtype=torch.float64))[1] for n in (1, 4)]
        with pytest.raises(ValueError, match="window - 1"):
            local.stack_states(states)
        ttt = _layer("ttt-linear")
        state = ttt.stack_states([ttt(torch.randn(1, n, 8, dtype=torch.float64))[1]
                                  for n in (3, 5)])
        with pytest.raises(ValueError, match="one token per call"):
            ttt(torch.randn(2, 2, 8, dtype=torch.float64), state)
        with pytest.raises(ValueError, match="non-empty"):
            ttt.stack_states([])
        with pytest.raises(ValueError, match="None"):
            ttt.stack_states([None])
