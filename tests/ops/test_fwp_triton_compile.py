"""Every Triton kernel of ops/delta_rule/triton.py compiles for real GPUs, checked without one.

tests/ops/triton_aot.py records every kernel launch the host code makes (forward and backward of
linear attention, normalised linear attention, the delta rule and the gated delta rule (the
delta rule's kernels with HAS_G on, one value head per key head and grouped heads), at Dk = 64
and Dk = 128, for each input dtype the dispatcher sends to Triton and the tiles ``tile_config``
gives each target)
and compiles each distinct one for sm_80 (A100) and sm_90 (H100) with Triton's ahead-of-time
compiler and the ptxas inside the triton wheel. The compile runs once per test session, in one
subprocess (a pool of one worker per core) without TRITON_INTERPRET, which tests/conftest.py
sets for the interpreter tests. Each record is then asserted on:

- the compile succeeds and yields a cubin;
- the shared memory a launch needs is within the per-block opt-in limit of the target: 163 KiB
  = 166,912 B on sm_80 and 227 KiB = 232,448 B on sm_90 (CUDA C Programming Guide, "Technical
  Specifications per Compute Capability"; the 232,448 B also appears as the "Hardware limit" in
  Triton's OutOfResources message on an H100, benchmarks/results/gpu_h100/baseline.log);
- no register spills: ptxas -v reports 0 bytes of spill stores and loads.

Triton specialises a launch on its arguments (pointers 16-byte aligned, integers divisible by
16) and compiles a binary per specialisation. The host code pads Dk and Dv to multiples of 16
and aligns every tensor it passes (ops/delta_rule/triton.py ``_prepare``), so what varies is
the sizes along time: T, N and C. The two ends are compiled here: T, N, C free ("odd_T"), for
every dtype, and all of them but H's divisible by 16 (the usual training shapes: "aligned"), for
bfloat16 and float32 (float16's kernels are bfloat16's with another element type). The test
``test_host_launches_are_aligned`` checks that odd head sizes and misaligned inputs reach the
kernels padded and aligned. The compile uses the installed Triton; ``-m slow`` with
FASTWEIGHTS_TRITON_PYTHONS compiles under other Tritons too (docs/kernels.md, "Triton
versions").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install fastweights[triton])")

from tests.ops.triton_aot import record_problems

HERE = Path(__file__).parent
SHARED_LIMIT = {80: 166_912, 90: 232_448}
ARCHS = (80, 90)
DTYPES = ("float16", "bfloat16", "float32")


def expected_variants(dtype: str) -> set[str]:
    """The distinct launches the host code makes: linear attention (plain and normalised) and,
    for half inputs, the delta rule and the gated delta rule, forward and backward,
    at one and two key blocks."""
    x, f = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype], "*fp32"
    names = set()
    for o in (x, f):  # normalised linear attention: o, hence dO, in float32
        names |= {"state_fwd[HAS_W=False,NK=1]", f"output[u={x},o={o}]",
                  f"state_bwd[HAS_W=False,NK=1,do={o}]", f"local_du[do={o}]",
                  f"grad[HAS_W=False,u={x},do={o}]"}
    if dtype == "float32":  # no float32 delta rule (tile_config)
        return names
    names |= {"ut_fwd", f"output[u={f},o={x}]", "ut_bwd", f"grad[HAS_W=True,u={f},do={x}]"}
    for gated in ("HAS_G", "HAS_G,GROUPED"):  # one value head per key head, and grouped
        names |= {f"ut_fwd[{gated}]", f"output[{gated},u={f},o={x}]", f"ut_bwd[{gated}]",
                  f"local_du[{gated},do={x}]", f"grad[HAS_W=True,{gated},u={f},do={x}]"}
        names |= {f"state_fwd[HAS_W=True,NK={nk},{gated}]" for nk in (1, 2)}
        names |= {f"state_bwd[HAS_W=True,NK={nk},{gated},do={x}]" for nk in (1, 2)}
    for nk in (1, 2):
        names |= {f"state_fwd[HAS_W=True,NK={nk}]", f"state_bwd[HAS_W=True,NK={nk},do={x}]"}
    return names


def compile_records(python: str, out: Path) -> list[dict]:
    """Every record, compiled by one run of the script under ``python`` (its worker pool covers
    both targets and every dtype)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([python, str(HERE / "triton_aot.py"), str(out),
                           *(str(a) for a in ARCHS)], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, f"compile script failed:\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def compiled(tmp_path_factory) -> list[dict]:
    """All records under the installed Triton, compiled once per session."""
    return compile_records(sys.executable, tmp_path_factory.mktemp("aot") / "records.json")


def problems(compiled: list[dict], arch: int, dtype: str) -> list[str]:
    """What is wrong with the records of one target and dtype: launches missing or compiled
    twice, errors, no cubin, shared memory over the target's limit, spills."""
    recs = [r for r in compiled if r["arch"] == arch and r["dtype"] == dtype]
    found = []
    for spec in ("odd_T", "aligned") if dtype != "float16" else ("odd_T",):
        names = [r["kernel"] for r in recs if r["spec"] == spec]
        if len(names) != len(set(names)):
            found.append(f"a launch compiled twice: {sorted(names)}")
        if set(names) != expected_variants(dtype):
            found.append(f"{spec}: compiled {sorted(set(names) ^ expected_variants(dtype))} "
                         "against the expected launches")
    for r in recs:
        name = (f"{r['kernel']} {dtype} sm_{arch} {r['spec']} BV={r['BV']} BK={r['BK']} "
                f"warps={r['num_warps']}")
        found += record_problems(r, name, SHARED_LIMIT[arch])
    return found


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_compiles_without_spills(compiled, arch, dtype):
    found = problems(compiled, arch, dtype)
    assert not found, "\n".join(found)


# Other Tritons to compile with (docs/kernels.md, "Triton versions"): python interpreters,
# separated by os.pathsep, of environments with another triton, e.g. a venv made with
# --system-site-packages and `pip install triton==3.8.0`.
OTHER_TRITONS = [p for p in os.environ.get("FASTWEIGHTS_TRITON_PYTHONS", "").split(os.pathsep)
                 if p]


@pytest.mark.slow
@pytest.mark.parametrize("python", OTHER_TRITONS or [pytest.param(None, marks=pytest.mark.skip(
    reason="FASTWEIGHTS_TRITON_PYTHONS names no other Triton environment"))])
def test_other_tritons_compile_without_spills(python, tmp_path):
    """The compile above under each other Triton of FASTWEIGHTS_TRITON_PYTHONS (the lowest the
    bounds allow, 3.8, and the GPU image's 3.6): every target and dtype."""
    version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    records = compile_records(python, tmp_path / "records.json")
    found = [f"Triton {version}: {p}" for arch in ARCHS for dtype in DTYPES
             for p in problems(records, arch, dtype)]
    assert not found, "\n".join(found)


def test_dispatched_configurations_are_the_compiled_ones(monkeypatch):
    """What the dispatcher sends to Triton is what the compile covers: Dk <= 128 (one or two
    key blocks, both compiled), chunk sizes <= 64 (one chunk tile), half inputs for both ops and
    float32 for linear attention only; tile_config gives every target a tiling for those."""
    from types import SimpleNamespace

    import torch

    from fastweights.ops import backend
    from fastweights.ops.delta_rule import triton as kernels

    assert backend.TRITON_MAX_DK == kernels.MAX_DK == 2 * kernels.BK
    assert set(kernels.OPS) <= set(backend.kernel_ops("triton"))
    monkeypatch.setattr(backend, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    for op in kernels.OPS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cuda = SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 8, 1, 128),
                                   device="cuda:0")
            chosen = backend.choose_backend(op, cuda, None, "chunk", 64)
            dispatched = not (op != "linear_attn" and dtype == torch.float32)
            assert chosen == ("triton" if dispatched else "torch"), (op, dtype, chosen)
            assert kernels.supports(op, dtype) == dispatched
            for arch in ARCHS:
                cfg = kernels.tile_config(arch, dtype, op)
                assert (cfg is not None) == dispatched
                if cfg is not None and op != "linear_attn":  # its own kernels have tiles
                    assert None not in cfg, cfg


def test_host_launches_are_aligned(monkeypatch):
    """Odd head sizes and an input at an address that is not 16-byte aligned reach every kernel
    padded to multiples of 16 and aligned (``_prepare``), forward and backward of each op: the
    specialisations compiled above are all the host launches."""
    import torch

    from fastweights.ops.delta_rule import triton as kernels
    from fastweights.ops.gated_delta_rule import triton as gated
    from fastweights.ops.linear_attn import triton as linear

    launches = []

    class Recorder:  # a kernel that records its arguments and computes nothing
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **constexprs: launches.append((self.fn, args))

    for name in [n for n in vars(kernels) if n.endswith("_kernel")]:
        monkeypatch.setattr(kernels, name, Recorder(getattr(kernels, name)))
    B, T, Hk, H, Dk, Dv = 1, 5, 1, 2, 7, 9

    def odd(*shape):  # 4 bytes past an aligned address
        return torch.zeros(1 + math.prod(shape))[1:].view(*shape).requires_grad_()

    q, k, v, beta, g = odd(B, T, Hk, Dk), odd(B, T, Hk, Dk), odd(B, T, H, Dv), odd(B, T, H), \
        odd(B, T, H)
    S0 = torch.zeros(B, H, Dk, Dv)
    runs = [gated.gated_delta_rule_triton(q, k, v, beta, g, S0, 4),
            kernels.delta_rule_triton(q, k, v[:, :, :1], beta[:, :, :1], S0[:, :1], 4),
            linear.linear_attn_triton(q, k, v[:, :, :1], S0[:, :1], S0[:, :1, :, 0], True,
                                      1e-6, 4)]
    for out in runs:
        torch.autograd.backward([out[0].sum()], inputs=[q, k])
    assert {fn.__name__ for fn, _ in launches} == {
        n for n in vars(kernels) if n.startswith("_") and n.endswith("_kernel")}
    for fn, args in launches:
        for name, arg in zip(fn.arg_names, args):
            if isinstance(arg, torch.Tensor):
                assert arg.data_ptr() % 16 == 0, (fn.__name__, name)
            elif name in ("Dk", "Dv"):
                assert arg % 16 == 0, (fn.__name__, name, arg)
