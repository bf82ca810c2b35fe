"""Would a compiled inner step make TTT-MLP's mini-batch scan scale? One forward step of the
dual form (no LayerNorm, as in the op benchmark; biases folded in as in ops/ttt/chunk.py)
written plainly, run over 256 mini-batches of [8, 16, .] eagerly and under torch.compile
(inductor's CPU code: fused elementwise loops, extern GEMMs), 7 interleaved rounds at 1 and 2
threads. Output in compiled_step.txt. (The library's own scan, ops/ttt/mlp_scan.py, is a
hand-fused eager version of the same step: 173-183 ms / 124-131 ms at 1 / 2 threads in this
record.)

    python benchmarks/results/threads_epyc_avx2_ii/compiled_step.py
"""

from __future__ import annotations

import math
import statistics as st
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
N, BH, b, Dk, Dh, Dv = 256, 8, 16, 65, 256, 64
KQ = torch.randn(N, BH, 2 * b, Dk) * 0.3
tgt = torch.randn(N, BH, b, Dv)
eta = torch.rand(N, BH, b, 1) / 64
M1 = torch.randn(N, BH, b, b).tril() * 0.01
E = torch.rand(N, BH, b, b).tril() * 0.01
W1_0, W2_0 = torch.randn(BH, Dk, Dh) * 0.02, torch.randn(BH, Dh + 1, Dv) * 0.02
ones = torch.ones(BH, b, 1)
C = math.sqrt(2 / math.pi)


def step(kq, tg, m1, e, et, W1, W2):
    Z = kq @ W1
    Z1, Zq = Z[:, :b], Z[:, b:]
    X2 = torch.cat([F.gelu(Z1, approximate="tanh"), ones], -1)
    G2 = X2 @ W2 - tg
    A = G2 @ W2[:, :Dh].transpose(-1, -2)
    th = torch.tanh(C * (Z1 + 0.044715 * Z1**3))
    g1p = 0.5 * (1 + th) + 0.5 * Z1 * (1 - th * th) * C * (1 + 3 * 0.044715 * Z1 * Z1)
    G1 = A * g1p
    Zb1 = Zq - m1 @ G1
    Xb2 = torch.cat([F.gelu(Zb1, approximate="tanh"), ones], -1)
    o = Xb2 @ W2 - (e * (Xb2 @ X2.transpose(-1, -2))) @ G2
    W1n = W1 - (kq[:, :b] * et).transpose(-1, -2) @ G1
    W2n = W2 - (X2 * et).transpose(-1, -2) @ G2
    return o, W1n, W2n


def run(f):
    W1, W2, outs = W1_0, W2_0, []
    for n in range(N):
        o, W1, W2 = f(KQ[n], tgt[n], M1[n], E[n], eta[n], W1, W2)
        outs.append(o)
    return outs


def main() -> None:
    compiled = torch.compile(step, dynamic=False)
    t = time.perf_counter()
    run(compiled)
    print(f"torch {torch.__version__}; compile and first run {time.perf_counter() - t:.1f} s")
    eager_out, compiled_out = run(step), run(compiled)
    print("largest |eager - compiled|",
          max((x - y).abs().max().item() for x, y in zip(eager_out, compiled_out)))
    res: dict = {}
    for th in (1, 2):
        torch.set_num_threads(th)
        run(step)
        run(compiled)
    for _ in range(7):
        for th in (1, 2):
            torch.set_num_threads(th)
            for name, f in (("eager", step), ("compiled", compiled)):
                t = time.perf_counter()
                run(f)
                res.setdefault((name, th), []).append(time.perf_counter() - t)
    for (name, th), v in sorted(res.items()):
        print(f"{name} {th} thread(s): {st.median(v) * 1e3:.1f} ms")
    for name in ("eager", "compiled"):
        rat = sorted(a / c for a, c in zip(res[(name, 1)], res[(name, 2)]))
        print(f"{name} speed-up 1 -> 2 threads: {st.median(rat):.2f}x [{rat[0]:.2f}-{rat[-1]:.2f}]")


if __name__ == "__main__":
    main()
