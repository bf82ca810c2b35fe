"""In-process A/B of AFT's prefix sums (ops/aft/chunk.py, _prefix) before and after the change:
AFT-conv, AFT-simple and AFT-local forward (no grad) with each _prefix in turn, alternating,
20 rounds; CPU time (time.process_time) of one call, median and min. The op code is the
worktree's; BASE_CHUNK is the chunk.py of the revision before the change:

    git show b0fb4c8:src/fastweights/ops/aft/chunk.py > /tmp/base_chunk.py
    BASE_CHUNK=/tmp/base_chunk.py PYTHONPATH=src python benchmarks/results/aft_cpu/ab_prefix.py 512
"""

import os
import torch, time, importlib, importlib.util, statistics, sys
torch.set_num_threads(1)
chunk = importlib.import_module("fastweights.ops.aft.chunk")
spec = importlib.util.spec_from_file_location("basechunk", os.environ["BASE_CHUNK"])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from fastweights.ops import aft_conv, aft, aft_local
new_prefix = chunk._prefix
g = torch.Generator().manual_seed(0)
T = int(sys.argv[1]); D, H, s = 512, 8, 64
qc, vc = (torch.randn(1, T, H, D // H, generator=g) for _ in range(2))
kc = torch.randn(1, T, H, generator=g); wc = 0.01 * torch.randn(H, s, generator=g)
q, k, v = (torch.randn(1, T, D, generator=g) for _ in range(3)); band = 0.01*torch.randn(T, s, generator=g)
cases = {"conv": lambda: aft_conv(qc, kc, vc, wc), "simple": lambda: aft(q, k, v), "local": lambda: aft_local(q, k, v, band, window=s)}
for name, f in cases.items():
    res = {"old": [], "new": []}
    with torch.no_grad():
        for r in range(20):
            order = (("old", old._prefix), ("new", new_prefix)) if r % 2 else (("new", new_prefix), ("old", old._prefix))
            for which, pf in order:
                chunk._prefix = pf
                t0 = time.process_time(); f(); res[which].append(time.process_time() - t0)
    print(T, name, " ".join("%s med %.2f min %.2f" % (w, statistics.median(res[w])*1e3, min(res[w])*1e3) for w in res), flush=True)
