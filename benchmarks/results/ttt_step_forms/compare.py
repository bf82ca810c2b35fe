"""Why TTT keeps two one-token forms (issue #25): the public op's step in the weights form
(ops/ttt/step.py, what ``ttt_linear``/``ttt_mlp`` run for T = 1) against the same step through the
layers' rows form (ops/ttt/decode.py) converted back to the op state the contract fixes
(current weights, start weights, gradient sums, place). Same process, interleaved rounds.

    PYTHONPATH=src python benchmarks/results/ttt_step_forms/compare.py THREADS BATCH
"""
import statistics
import sys
import time

import torch

from fastweights.ops.ttt import decode
from fastweights.ops.ttt.common import Carry
from fastweights.ops.ttt.step import ttt_linear_step, ttt_mlp_step


def rows_form_op_step(kind, q, k, v, eta, carry, ln_weight, ln_bias, residual, tau, final):
    """The op's step through the rows form: a carry without rows in, gradient sums out."""
    b = tau.shape[-1]
    rows = decode._empty_rows(carry.start, len(carry.start) // 2, 0)
    steps = 0 if carry.grads is None else b - carry.pos
    start = decode.DecodeCarry(carry.start, carry.grads, rows, carry.pos, steps)
    step = decode._linear_step if kind == "linear" else decode._mlp_step
    o, after = step(q, k, v, eta, start, decode._group_norm(ln_weight, ln_bias), residual, tau)
    if not final:
        return o, None
    c = Carry(after.start, None, 0) if after.pos == 0 else Carry(after.start, after.sums(), after.pos)
    return o, c


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    B, H, D, b = int(sys.argv[2]) if len(sys.argv) > 2 else 1, 8, 64, 16
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    for kind in ("linear", "mlp"):
        Dh = 4 * D
        start = ((r(B, H, D, D) * .1, r(B, H, D)) if kind == "linear" else
                 (r(B, H, D, Dh) * .1, r(B, H, Dh), r(B, H, Dh, D) * .1, r(B, H, D)))
        tau, lw, lb = torch.ones(H, b), torch.ones(H, D), torch.zeros(H, D)

        def inputs(c):
            return dict(q=r(B, 1, H, D), k=r(B, 1, H, D), v=r(B, 1, H, D),
                        eta=torch.rand(B, 1, H, generator=g) * .1, carry=c, ln_weight=lw,
                        ln_bias=lb, residual=False, tau=tau)

        weights_step = ttt_linear_step if kind == "linear" else ttt_mlp_step

        def weights_form(c, final):
            o, (c2, cur) = weights_step(**inputs(c))
            return (c2.final_state(tau, cur) if final else None), c2

        def rows_form(c, final):
            o, c2 = rows_form_op_step(kind, **inputs(c), final=final)
            return (c2.final_state(tau) if final else None), c2

        for final in (True, False):
            times = {"weights": [], "rows": []}
            with torch.no_grad():
                for rnd in range(9):
                    order = [("weights", weights_form), ("rows", rows_form)]
                    for name, f in order if rnd % 2 == 0 else order[::-1]:
                        c = Carry(start, None, 0)
                        for _ in range(5):  # into the mini-batch: place 5, sums given
                            _, c = weights_form(c, True)
                        c0 = c
                        t0 = time.perf_counter()
                        for _ in range(160):
                            # final state asked: a decode loop through the op, carrying it on;
                            # else one step from the same mid-mini-batch state
                            _, c2 = f(c if final else c0, final)
                            if final:
                                c = c2
                        times[name].append((time.perf_counter() - t0) / 160 * 1e6)
            w, rw = statistics.median(times["weights"]), statistics.median(times["rows"])
            print(f"| {kind} | {B} | {final} | {torch.get_num_threads()} | {w:.0f} "
                  f"({min(times['weights']):.0f}-{max(times['weights']):.0f}) | {rw:.0f} "
                  f"({min(times['rows']):.0f}-{max(times['rows']):.0f}) | {rw / w:.2f}x |")


if __name__ == "__main__":
    main()
