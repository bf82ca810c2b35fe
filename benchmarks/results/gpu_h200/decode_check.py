"""GPU check of the TTT decoding kernels: exactness against the PyTorch step on the device,
and per-token time (kernel vs PyTorch step, op level and TTT layer level), one process."""
import sys
import time

import torch

from fastweights.layers import TTTMLP, TTTLinear
from fastweights.ops.ttt import ttt_decode_step
from fastweights.ops.ttt.decode import DecodeCarry

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
small = dev == "cpu"
torch.manual_seed(0)
print(torch.cuda.get_device_name() if dev == "cuda" else "cpu", flush=True)


def inputs(kind, B, H, D, b, T, dtype):
    g = torch.Generator(device="cpu").manual_seed(B + H + D + b)
    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dev)
    q, k, v = (r(B, T, H, D).to(dtype) for _ in range(3))
    eta = ((0.1 + torch.rand(B, T, H, generator=g)) / D).to(dev).to(dtype)
    shapes = [(D, D), (D,)] if kind == "linear" else [(D, 4 * D), (4 * D,), (4 * D, D), (D,)]
    state = tuple(r(1, H, *s, scale=0.02) for s in shapes)
    opts = {"ln_weight": 1 + 0.1 * r(H, D), "ln_bias": 0.1 * r(H, D), "residual": True,
            "mini_batch_size": b, "token_scale": (1.0 / torch.arange(1, b + 1)).to(dev)}
    return (q, k, v, eta), state, opts


def run(kind, xs, state, opts, backend, steps):
    outs = []
    with torch.no_grad():
        for t in range(steps):
            o, state = ttt_decode_step(kind, *(x[:, t:t + 1] for x in xs), state=state,
                                       backend=backend, **opts)
            outs.append(o)
    return torch.cat(outs, 1), state


def err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1)).item()


# 1. exactness: bf16 inputs, kernel vs PyTorch step over 2 b + 3 steps
worst = 0.0
for kind in ("linear", "mlp"):
    for D, b in ((64, 16), (128, 16), (128, 64), (128, 5)):
        if small:
            D, b = 16, min(b, 5)
        T = 2 * b + 3
        xs, state, opts = inputs(kind, 2 if small else 4, 2 if small else 8, D, b, T,
                                 torch.bfloat16)
        o1, c1 = run(kind, xs, state, opts, "triton", T)
        o2, c2 = run(kind, xs, state, opts, "torch", T)
        eo = err(o1, o2)
        ec = max(err(x, y) for x, y in zip((*c1.start, *c1.rows), (*c2.start, *c2.rows))
                 if x is not None)
        worst = max(worst, ec)
        print(f"exact {kind} D={D} b={b} T={T}: o {eo:.2e} (bf16 out) carry {ec:.2e}", flush=True)
print("worst carry error", worst, flush=True)


def timed(fn, n, reps=5):
    best = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(n)
        if dev == "cuda":
            torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / n)
    best.sort()
    return best[len(best) // 2]


# 2. op-level step time: B 4, H 8, D 128, b 16, 64 steps (4 commits), median of 5 runs
B, H, D, b = (2, 2, 16, 4) if small else (4, 8, 128, 16)
n = 8 if small else 64
for kind in ("linear", "mlp"):
    xs, state, opts = inputs(kind, B, H, D, b, n, torch.bfloat16)
    res = {}
    for backend in ("triton", "torch"):
        run(kind, xs, state, opts, backend, b + 1)  # warm up (compile)
        res[backend] = timed(lambda m: run(kind, xs, state, opts, backend, m), n)
    print(f"op step {kind} B{B} H{H} D{D} b{b}: kernel {res['triton'] * 1e3:.3f} ms, "
          f"PyTorch step {res['torch'] * 1e3:.3f} ms, x{res['torch'] / res['triton']:.2f}",
          flush=True)

# 3. layer-level decode per token: d_model 1024, 8 heads, B 4, bf16, after a prefill of 64
dm, heads = (32, 2) if small else (1024, 8)
x = torch.randn(B, 64 + n, dm, device=dev, dtype=torch.bfloat16)
for cls in (TTTLinear, TTTMLP):
    layers = {bk: cls(dm, heads, backend=bk).to(dev, torch.bfloat16) for bk in (None, "torch")}
    layers["torch"].load_state_dict(layers[None].state_dict())
    res, ys = {}, {}
    with torch.no_grad():
        for bk, m in layers.items():
            _, st0 = layers["torch"](x[:, :64])

            def go(m_steps, m=m, st0=st0):
                st = st0
                out = []
                for t in range(64, 64 + m_steps):
                    y, st = m(x[:, t:t + 1], st)
                    out.append(y)
                return torch.cat(out, 1)

            ys[bk] = go(n)
            res[bk] = timed(go, n)
    print(f"layer {cls.__name__} d{dm} H{heads} B{B} bf16 decode: auto (kernel) "
          f"{res[None] * 1e3:.3f} ms/token, torch {res['torch'] * 1e3:.3f} ms/token, "
          f"x{res['torch'] / res[None]:.2f}; outputs differ by {err(ys[None], ys['torch']):.2e}",
          flush=True)
