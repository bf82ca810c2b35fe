"""The CPU emulator of CUDA (tests/ops/cuda_emu/fw_emu.h, docs/cuda_emulation.md) on the toy
kernels of tests/ops/cuda_emu/toy_kernels.cu: WMMA products against torch, a cluster sum through
distributed shared memory, warp shuffles, and the emulator's checks (a missing barrier changes
the result under some schedule, a barrier in divergent code raises "deadlock", unwritten shared
memory reads as NaN). nvcc compiles the same file for sm_90a without spills.
"""

from __future__ import annotations

import ctypes
import math
import re

import pytest
import torch

from tests.ops.cuda_emu.build import EMU, barrier_mutants, build, ptxas_report

TOY = EMU / "toy_kernels.cu"
ORDERS = (0, 1, 2, 3)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_f = ctypes.POINTER(ctypes.c_float)
_u16 = ctypes.POINTER(ctypes.c_uint16)
_i, _u = ctypes.c_int, ctypes.c_uint
SIGNATURES = {
    "emu_matmul": [_i, _i, _f, _f, _f, _i, _i, _i, _u],
    "emu_cluster_sum": [_i, _f, _f, _i, _i, _u],
    "emu_warp_shuffles": [_f, _f, _i, _i, _u],
    "emu_block_sum": [_i, _f, _f, _i, _u],
    "emu_divergent_barrier": [_f, _i, _u],
    "emu_read_unwritten": [_f, _i],
    "emu_misuse": [_f, _i],
    "emu_barriers": [_f, _i, _i, _u],
    "emu_schedule": [ctypes.POINTER(_i), ctypes.POINTER(_i), _i, _u],
}


@pytest.fixture(scope="module", params=["switch", "ucontext"])
def lib(request) -> ctypes.CDLL:
    """The toy kernels built against the emulator, with its own x86-64 fiber switch and with the
    portable ucontext one."""
    defines = {"FW_EMU_UCONTEXT": None} if request.param == "ucontext" else None
    lib = build([TOY], "toy_kernels", defines)
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_char_p
    lib.emu_convert.argtypes = [_f, _u16, _u16, _f, _f, _i]
    lib.emu_convert.restype = None
    return lib


def _p(t: torch.Tensor, kind=_f):
    assert t.is_contiguous()
    return ctypes.cast(t.data_ptr(), kind)


def _call(lib, name, *args) -> None:
    err = getattr(lib, name)(*args)
    if err is not None:
        raise RuntimeError(err.decode())


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _matmul(lib, dtype, good, A, B, order):
    M, K = A.shape
    N = B.shape[1]
    C = torch.empty(M, N)
    _call(lib, "emu_matmul", DTYPES[dtype], int(good), _p(A), _p(B), _p(C), M, N, K, order)
    return C


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_wmma_matmul(lib, dtype):
    M, N, K = 48, 80, 112
    A, B = _randn(M, K, seed=1), _randn(K, N, seed=2)
    C = _matmul(lib, dtype, True, A, B, 0)
    # operands rounded to dtype (as torch rounds), products exact, float32 between k-tiles
    ref = A.to(dtype).double() @ B.to(dtype).double()
    err = (C.double() - ref).abs().max().item()
    assert err <= 4e-6 * ref.abs().max().item(), err
    # a wrong operand rounding of one element moves its products by far more than that
    if dtype != torch.float32:
        assert (A.double() @ B.double() - ref).abs().max() > 1e-3


def test_wmma_matmul_schedules(lib):
    """The correct kernel gives the same bits under every schedule; without the __syncwarp
    between store_matrix_sync and the lanes' reads of the stored tile it does not."""
    A, B = _randn(32, 16, seed=3), _randn(16, 48, seed=4)
    good = [_matmul(lib, torch.bfloat16, True, A, B, o) for o in ORDERS]
    assert all(torch.equal(g, good[0]) for g in good)
    bad = [_matmul(lib, torch.bfloat16, False, A, B, o) for o in ORDERS]
    assert any(not torch.equal(b, good[0]) for b in bad)


def _cluster_sum(lib, bug, x, clusters, order):
    out = torch.empty_like(x)
    _call(lib, "emu_cluster_sum", bug, _p(x), _p(out), clusters, x.shape[1], order)
    return out


def test_cluster_sum(lib):
    clusters, L = 2, 300
    x = _randn(4 * clusters, L, seed=5)
    expect = x.view(clusters, 4, L).sum(1, keepdim=True).expand(clusters, 4, L).reshape(4 * clusters, L)
    outs = [_cluster_sum(lib, bug, x, clusters, order) for bug in (0, 3) for order in ORDERS]
    for out in outs:  # 3: the first barrier split into barrier_arrive / barrier_wait
        torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
        assert torch.equal(out, outs[0])


def test_cluster_sum_missing_syncs(lib):
    """Without the cluster.sync() before the peers' reads, some schedule reads a peer's unwritten
    shared memory (NaN); without the one before leaving, a CTA reads a peer that has left."""
    clusters, L = 1, 200
    x = _randn(4 * clusters, L, seed=5)
    assert any(_cluster_sum(lib, 1, x, clusters, order).isnan().any() for order in ORDERS)
    with pytest.raises(RuntimeError, match="already exited"):
        _cluster_sum(lib, 2, x, clusters, 0)
    # the split barrier's peers read before barrier_wait
    assert any(_cluster_sum(lib, 4, x, clusters, order).isnan().any() for order in ORDERS)


def test_warp_shuffles(lib):
    blocks, threads = 3, 96
    x = _randn(blocks * threads, seed=6)
    out = torch.empty(3, blocks * threads)
    _call(lib, "emu_warp_shuffles", _p(x), _p(out), blocks, threads, 2)
    warps = x.view(-1, 32)
    sums = out[0].view(-1, 32)
    assert torch.equal(sums, sums[:, :1].expand_as(sums))  # a butterfly gives every lane the same bits
    torch.testing.assert_close(sums[:, 0], warps.sum(1), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1].view(-1, 32), warps.flip(1))
    down = torch.cat([warps[:, 1:], warps[:, 31:]], 1)
    assert torch.equal(out[2].view(-1, 32), down)


def test_missing_syncthreads(lib):
    n = 128
    x = _randn(n, seed=7)
    good, bad = [], []
    for order in ORDERS:
        for ok, outs in ((1, good), (0, bad)):
            out = torch.zeros(1)
            _call(lib, "emu_block_sum", ok, _p(x), _p(out), n, order)
            outs.append(out.item())
    assert len(set(good)) == 1 and abs(good[0] - x.sum().item()) < 1e-4
    assert math.isnan(bad[0])  # thread 0 runs first: nobody else has written
    assert bad[1] == good[0]  # thread 0 runs last


def _schedule(lib, n, order):
    counter, out = torch.zeros(1, dtype=torch.int32), torch.empty(2, n, dtype=torch.int32)
    _call(lib, "emu_schedule", _p(counter, ctypes.POINTER(_i)), _p(out, ctypes.POINTER(_i)), n,
          order)
    return out


def test_schedules(lib):
    """Order 0 runs the threads forward, 1 backward, k >= 2 a permutation seeded by k and drawn
    anew for every round (here: before and after a __syncthreads)."""
    n = 64
    ar = torch.arange(n, dtype=torch.int32)
    assert torch.equal(_schedule(lib, n, 0), torch.stack([ar, ar]))
    assert torch.equal(_schedule(lib, n, 1), torch.stack([ar.flip(0), ar.flip(0)]))
    perms = [_schedule(lib, n, k) for k in (2, 3)]
    for p in perms:
        assert torch.equal(p.sort(1).values, torch.stack([ar, ar]))
        assert not torch.equal(p[0], ar) and not torch.equal(p[0], p[1])
    assert not torch.equal(perms[0], perms[1])
    assert torch.equal(_schedule(lib, n, 2), perms[0])


@pytest.mark.parametrize("which,message", [(0, "deadlock"), (1, "barrier divergence")])
def test_divergent_barrier_raises(lib, which, message):
    out = torch.zeros(128)
    with pytest.raises(RuntimeError, match=message):
        _call(lib, "emu_divergent_barrier", _p(out), which, 0)


@pytest.mark.parametrize("which,message", [
    (0, "load_matrix_sync.* called with different arguments by the lanes of a warp"),
    (1, "32-byte"),
    (2, "have not all reached it"),
    (3, "warp divergence"),
    (4, "mask other than 0xffffffff"),
    (5, "block 0 thread 0: .*not into this CTA's dynamic shared memory"),
    (6, "barrier_wait .* without a barrier_arrive"),
], ids=["lanes-disagree", "misaligned", "exited-lanes", "warp-divergence", "mask", "dsmem", "wait"])
def test_misuse_raises(lib, which, message):
    out = torch.zeros(64)
    with pytest.raises(RuntimeError, match=message):
        _call(lib, "emu_misuse", _p(out), which)


def test_unwritten_shared_memory_is_nan(lib):
    out = torch.zeros(64)
    _call(lib, "emu_read_unwritten", _p(out), 64)
    assert (out.view(torch.int32) == -1).all()  # 0xFF bytes: a NaN in every float format


def test_launch_errors(lib):
    out = torch.zeros(4 * 100)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _call(lib, "emu_barriers", _p(out), 1, 100, 0)
    x = torch.zeros(48 * 16)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        _call(lib, "emu_matmul", 1, 1, _p(x), _p(x), _p(x), 48, 16, 15, 0)


def test_barriers(lib):
    threads, rounds = 64, 5
    out = torch.zeros(4 * threads)
    _call(lib, "emu_barriers", _p(out), rounds, threads, 5)
    assert (out == rounds).all()


def test_conversions_match_torch(lib):
    g = torch.Generator().manual_seed(8)
    x = torch.cat([
        torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 20, (20000,), generator=g).float()),
        # every bfloat16 and float16 value, and the midpoints next to them (the ties)
        torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float(),
        torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16).float(),
        (torch.arange(0, 2 ** 15, dtype=torch.int32) << 13 | 0x1000).view(torch.float32),
        (torch.arange(0, 2 ** 15, dtype=torch.int32) << 16 | 0x8000).view(torch.float32),
        torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 2.0 ** -25, 2.0 ** -24, 3 * 2.0 ** -26,
                      float("inf"), -float("inf"), 3.4e38]),
    ]).contiguous()
    n = x.numel()
    bf, h = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    bf_back, h_back = torch.empty(n), torch.empty(n)
    lib.emu_convert(_p(x), _p(bf, _u16), _p(h, _u16), _p(bf_back), _p(h_back), n)
    for bits, back, dtype in ((bf, bf_back, torch.bfloat16), (h, h_back, torch.float16)):
        ref = x.to(dtype)
        finite = ~x.isnan()
        assert torch.equal(bits[finite], ref.view(torch.int16)[finite]), dtype
        assert torch.equal(back[finite], ref.float()[finite]), dtype
        assert back[~finite].isnan().all()


def test_nvcc_compiles_without_spills():
    report = ptxas_report(TOY)
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    props = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(entries) == 11 and len(props) == len(entries), report
    assert all(s == "0" and ld == "0" for s, ld in props), report


@pytest.mark.slow
def test_barrier_mutants_of_the_matmul():
    """Each barrier of the WMMA matmul removed in turn (build.barrier_mutants): the schedules
    find the missing __syncthreads after the shared-memory fill and the missing __syncwarp
    between the store and the lanes' reads, not the __syncwarp before the next tile's store,
    whose own warp barrier stands in for it here (docs/cuda_emulation.md, "What it cannot
    check")."""
    A, B = _randn(32, 16, seed=3), _randn(16, 48, seed=4)
    src = TOY.read_text().splitlines()
    lines = {n: src[n - 1] for n, _ in barrier_mutants(TOY)}
    fill = next(n for n, t in lines.items() if t.strip() == "__syncthreads();")
    read = next(n for n, t in lines.items() if "every lane reads the tile" in t)
    reuse = next(n for n, t in lines.items() if "before the next tile's store" in t)
    ref = None
    found = {}
    for n, path in barrier_mutants(TOY):
        if n not in (fill, read, reuse):
            continue
        lib = build([path], f"toy_l{n}")
        fn = lib.emu_matmul
        fn.argtypes, fn.restype = SIGNATURES["emu_matmul"], ctypes.c_char_p
        if ref is None:
            good = build([TOY], "toy_kernels")
            good.emu_matmul.argtypes, good.emu_matmul.restype = fn.argtypes, fn.restype
            ref = _matmul(good, torch.bfloat16, True, A, B, 0)
        found[n] = any(not torch.equal(_matmul(lib, torch.bfloat16, True, A, B, o), ref)
                       for o in ORDERS)
    assert found == {fill: True, read: True, reuse: False}
