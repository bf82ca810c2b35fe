"""Accuracy of AFT-full's forms against the float64 oracle (docs/maths.md 4.4, the choice of the
default): the product form with its guard (mode "chunk", the default), the product form without
the guard (the paper's form as written), and the log-sum-exp form (every row through
``exact_rows``), each in float64 and with bfloat16 inputs (float32 compute), and the Triton
kernels under the interpreter (bfloat16 inputs; float32 products, where a GPU runs TF32).

    PYTHONPATH=src python benchmarks/results/aft_product_error/measure.py [--kernels]

Inputs: B 2, T 256, D 32, q, v ~ N(0, 1), k and w ~ N(0, s^2) for the spreads s below, plus
"rising": keys growing by 0.5 per token (channel maxima set by late keys) with w ~ N(0, 1).
Every figure is max |x - ref| / max |ref| over the output o and the gradients of k and w (of
sum(o * g), g ~ N(0, 1)), the reference the float64 oracle on the same (rounded) inputs; then
how many rows the guard redoes.
"""

from __future__ import annotations

import importlib
import os
import sys

if "--kernels" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from fastweights.ops.aft.naive import full_naive
from fastweights.ops.aft.product import exact_rows, full_product

F64 = torch.float64
B, T, D = 2, 256, 32


def inputs(spread: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, D, generator=g, dtype=F64) for _ in range(3))
    w = torch.randn(T, T, generator=g, dtype=F64)
    if spread == "rising":
        k = k + 0.5 * torch.arange(T, dtype=F64)[:, None]
    else:
        k, w = float(spread) * k, float(spread) * w
    return [q, k, v, w]


def oracle(q, k, v, w, causal):
    return torch.sigmoid(q) * full_naive(k, v.unsqueeze(-1), w, 0, causal).squeeze(-1)


def product(guarded: bool):
    def run(q, k, v, w, causal):
        cd = F64 if q.dtype == F64 else torch.float32
        R, lossy = full_product(k.to(cd), v.to(cd), w.to(cd), 0, causal, 64)
        if guarded and bool(lossy.any()):
            rows = lossy.nonzero().squeeze(1)
            R = R.index_copy(1, rows, exact_rows(k.to(cd), v.to(cd), w.to(cd), rows, 0, causal))
        return torch.sigmoid(q.to(cd)) * R
    return run


def log_sum_exp(q, k, v, w, causal):
    cd = F64 if q.dtype == F64 else torch.float32
    R = exact_rows(k.to(cd), v.to(cd), w.to(cd), torch.arange(T), 0, causal)
    return torch.sigmoid(q.to(cd)) * R


def kernels(q, k, v, w, causal):
    module = importlib.import_module("fastweights.ops.aft.triton")
    return module.aft_full_triton(q, k, v, w, 0, causal)[0]  # lossy rows 0, unguarded


def errors(form, xs, causal, dtype, g):
    leaves = [x.to(dtype).requires_grad_() for x in xs]
    o = form(*leaves, causal)
    (o.double() * g).sum().backward()
    ref_leaves = [x.detach().to(F64).requires_grad_() for x in leaves]
    ref = oracle(*ref_leaves, causal)
    (ref * g).sum().backward()
    out = []
    for a, b in ((o, ref), (leaves[1].grad, ref_leaves[1].grad), (leaves[3].grad, ref_leaves[3].grad)):
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        out.append("nan" if err != err else f"{err:.1e}")
    return "/".join(out)


def main() -> None:
    forms = {"product+guard": product(True), "product": product(False), "log-sum-exp": log_sum_exp}
    cases = [(F64, name) for name in forms] + [(torch.bfloat16, name) for name in forms]
    if "--kernels" in sys.argv:
        forms["kernels"] = kernels
        cases.append((torch.bfloat16, "kernels"))
    spreads = ["1", "3", "10", "30", "100", "rising"]
    print("| causal | dtype | form | " + " | ".join(f"s={s}" for s in spreads) + " |")
    print("|---|---|---|" + "---|" * len(spreads))
    for causal in (True, False):
        for dtype, name in cases:
            row = []
            for spread in spreads:
                xs = inputs(spread)
                g = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), dtype=F64)
                row.append(errors(forms[name], xs, causal, dtype, g))
            print(f"| {causal} | {str(dtype)[6:]} | {name} | " + " | ".join(row) + " |",
                  flush=True)
    print("\nRows the guard redoes (float32 compute), of", T)
    print("| causal | " + " | ".join(f"s={s}" for s in spreads) + " |")
    print("|---|" + "---|" * len(spreads))
    for causal in (True, False):
        counts = []
        for spread in spreads:
            q, k, v, w = (x.float() for x in inputs(spread))
            counts.append(str(int(full_product(k, v, w, 0, causal, 64)[1].sum())))
        print(f"| {causal} | " + " | ".join(counts) + " |")


if __name__ == "__main__":
    main()
