"""Where the time of a mixer layer goes on a GPU: torch.profiler over one call of the layer's
forward, forward+backward and decoding step (the same workloads as `fastweights bench gpu`'s
layers section: B4, d_model 1024, 8 heads, bfloat16, the automatic backend). Prints, per
(mixer, T, pass), the number of GPU kernel launches, the summed GPU kernel time, the wall time
of the call, and the top kernels by GPU time. Usage: profile_layers.py OUT.json T MIXER...
"""
import json
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fastweights.bench.targets import Setting, mixer_targets

out_path, T, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
B, d, H = (4, 1024, 8) if dev.type == "cuda" else (1, 64, 2)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
records = []


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


for name in names:
    work = mixer_targets([(name, name, {})])[0].build(T, Setting(B, d, H, torch.bfloat16, dev))
    calls = [("fwd", work.forward), ("fwdbwd", work.forward_backward)]
    if work.prefill is not None:
        state = work.prefill()
        calls.append(("decode", lambda: work.step(state)))
    for p, call in calls:
        call()
        call()
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        wall = time.perf_counter() - t0
        with profile(activities=acts) as prof:
            call()
            sync()
        kern = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        per = {}
        for e in kern:
            n, t = per.get(e.name, (0, 0.0))
            per[e.name] = (n + 1, t + e.device_time_total)
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:12]
        steps = work.decode_steps if p == "decode" else 1
        rec = {"mixer": name, "T": T, "pass": p, "wall_ms": 1e3 * wall, "steps": steps,
               "launches": len(kern), "gpu_ms": sum(e.device_time_total for e in kern) / 1e3,
               "top": [{"kernel": k[:120], "calls": n, "ms": t / 1e3} for k, (n, t) in top]}
        records.append(rec)
        print(f"== {name} T{T} {p}: wall {rec['wall_ms']:.2f} ms for {steps} call(s), "
              f"{rec['launches']} launches, GPU kernels {rec['gpu_ms']:.2f} ms", flush=True)
        for t in rec["top"]:
            print(f"   {t['ms']:9.3f} ms {t['calls']:6d}x  {t['kernel']}")
    del work
    if dev.type == "cuda":
        torch.cuda.empty_cache()
json.dump(records, open(out_path, "w"), indent=1)
