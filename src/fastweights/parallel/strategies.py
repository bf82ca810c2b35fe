"""How each mixer runs on its shard of a sequence (one strategy per layer class).

Every strategy builds on the layer contract alone (``forward(x, state) -> (y, state)``, pieces
with the state carried == whole): it finds the state the single-process run would carry into
this rank's first token, then runs the layer on the shard from that state. Three ways to find it:

- associative scan (``sum_scan``, ``delta_scan``, ``decay_scan``, ``infini_scan``,
  ``aft_simple_scan``): every rank runs its shard from an empty state, which gives its
  contribution B (the final state is linear in the incoming one, S_out = A S_in + B); one
  all-gather of the (A, B) of every rank; each rank folds the ranks before it. A is the identity
  for sums (linear attention, Infini's linear memory), lambda_h^T_r for TransNormer's decay, and
  for the delta rule (also Infini's delta memory, given its normaliser z) the Dk x Dk matrix read
  off by running the shard once more from the identity, batched as extra sequences (ceil(Dk/Dv)
  of them); AFT-simple merges its max-stabilised sums instead of adding;
- gather (``softmax_gather``, ``aft_full_gather``): the state is every earlier key and value,
  all-gathered; O(T) memory per rank, like the state itself;
- relay (``relay``): rank r receives rank r-1's final state, runs, sends its own on; sequential
  in time (memory is still split). Used where the state update is not affine (TTT's inner
  LayerNorm) and for AFT-local/conv's window caches;
- independent (``aligned_blocks``): DiagAttention's blocks never cross a block border, so
  shards starting on one need nothing from other ranks.

Compute: an associative scan runs the layer 2 (sum, decay, AFT-simple, Infini linear), 2 +
ceil(Dk/Dv) (delta) or 3 + ceil(Dk/Dv) (Infini delta) times per shard; the price of reading the
state off the unmodified layer rather than a dedicated kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .._checks import state_dtype
from ..layers import (
    TTTMLP,
    AFTConv,
    AFTFull,
    AFTLocal,
    AFTSimple,
    DiagAttention,
    InfiniAttention,
    LinearAttention,
    NormAttention,
    SoftmaxAttention,
    TTTLinear,
)
from ..layers.transnormer import NormState
from ..ops.aft import AFTFullState, AFTSimpleState
from ..ops.aft.chunk import merge
from ..ops.infini import InfiniSegmentState
from .comm import Channel, Shards

Run = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]  # (x, state) -> (y, state)


def _prefix(values: list[torch.Tensor], rank: int) -> torch.Tensor:
    """sum_{j < rank} values[j], the same graph on every rank (weights 0/1, exact)."""
    return sum(v * float(j < rank) for j, v in enumerate(values))


def _identity_blocks(Dk: int, Dv: int, like: torch.Tensor) -> list[torch.Tensor]:
    """The Dk x Dk identity as ceil(Dk/Dv) blocks of Dv columns (the last zero-padded)."""
    n = math.ceil(Dk / Dv)
    eye = torch.eye(Dk, n * Dv, dtype=like.dtype, device=like.device)
    return list(eye.split(Dv, dim=1))


def _transition(run_batched: Callable[[torch.Tensor], torch.Tensor], S_like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [B, H, Dk, Dk], B_ [B, H, Dk, Dv]) with run(S) = A S + B_, for run linear in S.

    ``run_batched(S0)`` takes S0 [(1+n) B, H, Dk, Dv] (the zero state then the n identity
    blocks, each for the whole batch) and returns the final S for each. Kept in S's dtype
    (float32 or wider: the ops keep states there)."""
    B, H, Dk, Dv = S_like.shape
    blocks = _identity_blocks(Dk, Dv, S_like)
    S0 = torch.cat([S_like.new_zeros(B, H, Dk, Dv)]
                   + [blk.expand(B, H, Dk, Dv) for blk in blocks])
    out = run_batched(S0).unflatten(0, (1 + len(blocks), B))
    const = out[0]
    A = torch.cat([out[1 + j] - const for j in range(len(blocks))], dim=-1)[..., :Dk]
    return A, const


def _fold_affine(As: list[torch.Tensor], Bs: list[torch.Tensor], S0: torch.Tensor,
                 rank: int) -> torch.Tensor:
    """S after ranks 0..rank-1: S <- A_j S + B_j from S0 (A_j a matrix [B, H, Dk, Dk], or a
    per-head scalar [H, 1, 1] that multiplies)."""
    S = S0
    for A, B_ in zip(As[:rank], Bs[:rank]):
        S = (A @ S if A.dim() == S.dim() else A * S) + B_
    return S


# ---------------------------------------------------------------------------------------------
# Strategies: (mixer, run, x, shards, chan, state0) -> (y, this rank's final state).
# ``state0`` is the state before the whole sequence (None for its start), the same on every
# rank. ``run`` calls the mixer (with its random draws replayed, see context.py).


def sum_scan(mixer: LinearAttention, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
             state0: Any) -> tuple[torch.Tensor, Any]:
    """Linear attention with the sum rule: S, z add up over ranks (LASP-2)."""
    _, part = run(x, None)
    gathered = chan.all_gather(list(part))
    S_in, z_in = (_prefix([g[i] for g in gathered], sh.rank) for i in range(2))
    if state0 is not None:
        S_in, z_in = S_in + state0[0], z_in + state0[1]
    start = type(part)(S_in, z_in) if (sh.rank or state0 is not None) else None
    return run(x, start)


def delta_scan(mixer: LinearAttention, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
               state0: Any) -> tuple[torch.Tensor, Any]:
    """The delta rule: S_out = A S_in + B with A = prod (I - beta k k^T), read off the layer."""
    B = x.shape[0]
    H, Dk, Dv = mixer.n_heads, mixer.feature_dim, mixer.head_dim
    like = x.new_zeros(B, H, Dk, Dv, dtype=state_dtype(x.dtype))

    def run_batched(S: torch.Tensor) -> torch.Tensor:
        reps = S.shape[0] // B
        return run(x.repeat(reps, 1, 1), (S,))[1][0]

    A, const = _transition(run_batched, like)
    gathered = chan.all_gather([A, const])
    S0 = like if state0 is None else state0[0].to(like.dtype)
    S_in = _fold_affine([g[0] for g in gathered], [g[1] for g in gathered], S0, sh.rank)
    start = (S_in,) if (sh.rank or state0 is not None) else None
    return run(x, start)


def decay_scan(mixer: NormAttention, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
               state0: Any) -> tuple[torch.Tensor, Any]:
    """TransNormer's global attention: S_out = lambda^T S_in + B (lambda = 1 without decay);
    the state's position is the shard's global offset."""
    B, H, D = x.shape[0], mixer.n_heads, mixer.head_dim
    S0, pos0 = NormState.check(state0)
    zero = x.new_zeros(B, H, D, D, dtype=state_dtype(x.dtype))
    S0 = zero if S0 is None else S0.to(zero.dtype)
    _, part = run(x, NormState(zero, pos0 + sh.offset))
    gathered = chan.all_gather([part.S])
    lam = torch.tensor(mixer.decay_values or (1.0,) * H, dtype=zero.dtype, device=x.device)
    As = [lam.pow(n)[:, None, None] for n in sh.lengths]
    S_in = _fold_affine(As, [g[0] for g in gathered], S0, sh.rank)
    return run(x, NormState(S_in, pos0 + sh.offset))


def infini_scan(mixer: InfiniAttention, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
                state0: Any) -> tuple[torch.Tensor, Any]:
    """Infini-attention on shards starting at segment borders: the memory (M, z) is a sum
    (linear update), or for the delta update z is a sum and, given z, M is affine in M."""
    B, H, D = x.shape[0], mixer.n_heads, mixer.head_dim
    sdtype = state_dtype(x.dtype)
    zeros = x.new_zeros(B, H, D, D, dtype=sdtype), x.new_zeros(B, H, D, dtype=sdtype)
    if state0 is None:
        M0, z0, first = zeros[0], zeros[1], None
    else:
        full = InfiniSegmentState.check(state0, B, H, D, D, mixer.segment_len, x)
        M0, z0 = full.M, full.z
        first = full._replace(M=zeros[0], z=zeros[1])  # rank 0 keeps the open segment
    empty = first if sh.rank == 0 else None
    _, part = run(x, empty)
    gathered = chan.all_gather([part.z] if mixer.update == "delta" else [part.M, part.z])
    z_in = z0 + _prefix([g[-1] for g in gathered], sh.rank)
    if mixer.update == "linear":
        M_in = M0 + _prefix([g[0] for g in gathered], sh.rank)
    else:
        def run_batched(M: torch.Tensor) -> torch.Tensor:
            reps = M.shape[0] // B
            base = empty if empty is not None else InfiniSegmentState.empty(
                zeros[0], zeros[1], B, H, D, D)
            start = InfiniSegmentState(
                M, z_in.repeat(reps, 1, 1), *(t.repeat(reps, 1, 1, 1) for t in base[2:]))
            return run(x.repeat(reps, 1, 1), start)[1].M

        A, const = _transition(run_batched, zeros[0])
        trans = chan.all_gather([A, const])
        M_in = _fold_affine([g[0] for g in trans], [g[1] for g in trans], M0, sh.rank)
    if sh.rank == 0 and state0 is not None:
        return run(x, first._replace(M=M_in, z=z_in))
    return run(x, (M_in, z_in))


def aft_simple_scan(mixer: AFTSimple, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
                    state0: Any) -> tuple[torch.Tensor, Any]:
    """AFT-simple: the max-stabilised sums (e^a n, e^a m) of the ranks before, merged."""
    _, part = run(x, None)
    gathered = chan.all_gather(list(part))
    parts = [(a, n.unsqueeze(-1), m) for a, n, m in gathered[:sh.rank]]
    if state0 is not None:
        parts.insert(0, (state0[0], state0[1].unsqueeze(-1), state0[2]))
    if not parts:
        return run(x, None)
    prefix = parts[0]
    for cur in parts[1:]:
        prefix = merge(prefix, cur)
    return run(x, AFTSimpleState(prefix[0], prefix[1].squeeze(-1), prefix[2]))


def _gather_cache(keys: torch.Tensor, values: torch.Tensor, sh: Shards, chan: Channel
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The [B, t, ...] keys and values of the ranks before this one (shards padded to the
    longest for the all-gather, then trimmed)."""
    longest = max(sh.lengths)
    pad = [0, 0] * (keys.dim() - 2) + [0, longest - keys.shape[1]]
    gathered = chan.all_gather([torch.nn.functional.pad(keys, pad),
                                torch.nn.functional.pad(values, pad)])
    ks = [g[0][:, :n] for g, n in zip(gathered, sh.lengths)][:sh.rank]
    vs = [g[1][:, :n] for g, n in zip(gathered, sh.lengths)][:sh.rank]
    return torch.cat([keys[:, :0], *ks], dim=1), torch.cat([values[:, :0], *vs], dim=1)


def softmax_gather(mixer: SoftmaxAttention, run: Run, x: torch.Tensor, sh: Shards,
                   chan: Channel, state0: Any) -> tuple[torch.Tensor, Any]:
    """Softmax attention: every earlier (rotated) key and value, all-gathered: O(T) memory."""
    past = 0 if state0 is None else state0[0].shape[1]
    k, v = mixer.keys_values(x, past + sh.offset)
    K, V = _gather_cache(k, v, sh, chan)
    if state0 is not None:
        K, V = torch.cat([state0[0].to(K.dtype), K], 1), torch.cat([state0[1].to(V.dtype), V], 1)
    return run(x, (K, V) if K.shape[1] else None)


def aft_full_gather(mixer: AFTFull, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
                    state0: Any) -> tuple[torch.Tensor, Any]:
    """AFT-full: its arbitrary T x T bias needs every earlier key: all-gathered, O(T) memory."""
    k, v = mixer.keys_values(x)
    K, V = _gather_cache(k, v, sh, chan)
    if state0 is not None:
        K, V = torch.cat([state0[0].to(K.dtype), K], 1), torch.cat([state0[1].to(V.dtype), V], 1)
    return run(x, AFTFullState(K, V) if K.shape[1] else None)


def relay(mixer: Any, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
          state0: Any) -> tuple[torch.Tensor, Any]:
    """Rank r waits for rank r-1's final state (sequential; each rank keeps only its shard's
    activations). The backward pass relays the state's gradient the other way."""
    start = state0 if sh.rank == 0 else chan.recv_state(sh.rank - 1, x.device)
    y, final = run(x, start)
    if sh.rank < sh.world - 1:
        chan.send_state(final, sh.rank + 1)
    return y, final


def aligned_blocks(mixer: DiagAttention, run: Run, x: torch.Tensor, sh: Shards, chan: Channel,
                   state0: Any) -> tuple[torch.Tensor, Any]:
    """DiagAttention on shards starting at block borders: nothing crosses ranks."""
    return run(x, state0 if sh.rank == 0 else None)


def open_len(mixer: Any, state0: Any) -> int:
    """Tokens of ``state0`` in the still open block (DiagAttention) or segment (Infini)."""
    if state0 is None:
        return 0
    if isinstance(mixer, DiagAttention):
        return state0[0].shape[1]
    return InfiniSegmentState.open_len(state0)


def _alignment(unit: str, size: Callable[[Any], int]) -> Callable[[Any, Shards, Any], str | None]:
    def check(mixer: Any, sh: Shards, state0: Any) -> str | None:
        w, r0 = size(mixer), open_len(mixer, state0)
        bad = [r for r in range(1, sh.world) if (r0 + sh.offsets[r]) % w]
        if not bad:
            return None
        return (f"{type(mixer).__name__} needs every shard to start on a {unit} border "
                f"({unit} size {w}, {r0} token(s) already in the open {unit}); rank(s) {bad} "
                f"start at global position(s) {[sh.offsets[r] for r in bad]}; shard lengths "
                f"{list(sh.lengths)}")
    return check


def _strategy(mixer: Any) -> tuple[str, Callable[..., tuple[torch.Tensor, Any]]]:
    if isinstance(mixer, LinearAttention):
        if mixer.update == "delta":  # the attention-normalised delta rule: passed rank to rank
            return ("relay", relay) if mixer.normalize.endswith("attention") else ("delta_scan", delta_scan)
        return "sum_scan", sum_scan
    table: list[tuple[type, str, Callable[..., tuple[torch.Tensor, Any]]]] = [
        (NormAttention, "decay_scan", decay_scan),
        (InfiniAttention, "infini_scan", infini_scan),
        (AFTSimple, "aft_simple_scan", aft_simple_scan),
        (SoftmaxAttention, "softmax_gather", softmax_gather),
        (AFTFull, "aft_full_gather", aft_full_gather),
        (DiagAttention, "aligned_blocks", aligned_blocks),
        (AFTLocal, "relay", relay),
        (AFTConv, "relay", relay),
        (TTTLinear, "relay", relay),
        (TTTMLP, "relay", relay),
    ]
    for cls, name, fn in table:
        if type(mixer) is cls:
            return name, fn
    raise TypeError(
        f"context parallelism has no strategy for mixer {type(mixer).__name__}; supported: "
        "LinearAttention/DeltaNet (linear, dpfp, favor, delta), NormAttention (norm), "
        "DiagAttention (diag), InfiniAttention (infini), AFTFull/AFTLocal/AFTSimple/AFTConv, "
        "TTTLinear/TTTMLP, SoftmaxAttention")


SHARD_CHECKS: dict[type, Callable[[Any, Shards, Any], str | None]] = {
    DiagAttention: _alignment("block", lambda m: m.block_size),
    InfiniAttention: _alignment("segment", lambda m: m.segment_len),
}


def strategy_name(mixer: Any) -> str:
    """The strategy ``context_parallel_forward`` uses for ``mixer`` (TypeError if none)."""
    return _strategy(mixer)[0]
