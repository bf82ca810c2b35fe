"""In-process A/B of AFT-full's one-token step with a cache of L - 1 tokens: the chunked form
before the change (chunk.full_rows) against the product form (product.full_product and the
guard's flag read), alternating, 40 rounds; CPU time, median and min. BASE_CHUNK as in
ab_prefix.py.
"""

import os
import torch, time, importlib, importlib.util, statistics
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("basechunk", os.environ["BASE_CHUNK"])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from fastweights.ops.aft.product import full_product
g = torch.Generator().manual_seed(0)
for L in (513, 2049):
    D = 512
    k, v = (torch.randn(1, L, D, generator=g) for _ in range(2))
    w = 0.01 * torch.randn(1, L, generator=g)
    def f_old(): return old.full_rows(k, v.unsqueeze(-1), w, L - 1, True, 64)
    def f_new():
        R, lossy = full_product(k, v, w, L - 1, True, 64)
        bool(lossy.any())
        return R
    res = {"old": [], "new": []}
    with torch.no_grad():
        for r in range(40):
            for which, f in ((("old", f_old), ("new", f_new)) if r % 2 else (("new", f_new), ("old", f_old))):
                t0 = time.process_time(); f(); res[which].append(time.process_time() - t0)
    print(L, " ".join("%s med %.3f min %.3f" % (w_, statistics.median(res[w_])*1e3, min(res[w_])*1e3) for w_ in res))
