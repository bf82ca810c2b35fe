"""Sum rule vs delta rule on random associations, with no training: the overwrite property of
docs/maths.md 1.7.

A memory of key dimension d reads a stream of L = 2S (key, value) writes whose keys are drawn with
replacement from S unit keys; each key is then queried and should return the value written with
it most recently. The sum rule returns the sum of everything written under overlapping keys; the
delta rule (beta = 1) overwrites, so it is exact while the keys are orthonormal (S <= d).

    python examples/recall_gap.py [--d 64] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from fastweights.ops import delta_rule, linear_attn


def recall_error(S: int, d: int, rule: str, gen: torch.Generator) -> float:
    if S <= d:  # orthonormal keys
        keys = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0][:S]
    else:
        keys = torch.nn.functional.normalize(torch.randn(S, d, generator=gen, dtype=torch.float64), dim=-1)
    values = torch.randn(S * 2, d, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, S, (2 * S,), generator=gen)
    k = keys[idx][None, :, None]  # [1, 2S, 1, d]
    v = values[None, :, None]
    if rule == "sum":
        _, (mem, _) = linear_attn(k, k, v, output_final_state=True)
    else:
        beta = torch.ones(1, 2 * S, 1, dtype=torch.float64)
        _, mem = delta_rule(k, k, v, beta, output_final_state=True)
    seen = sorted(set(idx.tolist()))
    last = {int(i): t for t, i in enumerate(idx.tolist())}
    read = keys[seen] @ mem[0, 0]
    target = values[[last[i] for i in seen]]
    return ((read - target) ** 2).sum(-1).mean().item() / d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=64, help="key dimension")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    print(f"mean squared recall error per value dim, d = {args.d}, L = 2S writes")
    print(f"{'S keys':>8} {'sum rule':>10} {'delta rule':>11}")
    for S in (8, 16, 32, 64, 128, 256):
        e_sum, e_delta = (recall_error(S, args.d, r, gen) for r in ("sum", "delta"))
        print(f"{S:>8} {e_sum:>10.4f} {e_delta:>11.4f}")


if __name__ == "__main__":
    main()
