"""Every op declares its example call once, in its folder (``<folder>/examples.py``,
``fastweights.ops.example_inputs``): every op of ``fastweights.ops`` has one, the op takes it,
and the benchmark's op targets are exactly these (``fastweights bench --ops``: gated_delta_rule
included, no op left out)."""

from __future__ import annotations

import inspect

import pytest
import torch

import fastweights.ops as ops
from fastweights.bench.targets import Setting, op_targets

# fastweights.ops' names that are not ops: feature maps, steps, states, modes, helpers (the
# layers' fused elementwise work among them).
NOT_OPS = {"elu_plus_one", "relu", "dpfp", "sum_norm", "favor_features", "draw_favor_projection",
           "open_block_attention", "merge_simple_states", "srms_norm", "example_inputs",
           "reading_nothing", "reads_allowed", "l2_normalize", "rms_norm_gated",
           "short_conv_silu", "fused_kernels_run"}


def _ops() -> list[str]:
    return [n for n in ops.__all__ if n not in NOT_OPS and not n.endswith("_step")
            and inspect.isfunction(getattr(ops, n))]


def test_every_op_has_an_example():
    assert sorted(ops.EXAMPLE_OPS) == sorted(_ops())


@pytest.mark.parametrize("op", ops.EXAMPLE_OPS)
def test_the_op_takes_its_example(op):
    ex = ops.example_inputs(op, 2, 19, 2, 8)
    out = ex.call(getattr(ops, op))
    o = out[0] if isinstance(out, tuple) else out
    assert o.shape[:2] == (2, 19) and torch.isfinite(o).all()
    again = ops.example_inputs(op, 2, 19, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(ex.qkv, again.qkv))  # seeded


def test_the_benchmark_runs_every_op():
    setting = Setting(1, 8, 2, torch.float32, torch.device("cpu"))
    targets, left_out = op_targets(setting)
    assert left_out == {}
    assert {t.name.split("[")[0] for t in targets} == set(ops.EXAMPLE_OPS)
    with pytest.raises(ValueError, match="op must be one of"):
        ops.example_inputs("nope", 1, 1, 1, 1)
