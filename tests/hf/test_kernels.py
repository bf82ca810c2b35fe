"""``fastweights.hf.use_fastweights``: transformers' own gated-delta models, every architecture
the installed transformers defines ``torch_chunk_gated_delta_rule`` for
(``gated_delta_architectures``: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid, LaraMini and
Qwen4-Exp in 5.24), each tiny with random weights of order one, built from its own config
class, with its gated-delta layers on fastweights' ops give the logits and greedy generations
of transformers' PyTorch fallbacks, in float64 (their modeling module's ``torch.float32`` bound
to float64, as tests/ops/test_gated_delta_transformers.py does for the functions alone), and
no longer crash on CPU where fla is installed. (Their RMSNorms still round through
``Tensor.float()``, in both runs alike, so the logits often agree exactly; a change of 1e-3 in
the layer's output shows.) A layer that a later release changes is refused by name, with
nothing patched."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
import warnings
from itertools import pairwise
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
import transformers

from fastweights.hf import use_fastweights
from fastweights.hf.kernels import (
    KERNELS,
    causal_conv1d_fn,
    chunk_gated_delta_rule,
    gated_delta_architectures,
    is_gated_delta_layer,
)
from tests.helpers import assert_close64

if not all(callable(getattr(importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5"),
                            name, None)) for name in KERNELS):
    pytest.skip(f"transformers {transformers.__version__} writes its gated-delta layers without the "
                "module-level kernel functions use_fastweights replaces (it refuses such a model: "
                "test_refused_where_transformers_has_no_kernel_names)", allow_module_level=True)

ARCHITECTURES = gated_delta_architectures()
V = 61
# One tiny config for every architecture: each config class takes the fields it knows and keeps
# the others as attributes. The QSA indexer fields are Qwen4-Exp's (its attention layers need
# them); the experts' eager loop is the MoE models' float64 path (grouped_mm has no float64
# kernel). An architecture a later release adds may need more: its test then fails to build it.
_TINY = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
         "linear_value_head_dim": 8, "pad_token_id": 0, "bos_token_id": None,
         "eos_token_id": None, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
         "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
         "indexer_budget": 8, "indexer_compress_ratio": 4,
         "layer_types": ["linear_attention", "full_attention", "linear_attention"]}


def modeling(name: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def causal_lm(name: str) -> type:
    """The architecture's one ``...ForCausalLM`` class."""
    module = modeling(name)
    found = [c for n, c in vars(module).items() if n.endswith("ForCausalLM")
             and isinstance(c, type) and c.__module__ == module.__name__]
    assert len(found) == 1, f"{name}: expected one ...ForCausalLM class, found {found}"
    return found[0]


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    cls = causal_lm(name)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cls.config_class(**_TINY)
        config._experts_implementation = "eager"
        model = cls(config)
    with torch.no_grad():  # order one everywhere (fresh norms are ones/zeros, linears tiny)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


class _Float64Torch(types.SimpleNamespace):
    """torch, but for ``float32`` and ``float``, which are float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


def float64_fallbacks(monkeypatch, name: str) -> None:
    """The architecture's modeling module computes in float64 and calls transformers' PyTorch
    fallbacks (not fla's Triton kernels, which the import bound where fla is installed)."""
    module = modeling(name)
    monkeypatch.setattr(module, "torch", _Float64Torch())
    for kernel in KERNELS:
        monkeypatch.setattr(module, kernel, inspect.unwrap(getattr(module, kernel)))


def ids(B: int = 2, T: int = 37, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_architectures_are_found_without_importing_them():
    """Read from the source files: the known ones (5.23's four, 5.24's six) and no import."""
    known = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"}
    if transformers.__version__.startswith("5.24."):
        known |= {"lara_mini", "qwen4_exp"}
    gated_delta_architectures.cache_clear()
    before = set(sys.modules)
    found = gated_delta_architectures()
    assert known <= set(found), found
    assert not {m for m in set(sys.modules) - before if m.startswith("transformers.models.")}


def test_readme_names_every_architecture():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [n for n in ARCHITECTURES if f"`{n}`" not in readme] == []


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_float64_logits_equal_transformers_fallback(name, monkeypatch):
    float64_fallbacks(monkeypatch, name)
    model, x = tiny_model(name).double(), ids()
    with torch.no_grad():
        expected = model(x).logits
        got = use_fastweights(model)(x).logits
    assert expected.abs().max() > 1  # order one: an absolute 1e-10 means something
    assert_close64(got, expected, atol=1e-10, what=f"{name} logits")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_generate_greedy_equals_transformers_fallback(name, monkeypatch):
    """Prefill by the chunked op, then one-token steps from transformers' cache (conv and
    recurrent states) by the step: same tokens and per-step logits as the fallbacks."""
    float64_fallbacks(monkeypatch, name)
    model, x = tiny_model(name).double(), ids(T=9)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True, "pad_token_id": 0}
    expected = model.generate(x, **kwargs)
    got = use_fastweights(model).generate(x, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert_close64(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-10,
                   what=f"{name} step logits")


def _fla_installed() -> bool:
    """Whether transformers' import bound the gated delta rule to fla's kernels."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            importlib.import_module("fla.ops.gated_delta_rule")
        except Exception:  # any import failure means transformers fell back
            return False
    return True


def _fla_reached_on_cpu() -> bool:
    """Whether an unmodified model's CPU forward reaches fla's kernels: fla is installed and
    transformers does not send inputs on devices fla lacks to its PyTorch fallbacks (from 5.25
    it does: ``hub_kernels._PACKAGE_SUPPORTED_DEVICES``)."""
    from transformers.integrations import hub_kernels

    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}).get("fla")
    return _fla_installed() and (devices is None or "cpu" in devices)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_cpu_forward_runs_where_fla_would_crash(name, monkeypatch):
    """Unmodified, with fla installed, the CPU forward reaches fla's Triton kernel and fails
    (transformers before 5.25; from 5.25 transformers itself sends CPU inputs to its PyTorch
    fallbacks, and the unmodified forward is the fallback's); with use_fastweights it runs,
    close to transformers' fallback in float32."""
    model, x = tiny_model(name), ids(B=1, T=20)
    unmodified = None
    with torch.no_grad():
        if _fla_reached_on_cpu():
            with pytest.raises(RuntimeError, match="active drivers"):
                model(x)
        else:
            unmodified = model(x).logits
        got = use_fastweights(model)(x).logits
        use_fastweights(model, enable=False)
        module = modeling(name)
        for kernel in KERNELS:
            monkeypatch.setattr(module, kernel, inspect.unwrap(getattr(module, kernel)))
        expected = model(x).logits
    assert_close64(got.double(), expected.double(), atol=2e-4, what=f"{name} float32 logits")
    if unmodified is not None:
        assert torch.equal(unmodified, expected)


def test_marking_is_per_model_and_reversible():
    a, b = tiny_model("qwen3_5"), tiny_model("qwen3_5")
    use_fastweights(a)
    use_fastweights(a)  # twice: one pair of hooks
    layers = [m for m in a.modules() if is_gated_delta_layer(m)]
    assert len(layers) == 2 and all(len(m._forward_pre_hooks) == 1 for m in layers)
    assert not any(m._forward_pre_hooks for m in b.modules() if is_gated_delta_layer(m))
    use_fastweights(a, enable=False)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in layers)


def test_a_model_without_gated_delta_layers_is_refused():
    with pytest.raises(ValueError, match="no transformers gated-delta layer"):
        use_fastweights(torch.nn.Linear(3, 3))


def test_refused_where_transformers_has_no_kernel_names(monkeypatch):
    # Older transformers releases (5.10 here) write the layer without the module-level kernel
    # functions: the model is refused with the reason and the tested versions, not as
    # "no gated-delta layer".
    model = tiny_model("qwen3_5")
    monkeypatch.delattr(modeling("qwen3_5"), "causal_conv1d_update")
    with pytest.raises(ValueError, match=r"without the module-level functions .*tested with "
                                         r"transformers 5.23 and 5.24"):
        use_fastweights(model)


def _later_release(forward=None) -> tuple[torch.nn.Module, type]:
    """A tiny Qwen3.5 whose gated-delta layers are of a new class of the same modeling module
    (with ``forward``, if given), as a later transformers release might write them."""
    model = tiny_model("qwen3_5")
    base = modeling("qwen3_5").Qwen3_5GatedDeltaNet
    new = type("Qwen9GatedDeltaNet", (base,), {"__module__": base.__module__,
                                                **({"forward": forward} if forward else {})})
    for layer in model.modules():
        if type(layer) is base:
            layer.__class__ = new
    return model, new


def _unmarked(model: torch.nn.Module) -> bool:
    return not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_a_later_release_calling_another_kernel_is_refused_by_name(monkeypatch):
    """A layer whose forward also calls a kernel function use_fastweights does not replace
    would run half on fastweights: refused, naming the model, the layer and the function."""
    module = modeling("qwen3_5")

    def kernel(x):
        return x

    kernel.__module__ = module.__name__  # defined there, bound through a wrapper, as transformers does
    monkeypatch.setattr(module, "fused_gated_norm", functools.wraps(kernel)(lambda x: kernel(x)),
                        raising=False)
    code = {}
    exec("def forward(self, hidden_states, *args, **kwargs):\n"
         "    return fused_gated_norm(torch_chunk_gated_delta_rule(hidden_states))\n", {}, code)
    model, new = _later_release(code["forward"])
    with pytest.raises(ValueError, match=r"cannot serve Qwen3_5ForCausalLM .*Qwen9GatedDeltaNet "
                                         r"\(transformers.models.qwen3_5.modeling_qwen3_5\) also "
                                         r"calls the kernel function\(s\) fused_gated_norm"):
        use_fastweights(model)
    assert _unmarked(model)
    assert not is_gated_delta_layer(next(m for m in model.modules() if type(m) is new))


def test_a_later_release_with_a_new_kernel_parameter_is_refused_by_name(monkeypatch):
    """transformers' gated delta rule taking a parameter fastweights' does not (it would be
    dropped): refused, naming the function and the parameter."""
    module = modeling("qwen3_5")
    fallback = inspect.unwrap(module.torch_chunk_gated_delta_rule)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, scale=None, **kwargs):
        return fallback(query, key, value, g, beta, chunk_size, initial_state,
                        output_final_state, use_qk_l2norm_in_kernel, **kwargs)

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", torch_chunk_gated_delta_rule)
    model, _ = _later_release()
    with pytest.raises(ValueError, match=r"Qwen9GatedDeltaNet .*calls torch_chunk_gated_delta_rule"
                                         r"\(.*\): fastweights' replacement takes \(.*\), not scale"):
        use_fastweights(model)
    assert _unmarked(model) and module.torch_chunk_gated_delta_rule is torch_chunk_gated_delta_rule


def test_packed_documents_equal_separate_calls():
    """cu_seqlens (transformers' packed sequences, which its fallbacks refuse): the convolution
    and the recurrence restart at every document."""
    g = torch.Generator().manual_seed(0)
    bounds = [0, 5, 12, 20]
    x = torch.randn(1, 6, 20, dtype=torch.float64, generator=g)  # [B, C, T]
    w = torch.randn(6, 4, dtype=torch.float64, generator=g)
    packed = causal_conv1d_fn(x, w, activation="silu", cu_seq_lens_q=torch.tensor(bounds))
    alone = torch.cat([causal_conv1d_fn(x[..., a:b], w, activation="silu")
                       for a, b in pairwise(bounds)], dim=-1)
    assert_close64(packed, alone, what="conv")
    q, k = (torch.randn(1, 20, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(1, 20, 4, 5, dtype=torch.float64, generator=g)
    beta, gate = torch.rand(1, 20, 4, dtype=torch.float64), -torch.rand(1, 20, 4, dtype=torch.float64)
    S0 = torch.randn(3, 4, 8, 5, dtype=torch.float64, generator=g)
    o, S = chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=S0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(bounds))
    for i, (a, b) in enumerate(pairwise(bounds)):
        oi, Si = chunk_gated_delta_rule(
            *(t[:, a:b] for t in (q, k, v, gate, beta)), initial_state=S0[i:i + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close64(o[:, a:b], oi, what=f"o doc {i}")
        assert_close64(S[i:i + 1], Si, what=f"S doc {i}")


def test_bfloat16_model_calls_the_op_in_bfloat16(monkeypatch):
    """No silent float32 in a bfloat16 model: its prefill calls ``gated_delta_rule`` with
    bfloat16 q, k, v (the dtype the GPU kernels take; q and k are L2-normalised in float32
    first), and the logits stay finite."""
    import fastweights.hf.kernels as hf_kernels

    seen = []
    op = hf_kernels.gated_delta_rule
    monkeypatch.setattr(hf_kernels, "gated_delta_rule",
                        lambda q, k, v, *a, **kw: seen.append((q.dtype, k.dtype, v.dtype))
                        or op(q, k, v, *a, **kw))
    model = use_fastweights(tiny_model("qwen3_5").bfloat16())
    logits = model(torch.randint(1, V, (1, 9))).logits
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    assert torch.isfinite(logits).all()
