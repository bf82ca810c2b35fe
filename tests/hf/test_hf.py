"""The Hugging Face integration: generate() against full forwards (with left padding), the cache,
save/load through AutoModelForCausalLM, and lossless native <-> Hugging Face conversion."""

from __future__ import annotations

import copy
import inspect
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fastweights.hf import (
    CACHE_FIELD,
    FastWeightsCache,
    FastWeightsConfig,
    FastWeightsForCausalLM,
    hf_to_native,
    native_to_hf,
)
from fastweights.models.config import LMConfig
from fastweights.models.lm import LanguageModel
from tests.helpers import (
    GENERATE_SETTINGS,
    assert_close64,
    assert_generate_passes_declared_keywords,
)

V, PAD = 29, 0
MIXERS = {"delta": "delta", "softmax": "softmax", "mixed": ["delta", "softmax"]}


def tiny_config(mixer: str | list[str], **extra) -> FastWeightsConfig:
    names = [mixer] * 2 if isinstance(mixer, str) else mixer
    # chunk_size 4 does not divide the prompt lengths: the chunk boundaries are exercised
    options = [{"chunk_size": 4} if name == "delta" else {} for name in names]
    return FastWeightsConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=2, mixer=mixer,
                             mixer_options=options, pad_token_id=PAD, **extra)


def tiny_model(mixer: str | list[str], seed: int = 0, **extra) -> FastWeightsForCausalLM:
    torch.manual_seed(seed)
    return FastWeightsForCausalLM(tiny_config(mixer, **extra)).double().eval()


def prompt(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (1, T), generator=g)  # ids >= 1: PAD never occurs in a prompt


def argmax_by_full_forwards(model: FastWeightsForCausalLM, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation recomputing the whole sequence every step (no cache)."""
    for _ in range(n):
        logits = model(ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_config_mirrors_lmconfig():
    hf_fields = {f.name: f for f in fields(FastWeightsConfig)}
    default = FastWeightsConfig()
    for f in fields(LMConfig):
        assert f.name in hf_fields, f"FastWeightsConfig lacks LMConfig.{f.name}"
        assert hf_fields[f.name].type == f.type, f"FastWeightsConfig.{f.name} type"
        assert getattr(default, f.name) == getattr(LMConfig(), f.name), f.name
    lm = LMConfig(vocab_size=40, d_model=8, n_layers=3, n_heads=2, mixer=["delta", "softmax", "delta"],
                  mixer_options=[{}, {"rope": False}, {}], ffn="glu", tie_embeddings=False)
    cfg = FastWeightsConfig.from_lm_config(lm)
    assert cfg.to_lm_config() == lm
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.tie_word_embeddings) == (8, 3, False)
    assert FastWeightsConfig.from_dict(cfg.to_dict()).to_lm_config() == lm


@pytest.mark.parametrize("bad", [{"mixer": "nope"}, {"ffn": "big"}, {"n_layers": 0}],
                         ids=["mixer", "ffn", "n_layers"])
def test_config_validates_like_lmconfig(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        FastWeightsConfig(**bad)


@pytest.mark.parametrize("mixer", MIXERS.values(), ids=MIXERS.keys())
def test_forward_is_the_native_model(mixer):
    model = tiny_model(mixer)
    ids = prompt(9, seed=1)
    assert_close64(model(ids).logits, model.model(ids)[0], what="logits")


@pytest.mark.parametrize("mixer", MIXERS.values(), ids=MIXERS.keys())
def test_greedy_generate_equals_full_forward_argmax(mixer):
    model = tiny_model(mixer)
    ids = torch.cat([prompt(7, seed=2), prompt(7, seed=3)])
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, argmax_by_full_forwards(model, ids, 6))


@pytest.mark.parametrize("mixer", MIXERS.values(), ids=MIXERS.keys())
def test_left_padded_batch_matches_unpadded_rows(mixer):
    model = tiny_model(mixer)
    short, long = prompt(4, seed=4), prompt(9, seed=5)
    pad = torch.full((1, 5), PAD)
    ids = torch.cat([torch.cat([pad, short], 1), long])
    mask = (ids != PAD).long()
    logits = model(ids, attention_mask=mask).logits
    assert_close64(logits[0, 5:], model(short).logits[0], what="padded row logits")
    assert_close64(logits[1], model(long).logits[0], what="unpadded row logits")
    assert logits[0, :5].abs().max() == 0  # pad positions carry no prediction

    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out[0, 5:], argmax_by_full_forwards(model, short, 5)[0])
    assert torch.equal(out[1], argmax_by_full_forwards(model, long, 5)[0])


@pytest.mark.parametrize("mixer,groups", [("delta", 1), ("softmax", 2)], ids=["delta", "softmax"])
def test_pad_groups_merge_when_states_agree(mixer, groups):
    # Recurrent states of both pad lengths have one shape and are decoded as one batch; softmax
    # KV caches of different lengths are kept (and decoded) per pad length.
    model = tiny_model(mixer)
    ids = torch.cat([torch.cat([torch.full((1, 3), PAD), prompt(3, 6)], 1), prompt(6, 7)])
    cache = model(ids, attention_mask=(ids != PAD).long())[CACHE_FIELD]
    assert len(cache.groups) == groups
    assert sorted(torch.cat([rows for rows, _ in cache.groups]).tolist()) == [0, 1]


def test_delta_cache_is_constant_size_and_softmax_grows():
    sizes = {}
    for mixer in ("delta", "softmax"):
        model = tiny_model(mixer)
        out = model(prompt(5, seed=8))
        cache, seen = out[CACHE_FIELD], []
        assert isinstance(cache, FastWeightsCache)
        for _ in range(4):
            seen.append(cache.state_bytes())
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, cache=cache)
            assert out[CACHE_FIELD] is cache
        sizes[mixer] = seen
        assert cache.get_seq_length() == 5 + 4
    assert len(set(sizes["delta"])) == 1 and sizes["delta"][0] > 0
    step = sizes["softmax"][1] - sizes["softmax"][0]
    assert step > 0 and all(b - a == step for a, b in zip(sizes["softmax"], sizes["softmax"][1:]))


def test_generate_returns_the_fastweights_cache():
    model = tiny_model("delta")
    res = model.generate(prompt(5, 9), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)
    assert isinstance(res[CACHE_FIELD], FastWeightsCache)
    assert res[CACHE_FIELD].get_seq_length() == 5 + 3 - 1  # the last token is not fed back


@pytest.mark.parametrize("setting", GENERATE_SETTINGS)
@pytest.mark.parametrize("mixer", ["delta", "softmax"])
def test_generate_passes_only_declared_keywords(mixer, setting):
    model = tiny_model(mixer)
    ids = torch.cat([torch.cat([torch.full((1, 2), PAD), prompt(4, 3)], 1), prompt(6, 4)])
    assert_generate_passes_declared_keywords(model, ids, attention_mask=(ids != PAD).long(),
                                             **GENERATE_SETTINGS[setting])


def test_cache_is_passed_by_either_name_and_returned_under_the_installed_one():
    model = tiny_model("delta")
    ids = prompt(7, seed=5)
    with torch.no_grad():
        cache = model(ids[:, :4])[CACHE_FIELD]
    assert isinstance(cache, FastWeightsCache)
    # the same continuation whichever name carries the cache in (copies: the cache is updated)
    by_new = model(ids[:, 4:], cache=copy.deepcopy(cache))
    by_old = model(ids[:, 4:], past_key_values=copy.deepcopy(cache))
    assert_close64(by_new.logits, by_old.logits, what="cache= vs past_key_values=")
    assert_close64(by_new.logits, model(ids).logits[:, 4:], what="continued vs whole")
    if CACHE_FIELD == "cache":  # transformers >= 5.24 keeps the old name as a read-only alias
        assert by_new.past_key_values is by_new.cache
    assert getattr(model(ids, use_cache=False), CACHE_FIELD) is None


@pytest.mark.parametrize("mixer", MIXERS.values(), ids=MIXERS.keys())
def test_beam_search_with_cache_equals_without(mixer):
    # Beam search reorders the cache rows every step (FastWeightsCache.reorder_cache).
    model = tiny_model(mixer)
    ids = torch.cat([prompt(5, seed=10), prompt(5, seed=16)])
    opts = {"max_new_tokens": 5, "num_beams": 3, "num_return_sequences": 2, "do_sample": False}
    cached = model.generate(ids, **opts)
    assert cached.shape == (4, 10)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **opts))


def test_loss_is_next_token_cross_entropy_ignoring_pads():
    model = tiny_model("delta")
    short, long = prompt(4, seed=11), prompt(7, seed=12)
    ids = torch.cat([torch.cat([torch.full((1, 3), PAD), short], 1), long])
    mask = (ids != PAD).long()
    out = model(ids, attention_mask=mask, labels=ids)
    lp = torch.cat([model(short).logits[0, :-1].log_softmax(-1), model(long).logits[0, :-1].log_softmax(-1)])
    target = torch.cat([short[0, 1:], long[0, 1:]])
    assert_close64(out.loss, -lp[torch.arange(len(target)), target].mean(), what="loss")


@pytest.mark.parametrize("mixer", ["delta", "mixed"])
def test_gradient_checkpointing_enable_recomputes_with_the_same_gradients(mixer):
    model = tiny_model(MIXERS[mixer]).train()
    ids = torch.cat([prompt(9, seed=3), prompt(9, seed=4)])

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    # transformers >= 5.24 names it activation_checkpointing_enable (the old name warns)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert model.model.gradient_checkpointing
    recomputed = grads()
    assert plain.keys() == recomputed.keys() and plain
    for n in plain:
        assert_close64(recomputed[n], plain[n], what=n)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert not model.model.gradient_checkpointing


@pytest.mark.skipif(
    "every_n_layers" not in inspect.signature(
        getattr(FastWeightsForCausalLM, "activation_checkpointing_enable", lambda: None)).parameters,
    reason="this transformers has no activation_checkpointing_enable(every_n_layers=...)")
@pytest.mark.parametrize("every", [1, 2, 3])
def test_activation_checkpointing_every_n_layers_recomputes_those_blocks(every, monkeypatch):
    import fastweights.models.lm as lm

    torch.manual_seed(0)
    model = FastWeightsForCausalLM(FastWeightsConfig(
        vocab_size=V, d_model=12, n_layers=4, n_heads=2, mixer="delta")).double().train()
    ids = torch.cat([prompt(9, seed=3), prompt(9, seed=4)])

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    recomputed_blocks = []
    block_index = {b: i for i, b in enumerate(model.model.blocks)}
    real = lm._checkpointed_block
    monkeypatch.setattr(lm, "_checkpointed_block", lambda run, block, *args: (
        recomputed_blocks.append(block_index[block]), real(run, block, *args))[1])
    model.activation_checkpointing_enable(every_n_layers=every)
    recomputed = grads()
    assert recomputed_blocks == list(range(0, 4, every))  # transformers' blocks 0, n, 2n, ...
    for n in plain:
        assert_close64(recomputed[n], plain[n], what=n)
    model.activation_checkpointing_disable()
    recomputed_blocks.clear()
    grads()
    assert recomputed_blocks == [] and model.model._gradient_checkpointing_func is None
    with pytest.raises(ValueError, match="every_n_layers must be an int >= 1"):
        model.activation_checkpointing_enable(every_n_layers=0)


def test_bad_inputs_raise():
    model = tiny_model("delta")
    ids = prompt(4, seed=13).repeat(2, 1)
    with pytest.raises(ValueError, match="only left padding"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(ids, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="no token"):
        model(ids, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(TypeError, match="FastWeightsCache"):
        model(ids, past_key_values=object())
    with pytest.raises(TypeError, match="FastWeightsCache"):
        model(ids, cache=object())
    cache = model(ids)[CACHE_FIELD]
    with pytest.raises(ValueError, match="batch 1"):
        model(ids[:1, :1], cache=cache)
    with pytest.raises(ValueError, match=r"cache= or as past_key_values="):
        model(ids[:, :1], cache=cache, past_key_values=cache)


@pytest.mark.parametrize("mixer", ["delta", "softmax"])
def test_save_load_round_trip(tmp_path, mixer):
    model = tiny_model(mixer)
    ids = prompt(8, seed=14)
    model.save_pretrained(tmp_path)
    for cls in (FastWeightsForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path).eval()
        assert type(loaded) is FastWeightsForCausalLM and loaded.dtype == torch.float64
        assert torch.equal(loaded(ids).logits, model(ids).logits), cls.__name__
        assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False),
                           model.generate(ids, max_new_tokens=4, do_sample=False))


POSITIONED = {"learned": {"position": "learned", "max_seq_len": 32},
              "sinusoidal": {"position": "sinusoidal"}}


@pytest.mark.parametrize("extra", POSITIONED.values(), ids=POSITIONED.keys())
def test_absolute_positions_round_trip_and_continue_in_decoding(tmp_path, extra):
    """LMConfig.position flows through FastWeightsConfig: saved and loaded, and its positions
    continue across the cache in generation, also for left-padded rows (counted from their
    first real token)."""
    model = tiny_model("delta", **extra)
    assert model.config.position == extra["position"]
    ids = torch.cat([prompt(7, seed=2), prompt(7, seed=3)])
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, argmax_by_full_forwards(model, ids, 6))
    short, long = prompt(4, seed=4), prompt(9, seed=5)
    padded = torch.cat([torch.cat([torch.full((1, 5), PAD), short], 1), long])
    out = model.generate(padded, attention_mask=(padded != PAD).long(), max_new_tokens=5,
                         do_sample=False)
    assert torch.equal(out[0, 5:], argmax_by_full_forwards(model, short, 5)[0])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.to_lm_config() == model.config.to_lm_config()
    assert torch.equal(loaded(long).logits, model(long).logits)


def test_from_pretrained_refuses_mismatched_weights(tmp_path):
    tiny_model("delta").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not match"):
        FastWeightsForCausalLM.from_pretrained(tmp_path, n_layers=3, mixer_options={})


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_native_hf_conversion_is_lossless(tmp_path, tie):
    torch.manual_seed(0)
    native = LanguageModel(LMConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=2,
                                    mixer=["softmax", "delta"], tie_embeddings=tie)).eval()
    # float32: LanguageModel.from_pretrained builds a float32 model and casts into it
    ids = prompt(8, seed=15)
    native.save_pretrained(tmp_path / "native")
    native_to_hf(tmp_path / "native", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(hf(ids).logits, native(ids)[0])

    hf_to_native(tmp_path / "hf", tmp_path / "back")
    back = LanguageModel.from_pretrained(tmp_path / "back").eval()
    assert torch.equal(back(ids)[0], native(ids)[0])
    assert back.config == native.config
    a, b = load_file(tmp_path / "native" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)

    # A model saved by transformers converts back too.
    hf.save_pretrained(tmp_path / "hf2")
    hf_to_native(tmp_path / "hf2", tmp_path / "back2")
    assert torch.equal(LanguageModel.from_pretrained(tmp_path / "back2")(ids)[0], native(ids)[0])


def test_conversion_refuses_non_empty_destination(tmp_path):
    LanguageModel(LMConfig(vocab_size=V, d_model=8, n_layers=1, n_heads=2)).save_pretrained(tmp_path / "n")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="dst_dir"):
        native_to_hf(tmp_path / "n", tmp_path / "busy")
    native_to_hf(tmp_path / "n", tmp_path / "h")
    with pytest.raises(ValueError, match="dst_dir"):
        hf_to_native(tmp_path / "h", tmp_path / "busy")
    with pytest.raises(ValueError, match="model_type"):
        hf_to_native(tmp_path / "n", tmp_path / "new")  # a native folder is not a HF one
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="src_dir"):
        native_to_hf(tmp_path / "missing", tmp_path / "new")


def test_core_library_does_not_import_transformers():
    code = "import sys, fastweights; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_readme_example_runs(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    section = readme.split("## Hugging Face", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    tiny_model("delta").float().save_pretrained(tmp_path / "checkpoints" / "hf")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})


def test_config_json_written_before_generated_fields_loads():
    """A config.json saved when FastWeightsConfig listed LMConfig's fields by hand (ints where
    floats are meant included) loads to the same LMConfig and saves back unchanged."""
    saved = {
        "architectures": ["FastWeightsForCausalLM"], "bos_token_id": None, "d_model": 8,
        "dropout": 0, "dtype": "float32", "eos_token_id": None, "ffn": "mlp", "ffn_hidden": None,
        "glu_activation": "silu", "max_seq_len": None, "mixer": ["delta", "softmax"],
        "mixer_options": [{}, {"rope": False}], "model_type": "fastweights", "n_heads": 2,
        "n_layers": 2, "norm": "rmsnorm", "norm_eps": 1e-05, "pad_token_id": 0,
        "tie_embeddings": True, "transformers_version": "5.23.0", "use_cache": True,
        "vocab_size": 40,
    }
    cfg = FastWeightsConfig.from_dict(saved)
    assert cfg.to_lm_config() == LMConfig(vocab_size=40, d_model=8, n_heads=2,
                                          mixer=["delta", "softmax"],
                                          mixer_options=[{}, {"rope": False}], norm_eps=1e-5)
    assert cfg.pad_token_id == 0 and cfg.use_cache
    again = cfg.to_dict()
    assert {k: again[k] for k in saved if k != "transformers_version"} == \
        {k: v for k, v in saved.items() if k != "transformers_version"}
