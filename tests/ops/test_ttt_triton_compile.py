"""Every Triton kernel of ops/ttt/triton.py that the dispatcher launches compiles for real
GPUs without register spills, checked without one (tests/ops/triton_aot.py ``--ttt``, as
tests/ops/test_fwp_triton_compile.py does for the fast-weight kernels; the limits are that
file's).

The launches are recorded from ``_LinearTriton``'s and ``_MLPTriton``'s forward and backward
(calls with full and partial mini-batches, so that every variant of the backward's kernels is
launched; TTT-Linear with both forward kernels, the register-resident one of
ops/ttt/triton_regs.py where ``regs_config`` has a tiling; the backward kernels of an op outside ``BACKWARD_OPS``, which the dispatcher does
not send gradient-recording calls to, would be left out: ``triton_aot.dispatched``) for the
cases of ``triton_aot.TTT_CASES`` and compiled for sm_80 and sm_90 by Triton's ahead-of-time
compiler and the ptxas of the triton wheel. By default the target shapes (bfloat16, head size
128, aligned; every flag on, as the layers call it, and every flag off); ``-m slow`` compiles
all cases (head sizes 64 and 128, float16, the generic specialisation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install fastweights[triton])")

from tests.ops.test_fwp_triton_compile import ARCHS, SHARED_LIMIT
from tests.ops.triton_aot import TTT_CASES, dispatched, record_problems

HERE = Path(__file__).parent
KERNELS = {"qk", "linear_fwd", "linear_bwd_a", "linear_bwd_b", "linear_bwd_b[TAIL]",
           "linear_bwd_c", "linear_bwd_c[TAIL]", "mlp_fwd", "mlp_recompute", "mlp_bwd_a",
           "mlp_bwd_b", "mlp_bwd_b[TAIL]", "linear_decode", "linear_decode[COMMIT]", "mlp_decode",
           "mlp_decode[COMMIT]", "linear_fwd_regs", "linear_fwd_res", "linear_bwd_a_res",
           "linear_bwd_b_res", "linear_bwd_b_res[TAIL]"}


def compile_records(tmp_path: Path, which: str) -> list[dict]:
    out = tmp_path / "records.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(HERE / "triton_aot.py"), str(out), which,
                           *(str(a) for a in ARCHS)], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, f"compile script failed:\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def compiled_kernels() -> set[str]:
    """KERNELS less those the dispatcher does not send launches to (triton_aot.dispatched)."""
    from fastweights.ops.ttt import triton as ttt_kernels

    return {n for n in KERNELS if dispatched(ttt_kernels, n)}


def check(records: list[dict], cases) -> None:
    import torch

    from fastweights.ops.ttt.triton_regs import regs_config
    from fastweights.ops.ttt.triton_resident import BWD_MIN_ARCH

    problems = []
    for arch in ARCHS:
        for dtype, D, flags, spec in cases:
            kernels = compiled_kernels()
            if regs_config(arch, getattr(torch, dtype), D) is None:  # the streamed forward
                kernels.discard("linear_fwd_regs")
            if arch < BWD_MIN_ARCH:  # the resident backward kernels are refused there
                kernels -= {"linear_bwd_a_res", "linear_bwd_b_res", "linear_bwd_b_res[TAIL]"}
            case = {s: {r["kernel"] for r in records if r["arch"] == arch
                        and r["dtype"] == dtype and r["D"] == D and r["flags"] == flags
                        and r["spec"] == s} for s in (spec, "aligned")}
            missing = set(kernels) - case[spec]
            if spec == "odd_T":  # kernels without a T or N argument: compiled once, as aligned
                missing -= case["aligned"]
            if missing or not case[spec] <= set(kernels):
                problems.append(f"sm_{arch} {dtype} D={D} {flags} {spec}: {sorted(case[spec])}")
    for r in records:
        name = (f"{r['kernel']} {r['dtype']} D={r['D']} {r['flags']} sm_{r['arch']} {r['spec']} "
                f"warps={r['num_warps']}")
        problems += record_problems(r, name, SHARED_LIMIT[r["arch"]])
    assert not problems, "\n".join(problems)


def test_ttt_kernels_compile_without_spills(tmp_path):
    check(compile_records(tmp_path, "--ttt"), TTT_CASES[:2])


@pytest.mark.slow
def test_ttt_kernels_compile_without_spills_every_case(tmp_path):
    check(compile_records(tmp_path, "--ttt-full"), TTT_CASES)


def test_dispatched_configurations_are_the_compiled_ones(monkeypatch):
    """What the dispatcher sends to the TTT kernels is what the compile covers: half inputs,
    head sizes <= 128 (compiled at 64 and 128: the tiles change at 64) that are multiples of
    16 (checked by the ops, tests/ops/test_ttt_triton.py), mini-batches <= 64 (one tile);
    float32 goes to PyTorch; the ops with kernels are the dispatcher's."""
    from types import SimpleNamespace

    import torch

    from fastweights.ops import backend
    from fastweights.ops.ttt import triton as kernels

    assert set(kernels.OPS) <= set(backend.kernel_ops("triton"))
    assert backend.TRITON_MAX_DK == kernels.MAX_D and kernels.MAX_MINI_BATCH == 64
    assert kernels.HEAD_MULTIPLE == 16
    monkeypatch.setattr(backend, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    for op in kernels.OPS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for D in (16, 64, 128):
                cuda = SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 8, 1, D),
                                       device="cuda:0")
                chosen = backend.choose_backend(op, cuda, None, "dual", 16)
                dispatched = dtype != torch.float32
                assert chosen == ("triton" if dispatched else "torch"), (op, dtype, D, chosen)
                for arch in ARCHS:
                    cfg = kernels.tile_config(arch, dtype, op, D)
                    assert (cfg is not None) == dispatched
            assert kernels.supports(op, dtype) == (dtype != torch.float32)
        cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 8, 1, 144),
                               device="cuda:0")
        assert backend.choose_backend(op, cuda, None, "dual", 16) == "torch"


def test_dispatched_decode_configurations_are_the_compiled_ones(monkeypatch):
    """The one-token steps' kernels (ops/ttt/triton_decode.py, registered under the ops' own
    names): the dispatcher takes them for one-token calls with half inputs (compiled above at
    head sizes 64 and 128); float32 goes to PyTorch."""
    from types import SimpleNamespace

    import torch

    from fastweights.ops import backend
    from fastweights.ops.ttt import triton_decode

    assert set(triton_decode.OPS) <= set(backend.kernel_ops("triton"))
    assert triton_decode.MAX_D == backend.TRITON_MAX_DK
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    assert triton_decode.OPS == ("ttt_linear", "ttt_mlp")
    for op in triton_decode.OPS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for D in (16, 64, 128):
                cuda = SimpleNamespace(is_cuda=True, dtype=dtype, shape=(4, 1, 8, D),
                                       device="cuda:0")
                chosen = backend.choose_backend(op, cuda, None, "dual", 16)
                dispatched = dtype != torch.float32
                assert chosen == ("triton" if dispatched else "torch"), (op, dtype, D, chosen)
                for arch in ARCHS:
                    cfg = triton_decode.tile_config(arch, dtype, op, D)
                    assert (cfg is not None) == dispatched

