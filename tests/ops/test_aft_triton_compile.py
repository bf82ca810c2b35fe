"""Every Triton kernel launch of ops/aft/triton.py (AFT-full's and AFT-local's product forms)
compiles for real
GPUs without register spills, checked without one (tests/ops/triton_aot_aft.py, as
tests/ops/test_fwp_triton_compile.py does for the fast-weight kernels; the limits are that
file's).

The launches are recorded from ``_AFTTriton``'s forward and backward, AFT-full causal with a
cached past and bidirectional and causal AFT-local, and compiled for sm_80 and sm_90 by Triton's ahead-of-time compiler and
the ptxas of the triton wheel, with the specialisations the dispatcher's calls get (channel
counts that are multiples of 16; T and the key count either). The Triton version is the one of
the interpreter running the tests: run the file under each Triton the project supports (the
figures per version are in docs/kernels.md). By default bfloat16; ``-m slow`` adds float16.
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
from tests.ops.triton_aot import record_problems

HERE = Path(__file__).parent
KERNELS = {"prep", "bwd_prep"} | {f"{k}[{v}]" for k in ("fwd", "bwd_kv", "bwd_w")
                                   for v in ("causal", "bidir", "local")}


def compile_records(tmp_path: Path, dtypes: tuple[str, ...], script: str = "triton_aot_aft.py",
                    python: str = sys.executable) -> list[dict]:
    """The records of one run of ``script`` (tests/ops/) under ``python``, for ``dtypes`` on
    every target of ARCHS."""
    out = tmp_path / "records.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([python, str(HERE / script), str(out),
                           ",".join(dtypes), *(str(a) for a in ARCHS)], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"compile script failed:\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def check(records: list[dict], dtypes: tuple[str, ...]) -> None:
    from tests.ops.triton_aot_aft import SPECS

    problems = []
    for arch in ARCHS:
        for spec in SPECS:
            # a launch two dtypes share (the backward's float32 kernels) is compiled once
            got = {r["kernel"] for r in records if r["arch"] == arch and r["spec"] == spec}
            if got != KERNELS:
                problems.append(f"sm_{arch} {spec}: compiled {sorted(got)}")
    for dtype in dtypes:
        if not any(r["dtype"] == dtype for r in records):
            problems.append(f"nothing compiled for {dtype}")
    for r in records:
        name = f"{r['kernel']} {r['dtype']} sm_{r['arch']} {r['spec']} warps={r['num_warps']}"
        problems += record_problems(r, name, SHARED_LIMIT[r["arch"]])
    assert not problems, "\n".join(problems)


def test_aft_kernels_compile_without_spills(tmp_path):
    check(compile_records(tmp_path, ("bfloat16",)), ("bfloat16",))


@pytest.mark.slow
def test_aft_kernels_compile_without_spills_every_dtype(tmp_path):
    check(compile_records(tmp_path, ("bfloat16", "float16")), ("bfloat16", "float16"))


def test_dispatched_configurations_are_the_compiled_ones(monkeypatch):
    """What the dispatcher sends to the AFT kernels is what the compile covers: half inputs with
    D a multiple of 16 (float32 and other D go to PyTorch), and the op with kernels is the
    dispatcher's."""
    from types import SimpleNamespace

    import torch

    from fastweights.ops import backend
    from fastweights.ops.aft import triton as kernels
    from tests.ops.triton_aot_aft import DIVISIBLE

    assert set(kernels.OPS) == {"aft", "aft_local"} <= set(backend.kernel_ops("triton"))
    assert kernels.CHANNEL_MULTIPLE == 16 and DIVISIBLE["odd_T"] == ("D",)
    monkeypatch.setattr(backend, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    for op in kernels.OPS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cuda = SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, 8, 1024, 1),
                                   device="cuda:0")
            chosen = backend.choose_backend(op, cuda, None, "chunk", 64)
            assert chosen == ("torch" if dtype == torch.float32 else "triton"), (dtype, chosen)
            for arch in ARCHS:
                assert (kernels.tile_config(arch, dtype, op) is None) == (dtype == torch.float32)
