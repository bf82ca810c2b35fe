"""Builds and runs benchmarks/ttt_sync_micro.cu: what one intra-CTA reduction round, one 2- and
4-CTA cluster exchange round and a fence after a load in flight cost on this GPU, in SM cycles
(docs/gpu_ttt_kernels.md, "What only a GPU can tell"; the figures that
benchmarks/ttt_resident_sass.py assumes).

    python benchmarks/ttt_sync_micro.py [--out DIR] [--nvcc PATH]

Compiles with nvcc (CUDA 12.0 or newer: thread-block clusters) for sm_90a, ptxas's register and
spill report kept in DIR/ptxas.log, then runs the binary and writes its JSON lines to
DIR/micro.jsonl. Where there is no GPU it still compiles, then refuses in one line (exit 2);
without nvcc it refuses before anything (exit 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "ttt_sync_micro.cu"
ARCH = "-gencode=arch=compute_90a,code=sm_90a"


def find_nvcc(given: str | None) -> str | None:
    """nvcc: ``given``, else on PATH, else under CUDA_HOME."""
    if given:
        return given if Path(given).exists() or shutil.which(given) else None
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home, "bin", "nvcc") if home else None
    return str(candidate) if candidate and candidate.exists() else None


def build(nvcc: str, out: Path) -> Path:
    """The binary in ``out`` (ptxas's -v report in out/ptxas.log); raises on a compile error."""
    out.mkdir(parents=True, exist_ok=True)
    binary = out / "ttt_sync_micro"
    done = subprocess.run([nvcc, "-O3", "-std=c++17", ARCH, "-Xptxas", "-v", str(SOURCE), "-o",
                           str(binary)], capture_output=True, text=True, check=False)
    (out / "ptxas.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{done.stderr[-3000:]}")
    return binary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/ttt-sync-micro"))
    p.add_argument("--nvcc", default=None, help="the nvcc to use (default: PATH, CUDA_HOME)")
    a = p.parse_args(argv)
    nvcc = find_nvcc(a.nvcc)
    if nvcc is None:
        where = a.nvcc or "on PATH or under CUDA_HOME"
        print(f"ttt_sync_micro: no nvcc (CUDA 12.0 or newer) {where}: cannot build",
              file=sys.stderr)
        return 2
    binary = build(nvcc, a.out)
    done = subprocess.run([str(binary)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
              f"ttt_sync_micro: exit {done.returncode}", file=sys.stderr)
        return 2
    (a.out / "micro.jsonl").write_text(done.stdout)
    print(done.stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
