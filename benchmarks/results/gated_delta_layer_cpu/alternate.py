"""Alternating rounds of two checkouts (BASE_SRC, NEW_SRC: their src folders; BASE, NEW, BASE,
...) of one op's or the gated-delta layer's forward and forward+backward on the CPU, one thread,
one process per round; per round the min of three calls. Prints both lists and the median of
the per-round ratios (new / base), which a shared machine's drift affects least.

    BASE_SRC=... NEW_SRC=... python alternate.py {delta_rule,gated_delta_rule,layer} ROUNDS
"""

import os
import statistics
import subprocess
import sys

CODE = r'''
import time, torch
torch.manual_seed(0)
op = "%s"
B, T, H, D = 1, 2048, 8, 64
q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).requires_grad_()
        for _ in range(2))
v = torch.randn(B, T, H, D, requires_grad=True)
beta = torch.rand(B, T, H, requires_grad=True)
g = (-torch.rand(B, T, H) * 0.1).requires_grad_()
if op == "delta_rule":
    from fastweights.ops import delta_rule as f
    call = lambda: f(q, k, v, beta, output_final_state=True, chunk_size=32)
elif op == "gated_delta_rule":
    from fastweights.ops import gated_delta_rule as f
    call = lambda: f(q, k, v, beta, g, output_final_state=True, chunk_size=32)
else:  # the layer: d_model 512, 8 heads (Dk 64, Dv 128), chunk size of the CPU
    from fastweights.layers.gated_delta import GatedDeltaNet
    layer = GatedDeltaNet(512, 8, chunk_size=None)
    x = torch.randn(1, T, 512, requires_grad=True)
    call = lambda: layer(x)
def step(bwd):
    o, S = call()
    if bwd:
        (o.sum() + (S.sum() if isinstance(S, torch.Tensor) else 0)).backward()
for bwd in (False, True):
    step(bwd)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); step(bwd); ts.append(time.perf_counter() - t0)
    print(min(ts))
'''


def main() -> None:
    op, rounds = sys.argv[1], int(sys.argv[2])
    res: dict[str, list[list[float]]] = {"base": [], "new": []}
    for _ in range(rounds):
        for name, src in (("base", os.environ["BASE_SRC"]), ("new", os.environ["NEW_SRC"])):
            out = subprocess.run([sys.executable, "-c", CODE % op], capture_output=True,
                                 text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"})
            res[name].append([float(x) for x in out.stdout.split()])
    for i, p in enumerate(("fwd", "fwdbwd")):
        b = [x[i] for x in res["base"]]
        n = [x[i] for x in res["new"]]
        ratio = statistics.median(y / x for x, y in zip(b, n))
        print(op, p, "base s", [round(x, 3) for x in b], "new s", [round(x, 3) for x in n],
              "median ratio", round(ratio, 3))


if __name__ == "__main__":
    main()
