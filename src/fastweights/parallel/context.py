"""``context_parallel_forward``: a mixer's forward on this process's shard of one sequence,
by the strategy the layer declares (``Mixer.context_parallel``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._checks import check_bool, check_layer_input
from ..layers.base import Mixer
from .comm import Channel, Shards, agree
from .mechanisms import Shard


def _replaying(mixer: Mixer) -> Any:
    """Call ``mixer`` with the same random draws each time (FAVOR+ redraws its projection on
    every training forward): every call starts from the generator state of the first, so a
    strategy that runs the layer several times sees the one draw a single-process run makes."""
    rng: list[torch.Tensor] = []

    def run(x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        if rng:
            torch.set_rng_state(rng[0])
        else:
            rng.append(torch.get_rng_state())
        return mixer(x, state)

    return run


def context_parallel_forward(
    mixer: Mixer, x: torch.Tensor, *, group: Any = None, state: Any = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """Run ``mixer`` on this rank's contiguous shard of one sequence, exactly as the whole
    sequence on one process would: ``y`` is this shard's slice of the single-process output and
    gradients (inputs and parameters) are this shard's share of the single-process ones (sum
    the parameter gradients over the group, as data parallelism does).

    x: [B, T_r, d_model], the tokens offsets[r] .. offsets[r] + T_r - 1 of the sequences, rank
    order = sequence order (``group``'s ranks; None = the default group). Shards may differ in
    length (each >= 1 token); B, d_model and the dtype must agree. ``state``: the state before
    the whole sequence (None for its start), the same on every rank. Every rank must call this,
    for the same mixer (same parameters), with its shard.

    Returns (y [B, T_r, d_model], final_state): the state after the whole sequence on every
    rank when ``output_final_state`` (sent from the last rank), else None.

    A bad input on any rank (or a shard layout the mixer cannot take: DiagAttention and
    Infini-attention need shards starting on block/segment borders) raises the same ValueError
    on every rank before any other communication. ``cu_seqlens`` (packed documents) is refused:
    the strategies carry one sequence's state across ranks, not per-document states.
    """
    plan = mixer.context_parallel()  # TypeError for a mixer without one, before any collective
    check_bool("output_final_state", output_final_state)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_forward needs torch.distributed to be initialised "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    error = None
    try:
        check_layer_input(x, mixer.d_model)
        if x.shape[1] < 1:
            raise ValueError(f"every shard needs at least one token, got x of shape {tuple(x.shape)}")
        if cu_seqlens is not None:
            raise ValueError(
                f"cu_seqlens is not supported by context parallelism ({type(mixer).__name__}); "
                "pack documents into one sequence per batch row and pass their states instead")
    except (TypeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    meta = (tuple(x.shape[::2]), str(x.dtype)) if isinstance(x, torch.Tensor) else None
    payloads = agree(group, error, (meta, x.shape[1] if error is None else 0))
    metas = {p[0] for p in payloads}
    if len(metas) != 1:
        raise ValueError(f"every rank's shard must share batch size, d_model and dtype; got "
                         f"{[p[0] for p in payloads]} (rank order)")
    shards = Shards(group, dist.get_rank(group), dist.get_world_size(group),
                    tuple(p[1] for p in payloads))
    problem = plan.check(shards, state) if plan.check is not None else None
    if problem is not None:
        raise ValueError(f"context parallel forward ({plan.name}) refused: {problem}")
    chan = Channel(shards)
    y, final = plan.forward(Shard(shards, chan, _replaying(mixer)), x, state)
    if output_final_state:
        final = chan.broadcast_state(final, shards.world - 1, x.device)
    return chan.finish(y), (final if output_final_state else None)
