"""Peak resident-memory growth of one ttt_mlp forward+backward (B1 H8 D64, float32, mini-batch
16, LayerNorm and residual on), one variant per process:

    python benchmarks/results/cpu_ttt_mlp_backward/peak_memory.py T {handwritten,autograd} [GROUP]

"autograd" runs the plain scan differentiated by autograd (the path before the hand-written
backward, still the one torch.compile traces); GROUP is checkpoint_group (0: none)."""

import gc
import resource
import sys

import torch

from fastweights.bench.ttt_mlp_backward import _autograd_scan
from fastweights.ops import ttt_mlp

T, variant = int(sys.argv[1]), sys.argv[2]
group = (int(sys.argv[3]) or None) if len(sys.argv) > 3 else None
torch.manual_seed(0)
H, D = 8, 64
q, k, v = ((0.3 * torch.randn(1, T, H, D)).requires_grad_() for _ in range(3))
eta = torch.full((1, T, H), 0.05 / D, requires_grad=True)
init = tuple(w.requires_grad_() for w in (0.02 * torch.randn(1, H, D, 4 * D), torch.zeros(1, H, 4 * D),
                                          0.02 * torch.randn(1, H, 4 * D, D), torch.zeros(1, H, D)))
lw, lb = torch.ones(H, D, requires_grad=True), torch.zeros(H, D, requires_grad=True)
ctx = _autograd_scan if variant == "autograd" else torch.enable_grad


def fwd_bwd(n: int) -> None:
    with ctx():
        o, _ = ttt_mlp(q[:, :n], k[:, :n], v[:, :n], eta[:, :n], initial_state=init, ln_weight=lw,
                       ln_bias=lb, residual=True, output_final_state=True, checkpoint_group=group)
        o.sum().backward()


fwd_bwd(64)  # libraries loaded, allocator warm
gc.collect()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fwd_bwd(T)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"T={T} {variant} checkpoint_group={group}: peak RSS growth {(peak - base) / 1024:.0f} MiB")
