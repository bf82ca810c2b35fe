"""Bad inputs across the whole public API and the CLI: every one raises a clear
ValueError/TypeError naming the argument before any computation, or, on the command line, exits
with code 2 and one line on stderr.

These cases complement the per-family tables in tests/ops/test_*_bad_input.py: devices that
disagree (a ``meta`` tensor stands in for a second device), non-finite scalars, states from a
different batch size or a different mixer, every registered mixer's constructor and forward,
``build_mixer``, ``LMConfig``, ``LanguageModel.forward``/``generate`` and the CLI subcommands.
"""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer, mixer_names
from fastweights.cli import main
from fastweights.models import LanguageModel, LMConfig
from fastweights.ops import (
    aft,
    aft_conv,
    aft_local,
    block_attention,
    decay_linear_attn,
    delta_rule,
    dpfp,
    draw_favor_projection,
    elu_plus_one,
    favor_features,
    infini_attention,
    linear_attn,
    relu,
    softmax_attention,
    sum_norm,
    ttt_linear,
    ttt_mlp,
)

B, T, H, D = 2, 5, 3, 4
q = torch.randn(B, T, H, D)
beta = torch.rand(B, T, H)
meta = torch.empty(B, T, H, D, device="meta")  # a tensor on another device
x3 = torch.randn(B, T, 8)  # AFT layout [B, T, D]
w = torch.randn(T, T)
kc = torch.randn(B, T, H)  # AFT-conv keys, one per head
wc = torch.randn(H, 3)
S = torch.zeros(B, H, D, D)
z = torch.zeros(B, H, D)
W_ttt = torch.zeros(1, H, D, D)
nan = float("nan")

OP_CASES = [
    # linear_attn / delta_rule
    ("linear_attn-k-other-device", lambda: linear_attn(q, meta, q), ValueError, ["k", "device"]),
    ("linear_attn-scale-nan", lambda: linear_attn(q, q, q, scale=nan), ValueError, ["scale", "finite"]),
    ("linear_attn-flag-int", lambda: linear_attn(q, q, q, output_final_state=1), TypeError,
     ["output_final_state", "bool"]),
    ("linear_attn-normalize-str", lambda: linear_attn(q, q, q, normalize="yes"), TypeError,
     ["normalize", "bool"]),
    ("linear_attn-state-batch", lambda: linear_attn(q, q, q, initial_state=(S[:1], z[:1])),
     ValueError, ["initial_state[0]", "[B, H, Dk, Dv]"]),
    ("linear_attn-state-int", lambda: linear_attn(q, q, q, initial_state=(S.long(), z)), TypeError,
     ["initial_state[0]", "floating-point"]),
    ("linear_attn-chunk-bool", lambda: linear_attn(q, q, q, chunk_size=True), TypeError,
     ["chunk_size", "int"]),
    ("delta_rule-beta-int", lambda: delta_rule(q, q, q, beta.long()), TypeError,
     ["beta", "floating-point"]),
    ("delta_rule-beta-other-device", lambda: delta_rule(q, q, q, beta.to("meta")), ValueError,
     ["beta", "device"]),
    ("delta_rule-state-batch", lambda: delta_rule(q, q, q, beta, initial_state=S[:1]), ValueError,
     ["initial_state", "[B, H, Dk, Dv]"]),
    ("delta_rule-state-tuple", lambda: delta_rule(q, q, q, beta, initial_state=(S, z)), TypeError,
     ["initial_state", "torch.Tensor"]),
    ("delta_rule-scale-inf", lambda: delta_rule(q, q, q, beta, scale=float("inf")), ValueError,
     ["scale", "finite"]),
    # feature maps
    ("elu_plus_one-int", lambda: elu_plus_one(q.long()), TypeError, ["x", "floating-point"]),
    ("relu-list", lambda: relu([1.0]), TypeError, ["x", "torch.Tensor"]),
    ("dpfp-scalar", lambda: dpfp(torch.tensor(1.0)), ValueError, ["x"]),
    ("sum_norm-eps-negative", lambda: sum_norm(q, eps=-1.0), ValueError, ["eps"]),
    ("favor-projection-int", lambda: favor_features(q, torch.ones(8, D, dtype=torch.long)), TypeError,
     ["projection", "floating-point"]),
    ("favor-projection-other-device", lambda: favor_features(q, torch.ones(8, D, device="meta")),
     ValueError, ["projection", "device"]),
    ("draw_favor-d-zero", lambda: draw_favor_projection(4, 0), ValueError, ["d", ">= 1"]),
    ("draw_favor-orthogonal-int", lambda: draw_favor_projection(4, 4, orthogonal=1), TypeError,
     ["orthogonal", "bool"]),
    ("draw_favor-int-dtype", lambda: draw_favor_projection(4, 4, dtype=torch.long), TypeError,
     ["dtype", "floating"]),
    # softmax / block attention
    ("softmax-int", lambda: softmax_attention(q.long(), q.long(), q.long()), TypeError,
     ["q", "floating-point"]),
    ("softmax-v-other-device", lambda: softmax_attention(q, q, meta), ValueError, ["v", "device"]),
    ("softmax-causal-int", lambda: softmax_attention(q, q, q, causal=1), TypeError, ["causal", "bool"]),
    ("softmax-scale-nan", lambda: softmax_attention(q, q, q, scale=nan), ValueError, ["scale", "finite"]),
    ("softmax-rank", lambda: softmax_attention(q[0], q[0], q[0]), ValueError, ["q", "4-D"]),
    ("block_attention-size-0", lambda: block_attention(q, q, q, block_size=0), ValueError,
     ["block_size", ">= 1"]),
    ("block_attention-kernel", lambda: block_attention(q, q, q, block_size=2, kernel="tanh"),
     ValueError, ["kernel", "one of"]),
    ("block_attention-v-batch", lambda: block_attention(q, q, q[:1], block_size=2), ValueError,
     ["v", "shape"]),
    ("block_attention-scale-nan", lambda: block_attention(q, q, q, block_size=2, scale=nan),
     ValueError, ["scale", "finite"]),
    # decay_linear_attn (TransNormer)
    ("decay-rank", lambda: decay_linear_attn(q, q, q, torch.rand(B, T, H)), ValueError, ["decay"]),
    ("decay-heads", lambda: decay_linear_attn(q, q, q, torch.rand(H + 1)), ValueError, ["decay"]),
    ("decay-not-tensor", lambda: decay_linear_attn(q, q, q, 0.9), TypeError, ["decay", "torch.Tensor"]),
    ("decay-mode", lambda: decay_linear_attn(q, q, q, torch.rand(H), mode="dual"), ValueError,
     ["mode", "one of"]),
    ("decay-chunk-0", lambda: decay_linear_attn(q, q, q, torch.rand(H), chunk_size=0), ValueError,
     ["chunk_size", ">= 1"]),
    ("decay-state-batch", lambda: decay_linear_attn(q, q, q, torch.rand(H), initial_state=S[:1]),
     ValueError, ["initial_state"]),
    ("decay-k-other-device", lambda: decay_linear_attn(q, meta, q, torch.rand(H)), ValueError,
     ["k", "device"]),
    # TTT
    ("ttt_linear-eta-int", lambda: ttt_linear(q, q, q, beta.long(), initial_state=(W_ttt, None)),
     TypeError, ["eta", "floating-point"]),
    ("ttt_linear-W-other-device", lambda: ttt_linear(
        q, q, q, beta, initial_state=(W_ttt.to("meta"), None)), ValueError, ["initial_state[0]", "device"]),
    ("ttt_linear-flag-int", lambda: ttt_linear(q, q, q, beta, initial_state=(W_ttt, None),
                                               output_final_state=1), TypeError, ["output_final_state"]),
    ("ttt_mlp-mini-batch-0", lambda: ttt_mlp(q, q, q, beta, initial_state=(
        torch.zeros(1, H, D, 4 * D), None, torch.zeros(1, H, 4 * D, D), None), mini_batch_size=0),
     ValueError, ["mini_batch_size", ">= 1"]),
    # AFT
    ("aft-w-other-device", lambda: aft(x3, x3, x3, torch.randn(T, T, device="meta")), ValueError,
     ["w", "device"]),
    ("aft-causal-none", lambda: aft(x3, x3, x3, causal=None), TypeError, ["causal", "bool"]),
    ("aft_local-causal-str", lambda: aft_local(x3, x3, x3, w, window=2, causal="no"), TypeError,
     ["causal", "bool"]),
    ("aft_conv-chunk-0", lambda: aft_conv(q, kc, q, wc, chunk_size=0), ValueError, ["chunk_size"]),
    ("aft-simple-state-batch", lambda: aft(
        x3, x3, x3, initial_state=(torch.zeros(1, 8),) * 3), ValueError, ["initial_state[0]"]),
    ("aft_local-window-float", lambda: aft_local(
        x3, x3, x3, torch.randn(T, 3), window=2.0), TypeError, ["window"]),
    ("aft_conv-mode", lambda: aft_conv(q, kc, q, wc, mode="fast"), ValueError,
     ["mode", "one of"]),
    ("aft-w-int", lambda: aft(x3, x3, x3, w.long()), TypeError,
     ["w", "floating-point"]),
    # Infini-attention
    ("infini-gate-other-device", lambda: infini_attention(
        q, q, q, torch.zeros(H, device="meta"), segment_len=2), ValueError, ["gate", "device"]),
    ("infini-state-batch", lambda: infini_attention(
        q, q, q, torch.zeros(H), segment_len=2, initial_state=(S[:1], z[:1])), ValueError,
     ["initial_state[0]"]),
    ("infini-segment-bool", lambda: infini_attention(q, q, q, torch.zeros(H), segment_len=True),
     TypeError, ["segment_len"]),
]


def _mixer(name: str, **options):
    small = {"aft-full": {"max_len": 32, "d_bias": 8}, "aft-local": {"window": 3, "max_len": 32,
                                                                    "d_bias": 8}}
    return build_mixer(name, 16, 2, **{**small.get(name, {}), **options})


def _state_of(name: str, batch: int = B):
    _, state = _mixer(name)(torch.randn(batch, 4, 16))
    return state


# A registered mixer whose state is certainly not the given mixer's (different structure).
FOREIGN = {name: ("norm" if name == "delta" else "delta") for name in mixer_names()}

MIXER_CASES = []
for _name in mixer_names():
    MIXER_CASES += [
        (f"{_name}-wrong-d_model", lambda n=_name: _mixer(n)(torch.randn(B, T, 12)), ValueError,
         ["x", "d_model=16"]),
        (f"{_name}-wrong-rank", lambda n=_name: _mixer(n)(torch.randn(T, 16)), ValueError,
         ["x", "3-D"]),
        (f"{_name}-int-dtype", lambda n=_name: _mixer(n)(torch.ones(B, T, 16, dtype=torch.long)),
         TypeError, ["x", "floating-point"]),
        (f"{_name}-state-other-batch", lambda n=_name: _mixer(n)(torch.randn(3, T, 16), _state_of(n)),
         ValueError, ["state", "3"]),
        (f"{_name}-state-other-mixer", lambda n=_name: _mixer(n)(torch.randn(B, T, 16),
                                                                 _state_of(FOREIGN[n])),
         (TypeError, ValueError), ["state"]),
    ]

BUILD_CASES = [
    ("build-unknown-name", lambda: build_mixer("flash", 16, 2), ValueError, ["unknown mixer", "'flash'"]),
    ("build-unknown-option", lambda: build_mixer("delta", 16, 2, windo=3), ValueError,
     ["unknown option", "windo"]),
    ("build-d_model-float", lambda: build_mixer("delta", 16.0, 2), TypeError, ["d_model"]),
    ("build-n_heads-0", lambda: build_mixer("delta", 16, 0), ValueError, ["n_heads", ">= 1"]),
    ("build-heads-not-dividing", lambda: build_mixer("softmax", 16, 3), ValueError,
     ["d_model", "n_heads", "divisible"]),
    ("build-linear-feature-map", lambda: build_mixer("linear", 16, 2, feature_map="tanh"), ValueError,
     ["feature_map", "one of"]),
    ("build-favor-m-0", lambda: build_mixer("favor", 16, 2, m=0), ValueError, ["m", ">= 1"]),
    ("build-dpfp-nu-float", lambda: build_mixer("dpfp", 16, 2, nu=1.5), (TypeError, ValueError), ["nu"]),
    ("build-delta-mode", lambda: build_mixer("delta", 16, 2, mode="fast"), ValueError, ["mode"]),
    ("build-infini-segment-0", lambda: build_mixer("infini", 16, 2, segment_len=0), ValueError,
     ["segment_len", ">= 1"]),
    ("build-infini-update", lambda: build_mixer("infini", 16, 2, update="sum"), ValueError,
     ["update", "one of"]),
    ("build-softmax-rope-base-0", lambda: build_mixer("softmax", 16, 2, rope_base=0.0), ValueError,
     ["rope_base", "> 0"]),
    ("build-ttt-rope-base-nan", lambda: build_mixer("ttt-linear", 16, 2, rope_base=nan), ValueError,
     ["rope_base"]),
    ("build-norm-activation", lambda: build_mixer("norm", 16, 2, activation="gelu"), ValueError,
     ["activation", "one of"]),
    ("build-diag-block-0", lambda: build_mixer("diag", 16, 2, block_size=0), ValueError,
     ["block_size", ">= 1"]),
    ("build-aft-local-window-0", lambda: build_mixer("aft-local", 16, 2, window=0), ValueError,
     ["window", ">= 1"]),
    ("build-aft-conv-d_hidden-0", lambda: build_mixer("aft-conv", 16, 2, d_hidden=0), ValueError,
     ["d_hidden", ">= 1"]),
    ("build-ttt-mini-batch-0", lambda: build_mixer("ttt-mlp", 16, 2, mini_batch_size=0), ValueError,
     ["mini_batch_size", ">= 1"]),
    ("build-ttt-eta-negative", lambda: build_mixer("ttt-linear", 16, 2, eta_base=-1.0), ValueError,
     ["eta_base"]),
    ("build-head-dim-odd-rope", lambda: build_mixer("softmax", 16, 2, head_dim=5), ValueError,
     ["even head dim"]),
]

CONFIG_CASES = [
    ("config-vocab-0", lambda: LMConfig(vocab_size=0), ValueError, ["vocab_size", "positive int"]),
    ("config-d_model-float", lambda: LMConfig(d_model=64.0), ValueError, ["d_model"]),
    ("config-n_layers-bool", lambda: LMConfig(n_layers=True), ValueError, ["n_layers"]),
    ("config-mixer-unknown", lambda: LMConfig(mixer="flash"), ValueError, ["mixer", "'flash'"]),
    ("config-mixer-list-length", lambda: LMConfig(mixer=["delta"] * 3, n_layers=2), ValueError,
     ["mixer", "n_layers"]),
    ("config-mixer-not-str", lambda: LMConfig(mixer=3), ValueError, ["mixer"]),
    ("config-options-unknown", lambda: LMConfig(mixer_options={"windo": 2}), ValueError,
     ["mixer_options", "windo"]),
    ("config-options-list-length", lambda: LMConfig(mixer_options=[{}] * 3), ValueError,
     ["mixer_options", "n_layers"]),
    ("config-ffn", lambda: LMConfig(ffn="swiglu"), ValueError, ["ffn", "one of"]),
    ("config-norm", lambda: LMConfig(norm="batchnorm"), ValueError, ["norm", "one of"]),
    ("config-norm_eps-0", lambda: LMConfig(norm_eps=0.0), ValueError, ["norm_eps"]),
    ("config-dropout-1", lambda: LMConfig(dropout=1.0), ValueError, ["dropout", "[0, 1)"]),
    ("config-tie-int", lambda: LMConfig(tie_embeddings=1), ValueError, ["tie_embeddings", "bool"]),
    ("config-max_seq_len-0", lambda: LMConfig(max_seq_len=0), ValueError, ["max_seq_len"]),
    ("config-ffn_hidden-negative", lambda: LMConfig(ffn_hidden=-4), ValueError, ["ffn_hidden"]),
    ("config-heads-not-dividing", lambda: LanguageModel(LMConfig(d_model=30, n_heads=4)), ValueError,
     ["d_model", "n_heads"]),
    ("config-from-dict-unknown", lambda: LMConfig.from_dict({"layers": 2}), ValueError,
     ["unknown LMConfig field", "layers"]),
    ("model-config-dict", lambda: LanguageModel({"d_model": 16}), TypeError, ["config", "LMConfig"]),
    ("config-glu-activation", lambda: LMConfig(glu_activation="relu"), ValueError,
     ["glu_activation", "one of"]),
    ("config-heads-split", lambda: LMConfig(d_model=10, n_heads=3), ValueError,
     ["LMConfig layer 0", "divisible by n_heads"]),
    ("config-option-value-nu", lambda: LMConfig(mixer="dpfp", mixer_options={"nu": 0}), ValueError,
     ["LMConfig layer 0", "nu"]),
    ("config-option-value-chunk", lambda: LMConfig(mixer="delta", mixer_options={"chunk_size": 0}),
     ValueError, ["LMConfig layer 0", "chunk_size"]),
    ("config-option-value-segment", lambda: LMConfig(mixer=["delta", "infini"], n_layers=2,
     mixer_options=[{}, {"segment_len": -1}]), ValueError, ["LMConfig layer 1", "segment_len"]),
    ("train-recompute-str", lambda: _train_config(recompute="yes"), TypeError, ["recompute", "bool"]),
    ("train-pack-int", lambda: _train_config(pack=1), TypeError, ["pack", "bool"]),
    ("train-bf16-str", lambda: _train_config(bf16="true"), TypeError, ["bf16", "bool"]),
    ("model-checkpointing-str", lambda: LanguageModel(LMConfig(d_model=16, n_heads=2))
     .set_gradient_checkpointing("yes"), TypeError, ["enable", "bool"]),
]


def _train_config(**kw):
    from fastweights.train.trainer import TrainConfig

    return TrainConfig(**kw)

_lm = None


def lm() -> LanguageModel:
    global _lm
    if _lm is None:
        torch.manual_seed(0)
        _lm = LanguageModel(LMConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, max_seq_len=12))
    return _lm


ids = torch.randint(0, 11, (2, 4))
MODEL_CASES = [
    ("forward-id-too-large", lambda: lm()(torch.full((1, 3), 11)), ValueError, ["input_ids", "[0, 11)"]),
    ("forward-id-negative", lambda: lm()(torch.full((1, 3), -1)), ValueError, ["input_ids", "[0, 11)"]),
    ("forward-float-ids", lambda: lm()(ids.float()), TypeError, ["input_ids", "torch.long"]),
    ("forward-rank-1", lambda: lm()(ids[0]), ValueError, ["input_ids", "[B, T]"]),
    ("forward-rank-3", lambda: lm()(ids[None]), ValueError, ["input_ids", "[B, T]"]),
    ("forward-list", lambda: lm()([[1, 2]]), TypeError, ["input_ids", "torch.Tensor"]),
    ("forward-empty", lambda: lm()(ids[:, :0]), ValueError, ["input_ids", "T >= 1"]),
    ("forward-too-long", lambda: lm()(torch.zeros(1, 13, dtype=torch.long)), ValueError,
     ["max_seq_len", "13"]),
    ("forward-state-length", lambda: lm()(ids, [None]), ValueError, ["state", "2 layer states"]),
    ("forward-state-other-batch", lambda: lm()(ids[:1], lm()(ids)[1]), ValueError, ["state"]),
    ("generate-max-new-negative", lambda: lm().generate(ids, -1), ValueError, ["max_new_tokens"]),
    ("generate-max-new-float", lambda: lm().generate(ids, 2.0), ValueError, ["max_new_tokens"]),
    ("generate-temperature-negative", lambda: lm().generate(ids, 2, temperature=-0.5), ValueError,
     ["temperature"]),
    ("generate-temperature-nan", lambda: lm().generate(ids, 2, temperature=nan), ValueError,
     ["temperature"]),
    ("generate-top_k-0", lambda: lm().generate(ids, 2, top_k=0), ValueError, ["top_k"]),
    ("generate-seed-float", lambda: lm().generate(ids, 2, seed=1.5), ValueError, ["seed"]),
    ("generate-float-prompt", lambda: lm().generate(ids.float(), 2), TypeError, ["prompt_ids"]),
    ("generate-prompt-out-of-vocab", lambda: lm().generate(ids + 11, 2), ValueError,
     ["prompt_ids", "[0, 11)"]),
    ("generate-past-max-seq-len", lambda: lm().generate(ids, 9), ValueError, ["max_seq_len"]),
]

API_CASES = OP_CASES + MIXER_CASES + BUILD_CASES + CONFIG_CASES + MODEL_CASES


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


CLI_CASES = [
    ("no-command", [], ["COMMAND"]),
    ("unknown-command", ["fit"], ["invalid choice", "'fit'"]),
    ("unknown-flag", ["train", "--epochs", "3"], ["unrecognized arguments", "--epochs"]),
    ("train-steps-not-int", ["train", "--steps", "many"], ["--steps", "'many'"]),
    ("train-steps-negative", ["train", "--steps", "-1"], ["steps", "-1"]),
    ("train-seq-len-0", ["train", "--seq-len", "0"], ["seq_len", "0"]),
    ("train-batch-size-0", ["train", "--batch-size", "0"], ["batch_size"]),
    ("train-unknown-mixer", ["train", "--mixer", "flash"], ["mixer", "'flash'"]),
    ("train-lr-negative", ["train", "--lr", "-1"], ["lr"]),
    ("train-dropout-1.5", ["train", "--dropout", "1.5"], ["dropout"]),
    ("train-heads-not-dividing", ["train", "--d-model", "30", "--n-heads", "4"], ["d_model", "n_heads"]),
    ("train-ffn-choice", ["train", "--ffn", "swiglu"], ["--ffn", "invalid choice"]),
    ("train-missing-data", ["train", "--data", "/nonexistent/corpus.txt", "--steps", "1"],
     ["/nonexistent/corpus.txt", "does not exist"]),
    ("train-warmup-negative", ["train", "--warmup", "-3"], ["warmup"]),
    ("eval-missing-checkpoint", ["eval", "--checkpoint", "/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
    ("eval-no-checkpoint-flag", ["eval"], ["--checkpoint", "required"]),
    ("generate-missing-checkpoint", ["generate", "--checkpoint", "/nonexistent/ckpt"],
     ["/nonexistent/ckpt"]),
    ("generate-temperature-not-float", ["generate", "--checkpoint", "x", "--temperature", "hot"],
     ["--temperature", "'hot'"]),
    ("recall-sizes", ["recall", "--sizes", "a,b"], ["--sizes"]),
    ("recall-task", ["recall", "--task", "sorting"], ["--task", "'sorting'"]),
    ("recall-steps-0", ["recall", "--steps", "0"], ["--steps"]),
    ("recall-d-key-0", ["recall", "--d-key", "0"], ["--d-key"]),
    ("mixers-d-model-0", ["mixers", "--d-model", "0"], ["d_model", "0"]),
    ("mixers-heads-not-dividing", ["mixers", "--d-model", "10", "--n-heads", "3"], ["divisible"]),
    ("mixers-seq-len-0", ["mixers", "--seq-len", "0"], ["--seq-len"]),
    ("bench-unknown-mixer", ["bench", "--mixers", "flash"], ["--mixers", "flash"]),
]


@pytest.mark.parametrize("argv,words", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(argv, words, capsys, tmp_path):
    if argv[:1] in (["train"], ["recall"]):
        argv = [*argv, "--out", str(tmp_path / "run")]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "error" in lines[0] and "Traceback" not in captured.err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


def test_table_size():
    """At least 60 bad inputs across the API and the CLI are covered."""
    assert len(API_CASES) + len(CLI_CASES) >= 60
