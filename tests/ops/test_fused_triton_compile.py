"""Every Triton kernel launch of ops/fused/triton.py (the gated-delta layer's fused short
convolution and gated RMSNorm) compiles for real GPUs without register spills, checked without
one (tests/ops/triton_aot_fused.py, as tests/ops/test_fwp_triton_compile.py does for the
fast-weight kernels; the limits are that file's).

The launches are recorded from the host code, forward and backward, at every convolution
tiling (heads of 16 to 256 channels) and every gate and output dtype of the norm, and compiled
for sm_80 and sm_90 by Triton's ahead-of-time compiler and the ptxas of the triton wheel, with
sizes free and with every size a multiple of 16. The default run compiles bfloat16 under the
installed Triton; ``-m slow`` adds float16, and with FASTWEIGHTS_TRITON_PYTHONS the other
Tritons (docs/kernels.md, "Triton versions"; the figures per version are in docs/kernels.md,
"The gated-delta layer's fused elementwise kernels").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install fastweights[triton])")

from tests.ops.test_aft_triton_compile import compile_records as aft_compile_records
from tests.ops.test_fwp_triton_compile import ARCHS, OTHER_TRITONS, SHARED_LIMIT
from tests.ops.triton_aot import record_problems

NORM = {f"norm_{p}[ACT={a},{o}]" for p in ("fwd", "bwd") for a in (0, 1, 2) for o in ("X", "fp32")}


def expected(dtype: str) -> set[str]:
    """The distinct launches: the convolution's two kernels at BD 16 to 256, the norm's two for
    each gate (none, SiLU, sigmoid) and output dtype (x's, float32)."""
    x = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    bds = (16, 32, 64, 128, 256)
    conv = {f"conv_fwd[BD={bd},W={w}]" for bd in bds for w in (2, 3, 4)}
    conv |= {f"conv_bwd[BD={bd}]" for bd in bds}  # W is a run-time argument there
    return conv | {n.replace("X", x) for n in NORM}


def compile_records(python: str, tmp_path: Path, dtypes: tuple[str, ...]) -> list[dict]:
    return aft_compile_records(tmp_path, dtypes, "triton_aot_fused.py", python)


def check(records: list[dict], dtypes: tuple[str, ...]) -> None:
    from tests.ops.triton_aot_fused import SPECS

    problems = []
    for arch in ARCHS:
        for spec in SPECS:
            for dtype in dtypes:
                got = {r["kernel"] for r in records
                       if (r["arch"], r["spec"], r["dtype"]) == (arch, spec, dtype)}
                if got != expected(dtype):
                    problems.append(f"sm_{arch} {spec} {dtype}: compiled {sorted(got)}")
    for r in records:
        name = f"{r['kernel']} {r['dtype']} sm_{r['arch']} {r['spec']} warps={r['num_warps']}"
        problems += record_problems(r, name, SHARED_LIMIT[r["arch"]])
    assert not problems, "\n".join(problems)


def test_fused_kernels_compile_without_spills(tmp_path):
    check(compile_records(sys.executable, tmp_path, ("bfloat16",)), ("bfloat16",))


@pytest.mark.slow
def test_fused_kernels_compile_without_spills_every_dtype(tmp_path):
    check(compile_records(sys.executable, tmp_path, ("bfloat16", "float16")),
          ("bfloat16", "float16"))


@pytest.mark.slow
@pytest.mark.parametrize("python", OTHER_TRITONS or [pytest.param(None, marks=pytest.mark.skip(
    reason="FASTWEIGHTS_TRITON_PYTHONS names no other Triton environment"))])
def test_other_tritons_compile_without_spills(python, tmp_path):
    """The compile above under each other Triton of FASTWEIGHTS_TRITON_PYTHONS (3.8, the GPU
    image's 3.6): both half dtypes."""
    check(compile_records(python, tmp_path, ("bfloat16", "float16")), ("bfloat16", "float16"))


def test_dispatched_configurations_are_the_compiled_ones(monkeypatch):
    """What the dispatcher sends to the kernels is what the compile covers: half inputs with
    heads of at most MAX_GROUP = 256 channels (the largest BD compiled), each head size's tiles
    among the compiled ones; float32 goes to PyTorch."""
    from types import SimpleNamespace

    import torch

    from fastweights.ops import backend
    from fastweights.ops.fused import triton as kernels
    from tests.ops.triton_aot_fused import CONV_SIZES, GROUPS

    assert set(kernels.OPS) <= set(backend.kernel_ops("triton"))
    assert max(GROUPS) == kernels.MAX_GROUP and 4 in CONV_SIZES
    monkeypatch.setattr(backend, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    compiled = {kernels.tile_config(80, torch.bfloat16, "short_conv_silu", g) for g in GROUPS}
    for head_dim in range(1, kernels.MAX_GROUP + 1):
        for arch in ARCHS:
            assert kernels.tile_config(arch, torch.bfloat16, "short_conv_silu",
                                       head_dim) in compiled
    for op in kernels.OPS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cuda = SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 8, 64, 1),
                                   device="cuda:0", requires_grad=False)
            chosen = backend.choose_backend(op, cuda, None, "fused", 1,
                                            facts={"head_dim": kernels.MAX_GROUP})
            assert chosen == ("torch" if dtype == torch.float32 else "triton"), (op, dtype)
