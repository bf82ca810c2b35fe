"""Same-process, interleaved A/B of op forwards: a baseline copy of the package against the
working tree, at 1 and 2 threads (the record in results.md).

Set up the baseline (the commit before this record's changes) as a package named fw_base:

    git archive 5ca7a86 src/fastweights | tar -x -C /tmp/base
    mv /tmp/base/src/fastweights /tmp/base/fw_base

then, from the repository root (PYTHONPATH=src or an editable install):

    python benchmarks/results/threads_epyc_avx2_ii/compare_base.py OP B,T,H,D [ROUNDS]

OP: ttt_linear, ttt_mlp, delta_rule, linear_attn, decay_linear_attn, gated_delta_rule.
Prints each version's median ms at 1 and 2 threads, the speed-up from the second thread
(median and min-max of per-round ratios), page faults per call, and new-over-base ratios.
"""

from __future__ import annotations

import resource
import statistics as st
import sys
import time

import torch

sys.path.insert(0, "/tmp/base")
import fw_base.ops as base

import fastweights.ops as new


def calls(op: str, B: int, T: int, H: int, D: int):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    kn = torch.nn.functional.normalize(k, dim=-1)
    beta, g = torch.sigmoid(torch.randn(B, T, H)), -torch.rand(B, T, H) * 0.1
    eta = torch.sigmoid(torch.randn(B, T, H)) / D
    lin = (0.02 * torch.randn(1, H, D, D), torch.zeros(1, H, D))
    mlp = (0.02 * torch.randn(1, H, D, 4 * D), torch.zeros(1, H, 4 * D),
           0.02 * torch.randn(1, H, 4 * D, D), torch.zeros(1, H, D))
    decay = torch.linspace(0.9, 0.999, H)
    args = {
        "ttt_linear": lambda m: m.ttt_linear(q, k, v, eta, initial_state=lin),
        "ttt_mlp": lambda m: m.ttt_mlp(q, k, v, eta, initial_state=mlp),
        "delta_rule": lambda m: m.delta_rule(q, kn, v, beta),
        "linear_attn": lambda m: m.linear_attn(q, k, v),
        "decay_linear_attn": lambda m: m.decay_linear_attn(q, k, v, decay),
        "gated_delta_rule": lambda m: m.gated_delta_rule(q, kn, v, beta, g),
    }[op]
    return {"base": lambda: args(base), "new": lambda: args(new)}


def main() -> None:
    op, shape = sys.argv[1], [int(a) for a in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    fs = calls(op, *shape)
    with torch.no_grad():
        diff = (fs["base"]()[0] - fs["new"]()[0]).abs().max().item()
        print(f"{op} B,T,H,D={shape} torch {torch.__version__}; largest |base - new| {diff:.3g}")
        res = {(n, th): [] for n in fs for th in (1, 2)}
        faults = {key: [] for key in res}
        for th in (1, 2):
            torch.set_num_threads(th)
            for f in fs.values():
                f()
        for _ in range(rounds):
            for th in (1, 2):
                torch.set_num_threads(th)
                for name, f in fs.items():
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t = time.perf_counter()
                    f()
                    res[(name, th)].append(time.perf_counter() - t)
                    faults[(name, th)].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    for name in fs:
        r1, r2 = res[(name, 1)], res[(name, 2)]
        rat = sorted(a / b for a, b in zip(r1, r2))
        print(f"  {name}: 1 thr {st.median(r1) * 1e3:.1f} ms, 2 thr {st.median(r2) * 1e3:.1f} ms, "
              f"speed-up {st.median(rat):.2f}x [{rat[0]:.2f}-{rat[-1]:.2f}], page faults per call "
              f"{int(st.median(faults[(name, 1)]))} / {int(st.median(faults[(name, 2)]))}")
    for th in (1, 2):
        rat = sorted(a / b for a, b in zip(res[("base", th)], res[("new", th)]))
        print(f"  base / new at {th} thread(s): {st.median(rat):.2f}x [{rat[0]:.2f}-{rat[-1]:.2f}]")


if __name__ == "__main__":
    main()
