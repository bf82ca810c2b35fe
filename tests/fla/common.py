"""What the fla equality tests of every family share (test_deltanet_reference.py for DeltaNet,
test_retnet_reference.py for RetNet): fla checkpoints with random weights of order one, the
checks of logits, cache decoding, loading and the option lists. Needs fla and transformers
(the test modules skip without them before importing this)."""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F
from fla.modules.norm.layernorm_gated import rms_norm_ref
from transformers import AutoModelForCausalLM

from fastweights.fla import from_fla
from fastweights.hf import CACHE_FIELD
from tests.helpers import assert_close64


def make_fla_checkpoint(folder, config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                        max_shard_size: str | None = None):
    """fla's model of ``config`` with random float32 weights of order one (norm gains and
    convolutions included, which fla initialises to ones / near zero), saved by fla's
    save_pretrained; returned in eval mode."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla: "ShortConvolution is crucial ..." without conv
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "embeddings" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model.eval()


SMALL = {"hidden_size": 32, "num_heads": 4, "num_hidden_layers": 2, "norm_eps": 1e-5,
         "pad_token_id": 0, "tie_word_embeddings": False}  # the reference tests' model size


class Family:
    """One fla model family's helpers for its reference tests: configs at the tests' size
    (``SMALL``, then ``base``), checkpoints saved by fla, token ids; vocabulary ``vocab``, default
    length ``length``."""

    def __init__(self, config_class, vocab: int, length: int, **base) -> None:
        self.config_class, self.vocab, self.length, self.base = config_class, vocab, length, base

    def config(self, **overrides):
        return self.config_class(**{**SMALL, "vocab_size": self.vocab, **self.base, **overrides})

    def checkpoint(self, folder, seed: int = 0, dtype: torch.dtype = torch.float32,
                   max_shard_size: str | None = None, **overrides):
        """fla's model with random float32 weights of order one, saved by fla's save_pretrained."""
        return make_fla_checkpoint(folder, self.config(**overrides), seed=seed, dtype=dtype,
                                   max_shard_size=max_shard_size)

    def ids(self, B: int = 2, length: int | None = None, seed: int = 1) -> torch.Tensor:
        return token_ids(self.vocab, B, self.length if length is None else length, seed)


def assert_float32_logits_match(ref, folder, x: torch.Tensor) -> None:
    """Our float32 load of ``folder`` gives fla's model ``ref``'s float32 logits (to 2e-4)."""
    ours = from_fla(folder)
    assert ours.dtype == torch.float32
    with torch.no_grad():
        assert_close64(ours(x).logits, ref(x, use_cache=False).logits, atol=2e-4, what="logits")


def token_ids(vocab: int, B: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (B, length), generator=torch.Generator().manual_seed(seed))


# fla's norm modules -> rms_norm_ref (weights None, elementwise_affine=False, mean weight 1)


def _weight(norm, x):
    return norm.weight if norm.weight is not None else x.new_ones(x.shape[-1])


def rmsnorm_ref(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None:
        x = x + residual
    y = rms_norm_ref(x, _weight(self, x), self.bias, eps=self.eps, upcast=False)
    return (y, x) if prenorm else y


def gated_rmsnorm_ref(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    assert residual is None and self.activation in ("swish", "silu", "sigmoid")
    if self.activation == "sigmoid":  # rms_norm_ref's gate is SiLU only: norm, then the gate
        return rms_norm_ref(x, _weight(self, x), self.bias, eps=self.eps,
                            upcast=False) * torch.sigmoid(g)
    return rms_norm_ref(x, _weight(self, x), self.bias, z=g, eps=self.eps, norm_before_gate=True,
                        upcast=False)


def patch_norms_and_mlp(monkeypatch) -> None:
    """fla's RMSNorm, gated RMSNorm and SwiGLU kernels -> their PyTorch references."""
    import fla.modules.mlp as fla_mlp
    from fla.modules import FusedRMSNormGated, RMSNorm

    monkeypatch.setattr(RMSNorm, "forward", rmsnorm_ref)
    monkeypatch.setattr(FusedRMSNormGated, "forward", gated_rmsnorm_ref)
    monkeypatch.setattr(fla_mlp, "swiglu", lambda x, y: F.silu(x) * y)
    monkeypatch.setattr(fla_mlp, "swiglu_linear", lambda x, y, w, b: F.linear(F.silu(x) * y, w, b))


# checks


def assert_float64_logits_equal(ref, folder, x: torch.Tensor):
    """fastweights' model of ``folder`` gives fla's float64 logits on ``x``; returns it."""
    ref = ref.double()
    ours = from_fla(folder, dtype=torch.float64)
    with torch.no_grad():
        expected = ref(x, use_cache=False).logits
        got = ours(x, use_cache=False).logits
    assert expected.dtype == got.dtype == torch.float64
    assert expected.abs().max() > 1  # logits of order one: an absolute 1e-10 means something
    assert_close64(got, expected, what="logits")
    return ours


def assert_decoding_equals_full_forward(ref, folder, x: torch.Tensor, prefill: int = 5) -> None:
    """A prefill of ``prefill`` tokens, then one-token steps from the cache, give fla's float64
    full-forward logits."""
    ref = ref.double()
    ours = from_fla(folder, dtype=torch.float64)
    with torch.no_grad():
        expected = ref(x, use_cache=False).logits
        out = ours(x[:, :prefill], use_cache=True)
        steps = [out.logits]
        for t in range(prefill, x.shape[1]):
            out = ours(x[:, t:t + 1], cache=out[CACHE_FIELD], use_cache=True)
            steps.append(out.logits)
    assert_close64(torch.cat(steps, dim=1), expected, what="prefill + one-token steps")


def assert_loads_unchanged(ref, folder, dtype: torch.dtype) -> None:
    """Every tensor of fla's checkpoint loads unchanged, in its dtype, tied embeddings tied."""
    ours = from_fla(folder)
    assert ours.dtype == dtype
    theirs, mine = ref.state_dict(), ours.state_dict()
    assert set(mine) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    if ref.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embeddings.weight


def assert_every_option_classified(fla_config_class, options: dict[str, str]) -> None:
    params = set(inspect.signature(fla_config_class.__init__).parameters) - {"self", "kwargs"}
    assert params == set(options), (sorted(params - set(options)), sorted(set(options) - params))


def assert_fla_reads_our_save(folder, out_folder, x: torch.Tensor) -> None:
    """A folder written by fastweights loads in fla with the same float64 logits."""
    ours = from_fla(folder, dtype=torch.float64)
    ours.save_pretrained(out_folder)
    theirs = AutoModelForCausalLM.from_pretrained(out_folder, dtype=torch.float64)
    assert type(theirs).__module__.startswith("fla.")
    with torch.no_grad():
        assert_close64(ours(x).logits, theirs(x, use_cache=False).logits, what="logits")
