"""Same-process, interleaved A/B of the delta rule and the gated delta rule, forward and
forward+backward, baseline package copy (fw_base, set up as in identity.py) against the working
tree, at 1 and 2 threads:

    PYTHONPATH=src python benchmarks/results/delta_unified/speed.py [B,T,H,D] [ROUNDS]

Every round runs each (op, pass, threads, version) once, in that interleaved order. Prints the
median ms, the min-max over rounds and the median of the per-round new/base ratios.
"""

from __future__ import annotations

import statistics as st
import sys
import time

import torch

sys.path.insert(0, "/tmp/base36ops")
import fw_base.ops as base

import fastweights.ops as new


def main() -> None:
    B, T, H, D = (int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1,4096,8,64").split(","))
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta, g = torch.sigmoid(torch.randn(B, T, H)), -torch.rand(B, T, H) * 0.1
    ins = {"delta_rule": (q, k, v, beta), "gated_delta_rule": (q, k, v, beta, g)}

    def call(mod, op, backward):
        if not backward:
            with torch.no_grad():
                return getattr(mod, op)(*ins[op])[0]
        xs = [x.detach().requires_grad_() for x in ins[op]]
        o, _ = getattr(mod, op)(*xs)
        o.backward(torch.ones_like(o))
        return [o.detach()] + [x.grad for x in xs]

    for op in ins:  # largest differences at this shape
        for backward in (False, True):
            a, b = call(base, op, backward), call(new, op, backward)
            a, b = (a, b) if backward else ([a], [b])
            d = max((x - y).abs().max().item() for x, y in zip(a, b))
            print(f"{op} {'fwd+bwd' if backward else 'fwd'}: largest |base - new| {d:.3g}")
    keys = [(op, bw, th) for op in ins for bw in (False, True) for th in (1, 2)]
    res = {(key, ver): [] for key in keys for ver in ("base", "new")}
    for th in (1, 2):  # warm-up
        torch.set_num_threads(th)
        for op, bw, _ in keys:
            call(base, op, bw), call(new, op, bw)
    for r in range(rounds):
        for op, bw, th in keys:
            torch.set_num_threads(th)
            order = (("base", base), ("new", new)) if r % 2 == 0 else (("new", new), ("base", base))
            for name, mod in order:
                t = time.perf_counter()
                call(mod, op, bw)
                res[((op, bw, th), name)].append(time.perf_counter() - t)
    print(f"B,T,H,D = {B},{T},{H},{D} float32, torch {torch.__version__}, {rounds} rounds")
    print("| op | pass | threads | base ms (min-max) | new ms (min-max) | new/base median [min-max] |")
    print("|---|---|---|---|---|---|")
    for key in keys:
        a, b = res[(key, "base")], res[(key, "new")]
        rat = sorted(y / x for x, y in zip(a, b))
        op, bw, th = key
        print(f"| {op} | {'fwd+bwd' if bw else 'fwd'} | {th} | {st.median(a) * 1e3:.1f} "
              f"({min(a) * 1e3:.1f}-{max(a) * 1e3:.1f}) | {st.median(b) * 1e3:.1f} "
              f"({min(b) * 1e3:.1f}-{max(b) * 1e3:.1f}) | {st.median(rat):.3f} "
              f"[{rat[0]:.3f}-{rat[-1]:.3f}] |")


if __name__ == "__main__":
    main()
