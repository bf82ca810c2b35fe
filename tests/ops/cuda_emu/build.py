"""Build CUDA C++ sources against the CPU emulator (fw_emu.h) into a shared library, and compile
them with nvcc for the ptxas report: docs/cuda_emulation.md.

Builds are cached by a hash of the sources, the headers of both include directories, the
compiler and its flags, so a test session compiles each library once; the cache lives in
``$FW_EMU_CACHE`` or the system's temporary directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CUDA_SRC = ROOT / "src" / "fastweights" / "ops" / "ttt" / "cuda"
EMU = Path(__file__).resolve().parent
INCLUDES = (CUDA_SRC, EMU)
GXX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-DFW_EMULATE", "-Wno-unknown-pragmas")


def cache_dir() -> Path:
    """Where built libraries and ptxas reports are kept between runs."""
    path = Path(os.environ.get("FW_EMU_CACHE") or Path(tempfile.gettempdir()) / "fastweights_cuda_emu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _key(tool: str, sources: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    h.update(tool.encode())
    for flag in flags:
        h.update(b"\0" + flag.encode())
    headers = sorted(p for d in INCLUDES for p in d.glob("*.h"))
    for path in [*map(Path, sources), *headers]:
        h.update(b"\0" + str(path).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


def _define_flags(defines: dict | None) -> list[str]:
    flags = []
    for name, value in (defines or {}).items():
        if not str(name).isidentifier():
            raise ValueError(f"defines: {name!r} is not a C identifier")
        flags.append(f"-D{name}" if value is None else f"-D{name}={value}")
    return flags


def build(sources: list[Path], name: str, defines: dict | None = None) -> ctypes.CDLL:
    """The shared library of ``sources`` compiled with g++ and -DFW_EMULATE (.cu files as C++),
    with src/fastweights/ops/ttt/cuda and tests/ops/cuda_emu on the include path and
    ``defines`` ({NAME: value or None}) as -D flags. Skips the test when g++ is missing; raises
    RuntimeError with the compiler's messages when the build fails."""
    gxx = shutil.which(os.environ.get("CXX", "g++"))
    if gxx is None:
        pytest.skip("g++ is not installed: the CUDA emulation tests need a C++17 compiler")
    if not name.isidentifier():
        raise ValueError(f"name: expected a file-name-safe identifier, got {name!r}")
    sources = [Path(s) for s in sources]
    for s in sources:
        if not s.is_file():
            raise FileNotFoundError(f"sources: {s} does not exist")
    flags = [*GXX_FLAGS, *(f"-I{d}" for d in INCLUDES), *_define_flags(defines)]
    out = cache_dir() / f"{name}-{_key(gxx, sources, flags)}.so"
    if not out.exists():
        tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
        cmd = [gxx, *flags, "-x", "c++", *map(str, sources), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed ({' '.join(cmd)}):\n{proc.stderr}")
        os.replace(tmp, out)
    return ctypes.CDLL(str(out))


def ptxas_report(source: Path, arch: str = "sm_90a", defines: dict | None = None) -> str:
    """ptxas's -v report of ``source`` compiled by nvcc for ``arch`` (the real branch of
    fw_cuda.h). Skips the test when nvcc is missing; raises RuntimeError when it fails."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    flags = [f"-arch={arch}", "-cubin", "-Xptxas", "-v", *(f"-I{d}" for d in INCLUDES),
             *_define_flags(defines)]
    out = cache_dir() / f"{Path(source).stem}-{_key(nvcc, [Path(source)], flags)}.ptxas.txt"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [nvcc, *flags, str(source), "-o", str(Path(tmp) / "out.cubin")]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}")
        tmp_out = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp_out.write_text(proc.stdout + proc.stderr)
        os.replace(tmp_out, out)
    return out.read_text()


BARRIER = re.compile(r"(?:__syncthreads|__syncwarp|\b\w+\.sync)\(\);")


def barrier_mutants(source: Path) -> list[tuple[int, Path]]:
    """For every line of ``source`` that calls a barrier as a statement (``__syncthreads();``,
    ``__syncwarp();``, ``cluster.sync();``), a copy of ``source`` with that call removed, beside
    copies of the headers of its directory: (line number, path). Run a kernel built from each
    under several schedules to see which barriers its tests would miss."""
    source = Path(source)
    lines = source.read_text().splitlines(keepends=True)
    out = cache_dir() / f"mutants-{source.stem}-{_key('mutants', [source], [])}"
    out.mkdir(exist_ok=True)
    for header in source.parent.glob("*.h"):
        shutil.copy(header, out / header.name)
    mutants = []
    for i, line in enumerate(lines):
        if BARRIER.search(line.split("//")[0]):
            path = out / f"{source.stem}_l{i + 1}{source.suffix}"
            path.write_text("".join([*lines[:i], BARRIER.sub(";", line, count=1), *lines[i + 1:]]))
            mutants.append((i + 1, path))
    return mutants


def struct_fields(header: Path, struct: str) -> tuple[str, ...]:
    """The field names of ``struct <struct> { ... };`` in ``header``, in order (declarations of
    pointers and ints, several names a line allowed): what a ctypes mirror must list."""
    text = Path(header).read_text()
    start = text.index(f"struct {struct} {{")
    body = text[start:text.index("};", start)]
    fields: list[str] = []
    for line in body.splitlines()[1:]:
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            fields += [name.strip().lstrip("*") for name in
                       re.sub(r"^(const\s+)?(void|float|int)\s*\*?", "", decl).split(",")]
    return tuple(fields)
