"""One process: min-of-3 wall times of the AFT ops' CPU forms (forward; forward+backward; a one-token
step with a state), B 1, d 512 (AFT-conv 8 heads of 64), window 64, float32, one thread, as
JSON. Run alternately with PYTHONPATH at the source before and after the change (run.sh).
"""
import json, sys, time
import torch
from fastweights.ops import aft, aft_conv, aft_local
torch.set_num_threads(1)
out = {}
for T in (512, 2048):
    g = torch.Generator().manual_seed(0)
    D, H, s = 512, 8, 64
    q, k, v = (torch.randn(1, T, D, generator=g) for _ in range(3))
    w = 0.01 * torch.randn(T, T + 1, generator=g)
    band = 0.01 * torch.randn(T, s, generator=g)
    qc, vc = (torch.randn(1, T, H, D // H, generator=g) for _ in range(2))
    kc = torch.randn(1, T, H, generator=g)
    wc = 0.01 * torch.randn(H, s, generator=g)
    calls = {
        "aft (full)": (lambda *x: aft(*x[:3], x[3]), (q, k, v, w)),
        "aft (simple)": (lambda *x: aft(*x), (q, k, v)),
        "aft_local": (lambda *x: aft_local(*x, window=s), (q, k, v, band)),
        "aft_conv": (lambda *x: aft_conv(*x), (qc, kc, vc, wc)),
    }
    for name, (f, xs) in calls.items():
        def fwd():
            with torch.no_grad():
                f(*xs)
        leaves = [x.clone().requires_grad_() for x in xs]
        def fwdbwd():
            f(*leaves)[0].sum().backward()
        with torch.no_grad():
            if name == "aft (full)":
                st = aft(q, k, v, w, output_final_state=True)[1]
                step = lambda: aft(q[:, :1], k[:, :1], v[:, :1], w[-1:], initial_state=st)
            elif name == "aft (simple)":
                st = aft(q, k, v, output_final_state=True)[1]
                step = lambda: aft(q[:, :1], k[:, :1], v[:, :1], initial_state=st)
            elif name == "aft_local":
                st = aft_local(q, k, v, band, window=s, output_final_state=True)[1]
                step = lambda: aft_local(q[:, :1], k[:, :1], v[:, :1], band[:1], window=s, initial_state=st)
            else:
                st = aft_conv(qc, kc, vc, wc, output_final_state=True)[1]
                step = lambda: aft_conv(qc[:, :1], kc[:, :1], vc[:, :1], wc, initial_state=st)
        def decode():
            with torch.no_grad():
                for _ in range(10):
                    step()
        for pas, fn, n in (("fwd", fwd, 1), ("fwdbwd", fwdbwd, 1), ("step", decode, 10)):
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) / n)
            out[f"{name}|{pas}|{T}"] = min(ts)
print(json.dumps(out))
