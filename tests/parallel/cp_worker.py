"""Worker processes for the context-parallel tests: each runs every case on its shard and
records, per case, the largest difference from the single-process run (computed in the same
process, so nothing but results crosses processes)."""

from __future__ import annotations

import json
import socket
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fastweights import build_mixer, mixer_names
from fastweights.layers import Mixer
from fastweights.parallel import context_parallel_forward

D_MODEL, HEADS, PREFIX = 8, 2, 2
# (id, registered name, options, aligned): aligned mixers need shards on block/segment borders.
_LISTED: list[tuple[str, str, dict, bool]] = [
    ("softmax", "softmax", {}, False),
    ("linear", "linear", {}, False),
    ("dpfp", "dpfp", {}, False),
    ("favor", "favor", {}, False),
    ("delta", "delta", {}, False),
    ("delta-dpfp", "linear", {"feature_map": "dpfp", "nu": 1, "update": "delta", "normalize": "sum"}, False),
    # the attention-normalised delta rule is relayed (its z is not affine): both normalisers
    ("delta-attention", "delta", {"normalize": "attention"}, False),
    ("delta-sum-attention", "delta", {"normalize": "sum+attention"}, False),
    ("ttt-linear", "ttt-linear", {"mini_batch_size": 4}, False),
    ("ttt-mlp", "ttt-mlp", {"mini_batch_size": 4}, False),
    ("norm", "norm", {"chunk_size": 4}, False),
    ("norm-decay", "norm", {"decay": True, "chunk_size": 4}, False),
    ("diag", "diag", {"block_size": 4}, True),
    ("aft-full", "aft-full", {"max_len": 64, "d_bias": 4, "bias_std": 0.5, "chunk_size": 4}, False),
    ("aft-local", "aft-local", {"window": 3, "max_len": 64, "d_bias": 4, "bias_std": 0.5,
                                "chunk_size": 4}, False),
    ("aft-simple", "aft-simple", {}, False),
    ("aft-conv", "aft-conv", {"window": 3, "reparam": False, "chunk_size": 4}, False),
    ("infini", "infini", {"segment_len": 4}, True),
    ("infini-delta", "infini", {"segment_len": 4, "update": "delta"}, True),
]
# Every registered mixer is a case: one not listed above runs with its defaults, aligned when
# its strategy checks the shard layout.
MIXER_CASES = _LISTED + [
    (name, name, {}, build_mixer(name, D_MODEL, HEADS).context_parallel().check is not None)
    for name in mixer_names() if name not in {c[1] for c in _LISTED}]
# Shard lengths per world size: unequal, and (aligned) on multiples of 4 after the prefix.
LENGTHS = {2: ([7, 13], [6, 10]), 4: ([5, 3, 7, 5], [2, 4, 8, 6])}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def canonical(state: Any) -> list[torch.Tensor]:
    """The state's tensors, AFT's max-stabilised (a, n, m) as the sums e^a n, e^a m (the
    reference a is free: runs split differently may pick another)."""
    leaves = [t for t in tree_flatten(state)[0] if isinstance(t, torch.Tensor)]
    if type(state).__name__ in ("AFTSimpleState", "AFTLocalState", "AFTConvState"):
        a, n, m = leaves[:3]
        ea = torch.exp(a)
        leaves = [ea.reshape(*ea.shape, *[1] * (n.dim() - a.dim())) * n, ea * m, *leaves[3:]]
    return [t.double() for t in leaves]


def _ints(state: Any) -> list[int]:
    return [x for x in tree_flatten(state)[0] if isinstance(x, int)]


def run_case(mixer: Mixer, lengths: list[int], with_state: bool, rank: int) -> dict[str, float]:
    """Max abs differences (outputs, final state, input and parameter gradients) between this
    rank's context-parallel run and the single-process run, for one mixer and shard layout."""
    g = torch.Generator().manual_seed(1)
    T = sum(lengths)
    x = torch.randn(2, T, D_MODEL, generator=g, dtype=torch.float64)
    gy = torch.randn(2, T, D_MODEL, generator=g, dtype=torch.float64)
    state0 = None
    if with_state:
        pre = torch.randn(2, PREFIX, D_MODEL, generator=g, dtype=torch.float64)
        with torch.no_grad():
            state0 = mixer(pre, None)[1]

    def loss_of(y: torch.Tensor, state: Any, rows: slice, with_state_term: bool) -> torch.Tensor:
        loss = (y * gy[:, rows]).sum()
        if with_state_term:
            gs = torch.Generator().manual_seed(2)
            for t in canonical(state):
                loss = loss + (t * torch.randn(t.shape, generator=gs, dtype=t.dtype)).sum()
        return loss

    rng = torch.get_rng_state()
    xr = x.clone().requires_grad_()
    y_ref, s_ref = mixer(xr, state0)
    loss_of(y_ref, s_ref, slice(None), True).backward()
    p_ref = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad(set_to_none=True)

    torch.set_rng_state(rng)
    off = sum(lengths[:rank])
    rows = slice(off, off + lengths[rank])
    xl = x[:, rows].clone().requires_grad_()
    y, s = context_parallel_forward(mixer, xl, state=state0, output_final_state=True)
    loss_of(y, s, rows, rank == 0).backward()
    out = {"y": (y - y_ref[:, rows]).abs().max().item(),
           "x_grad": (xl.grad - xr.grad[:, rows]).abs().max().item()}
    out["state"] = max((a - b).abs().max().item() if a.numel() else 0.0
                       for a, b in zip(canonical(s), canonical(s_ref, ), strict=True))
    if _ints(s) != _ints(s_ref):
        out["state"] = float("inf")
    worst = 0.0
    for n, p in mixer.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        ref = p_ref.get(n, torch.zeros_like(p))
        worst = max(worst, (grad - ref).abs().max().item())
    out["param_grad"] = worst
    mixer.zero_grad(set_to_none=True)
    return out


def _expect_error(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _Unknown(Mixer):
    def forward(self, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        return x, state


def equality_worker(rank: int, world: int, port: int, path: str) -> None:
    """Every mixer case, then the refusals; results to ``path``.rank.json."""
    init(rank, world, port, timeout_s=120)
    results: dict[str, Any] = {}
    plain, aligned = LENGTHS[world]
    for case_id, name, options, is_aligned in MIXER_CASES:
        for with_state in (False, True):
            key = f"{case_id}{'-state' if with_state else ''}"
            torch.manual_seed(0)
            mixer = build_mixer(name, D_MODEL, HEADS, **options).double()
            lengths = aligned if is_aligned else plain
            if not with_state and is_aligned:
                lengths = [lengths[0] + PREFIX, *lengths[1:]]
            try:
                results[key] = run_case(mixer, lengths, with_state, rank)
            except (RuntimeError, TypeError, ValueError):  # recorded: the test names the case
                results[key] = {"error": traceback.format_exc()}
            with open(f"{path}.{rank}.json", "w") as f:
                json.dump(results, f)
    diag = build_mixer("diag", D_MODEL, HEADS, block_size=4).double()
    x = torch.randn(1, 3 + rank, D_MODEL, dtype=torch.float64)
    results["refuse-misaligned"] = _expect_error(lambda: context_parallel_forward(diag, x))
    lin = build_mixer("linear", D_MODEL, HEADS).double()
    bad = torch.randn(1, 4, D_MODEL + (rank == world - 1), dtype=torch.float64)
    results["refuse-bad-input"] = _expect_error(lambda: context_parallel_forward(lin, bad))
    results["refuse-unknown"] = _expect_error(
        lambda: context_parallel_forward(_Unknown(D_MODEL, HEADS), x))
    cu = torch.tensor([0, 1, x.shape[1]])
    results["refuse-cu-seqlens"] = _expect_error(
        lambda: context_parallel_forward(lin, x[:1], cu_seqlens=cu))
    with open(f"{path}.{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def failing_worker(rank: int, world: int, port: int, path: str) -> None:
    """Rank 1's layer raises in the middle of the forward (after the agreement step); every
    rank must come back with an exception (the others from the collective's timeout or the
    closed connection), none may hang."""
    init(rank, world, port, timeout_s=10)
    mixer = build_mixer("delta", D_MODEL, HEADS).double()
    if rank == 1:
        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("rank 1 fails on purpose")
        mixer.qkvb.forward = broken
    outcome = "no error"
    try:
        y, _ = context_parallel_forward(mixer, torch.randn(1, 4, D_MODEL, dtype=torch.float64))
        y.sum().backward()
    except RuntimeError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(f"{path}.{rank}.json", "w") as f:
        json.dump({"outcome": outcome}, f)
    dist.destroy_process_group()
