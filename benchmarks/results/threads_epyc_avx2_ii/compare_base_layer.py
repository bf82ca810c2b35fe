"""Same-process, interleaved A/B of one mixer's forward+backward (T 4096, d_model 512, 8 heads,
batch 1): the baseline copy fw_base (set up as in compare_base.py) against the working tree,
with the softmax layer timed in the same rounds, at 1 and 2 threads.

    python benchmarks/results/threads_epyc_avx2_ii/compare_base_layer.py MIXER [ROUNDS [T]]
"""

from __future__ import annotations

import resource
import statistics as st
import sys
import time

import torch

sys.path.insert(0, "/tmp/base")
from fw_base.models.registry import build_mixer as build_base

from fastweights.models.registry import build_mixer


def main() -> None:
    name = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    torch.manual_seed(0)
    before = build_base(name, 512, 8)
    after = build_mixer(name, 512, 8)
    after.load_state_dict(before.state_dict())
    layers = {"before": before, "after": after, "softmax": build_mixer("softmax", 512, 8)}
    T = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    x = torch.randn(1, T, 512, requires_grad=True)

    def run(layer: torch.nn.Module) -> None:
        y = layer(x)
        (y[0] if isinstance(y, tuple) else y).sum().backward()

    with torch.no_grad():
        diff = (before(x)[0] - after(x)[0]).abs().max().item()
    print(f"{name} fwd+bwd T{x.shape[1]} d512 H8, torch {torch.__version__}; largest |before - after| "
          f"{diff:.3g}")
    res = {(n, th): [] for n in layers for th in (1, 2)}
    faults = {key: [] for key in res}
    for th in (1, 2):
        torch.set_num_threads(th)
        for layer in layers.values():
            run(layer)
    for _ in range(rounds):
        for th in (1, 2):
            torch.set_num_threads(th)
            for n, layer in layers.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t = time.perf_counter()
                run(layer)
                res[(n, th)].append(time.perf_counter() - t)
                faults[(n, th)].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    for th in (1, 2):
        for n in layers:
            rat = sorted(a / b for a, b in zip(res[(n, th)], res[("softmax", th)]))
            print(f"  {th} thr {n:8s} {st.median(res[(n, th)]) * 1e3:7.0f} ms, / softmax "
                  f"{st.median(rat):.2f}x [{rat[0]:.2f}-{rat[-1]:.2f}], page faults "
                  f"{int(st.median(faults[(n, th)]))}")


if __name__ == "__main__":
    main()
