"""GPU baseline/final: correctness of fastweights Triton kernels on CUDA vs the torch chunk path,
and timings (bf16, B1 H8 D64) of linear_attn / delta_rule: triton, torch chunk, fla, SDPA flash."""
import json, os, sys, time, traceback
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from fastweights.ops.delta_rule import chunk as dch, triton as dk
from fastweights.ops.linear_attn import chunk as lch, triton as lk
from fastweights.ops import linear_attn, delta_rule

dev = "cuda"
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(),
      "SMs", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
try:
    import fla; from fla.ops.linear_attn import chunk_linear_attn
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla
    print("fla", fla.__version__)
except Exception as e:
    print("fla import failed", e); fla = None
res = {"device": torch.cuda.get_device_name(), "correct": [], "time": []}
MODE = sys.argv[1] if len(sys.argv) > 1 else "all"

def rnd(B, T, H, D, dtype, g):
    q = torch.randn(B, T, H, D, device=dev, generator=g).to(dtype) * D ** -0.5
    k = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=dev, generator=g).to(dtype)
    beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
    return q, k, v, beta

# ---- correctness on CUDA: triton vs torch chunk float32 ----
if MODE in ("all", "correct"):
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for (B, T, H, Dk, Dv, C) in ((2, 333, 3, 64, 64, 64), (1, 1000, 2, 128, 128, 64), (1, 77, 2, 37, 70, 32)):
            q, k, v, beta = rnd(B, T, H, Dk, dtype, g); v = torch.randn(B, T, H, Dv, device=dev, generator=g).to(dtype)
            S0 = torch.randn(B, H, Dk, Dv, device=dev, generator=g); z0 = torch.rand(B, H, Dk, device=dev, generator=g)
            for op in ("linear", "linear_norm", "delta"):
                row = dict(op=op, dtype=str(dtype), shape=(B, T, H, Dk, Dv, C))
                try:
                    f32 = lambda x: x.float()
                    if op.startswith("linear"):
                        nz = op == "linear_norm"
                        qq, kk = (q.abs(), k.abs()) if nz else (q, k)
                        o, S, z = lk.linear_attn_triton(qq, kk, v, S0, z0, nz, 1e-6, C)
                        ro, rS, rz = lch.linear_attn_chunk(f32(qq), f32(kk), f32(v), S0, z0, nz, 1e-6, C)
                    else:
                        o, S = dk.delta_rule_triton(q, k, v, beta, S0, C)
                        ro, rS = dch.delta_rule_chunk(f32(q), f32(k), f32(v), f32(beta), S0, C)
                    torch.cuda.synchronize()
                    row["S_max"] = rS.abs().max().item()
                    row["o_err"] = ((o.float() - ro).abs().max() / ro.abs().max()).item()
                    row["S_err"] = ((S - rS).abs().max() / rS.abs().max()).item()
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(row, flush=True); res["correct"].append(row)

# ---- gradients on CUDA: triton vs torch chunk float32 ----
if MODE in ("all", "correct"):
    g = torch.Generator(device=dev).manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for (B, T, H, Dk, Dv, C) in ((2, 333, 3, 64, 64, 64), (1, 200, 2, 37, 70, 32)):
            q, k, v, beta = rnd(B, T, H, Dk, dtype, g); v = torch.randn(B, T, H, Dv, device=dev, generator=g).to(dtype)
            S0 = torch.randn(B, H, Dk, Dv, device=dev, generator=g); z0 = torch.rand(B, H, Dk, device=dev, generator=g)
            wo = torch.randn(B, T, H, Dv, device=dev, generator=g); wS = torch.randn(B, H, Dk, Dv, device=dev, generator=g)
            for op in ("linear", "linear_norm", "delta"):
                row = dict(op=op + "_grad", dtype=str(dtype), shape=(B, T, H, Dk, Dv, C))
                try:
                    nz = op == "linear_norm"
                    base = [x.abs() if nz and i < 2 else x for i, x in enumerate((q, k, v, beta, S0, z0))]
                    a = [x.detach().clone().requires_grad_() for x in base]
                    r = [x.detach().float().clone().requires_grad_() for x in base]
                    if op == "delta":
                        o, S = dk.delta_rule_triton(a[0], a[1], a[2], a[3], a[4], C)
                        ro, rS = dch.delta_rule_chunk(r[0], r[1], r[2], r[3], r[4], C)
                        idx = (0, 1, 2, 3, 4)
                    else:
                        o, S, z = lk.linear_attn_triton(a[0], a[1], a[2], a[4], a[5], nz, 1e-6, C)
                        ro, rS, rz = lch.linear_attn_chunk(r[0], r[1], r[2], r[4], r[5], nz, 1e-6, C)
                        idx = (0, 1, 2, 4, 5) if nz else (0, 1, 2, 4)
                    ((o.float() * wo).sum() + (S * wS).sum()).backward()
                    ((ro * wo).sum() + (rS * wS).sum()).backward()
                    row["grad_rel_err"] = [round(((a[i].grad.float() - r[i].grad).abs().max() / r[i].grad.abs().max()).item(), 6) for i in idx]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(row, flush=True); res["correct"].append(row)

# ---- timings ----
def bench(fn, backward):
    if backward:
        def step():
            outs = fn()
            o = outs[0] if isinstance(outs, tuple) else outs
            o.backward(gout[: o.numel()].view_as(o) if False else torch.ones_like(o))
        return do_bench(step, warmup=10, rep=50)
    return do_bench(fn, warmup=10, rep=50)

if MODE in ("all", "time"):
    B, H, D = 1, 8, 64
    dtype = torch.bfloat16
    Ts = [int(t) for t in os.environ.get("TS", "4096,16384,65536").split(",")]
    for T in Ts:
        g = torch.Generator(device=dev).manual_seed(1)
        q, k, v, beta = rnd(B, T, H, D, dtype, g)
        for x in (q, k, v, beta): x.requires_grad_(True)
        qh, kh, vh = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
        cands = {
            "softmax_sdpa_flash": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
            "linear_triton": lambda: linear_attn(q, k, v),
            "delta_triton": lambda: delta_rule(q, k, v, beta),
        }
        if os.environ.get("TORCHPATH", "1") == "1":
            def lin_torch(): 
                os.environ["FASTWEIGHTS_TRITON"] = "0"
                try: return linear_attn(q, k, v)
                finally: os.environ["FASTWEIGHTS_TRITON"] = "1"
            def del_torch():
                os.environ["FASTWEIGHTS_TRITON"] = "0"
                try: return delta_rule(q, k, v, beta)
                finally: os.environ["FASTWEIGHTS_TRITON"] = "1"
            cands["linear_torch"] = lin_torch; cands["delta_torch"] = del_torch
        if fla is not None:
            cands["linear_fla"] = lambda: chunk_linear_attn(q, k, v, scale=1.0, normalize=False)
            cands["delta_fla"] = lambda: chunk_delta_rule(q, k, v, beta, scale=1.0)
        for name, fn in cands.items():
            for bw in (False, True):
                row = dict(T=T, name=name, backward=bw)
                try:
                    if bw:
                        ms = bench(fn, True)
                    else:
                        with torch.no_grad(): ms = bench(fn, False)
                    row["ms"] = round(ms, 4)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(row, flush=True); res["time"].append(row)
out = os.environ.get("OUT", ".")
json.dump(res, open(os.path.join(out, f"gpu_{os.environ.get('TAG','run')}.json"), "w"), indent=1)
