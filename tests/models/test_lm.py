"""LanguageModel and LMConfig: pieces == whole, generate == greedy full forwards, JSON and
checkpoint round trips, validation of bad configs and inputs. Runs over every registered mixer."""

from __future__ import annotations

import json

import pytest
import torch

from fastweights import mixer_names
from fastweights.models import LanguageModel, LMConfig
from tests.helpers import assert_close64
from tests.layers.test_contract import SMALL_OPTIONS


def tiny(mixer, **kw) -> LanguageModel:
    torch.manual_seed(0)
    names = mixer if isinstance(mixer, list) else [mixer, mixer]
    opts = [SMALL_OPTIONS.get(n, {}) for n in names]
    cfg = LMConfig(vocab_size=31, d_model=16, n_layers=len(names), n_heads=2, mixer=names,
                   mixer_options=opts, **kw)
    model = LanguageModel(cfg).double().eval()
    with torch.no_grad():  # non-trivial values everywhere (zero-initialised gates hide bugs)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def ids(B=2, T=13, V=31, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", mixer_names())
def test_pieces_equal_whole(name):
    model = tiny(name)
    x = ids()
    whole, _ = model(x)
    assert whole.shape == (2, 13, 31) and whole.dtype == torch.float64
    outs, state = [], None
    for a, b in [(0, 1), (1, 6), (6, 13)]:
        y, state = model(x[:, a:b], state)
        outs.append(y)
    assert len(state) == 2
    assert_close64(torch.cat(outs, 1), whole, what=name)


@pytest.mark.parametrize("name", mixer_names())
def test_generate_equals_greedy_full_forwards(name):
    model = tiny(name)
    prompt = ids(T=5)
    out = model.generate(prompt, max_new_tokens=6, temperature=0)
    ref = prompt
    for _ in range(6):
        logits, _ = model(ref)
        ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_generate_sampling_is_seeded_and_respects_top_k():
    model = tiny("delta")
    prompt = ids(T=4)[0]
    a = model.generate(prompt, 8, temperature=1.0, seed=3)
    b = model.generate(prompt, 8, temperature=1.0, seed=3)
    assert a.shape == (12,) and torch.equal(a, b)
    assert torch.equal(a[:4], prompt)
    top1 = model.generate(prompt, 8, temperature=2.0, top_k=1, seed=5)
    assert torch.equal(top1, model.generate(prompt, 8, temperature=0))


def test_mixed_schedule_and_ffn_choices():
    model = tiny(["softmax", "linear", "delta"], ffn="glu", norm="layernorm")
    kinds = [type(b.mixer).__name__ for b in model.blocks]
    assert kinds == ["SoftmaxAttention", "LinearAttention", "DeltaNet"]
    none = tiny("linear", ffn="none")
    assert all(b.ffn is None for b in none.blocks)
    assert none.num_parameters() < model.num_parameters()


def test_transnormer_block_choices_follow_spec_3_4():
    """Local-then-global schedule, SRMSNorm pre-norm (no gain), GLU with hidden int(8/3 d) and
    the activation as a choice (identity = the published models)."""
    from fastweights.layers import GLU
    from fastweights.layers.norms import SRMSNorm

    model = tiny(["diag", "norm"], ffn="glu", norm="srmsnorm", glu_activation="identity")
    block = model.blocks[0]
    assert isinstance(block.norm1, SRMSNorm) and not list(block.norm1.parameters())
    assert isinstance(block.ffn, GLU) and block.ffn.activation == "identity"
    assert block.ffn.hidden == int(8 / 3 * 16) == LMConfig(d_model=16, ffn="glu").ffn_hidden_size()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    h = block.ffn
    assert_close64(h(x), h.w3(h.w1(x) * h.w2(x)), what="identity GLU")
    with pytest.raises(ValueError, match="glu_activation"):
        LMConfig(glu_activation="relu")


def test_max_seq_len_sizes_the_aft_position_tables():
    cfg = LMConfig(vocab_size=5, d_model=8, n_layers=2, n_heads=1, mixer=["aft-full", "aft-local"],
                   mixer_options=[{}, {"window": 4}], max_seq_len=1100)
    assert [o["max_len"] for o in cfg.layer_options()] == [1100, 1100]
    model = LanguageModel(cfg).eval()
    logits, _ = model(torch.zeros(1, 1050, dtype=torch.long))  # beyond the tables' default 1024
    assert logits.shape == (1, 1050, 5)
    explicit = LMConfig(vocab_size=5, d_model=8, n_layers=1, n_heads=1, mixer="aft-full",
                        mixer_options={"max_len": 64}, max_seq_len=32)
    assert explicit.layer_options()[0]["max_len"] == 64  # an explicit option wins


def test_tied_embeddings_share_one_tensor():
    tied, untied = tiny("linear"), tiny("linear", tie_embeddings=False)
    assert tied.head.weight is tied.embed.weight
    assert untied.num_parameters() == tied.num_parameters() + 31 * 16


def test_config_json_round_trip(tmp_path):
    cfg = LMConfig(mixer=["linear", "delta"], mixer_options=[{"chunk_size": 8}, {}], ffn="glu",
                   max_seq_len=64)
    cfg.save(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["mixer"] == ["linear", "delta"]
    assert LMConfig.load(tmp_path / "c.json") == cfg
    assert LMConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("field,value,match", [
    ("mixer", "nope", "unknown mixer 'nope'"),
    ("mixer", ["linear"], "lists 1 mixers but n_layers is 2"),
    ("mixer_options", {"bogus": 1}, "unknown option"),
    ("mixer_options", [{}, {}, {}], "lists 3 dicts"),
    ("d_model", 0, "d_model must be a positive int"),
    ("ffn", "moe", "ffn must be one of"),
    ("norm", "batchnorm", "norm must be one of"),
    ("dropout", 1.5, "dropout"),
    ("max_seq_len", -3, "max_seq_len"),
])
def test_config_rejects_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        LMConfig(**{field: value})


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown LMConfig field"):
        LMConfig.from_dict({"vocab_size": 10, "colour": "red"})


def test_forward_rejects_bad_inputs():
    model = tiny("delta", max_seq_len=20)
    with pytest.raises(TypeError, match=r"torch.long"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[0, 31\)"):
        model(torch.full((1, 3), 31))
    with pytest.raises(ValueError, match="shape \\[B, T\\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len 20"):
        model(ids(T=21))
    with pytest.raises(ValueError, match="max_seq_len 20"):
        model.generate(ids(T=15), max_new_tokens=6)
    with pytest.raises(ValueError, match="list of 2 layer states"):
        model(ids(), state=[None])


def test_save_and_load_pretrained(tmp_path):
    model = tiny(["softmax", "favor"]).float()
    model.save_pretrained(tmp_path / "ckpt")
    loaded = LanguageModel.from_pretrained(tmp_path / "ckpt").eval()
    assert loaded.config == model.config
    x = ids()
    assert torch.equal(loaded(x)[0], model(x)[0])  # weights and the FAVOR+ projection restored


def test_from_pretrained_rejects_missing_and_corrupt(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LanguageModel.from_pretrained(tmp_path / "nothing")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "weights.bin").write_text("x")
    with pytest.raises(ValueError, match="not a fastweights checkpoint"):
        LanguageModel.from_pretrained(tmp_path / "foreign")
    tiny("linear").save_pretrained(tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"model.safetensors is truncated or altered"):
        LanguageModel.from_pretrained(tmp_path / "bad")
    (tmp_path / "bad" / "checksums.json").unlink()  # a folder from another tool: no checksums
    with pytest.raises(ValueError, match="cannot load weights"):
        LanguageModel.from_pretrained(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read model config"):
        LanguageModel.from_pretrained(tmp_path / "bad")


def test_from_pretrained_detects_a_flipped_byte_and_returns_eval_mode(tmp_path):
    model = tiny("favor").float().eval()  # FAVOR+ redraws in training mode: eval must come back
    model.save_pretrained(tmp_path / "m")
    loaded = LanguageModel.from_pretrained(tmp_path / "m")
    assert not loaded.training
    assert torch.equal(loaded(ids())[0], model(ids())[0])
    weights = tmp_path / "m" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # same size, one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors is corrupted: its SHA-256 differs"):
        LanguageModel.from_pretrained(tmp_path / "m")


def test_packed_forward_equals_documents_one_by_one():
    import torch as _torch

    from fastweights.models import LanguageModel as _LM
    from fastweights.models import LMConfig as _Cfg

    _torch.manual_seed(0)
    model = _LM(_Cfg(vocab_size=50, d_model=16, n_layers=2, n_heads=2,
                     mixer=["delta", "softmax"])).double().eval()
    ids = _torch.randint(0, 50, (1, 11))
    cu = _torch.tensor([0, 3, 4, 11])
    logits, state = model(ids, cu_seqlens=cu)
    assert len(state) == 2 and all(len(s) == 3 for s in state)
    for a, b in [(0, 3), (3, 4), (4, 11)]:
        ref, _ = model(ids[:, a:b])
        assert (logits[:, a:b] - ref).abs().max().item() < 1e-10


def _loss_and_grads(model, x, state=None, cu_seqlens=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # the same dropout masks and FAVOR+ redraws in both runs
    logits, new_state = model(x, state, cu_seqlens=cu_seqlens)
    loss = logits.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, new_state


@pytest.mark.parametrize("name", mixer_names())
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(name):
    model = tiny(name, dropout=0.1).train()
    x = ids()
    _, _, state = _loss_and_grads(model, x[:, :4])  # a carried state too
    state = [None if s is None else _detach(s) for s in state]
    plain_loss, plain, _ = _loss_and_grads(model, x[:, 4:], state)
    model.set_gradient_checkpointing(True)
    ck_loss, ck, _ = _loss_and_grads(model, x[:, 4:], state)
    assert model.gradient_checkpointing
    assert torch.equal(plain_loss, ck_loss), name
    assert plain.keys() == ck.keys() and plain  # (a carried state bypasses learned initial states)
    for n in plain:
        assert_close64(ck[n], plain[n], what=f"{name} grad {n}")


def _detach(state):
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, (list, tuple)):
        items = [_detach(s) for s in state]
        return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)
    if isinstance(state, dict):
        return {k: _detach(v) for k, v in state.items()}
    return state


def test_gradient_checkpointing_keeps_only_block_inputs():
    """With recomputation the autograd graph holds far fewer saved tensors between the
    forward and the backward pass (only each block's input, not its intermediates)."""
    def saved_bytes(model):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, _ = model(ids(T=64))
        return sum(total), logits

    model = LanguageModel(LMConfig(vocab_size=31, d_model=32, n_layers=4, n_heads=2,
                                   mixer="delta")).train()
    plain, _ = saved_bytes(model)
    checkpointed, _ = saved_bytes(model.set_gradient_checkpointing(True))
    assert checkpointed < plain / 3


def test_gradient_checkpointing_is_off_in_eval_and_no_grad_and_packed_works():
    model = tiny("delta").set_gradient_checkpointing(True)
    x = ids(B=1, T=11)
    with torch.no_grad():
        ref, _ = model(x)
    assert_close64(model(x)[0], ref, what="eval mode")
    model.train()
    cu = torch.tensor([0, 3, 11])
    loss, grads, _state = _loss_and_grads(model, x, cu_seqlens=cu)
    model.set_gradient_checkpointing(False)
    loss2, grads2, _ = _loss_and_grads(model, x, cu_seqlens=cu)
    assert torch.equal(loss, loss2) and all(torch.allclose(grads[n], grads2[n]) for n in grads)
    with pytest.raises(TypeError, match="enable must be a bool"):
        model.set_gradient_checkpointing("yes")


def test_inner_lr_warmup_reaches_the_layers_that_have_one():
    """set_inner_lr_warmup(progress) ramps TTT-MLP's eta_scale from 0.1 to 1 (docs/maths.md 2.6) and
    leaves layers without an inner learning-rate schedule as they are."""
    model = tiny(["ttt-mlp", "ttt-linear", "delta"])
    mlp, lin, delta = (b.mixer for b in model.blocks)
    before = {n: p.clone() for n, p in delta.named_parameters()}
    for progress, expected in [(0.0, 0.1), (0.5, 0.55), (1, 1.0)]:
        model.set_inner_lr_warmup(progress)
        assert abs(mlp.eta_scale - expected) < 1e-12 and lin.eta_scale == 1.0
    assert all(torch.equal(p, before[n]) for n, p in delta.named_parameters())
    assert not hasattr(delta, "eta_scale")
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="progress must be a number in"):
            model.set_inner_lr_warmup(bad)
