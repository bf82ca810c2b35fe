"""Same-process check that the unified chunked (gated) delta rule gives what the two twins gave:
a baseline copy of the package (fw_base, the commit before the change) against the working tree,
on random inputs of odd sizes, float32 and float64: outputs, final states and every gradient.

    git archive 3145b96 src/fastweights | tar -x -C /tmp/base36ops
    mv /tmp/base36ops/src/fastweights /tmp/base36ops/fw_base
    PYTHONPATH=src python benchmarks/results/delta_unified/identity.py

Prints, per case, "identical" or the largest absolute difference of each tensor that differs
(and the largest magnitude of that tensor).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, "/tmp/base36ops")
import fw_base.ops as base
import fw_base.ops._pieces as base_pieces

import fastweights.ops as new
import fastweights.ops._pieces as new_pieces


def inputs(B, T, Hk, H, Dk, Dv, dtype, seed, gated):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, Dk, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, Dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    S0 = 0.3 * torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    xs = [q, k, v, beta]
    if gated:
        gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 2
        gate[..., T // 3, :] = float("-inf") if T > 3 else 0.0  # a hard reset
        xs.append(gate)
    w = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    wS = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in [*xs, S0]], w.to(dtype), wS.to(dtype)


def run(mod, op, xs, w, wS, **kw):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    fn = getattr(mod, op)
    o, S = fn(*xs[:-1], initial_state=xs[-1], output_final_state=True, **kw)
    ((o * w).sum() + (S * wS).sum()).backward()
    return [o.detach(), S.detach()] + [x.grad for x in xs]


def compare(label, a, b, names):
    diffs = {n: ((x - y).abs().max().item(), y.abs().max().item())
             for n, x, y in zip(names, a, b) if not torch.equal(x, y)}
    print(f"{label}: " + ("identical" if not diffs else ", ".join(
        f"{n} {d:.3g} (largest |{n}| {m:.3g})" for n, (d, m) in diffs.items())))
    return diffs


def main() -> None:
    torch.manual_seed(0)
    shapes = [(2, 37, 3, 3, 5, 7, 4), (1, 203, 2, 2, 33, 17, 64), (3, 100, 1, 1, 16, 16, 32),
              (1, 129, 2, 2, 64, 64, 64), (1, 77, 3, 3, 9, 4, 1)]
    grouped = [(2, 37, 1, 3, 5, 7, 4), (1, 130, 2, 4, 33, 17, 64)]
    for dtype in (torch.float64, torch.float32):
        for op, gated, cases in (("delta_rule", False, shapes), ("gated_delta_rule", True, shapes + grouped)):
            names = ["o", "S", "dq", "dk", "dv", "dbeta"] + (["dg"] if gated else []) + ["dS0"]
            for i, (B, T, Hk, H, Dk, Dv, C) in enumerate(cases):
                xs, w, wS = inputs(B, T, Hk, H, Dk, Dv, dtype, i, gated)
                a = run(base, op, xs, w, wS, chunk_size=C)
                b = run(new, op, xs, w, wS, chunk_size=C)
                compare(f"{op} {str(dtype)[6:]} B{B} T{T} Hk{Hk} H{H} Dk{Dk} Dv{Dv} C{C}", a, b, names)
            # in pieces (ops/_pieces.py), with a piece size that cuts the call in several
            xs, w, wS = inputs(1, 300, 2, 2, 16, 16, dtype, 9, gated)
            base_pieces.PIECE_BYTES = new_pieces.PIECE_BYTES = 64 * 2 * 2 * 16 * 8
            a = run(base, op, xs, w, wS, chunk_size=16)
            b = run(new, op, xs, w, wS, chunk_size=16)
            base_pieces.PIECE_BYTES = new_pieces.PIECE_BYTES = 8 * 2**20
            compare(f"{op} {str(dtype)[6:]} in pieces T300 C16", a, b, names)
    # the CPU bfloat16 product path of delta_rule (float32 inputs under CPU bfloat16 autocast)
    os.environ["FASTWEIGHTS_CPU_BF16"] = "on"
    names = ["o", "S", "dq", "dk", "dv", "dbeta", "dS0"]
    for i, (B, T, Hk, H, Dk, Dv, C) in enumerate(shapes):
        xs, w, wS = inputs(B, T, Hk, H, Dk, Dv, torch.float32, i, False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = run(base, "delta_rule", xs, w, wS, chunk_size=C)
            b = run(new, "delta_rule", xs, w, wS, chunk_size=C)
        compare(f"delta_rule bf16 products B{B} T{T} H{H} Dk{Dk} Dv{Dv} C{C}", a, b, names)


if __name__ == "__main__":
    main()
