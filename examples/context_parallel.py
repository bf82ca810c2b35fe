"""One sequence split across processes (context parallelism), checked against one process.

Run with torchrun, e.g. 4 processes on this machine (gloo, CPU):

    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29511 \\
        examples/context_parallel.py --mixer delta --seq-len 4096

Each rank holds a contiguous quarter of the sequence; only states (or, for softmax and AFT-full,
keys and values) cross processes. Rank 0 then reruns the whole sequence on its own and prints the
largest differences of the outputs and of the parameter gradients.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from fastweights import build_mixer
from fastweights.parallel import context_parallel_forward, strategy_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", default="delta")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-heads", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")  # torchrun provides rank, world size and address
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same parameters and the same sequence on every rank
    layer = build_mixer(args.mixer, args.d_model, args.n_heads).double()
    x = torch.randn(1, args.seq_len, args.d_model, dtype=torch.float64)
    bounds = [args.seq_len * r // world for r in range(world + 1)]
    shard = x[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_()

    y, _ = context_parallel_forward(layer, shard)
    y.square().sum().backward()
    for param in layer.parameters():  # each rank holds its shard's share of the gradient
        dist.all_reduce(param.grad)
    ys = [None] * world
    dist.all_gather_object(ys, y.detach())
    if rank == 0:
        grads = [param.grad.clone() for param in layer.parameters()]
        layer.zero_grad()
        y_one, _ = layer(x)
        y_one.square().sum().backward()
        dy = (torch.cat(ys, dim=1) - y_one).abs().max().item()
        dg = max((g - param.grad).abs().max().item() for g, param in zip(grads, layer.parameters()))
        print(f"{args.mixer} ({strategy_name(layer)}) on {world} processes, T={args.seq_len}: "
              f"max |y - y_one| = {dy:.2e}, max |grad - grad_one| = {dg:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
