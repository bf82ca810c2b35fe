"""Mixed precision as on a GPU (layers/base.py ``like_values``, fastweights.testing).

CUDA autocast runs reductions and pointwise functions (sum, exp, rsqrt, softplus, softmax, ...)
in float32 where CPU autocast keeps them in bfloat16/float16, so a layer whose queries went
through a sum normalisation met bfloat16 values with float32 queries only on a GPU (the DeltaNet
layer crashed there, ``v has dtype torch.bfloat16 but q has dtype torch.float32``).
``cuda_autocast_policy`` reproduces CUDA's policy under CPU autocast; every registered mixer, and
the option variants that change how q and k are built, must train under it (forward, backward,
finite loss and gradients), and the ops that have GPU kernels must receive their q, k, v in the
autocast dtype (where the kernels run), as they must in a bfloat16 model.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fastweights.ops.backend as backends
from fastweights.models import LanguageModel, LMConfig
from fastweights.models.registry import mixer_names
from fastweights.testing import cuda_autocast_policy

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Options that change how a layer builds or casts what its op mixes.
VARIANTS = {
    **{f"linear-{n}-{u}": ("linear", {"normalize": n, "update": u})
       for n in ("none", "attention", "sum", "sum+attention") for u in ("sum", "delta")},
    "linear-relu-sum": ("linear", {"feature_map": "relu", "normalize": "sum"}),
    "dpfp-sum-delta": ("dpfp", {"normalize": "sum", "update": "delta"}),
    "favor-sum-delta": ("favor", {"normalize": "sum", "update": "delta"}),
    "delta-recurrent": ("delta", {"mode": "recurrent"}),
    "infini-delta": ("infini", {"update": "delta", "segment_len": 16}),
    "infini-rope-memory": ("infini", {"rope_memory": True, "segment_len": 16}),
    "norm-decay": ("norm", {"decay": True}),
    "norm-relu-no-lrpe": ("norm", {"activation": "relu", "lrpe": False}),
    "diag-relu": ("diag", {"kernel": "relu", "block_size": 16}),
    "ttt-linear-mamba": ("ttt-linear", {"mamba_backbone": True, "mini_batch_size": 8}),
    "ttt-mlp-no-norm": ("ttt-mlp", {"inner_norm": False, "residual": False}),
    "aft-conv-plain": ("aft-conv", {"reparam": False, "global_context": False}),
    "gated-delta-no-conv": ("gated-delta", {"use_short_conv": False, "use_gate": False}),
    "gated-delta-gva": ("gated-delta", {"num_v_heads": 4, "expand_v": 1.0,
                                        "allow_neg_eigval": True,
                                        "gate_activation": "sigmoid"}),
}
CASES = {name: (name, {}) for name in mixer_names()} | VARIANTS
# Every registered mixer under both half dtypes; the variants under bfloat16 (a GPU's choice).
RUNS = [(name, d) for name in mixer_names() for d in HALF] + [(name, "bf16") for name in VARIANTS]
KERNEL_OPS = ("linear_attn", "delta_rule", "gated_delta_rule", "decay_linear_attn")


@pytest.fixture
def kernel_calls(monkeypatch):
    """(op, q dtype) of every call of an op that has GPU kernels (they all choose a backend)."""
    seen: list[tuple[str, torch.dtype]] = []
    choose = backends.choose_backend

    def spy(op, q, *args, **kwargs):
        seen.append((op, q.dtype))
        return choose(op, q, *args, **kwargs)

    for module in ("linear_attn", "delta_rule", "gated_delta_rule", "transnormer.decay"):
        # by module object: fastweights.ops.linear_attn is also the op's name there
        monkeypatch.setattr(importlib.import_module(f"fastweights.ops.{module}"), "choose_backend",
                            spy)
    return seen


def _model(mixer: str, options: dict, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2,
                                  mixer=mixer, mixer_options=options))


def _ids(T: int = 37) -> torch.Tensor:
    return torch.randint(0, 61, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("case", "dtype"), RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_trains_under_simulated_cuda_autocast(case, dtype, kernel_calls):
    mixer, options = CASES[case]
    model = _model(mixer, options)
    ids = _ids()
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=HALF[dtype]):
        logits, _ = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    assert loss.dtype == torch.float32  # cross_entropy is on CUDA's float32 list
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # The kernels' operands in the autocast dtype, the dtype their kernels take (TransNormer's
    # float16 operands widened: test_float16_model_keeps_transnormer_in_float32).
    # The delta rule with attention normalisation (Table 3's ablation) runs the delta rule on
    # inputs it rescaled in float32 inside its own op: no kernel path, on purpose.
    attn_norm_delta = (options.get("normalize", "").endswith("attention")
                       and options.get("update") == "delta")
    widened = (mixer, dtype) == ("norm", "fp16") or attn_norm_delta
    want = torch.float32 if widened else HALF[dtype]
    assert all(dt == want for op, dt in kernel_calls), kernel_calls


@pytest.mark.parametrize("mixer", ["linear", "delta", "norm", "gated-delta"])
def test_kernel_ops_see_the_autocast_dtype(mixer, kernel_calls):
    """Each layer over an op with GPU kernels calls it (the list is not empty) in bfloat16."""
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        _model(mixer, {})(_ids())
    assert kernel_calls and {dt for _, dt in kernel_calls} == {torch.bfloat16}


@pytest.mark.parametrize("mixer", ["linear", "dpfp", "favor", "delta", "norm", "gated-delta"])
def test_bfloat16_model_calls_its_op_in_bfloat16(mixer, kernel_calls):
    """No silent float32 in a bfloat16 model (weights cast, no autocast): the op is called with
    bfloat16 q, k, v wherever a kernel exists (gates and states stay float32)."""
    model = _model(mixer, {}).bfloat16()
    logits, _ = model(_ids())
    assert logits.dtype == torch.bfloat16
    assert kernel_calls and {dt for _, dt in kernel_calls} == {torch.bfloat16}


def test_float16_model_keeps_transnormer_in_float32(kernel_calls):
    """The one exception, on purpose: NormAttention has no denominator, its output grows like t
    and overflows float16, so float16 operands are widened (bfloat16 has float32's range)."""
    _model("norm", {}).half()(_ids())
    assert {dt for _, dt in kernel_calls} == {torch.float32}


@pytest.mark.parametrize("mixer", ["delta", "gated-delta", "norm"])
def test_bfloat16_decoding_steps_equal_the_forward(mixer):
    """In a bfloat16 model the one-token steps round their operands as the full forward does:
    the logits of decoding token by token match the whole sequence's (float32 state rounding
    and bfloat16 projections aside)."""
    model = _model(mixer, {}).bfloat16()
    ids = _ids(19)
    whole, _ = model(ids)
    state, steps = None, []
    for t in range(ids.shape[1]):
        out, state = model(ids[:, t:t + 1], state)
        steps.append(out)
    diff = (torch.cat(steps, 1).float() - whole.float()).abs().max().item()
    assert diff <= 0.05 * max(1.0, whole.float().abs().max().item())


def test_cli_trains_with_bf16_under_the_cuda_policy(tmp_path):
    """The command line's mixed-precision training (``--bf16``) through the same policy, in a
    subprocess: DeltaNet and Gated DeltaNet finish their steps and write their run folders."""
    script = (
        "import sys\n"
        "from fastweights.cli import main\n"
        "from fastweights.testing import cuda_autocast_policy\n"
        "out, args = sys.argv[1], sys.argv[2:]\n"
        "with cuda_autocast_policy():\n"
        "    for mixer in ('delta', 'gated-delta'):\n"
        "        code = main(['train', '--mixer', mixer, '--out', f'{out}/{mixer}', *args])\n"
        "        if code:\n"
        "            sys.exit(code)\n")
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "--bf16", "--steps", "3", "--seq-len", "32",
         "--batch-size", "2", "--d-model", "32", "--n-heads", "2", "--eval-every", "3",
         "--eval-windows", "2", "--warmup", "1", "--quiet"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for mixer in ("delta", "gated-delta"):
        assert (tmp_path / mixer / "metrics.csv").exists(), sorted(tmp_path.rglob("*"))
