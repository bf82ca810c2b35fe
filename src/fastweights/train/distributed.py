"""The distributed set-up of training: the process group from torchrun's environment
(``dist_info``), the data-parallel and context-parallel coordinates of a rank and its
context-parallel group (``split_world``), gradients averaged over the world, one decision for
all ranks (finite losses, signals: ``Signals``), and the random states a checkpoint stores.

Context parallelism (``context_parallel`` N > 1, under torchrun): the world is N x the
data-parallel size D. Ranks d*N .. d*N + N - 1 form context-parallel group d: they train on the
same rows of the global batch (data-parallel replica d's slice), each on a contiguous shard of
seq_len / N tokens of every row, and every mixer runs on its shard through
``fastweights.parallel.context_parallel_forward`` on that group (installed with
``LanguageModel.set_mixer_runner``; embeddings, norms, feed-forwards and the head are per
token). Each rank's loss is the mean over its B/D x T/N tokens, all equal in number, and the
gradients are averaged over the whole world after the backward pass (``average_gradients``), as
DDP would (the parameters are replicated on every rank, so the context-parallel ranks' shares
must be summed as well as the replicas averaged): the result is the gradient of the global
batch's mean loss, one process's. Validation runs sharded the same way. Checkpoints and
resuming are unchanged (rank 0 writes); N is a launch setting like the world size, not
recorded in run.json, so a run may resume with another N.

FSDP (``fsdp``, under torchrun; ``device_mesh``, ``shard_model``): the world is one 2-D
``DeviceMesh`` (``dp_shard`` x ``cp``, rank = d*N + c as above). Every block and then the root
are ``fully_shard``-ed over the whole mesh (its two dimensions flattened, as torchtitan's
``dp_shard_cp``), so parameters, gradients and AdamW's moments are split over every rank;
FSDP's reduce-scatter averages the gradients over all of them, which is what
``average_gradients`` computes (it is not called). The context-parallel groups are the mesh's
``cp`` dimension. Optional mixed precision (``FSDP_MIXED``): bfloat16 parameters in compute,
float32 master weights, gradients reduced in float32. Like N, FSDP is a launch setting, not
recorded: a run may resume with or without it, on another world size.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .. import state_tree
from .._names import FSDP_MIXED  # --fsdp-mixed: the parameters' compute dtype (master: float32)
from ..parallel import context_parallel_forward


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM (``signum``) stopped training at ``step`` after the checkpoint
    ``checkpoint`` of that step was saved (None on a rank other than 0: under DDP it saves
    nothing, under FSDP its shard of the checkpoint rank 0 names)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint} saved" if checkpoint is not None else "checkpoint saved by rank 0"
        super().__init__(f"{name} at step {step}: {where}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class Signals:
    """While active, SIGINT and SIGTERM only record their number in ``signum`` (the training loop
    then saves and stops at the next step boundary, so no step is half done); a second signal
    raises KeyboardInterrupt at once. The previous handlers come back on exit. Outside the main
    thread, where Python cannot set handlers, nothing is installed."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def agreed(self, world: int, device: torch.device) -> int | None:
        """The signal number if any rank was signalled (one decision for all ranks, so that
        they save and stop at the same step), else None."""
        if world == 1:
            return self.signum
        t = torch.tensor([self.signum or 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None


def all_finite(loss: torch.Tensor, grad_norm: torch.Tensor, world: int) -> bool:
    """Whether loss and gradient norm are finite on every rank (one decision for all ranks)."""
    # each in its own dtype: a float64 value beyond float32's range is finite
    ok = (torch.isfinite(loss.detach()) & torch.isfinite(grad_norm)).all().float()
    if world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Every parameter's gradient summed over all ranks and divided by ``world``, as DDP does
    (a parameter without a gradient on a rank contributes zero there), in one all-reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def seed_all(seed: int) -> torch.Generator:
    """Seed torch's, Python's and NumPy's random generators with ``seed``; the data generator,
    seeded likewise (the global batches' positions)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return torch.Generator().manual_seed(seed)


def rng_states(data_gen: torch.Generator) -> dict[str, Any]:
    return {"data": data_gen.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_states(states: dict[str, Any], data_gen: torch.Generator) -> None:
    data_gen.set_state(states["data"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def dist_info() -> tuple[int, int, torch.device, bool]:
    """(rank, world size, device, whether this call created the process group) from torchrun's
    environment; initialises the process group (nccl on GPU, gloo on CPU) when WORLD_SIZE > 1
    and none exists yet."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    created = world > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device, created


def split_world(rank: int, world: int, cp: int, mesh: DeviceMesh | None = None
                ) -> tuple[int, int, int, list[Any], Any]:
    """(data-parallel replicas, this rank's replica, its place in its context-parallel group,
    every context-parallel group created, its own group or None without context parallelism).
    Every rank creates every group, in the same order, as ``new_group`` requires; with an FSDP
    ``mesh`` (``device_mesh``) the group is the mesh's ``cp`` dimension and none is created."""
    dp, dp_rank, cp_rank = world // cp, rank // cp, rank % cp
    groups: list[Any] = []
    own = None
    if mesh is not None:
        own = mesh.get_group("cp") if cp > 1 else None
    elif cp > 1:
        for d in range(dp):
            group = dist.new_group(list(range(d * cp, (d + 1) * cp)))
            groups.append(group)
            if d == dp_rank:
                own = group
    return dp, dp_rank, cp_rank, groups, own


def gather_rows(state: Any, world: int) -> Any:
    """Every rank's rows of a (carried) state tree on the CPU, concatenated in rank order along
    the batch; every rank takes part (None stays None)."""
    state = state_tree.map_tensors(lambda t: t.detach().cpu(), state)
    if world > 1:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, state)
        if state is not None:
            state = state_tree.cat_rows(parts, "carried state")
    return state


def end_process_groups(groups: list[Any], owns_world: bool) -> None:
    """Destroy the subgroups ``groups`` a session created, then the default process group when
    the session created it (``owns_world``: ``dist_info``'s fourth item)."""
    for group in groups:
        dist.destroy_process_group(group)
    if owns_world:
        dist.destroy_process_group()


def device_mesh(world: int, cp: int, device: torch.device) -> DeviceMesh:
    """The 2-D mesh (``dp_shard`` x ``cp``) of ``world`` ranks, rank = d * cp + c; every rank
    creates it (collective)."""
    return init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp_shard", "cp"))


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, mixed: str | None = None) -> None:
    """``fully_shard`` every block of ``model`` (``model.blocks``), then the root (embeddings,
    final norm, head), over all of ``mesh``'s ranks. ``mixed`` (a ``FSDP_MIXED`` key): compute
    with parameters in that dtype, reduce gradients in float32."""
    # FSDP shards over one flat group: the two mesh dimensions flattened (torchtitan's
    # dp_shard_cp; DeviceMesh has no public name for this yet).
    flat = mesh._flatten("dp_shard_cp") if mesh.size(1) > 1 else mesh["dp_shard"]
    policy = (MixedPrecisionPolicy(param_dtype=getattr(torch, FSDP_MIXED[mixed]), reduce_dtype=torch.float32)
              if mixed is not None else MixedPrecisionPolicy())
    # FSDP2 warns that a module returning a view loses its pre-backward hook to an in-place op
    # on that view: the blocks and the model return their recurrent states (views of the
    # layers' tensors), which the trainer only reads or detaches, never changes in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(Block|LanguageModel)\) "
                            "returned a view tensor")
    for block in model.blocks:
        fully_shard(block, mesh=flat, mp_policy=policy)
    fully_shard(model, mesh=flat, mp_policy=policy)


def context_parallel_runner(group: Any, fsdp: bool) -> Any:
    """The mixer runner (``LanguageModel.set_mixer_runner``) of context parallelism on
    ``group``; under FSDP every mixer parameter is touched on every rank
    (``touch_parameters``)."""

    def run(mixer: torch.nn.Module, x: torch.Tensor, state: Any, cu: torch.Tensor | None) -> Any:
        y, state = context_parallel_forward(mixer, x, group=group, state=state, cu_seqlens=cu)
        return (touch_parameters(mixer, y) if fsdp else y), state

    return run


def touch_parameters(module: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``y`` plus an exact zero that depends on every parameter of ``module``: each of them then
    gets a gradient (zero where unused) on every rank. FSDP reduce-scatters only the
    parameters that have one, so a parameter that only some context-parallel shards read (TTT's
    initial state, read by the first) would leave the ranks' collectives mismatched."""
    params = [p.sum() for p in module.parameters() if p.requires_grad]
    return y + torch.stack(params).sum().to(y.dtype) * 0 if params else y

