"""TTT-MLP's thread-block-cluster forward (ops/ttt/cluster.py, cuda/ttt_mlp_cluster.cu) as far as
a machine without a GPU can drive it: the switch, the refusals, the one log line and the Triton
kernel where it cannot run, the launcher's argument layout against the C header, and the nvcc
build (0 spills on sm_90) and the library's C launcher. Its arithmetic is tested through the CPU emulation of the same
source (tests/ops/test_ttt_cluster_kernel.py) and the tile model
(tests/ops/test_ttt_cluster_model.py)."""

from __future__ import annotations

import logging
import re
import shutil
from collections import Counter

import pytest
import torch

from fastweights.ops import ttt_mlp
from fastweights.ops.ttt import cluster
from tests.ops.cuda_emu.build import struct_fields
from tests.ops.test_ttt_triton import (  # noqa: F401 (fixtures)
    assert_matches,
    case,
    exact,
    kernels,
    launches,
    leaves,
    on_gpu,
)


def test_the_switch(monkeypatch):
    monkeypatch.delenv(cluster.ENV, raising=False)
    assert cluster.fwd_variant() == "stream"
    monkeypatch.setenv(cluster.ENV, "cluster")
    assert cluster.fwd_variant() == "cluster"
    monkeypatch.setenv(cluster.ENV, "clusters")
    with pytest.raises(ValueError, match=f"{cluster.ENV} must be one of stream, cluster"):
        cluster.fwd_variant()


@pytest.mark.parametrize("args,why", [
    ((80, torch.bfloat16, 128, 128, 512, 16), "sm_90 or newer"),
    ((90, torch.float32, 128, 128, 512, 16), "bfloat16 or float16"),
    ((90, torch.bfloat16, 96, 96, 384, 16), "Dk = Dv in (64, 128)"),
    ((90, torch.bfloat16, 128, 64, 512, 16), "Dk = Dv in (64, 128)"),
    ((90, torch.float16, 64, 64, 128, 16), "Dh = 4 Dk"),
    ((90, torch.bfloat16, 64, 64, 256, 17), "at most 16 tokens"),
])
def test_refusals_name_the_reason(args, why):
    assert why in cluster.refusal(*args)


@pytest.mark.parametrize("args", [(90, torch.bfloat16, 128, 128, 512, 16),
                                  (100, torch.float16, 64, 64, 256, 5)])
def test_what_it_takes(args):
    assert cluster.refusal(*args) is None


def test_cpu_inputs_are_refused():
    assert "CUDA device" in cluster.why_not(torch.zeros(1, 4, 2, 64), 64, 256, 16)


def test_asked_for_where_it_cannot_run_the_triton_kernel_runs_and_one_line_says_why(
        launches, exact, monkeypatch, caplog):  # noqa: F811 (fixtures)
    """FASTWEIGHTS_TTT_MLP_FWD=cluster on inputs it cannot take: the Triton forward runs (the
    result equals the default's exactly) and one warning, once per reason, names the switch and
    the reason."""
    monkeypatch.setattr(cluster, "_logged", set())
    args, kw = case(T=9, b=4, Dk=4, Dv=4, kind="mlp", seed=3)
    a32, kw32 = leaves(args, kw, torch.float32)
    with torch.no_grad():
        want = ttt_mlp(*a32, output_final_state=True, backend="triton", **kw32)
        monkeypatch.setenv(cluster.ENV, "cluster")
        with caplog.at_level(logging.WARNING, logger=cluster.__name__):
            got = ttt_mlp(*a32, output_final_state=True, backend="triton", **kw32)
            again = ttt_mlp(*a32, output_final_state=True, backend="triton", **kw32)
    assert launches == Counter(qk=3, mlp_fwd=3), launches
    assert_matches((*got, []), (*want, []), 0.0, "cluster asked for, Triton ran")
    assert_matches((*again, []), (*want, []), 0.0, "again")
    lines = [r.getMessage() for r in caplog.records if r.name == cluster.__name__]
    assert len(lines) == 1, lines
    assert cluster.ENV in lines[0] and "CUDA device" in lines[0] and "Triton kernel runs" in lines[0]


def header_fields(struct: str) -> tuple[str, ...]:
    """The field names of a struct of cuda/ttt_mlp_cluster.h in order."""
    return struct_fields(cluster.SOURCE_DIR / "ttt_mlp_cluster.h", struct)


def test_launch_arguments_follow_the_header():
    """pack's order is FwTTTMLPClusterArgs' field order (``LaunchArgs`` lays it out for the
    launcher and the emulation entry)."""
    assert header_fields("FwTTTMLPClusterArgs") == cluster.PTR_FIELDS + cluster.INT_FIELDS
    x = torch.zeros(2, 3)
    n = len(cluster.INT_FIELDS)
    ptrs, ints = cluster.pack([x, None] + [x] * 18, list(range(n)))
    assert ptrs[0] == x.data_ptr() and ptrs[1] == 0 and ints == list(range(n))
    with pytest.raises(ValueError, match="pack: k must be contiguous"):
        cluster.pack([x, x.t()] + [x] * 18, list(range(n)))
    with pytest.raises(ValueError, match=f"pack takes 20 tensors and {n} sizes"):
        cluster.pack([x], [1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The library as ``cluster.build`` makes it, with ptxas' report (one nvcc run)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path_factory.mktemp("cluster_build")
    lib = cluster.build(out, report=True)
    return lib, lib.with_suffix(".ptxas.txt").read_text()


def test_the_kernel_builds_for_sm90a_without_spills(built):
    """Every instantiation the launchers dispatch (the forward and the backward's pass;
    bfloat16, float16 x D 64, 128) compiles for sm_90 with 0 bytes of spill stores and loads
    and no stack frame."""
    report = built[1]
    entries = re.findall(
        r"Compiling entry function '(\S*ttt_mlp_cluster_fwd\S*)' for 'sm_90'.*?"
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
        r"Used (\d+) registers", report, flags=re.S)
    kinds = {(("bfloat16" if "bfloat16" in name else "half"), "Li128" in name)
             for name, *_ in entries}
    assert kinds == {("bfloat16", True), ("bfloat16", False), ("half", True), ("half", False)}, report
    for name, stack, stores, loads, regs in entries:
        assert (int(stack), int(stores), int(loads)) == (0, 0, 0), (name, stack, stores, loads)
        assert int(regs) <= 255
    # the backward's sequential pass: bfloat16 at D 128 sits at 255 registers with nothing
    # to spare (benchmarks/results/ttt_mlp_cluster_compile/; docs/gpu_ttt_kernels.md)
    bwd = re.findall(
        r"Compiling entry function '(\S*ttt_mlp_cluster_bwd_b\S*)' for 'sm_90'.*?"
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
        report, flags=re.S)
    assert len(bwd) == 4, report
    for name, stack, stores, loads in bwd:
        assert (int(stack), int(stores), int(loads)) == (0, 0, 0), (name, stack, stores, loads)


def test_the_library_builds_and_its_launcher_names_cuda_errors(built):
    """``build`` compiles the shared library (reused when unchanged), ``launch`` calls its C
    entry through ctypes: here, without a GPU, the CUDA error comes back as a RuntimeError
    naming it, before any memory is touched."""
    import ctypes

    lib_path, _ = built
    assert cluster.build(lib_path.parent, report=True) == lib_path
    assert len(list(lib_path.parent.glob("*.so"))) == 1
    lib = ctypes.CDLL(str(lib_path))
    lib.fw_ttt_mlp_cluster_launch.restype = ctypes.c_int
    lib.fw_ttt_mlp_cluster_error.restype = ctypes.c_char_p
    ptrs, ints = [0] * len(cluster.PTR_FIELDS), [1] * len(cluster.INT_FIELDS)
    with pytest.raises(RuntimeError, match=r"launch failed: CUDA error [0-9]+, "):
        cluster.launch(lib, ptrs, ints, 1, 128, 0)
    with pytest.raises(RuntimeError, match="invalid argument"):  # a head size it has no kernel for
        cluster.launch(lib, ptrs, ints, 1, 96, 0)


def test_read_out_backward_arguments_follow_the_header():
    """``BwdALaunchArgs`` lays out FwTTTMLPClusterBwdAArgs' fields in order."""
    assert header_fields("FwTTTMLPClusterBwdAArgs") == (cluster.BWD_A_PTR_FIELDS
                                                        + cluster.BWD_A_INT_FIELDS)
    assert [n for n, _ in cluster.BwdALaunchArgs._fields_] == list(
        cluster.BWD_A_PTR_FIELDS + cluster.BWD_A_INT_FIELDS)


def test_the_read_out_backward_builds_without_spills(built):
    """``ttt_mlp_cluster_bwd_a``: every instantiation the launcher dispatches (bfloat16,
    float16 x D 64, 128) compiles for sm_90 with 0 bytes of spills and no stack frame
    (benchmarks/results/ttt_mlp_cluster_compile/)."""
    entries = re.findall(
        r"Compiling entry function '(\S*ttt_mlp_cluster_bwd_a\S*)' for 'sm_90'.*?"
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
        r"Used (\d+) registers", built[1], flags=re.S)
    kinds = {(("bfloat16" if "bfloat16" in name else "half"), "Li128" in name)
             for name, *_ in entries}
    assert kinds == {("bfloat16", True), ("bfloat16", False), ("half", True), ("half", False)}
    for name, stack, stores, loads, regs in entries:
        assert (int(stack), int(stores), int(loads)) == (0, 0, 0), (name, stack, stores, loads)
        assert int(regs) <= 255


def test_the_read_out_backward_launcher_names_cuda_errors(built):
    """``launch_bwd_a`` calls the library's C entry: without a GPU the CUDA error comes back
    as a RuntimeError naming it; a head size it has no kernel for is an invalid argument."""
    import ctypes

    lib = ctypes.CDLL(str(built[0]))
    lib.fw_ttt_mlp_cluster_bwd_a_launch.restype = ctypes.c_int
    lib.fw_ttt_mlp_cluster_error.restype = ctypes.c_char_p
    ptrs, ints = [0] * len(cluster.BWD_A_PTR_FIELDS), [1] * len(cluster.BWD_A_INT_FIELDS)
    with pytest.raises(RuntimeError, match=r"read-out backward's launch failed: CUDA error"):
        cluster.launch_bwd_a(lib, ptrs, ints, 1, 128, 0)
    with pytest.raises(RuntimeError, match="invalid argument"):
        cluster.launch_bwd_a(lib, ptrs, ints, 1, 96, 0)
