"""benchmarks/ttt_sync_micro.py: the calibration micro-benchmarks compile for sm_90a without
register spills, and without a GPU the script refuses in one line after compiling (the run
itself needs a GPU; docs/gpu_ttt_kernels.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ttt_sync_micro.py"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 12.0 or newer)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_builds_spill_free_and_refuses_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == ["ttt_sync_micro: no CUDA GPU here: nothing to "
                                                "measure"]
    log = (tmp_path / "ptxas.log").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", log)
    assert len(kernels) == 7, log  # reduce_cta and bar_cta at 4 and 8 warps, 2 clusters, fence
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == 7 and all(s == ("0", "0") for s in spills), log


def test_refuses_without_nvcc(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--nvcc",
                           str(tmp_path / "missing-nvcc")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"ttt_sync_micro: no nvcc (CUDA 12.0 or newer) {tmp_path / 'missing-nvcc'}: cannot build"]
