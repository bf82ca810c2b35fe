"""TTT-Linear's four-warp forward at head size 64 (ops/ttt/linear_cuda.py, cuda/ttt_linear_warp.cu;
docs/gpu_ttt_kernels.md, "Four warps per head"): its CUDA source run on the CPU through the
emulator (tests/ops/cuda_emu, docs/cuda_emulation.md) with float32 operands (exact products,
emulation only) against the float64 token loop (outputs, final state, a partial last
mini-batch's sums, the checkpoints), with bfloat16 operands within the issue's bounds and
next to the resident Triton forward (``_linear_fwd_res_kernel``, the same precision rule) under
the interpreter, the same bits under several schedules, the Triton backward after it, planted
bugs; and what a machine without a GPU can check of the host side: the switch, the refusals,
the one log line and the Triton kernel where it cannot run, the argument layout against the C
header, the nvcc build (0 spills on sm_90)."""

from __future__ import annotations

import ctypes
import logging
import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from fastweights.ops import ttt_linear
from fastweights.ops.ttt import cluster, linear_cuda
from tests.ops.cuda_emu.build import CUDA_SRC, build, cache_dir, struct_fields
from tests.ops.test_ttt_triton import (  # noqa: F401 (fixtures)
    F64,
    TOL32,
    assert_matches,
    case,
    exact,
    kernels,
    launches,
    on_gpu,
    run,
)

D = 64
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the emulation entry's dtypes
BF16_OUT = 1e-2  # the bound on outputs, max |x - ref| / max |ref|


def _load(lib):
    lib.fw_emu_ttt_linear_warp_fwd.restype = ctypes.c_char_p
    lib.fw_emu_ttt_linear_warp_fwd.argtypes = [ctypes.POINTER(linear_cuda.LaunchArgs),
                                               ctypes.c_int, ctypes.c_uint]
    lib.fw_emu_ttt_linear_warp_smem.restype = ctypes.c_ulong
    return lib


@pytest.fixture(scope="module")
def lib():
    return _load(build([CUDA_SRC / "ttt_linear_warp.cu"], "ttt_linear_warp"))


def launch(lib, ptrs: list[int], ints: list[int], dtype_code: int, order: int = 0) -> None:
    err = lib.fw_emu_ttt_linear_warp_fwd(ctypes.byref(linear_cuda.LaunchArgs(*ptrs, *ints)),
                                         dtype_code, order)
    if err is not None:
        raise RuntimeError(err.decode())


def make(B=1, T=37, H=2, b=16, ln=True, ln_bias=True, bias=True, seed=0):
    """float64 inputs (q, k, v, eta) and keywords of one call (``case``'s), head size 64."""
    args, kw = case(B=B, T=T, H=H, Dk=D, Dv=D, b=b, ln=ln, bias=bias, seed=seed)
    if ln and not ln_bias:
        del kw["ln_bias"]
    return args, kw


def scores(q: torch.Tensor, k: torch.Tensor, b: int, has_bias: bool) -> torch.Tensor:
    """``_qk_kernel``'s A^T [B*H, N, 16, 16]: element (j, i) k_j . q_i [+1] of each
    mini-batch's tokens, zeros past b and T (and +1 there with the bias, as the kernel)."""
    B, T, H, _ = q.shape
    N = math.ceil(T / b)
    pad = N * b - T
    qq, kk = (torch.nn.functional.pad(x.double(), (0, 0, 0, 0, 0, pad)) for x in (q, k))
    qq, kk = (x.view(B, N, b, H, D).permute(0, 3, 1, 2, 4) for x in (qq, kk))
    At = torch.zeros(B, H, N, 16, 16, dtype=F64)
    At[..., :b, :b] = kk @ qq.transpose(-1, -2)
    if has_bias:
        At += 1.0
    return At.reshape(B * H, N, 16, 16).float().contiguous()


def emulate(lib, args, kw, residual, dtype, order=0, seg=2):
    """The kernel's results for float64 ``args`` (q, k, v, eta) and keywords ``kw`` (``make``),
    q, k, v in ``dtype``, everything else float32, allocated as ``_LinearTriton.forward`` does:
    (o, W, bias, S, s, ckw, ckb)."""
    q, k, v, eta = args
    B, T, H, _ = q.shape
    b = kw["mini_batch_size"]
    BH, N, NF = B * H, math.ceil(T / b), T // b
    W0, b0 = kw["initial_state"]
    lnw, lnb = kw.get("ln_weight"), kw.get("ln_bias")
    f32 = [None if x is None else x.float().contiguous() for x in (eta, kw["token_scale"], lnw,
                                                                   lnb)]
    qkv = [x.to(dtype).contiguous() for x in (q, k, v)]
    A = scores(*qkv[:2], b, b0 is not None)
    w = W0.reshape(BH, D, D).float().clone()
    c0 = None if b0 is None else b0.reshape(BH, D).float().contiguous()
    o = torch.zeros(B, T, H, D, dtype=dtype)
    bias, S, s = torch.zeros(BH, D), torch.zeros(BH, D, D), torch.zeros(BH, D)
    NC = math.ceil(NF / seg)
    ckw, ckb = torch.full((BH, NC, D, D), math.nan), torch.full((BH, NC, D), math.nan)
    ptrs, ints = cluster.pack(
        (*qkv, *f32[:2], A, *f32[2:], c0, o, w, bias, S, s, ckw, ckb),
        (B, T, H, b, N, NF, seg, 1, b0 is not None, lnw is not None, lnb is not None, residual),
        (linear_cuda.PTR_FIELDS, linear_cuda.INT_FIELDS))
    launch(lib, ptrs, ints, CODES[dtype], order)
    return o, w, bias, S, s, ckw, ckb


def oracle(args, kw, residual):
    """The float64 token loop: (o, final state) as ``ttt_linear(mode="naive")`` returns them
    (a ``TTTState`` inside a mini-batch, the weights at a boundary)."""
    return ttt_linear(*args, residual=residual, output_final_state=True, mode="naive", **kw)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])


def check_against_loop(got, args, kw, residual, tol, seg):
    """``emulate``'s results against the float64 loop: outputs, the state (the weights after
    the last full mini-batch; inside a mini-batch also its sums) and every checkpoint (the
    loop's final weights over the tokens before it) within ``tol`` of max |ref|."""
    o, w, bias, S, s, ckw, ckb = got
    want_o, state = oracle(args, kw, residual)
    assert rel(o, want_o) <= tol, ("o", rel(o, want_o))
    has_bias = kw["initial_state"][1] is not None
    T, b = args[0].shape[1], kw["mini_batch_size"]
    open_ = T % b != 0
    W_ref, b_ref = state.start if open_ else state
    assert rel(w, flat(W_ref)) <= tol, ("W", rel(w, flat(W_ref)))
    if has_bias:
        assert rel(bias, flat(b_ref)) <= tol, ("bias", rel(bias, flat(b_ref)))
    if open_:
        S_ref, s_ref = state.sums()
        assert rel(S, flat(S_ref)) <= tol, ("S", rel(S, flat(S_ref)))
        if has_bias:
            assert rel(s, flat(s_ref)) <= tol, ("s", rel(s, flat(s_ref)))
    else:
        assert not S.any() and not s.any()
    for c in range(ckw.shape[1]):
        n = c * seg * b
        if n == 0:
            want = [None if x is None else flat(x) for x in kw["initial_state"]]
        else:
            _, st = oracle([x[:, :n] for x in args], kw, residual)
            want = [None if x is None else flat(x) for x in st]
        assert rel(ckw[:, c], want[0]) <= tol, ("checkpoint", c)
        if has_bias:
            assert rel(ckb[:, c], want[1]) <= tol, ("checkpoint bias", c)


# (B, H, T, b, seg, flags): a partial last mini-batch (T % b != 0) but where T is a multiple
# of b (T 32, b 16; T 5, b 1); no full mini-batch where T < b (T 13, b 16)
F32_CASES = [
    (1, 2, 37, 16, 1, {}),
    (2, 1, 21, 5, 2, {"ln": False, "bias": False, "residual": False}),
    (1, 3, 32, 16, 1, {"ln_bias": False, "residual": False}),
    (1, 1, 13, 16, 1, {"bias": False}),
    (1, 1, 5, 1, 2, {}),  # one token a mini-batch
]


@pytest.mark.parametrize("B, H, T, b, seg, flags", F32_CASES,
                         ids=[f"B{c[0]}H{c[1]}T{c[2]}b{c[3]}seg{c[4]}-" + "-".join(
                             f"no_{k}" for k in c[5]) for c in F32_CASES])
def test_float32_operands_are_the_token_loop(lib, B, H, T, b, seg, flags):
    """Exact float32 products: outputs, the weights and bias after the last full mini-batch,
    a partial last mini-batch's gradient sums and every checkpoint against the float64 token
    loop, 1e-4 of max |ref|."""
    flags = dict(flags)
    residual = flags.pop("residual", True)
    args, kw = make(B=B, T=T, H=H, b=b, seed=T + b, **flags)
    got = emulate(lib, args, kw, residual, torch.float32, seg=seg)
    check_against_loop(got, args, kw, residual, TOL32, seg)


@pytest.mark.parametrize("dtype, out_tol", [(torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)])
def test_half_within_bounds_and_next_to_the_resident_triton_kernel(lib, on_gpu,  # noqa: F811
                                                                   monkeypatch, dtype, out_tol):
    """bfloat16 and float16 q, k, v, every flag on, two full mini-batches of 16 and a partial
    one: within the issue's bound of the float64 loop on the same rounded inputs (outputs,
    state and the partial mini-batch's sums 1e-2 of max |ref|), and next to
    ``_linear_fwd_res_kernel`` under the interpreter, whose products take the same operands
    (W, G, the scores and coef eta G rounded to the inputs' dtype): outputs within about two
    units of max |o| in that dtype (the interpreter's bfloat16 store truncates, this kernel's
    rounds to nearest), the weights and bias 100 times closer to it than to the float64 loop
    (bfloat16: over 2,000 times, float16 over 300)."""
    args, kw = make(T=40, seed=11)
    args = [x.to(dtype).double() for x in args]  # the loop sees the rounded inputs
    got = emulate(lib, args, kw, True, dtype)
    want_o, state = oracle(args, kw, True)
    assert rel(got[0], want_o) <= BF16_OUT, rel(got[0], want_o)
    for x, y in zip(got[1:5], (*state.start, *state.sums())):
        assert rel(x, flat(y)) <= BF16_OUT, rel(x, flat(y))
    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "resident")
    q, k, v, eta = args
    o, tri = ttt_linear(q.to(dtype), k.to(dtype), v.to(dtype), eta.float(), residual=True,
                        output_final_state=True, backend="triton",
                        **{n: x if n == "mini_batch_size" else
                           tuple(y.float() for y in x) if n == "initial_state" else x.float()
                           for n, x in kw.items()})
    assert rel(got[0], o) <= out_tol, rel(got[0], o)
    for x, y, ref in zip(got[1:3], tri.start, state.start):
        assert 100 * rel(x, flat(y)) <= rel(x, flat(ref)), (rel(x, flat(y)), rel(x, flat(ref)))


def test_the_same_bits_under_every_schedule(lib):
    """Four schedules of the emulated threads (forward, reverse, two seeded permutations) give
    bit-identical results: no result depends on an order the warp barriers leave open."""
    args, kw = make(B=1, T=21, H=2, b=5, seed=2)
    runs = [emulate(lib, args, kw, True, torch.bfloat16, order=o) for o in range(4)]
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x.nan_to_num(), y.nan_to_num())


def test_shared_memory_fits_sm90(lib):
    """The CTA's shared memory (the warps' staging areas, the operand copy of W, the double
    buffered input rows, the tiles) fits sm_90's 227 KiB three times over (the launcher
    opts in above the default 48 KiB)."""
    for code in (1, 2):
        assert 3 * lib.fw_emu_ttt_linear_warp_smem(code) <= 227 << 10


def test_the_triton_backward_runs_after_it(lib, launches, exact, monkeypatch):  # noqa: F811
    """``ttt_linear(backend="triton")`` with FASTWEIGHTS_TTT_FWD=cuda and the emulated kernel
    standing in for the built library (float32 operands): the forward is the warp kernel's
    (no Triton forward launches), the Triton backward reads its checkpoints and final state,
    and every input's gradient matches the float64 token loop within 1e-4."""
    calls = []

    def fake_launch(library, ptrs, ints, dtype_code, stream):
        assert library is lib
        calls.append(dtype_code)
        launch(lib, ptrs, ints, dtype_code)

    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "cuda")
    monkeypatch.setattr(linear_cuda, "why_not", lambda q, k, v, b: None)
    monkeypatch.setattr(linear_cuda, "_library", lambda: lib)
    monkeypatch.setattr(linear_cuda, "launch", fake_launch)
    monkeypatch.setattr(linear_cuda, "DTYPE_CODES", {torch.float32: 0})
    monkeypatch.setattr(linear_cuda.torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=0))
    args, kw = make(T=37, seed=9)
    kw["residual"] = True
    want = run(ttt_linear, args, kw, F64, mode="naive")
    got = run(ttt_linear, args, kw, torch.float32, backend="triton", checkpoint_group=1)
    assert calls == [0]
    assert launches["linear_fwd"] == launches["linear_fwd_regs"] == 0, launches
    assert launches["linear_bwd_b"] == 3, launches  # two segments of one and the partial one
    assert_matches(got, want, TOL32, "warp forward, Triton backward")


# ---------------------------------------------------------------------------- planted bugs

MUTANTS = {  # the text changed, and what it plants
    "causal": ("mv[e] = jj <= i ?", "mv[e] = jj < i ?"),  # the scores' diagonal dropped
    "eta": ("hv[e] = (G[c][e] * eta_r) * coef;", "hv[e] = G[c][e] * coef;"),
    "stat": ("const float ob = __shfl_xor_sync(0xffffffffu, sb, m);", "const float ob = sb;"),
    "barrier": ("load_inputs(in, a, bh, bb, h, n + 1, tid);\n    __syncthreads();",
                "load_inputs(in, a, bh, bb, h, n + 1, tid);"),  # the rows read before stored
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANTS))
def test_planted_bugs_fail(name):
    """The kernel with one planted bug (the causal mask, eta in the update, the other lanes'
    share of a LayerNorm statistic, the CTA barrier after the rows are stored) fails the
    float32 check against the loop, or gives different bits under another schedule."""
    src = (CUDA_SRC / "ttt_linear_warp.cu").read_text()
    old, new = MUTANTS[name]
    assert src.count(old) == 1, name
    out = cache_dir() / f"ttt_linear_warp_mutant_{name}"
    out.mkdir(exist_ok=True)
    for header in CUDA_SRC.glob("*.h"):
        shutil.copy(header, out / header.name)
    (out / "ttt_linear_warp.cu").write_text(src.replace(old, new))
    mutant = _load(build([out / "ttt_linear_warp.cu"], f"ttt_linear_warp_{name}"))
    args, kw = make(B=1, T=21, H=1, b=5, seed=2)
    try:
        got = [emulate(mutant, args, kw, True, torch.float32, order=o) for o in (0, 1)]
    except RuntimeError:
        return
    if not all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(*got)):
        return
    with pytest.raises(AssertionError):
        check_against_loop(got[0], args, kw, True, TOL32, 2)


# ---------------------------------------------------------------------------- host side


def test_the_switch_takes_cuda(monkeypatch):
    from fastweights.ops.ttt.triton_regs import fwd_variant

    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "cuda")
    assert fwd_variant(90, 64) == "cuda"
    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "cudaa")
    with pytest.raises(ValueError, match="FASTWEIGHTS_TTT_FWD must be one of"):
        fwd_variant(90, 64)


@pytest.mark.parametrize("args,why", [
    ((80, torch.bfloat16, 64, 64, 16), "sm_90 or newer"),
    ((90, torch.float32, 64, 64, 16), "bfloat16 or float16"),
    ((90, torch.bfloat16, 128, 128, 16), "Dk = Dv = 64"),
    ((90, torch.float16, 64, 32, 16), "Dk = Dv = 64"),
    ((90, torch.bfloat16, 64, 64, 17), "at most 16 tokens"),
])
def test_refusals_name_the_reason(args, why):
    assert why in linear_cuda.refusal(*args)


@pytest.mark.parametrize("args", [(90, torch.bfloat16, 64, 64, 16), (100, torch.float16, 64, 64, 5)])
def test_what_it_takes(args):
    assert linear_cuda.refusal(*args) is None


def test_cpu_inputs_are_refused():
    x = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    assert "CUDA device" in linear_cuda.why_not(x, x, x, 16)


def test_asked_for_where_it_cannot_run_the_triton_kernel_runs_and_one_line_says_why(
        launches, exact, monkeypatch, caplog):  # noqa: F811 (fixtures)
    """FASTWEIGHTS_TTT_FWD=cuda on inputs it cannot take (here: on the CPU): the automatic
    choice's Triton forward runs (the result equals the default's exactly) and one warning,
    once per reason, names the switch and the reason."""
    monkeypatch.setattr(linear_cuda, "_logged", set())
    args, kw = case(T=9, b=4, Dk=4, Dv=4, seed=3)
    a32 = [x.float() for x in args]
    kw32 = {n: x if n == "mini_batch_size" else
            tuple(y.float() for y in x) if n == "initial_state" else x.float()
            for n, x in kw.items()}
    with torch.no_grad():
        want = ttt_linear(*a32, output_final_state=True, backend="triton", **kw32)
        monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "cuda")
        with caplog.at_level(logging.WARNING, logger=linear_cuda.__name__):
            got = ttt_linear(*a32, output_final_state=True, backend="triton", **kw32)
            again = ttt_linear(*a32, output_final_state=True, backend="triton", **kw32)
    assert launches["linear_fwd_regs"] == 3, launches
    for x, y in zip((got[0], *got[1].start), (want[0], *want[1].start)):
        assert torch.equal(x, y)
    assert torch.equal(again[0], want[0])
    lines = [r.getMessage() for r in caplog.records if r.name == linear_cuda.__name__]
    assert len(lines) == 1, lines
    assert "FASTWEIGHTS_TTT_FWD=cuda" in lines[0] and "CUDA device" in lines[0]
    assert "Triton kernel runs" in lines[0]


def test_the_bench_rows_say_when_the_triton_kernel_ran_instead(monkeypatch):
    """``fastweights bench gpu``'s exactness rows of this kernel (``ttt_linear (cuda)``) on a
    GPU where it cannot run (head size 128, or its build failed) are the Triton kernel's: their
    status says so, with the reason; where it can run, they stay as measured."""
    from fastweights.bench import gpu, gpu_paper

    run = gpu.Run(gpu.GPU_SIZES, torch.device("cuda"), 0.0, ("triton",), 1.0)
    monkeypatch.setattr(gpu_paper.torch, "empty", lambda *a, **k: None)
    tools = gpu_paper.Tools(lambda r, op, backend, dtype, docs: r.row(status="ok"), None, None,
                            {"ttt_linear": SimpleNamespace(chunk=16)})
    for why in ("it takes Dk = Dv = 64, got Dk 128, Dv 128", None):
        monkeypatch.setattr(linear_cuda, "problem", lambda q, b, why=why: why)
        gpu_paper.opt_in_exact(run, tools, "ttt_linear (cuda)", torch.bfloat16, 128)
    assert [r["name"] for r in run.rows] == ["ttt_linear (cuda)"] * 2
    assert run.rows[0]["status"] == ("skipped: the Triton kernel ran, it takes Dk = Dv = 64, "
                                     "got Dk 128, Dv 128")
    assert run.rows[1]["status"] == "ok"


def test_launch_arguments_follow_the_header():
    """The field order of ``LaunchArgs`` is FwTTTLinearWarpArgs'."""
    fields = struct_fields(CUDA_SRC / "ttt_linear_warp.h", "FwTTTLinearWarpArgs")
    assert fields == linear_cuda.PTR_FIELDS + linear_cuda.INT_FIELDS


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The library as ``cluster.build`` makes it from this source, with ptxas' report."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path_factory.mktemp("linear_warp_build")
    lib = cluster.build(out, report=True, source=linear_cuda.SOURCE)
    return lib, lib.with_suffix(".ptxas.txt").read_text()


def test_the_kernel_builds_for_sm90_without_spills(built):
    """Both instantiations the launcher dispatches (bfloat16, float16) compile for sm_90 with
    no stack frame and 0 bytes of spill stores and loads; the library's C launcher returns
    the CUDA error (here, without a GPU) as a RuntimeError naming it."""
    lib_path, report = built
    entries = re.findall(
        r"Compiling entry function '(\S*ttt_linear_warp_fwd\S*)' for 'sm_90'.*?"
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
        r"Used (\d+) registers", report, flags=re.S)
    assert {("bfloat16" in name, "half" in name) for name, *_ in entries} == {
        (True, False), (False, True)}, report
    for name, stack, stores, loads, regs in entries:
        assert (int(stack), int(stores), int(loads)) == (0, 0, 0), (name, stack, stores, loads)
        assert int(regs) <= 255
    lib = ctypes.CDLL(str(lib_path))
    lib.fw_ttt_linear_warp_launch.restype = ctypes.c_int
    lib.fw_ttt_linear_warp_error.restype = ctypes.c_char_p
    ptrs, ints = [0] * len(linear_cuda.PTR_FIELDS), [1] * len(linear_cuda.INT_FIELDS)
    with pytest.raises(RuntimeError, match=r"launch failed: CUDA error [0-9]+, "):
        linear_cuda.launch(lib, ptrs, ints, 1, 0)
