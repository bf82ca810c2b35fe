"""The public Infini-attention op ``infini_attention`` (docs/maths.md 5.1-5.2) and its states:
argument checks, the ``mode=`` switch over chunk.py / recurrent.py / naive.py.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, N segment length,
n tokens of the open segment.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..._checks import (
    check_arg,
    check_bool,
    check_choice,
    check_finite_float,
    check_mode,
    check_nonneg_float,
    check_positive_int,
    check_qkv,
    check_same_dtype_device,
    check_shape,
    check_tensor,
    state_dtype,
)
from .._autocast import float32_compute
from .._modes import RECURRENT_MODES, reads_allowed
from .._state import checked_tensors
from .._steps import check_step_qkv, wide
from .._varlen import run_packed
from .chunk import infini_attention_chunk
from .memory import sigma, write
from .naive import infini_attention_naive
from .recurrent import infini_attention_recurrent, infini_attention_rows

MODES = RECURRENT_MODES
UPDATES = ("linear", "delta")


class InfiniSegmentState(NamedTuple):
    """What continuing a sequence needs: the memory of the complete segments (M [B, H, Dk, Dv],
    z [B, H, Dk]) and the open segment's keys, values and memory keys (k_seg, k_mem_seg
    [B, n, H, Dk], v_seg [B, n, H, Dv]; n < segment_len, 0 at a segment boundary)."""

    M: torch.Tensor
    z: torch.Tensor
    k_seg: torch.Tensor
    v_seg: torch.Tensor
    k_mem_seg: torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int, H: int, Dk: int, Dv: int, N: int,
              q: torch.Tensor) -> InfiniSegmentState:
        """An ``initial_state`` (an ``InfiniState``, a plain (M, z) at a segment boundary or the
        5 fields) for q [B, T, H, Dk] and segments of N tokens, in the compute dtype."""
        if isinstance(state, InfiniState):
            state = state.open_segment
        if not isinstance(state, (tuple, list)) or len(state) not in (2, 5):
            raise TypeError(
                "initial_state must be None, a state returned by infini_attention, (M [B, H, Dk, Dv], "
                f"z [B, H, Dk]) or the 5-tuple (M, z, k_seg, v_seg, k_mem_seg), got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, (tuple, list)) else "")
            )
        cdtype = state_dtype(q.dtype)
        memory = {"M": ((B, H, Dk, Dv), "[B, H, Dk, Dv]"), "z": ((B, H, Dk), "[B, H, Dk]")}
        if len(state) == 2:
            return cls.empty(*checked_tensors(state, cls, memory, q, cdtype).values(), B, H, Dk, Dv)
        check_tensor("initial_state[2] (k_seg)", state[2], 4, "[B, n, H, Dk]")
        n = state[2].shape[1]
        if n >= N:
            raise ValueError(
                f"initial_state[2] (k_seg) holds the open segment, so n must be < segment_len = {N}, "
                f"got shape {tuple(state[2].shape)}"
            )
        specs = {**memory, "k_seg": ((B, n, H, Dk), "[B, n, H, Dk]"),
                 "v_seg": ((B, n, H, Dv), "[B, n, H, Dv]"), "k_mem_seg": ((B, n, H, Dk), "[B, n, H, Dk]")}
        return cls(**checked_tensors(state, cls, specs, q, cdtype))

    @classmethod
    def carried(cls, state: Any, B: int, H: int, Dk: int, Dv: int, N: int,
                q: torch.Tensor) -> InfiniSegmentState:
        """``check`` of a carried state, or the empty memory (zeros in the compute dtype) for
        None."""
        if state is not None:
            return cls.check(state, B, H, Dk, Dv, N, q)
        cdtype = state_dtype(q.dtype)
        return cls.empty(q.new_zeros(B, H, Dk, Dv, dtype=cdtype), q.new_zeros(B, H, Dk, dtype=cdtype),
                         B, H, Dk, Dv)

    @classmethod
    def empty(cls, M: torch.Tensor, z: torch.Tensor, B: int, H: int, Dk: int,
              Dv: int) -> InfiniSegmentState:
        """The memory (M, z) at a segment boundary: an empty open segment."""
        return cls(M, z, M.new_zeros(B, 0, H, Dk), M.new_zeros(B, 0, H, Dv), M.new_zeros(B, 0, H, Dk))

    @staticmethod
    def open_len(state: Any) -> int:
        """Tokens already in the open segment of a carried state (0 for None or a bare (M, z));
        a malformed state is left for ``check`` to reject with a clear message."""
        if isinstance(state, InfiniState):
            state = state.open_segment
        if isinstance(state, (tuple, list)) and len(state) == 5 and isinstance(state[2], torch.Tensor) \
                and state[2].dim() == 4:
            return state[2].shape[1]
        return 0


class InfiniRowsState(NamedTuple):
    """The state of a batch whose rows sit at different places in their segments (streams
    decoded together; ``InfiniAttention.stack_states``): M [B, H, Dk, Dv], z [B, H, Dk] the
    memory of each row's complete segments; k_seg, k_mem_seg [B, N - 1, H, Dk] and
    v_seg [B, N - 1, H, Dv] the last N - 1 tokens, of which row b's open segment is the last
    ``fill[b]`` (long [B], 0 <= fill < N; the entries before are padding, never read).
    ``infini_attention`` continues it one token per call and returns it in the same form."""

    M: torch.Tensor
    z: torch.Tensor
    k_seg: torch.Tensor
    v_seg: torch.Tensor
    k_mem_seg: torch.Tensor
    fill: torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int, H: int, Dk: int, Dv: int, N: int,
              q: torch.Tensor) -> InfiniRowsState:
        """A carried per-row state for q [B, 1, H, Dk], tensors in the compute dtype."""
        fill = state[5]
        if not (isinstance(fill, torch.Tensor) and fill.dtype == torch.long
                and fill.shape == (B,) and fill.device == q.device):
            raise ValueError(f"initial_state.fill must be a long tensor [B] = [{B}] on {q.device}")
        if reads_allowed() and bool(((fill < 0) | (fill >= N)).any()):
            raise ValueError(f"initial_state.fill must lie in [0, segment_len = {N}), got "
                             f"{fill.tolist()}")
        seg = N - 1
        specs = {"M": ((B, H, Dk, Dv), "[B, H, Dk, Dv]"), "z": ((B, H, Dk), "[B, H, Dk]"),
                 "k_seg": ((B, seg, H, Dk), "[B, N - 1, H, Dk]"),
                 "v_seg": ((B, seg, H, Dv), "[B, N - 1, H, Dv]"),
                 "k_mem_seg": ((B, seg, H, Dk), "[B, N - 1, H, Dk]")}
        return cls(**checked_tensors(state, cls, specs, q, state_dtype(q.dtype)), fill=fill)


class InfiniState(tuple):
    """The final state of ``infini_attention``: the pair ``(M [B, H, Dk, Dv], z [B, H, Dk])`` of
    docs/design.md, "Public ops" (``M, z = state`` works), the memory after every token seen, a
    trailing incomplete segment included (written as docs/maths.md 5.1 writes a segment, with the
    memory from before it).

    ``open_segment`` additionally holds what continuing *inside* that incomplete segment needs,
    an ``InfiniSegmentState`` ``(M_closed, z_closed, k_seg [B, n, H, Dk], v_seg [B, n, H, Dv],
    k_mem_seg [B, n, H, Dk])``,
    the memory of the complete segments only and the open segment's keys, values and memory
    keys (n < segment_len; n = 0 at a segment boundary, where M_closed is M). Passed back as
    ``initial_state``, an ``InfiniState`` continues the sequence exactly (pieces equal the
    whole at any cut); a plain ``(M, z)`` pair means a memory at a segment boundary.
    """

    open_segment: tuple[torch.Tensor, ...]

    def __new__(cls, M: torch.Tensor, z: torch.Tensor,
                open_segment: tuple[torch.Tensor, ...]) -> InfiniState:
        obj = super().__new__(cls, (M, z))
        obj.open_segment = InfiniSegmentState(*open_segment)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle keep open_segment
        return (InfiniState, (self[0], self[1], self.open_segment))


@float32_compute
def infini_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, *, segment_len: int,
    update: str = "linear", scale: float | None = None, q_mem: torch.Tensor | None = None,
    k_mem: torch.Tensor | None = None, eps: float = 1e-6,
    initial_state: tuple[torch.Tensor, ...] | None = None, output_final_state: bool = False,
    mode: str = "chunk", cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, InfiniState | None]:
    """Infini-attention over segments of ``segment_len`` tokens (docs/maths.md 5.1-5.2).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; gate: [H], the per-head logit beta_h (one learned
    scalar per head, as in the paper; not per token). Per segment s and head h, with
    sigma = ELU+1 and g_h = sigmoid(beta_h):

    - A_dot = softmax(scale Q_s K_s^T + causal mask) V_s, attending only inside the segment;
      ``scale`` defaults to 1/sqrt(Dk) and applies to this path only;
    - A_mem = sigma(Q^mem_s) M_{s-1} / (sigma(Q^mem_s) z_{s-1}): retrieval from the memory as it
      was *before* the segment. The denominator is clamped at ``eps`` (default 1e-6, must be
      > 0), not shifted by it: while the memory is empty (M = z = 0) A_mem is exactly 0 and the
      gate is still applied; once it holds tokens (sigma > 0, so the denominator is positive)
      the ratio is exact;
    - A = g_h A_mem + (1 - g_h) A_dot, for every segment alike;
    - after the segment is complete: M_s = M_{s-1} + sigma(K^mem_s)^T V_s (``update="linear"``)
      or M_{s-1} + sigma(K^mem_s)^T (V_s - sigma(K^mem_s) M_{s-1} / sigma(K^mem_s) z_{s-1})
      (``"delta"``, the retrieval being 0 while the memory is empty, same eps clamp);
      z_s = z_{s-1} + sum_t sigma(k^mem_t). A trailing incomplete segment is read from (its
      queries see the memory before it); the returned (M, z) include it, written by the same
      rule, while ``state.open_segment`` keeps it open for a next call that continues it.

    ``q_mem``/``k_mem`` ([B, T, H, Dk], default q/k) are the queries/keys that feed the memory,
    so a layer can give the memory un-rotated q, k and the softmax path rotary-encoded ones.

    ``mode``: ``"chunk"`` (default; all segments at once, the linear update as block-causal
    normalised linear attention, the delta update by a scan over segments), ``"recurrent"``
    (token streaming with a cache of the open segment) or ``"naive"`` (literal segment loop).
    There is no ``chunk_size``: the segments are the chunks.

    State: an ``InfiniState``, the pair ``(M [B, H, Dk, Dv], z [B, H, Dk])`` with the open
    segment's cache as its ``open_segment`` attribute (see ``InfiniState``). A returned state
    continues the sequence exactly (pieces or single tokens equal the whole). ``initial_state``
    may be an ``InfiniState``, a plain ``(M, z)`` (a memory at a segment boundary) or the
    5-tuple ``(M_closed, z_closed, k_seg, v_seg, k_mem_seg)`` that ``open_segment`` holds
    (what the layer carries). Memory in float32 (float64 for float64 inputs), cache too.
    Returns (o [B, T, H, Dv] in q's dtype, state or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one, memory and open segment reset at
    each boundary; initial/final states are then lists with one state per document
    (ops/_varlen.py).
    An ``InfiniRowsState`` (rows at different places in their segments) is continued one token
    per call (T = 1, any mode: the streaming form) and the final state is again one.
    """
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    check_arg("gate", gate, (H,), "[H]", q)
    N = check_positive_int("segment_len", segment_len)
    check_choice("update", update, UPDATES)
    if scale is None:
        scale = 1.0 / math.sqrt(Dk)
    scale = check_finite_float("scale", scale)
    for name, x in (("q_mem", q_mem), ("k_mem", k_mem)):
        if x is not None:
            check_tensor(name, x, 4, "[B, T, H, Dk]")
            check_shape(name, x, tuple(q.shape), "[B, T, H, Dk] as q")
    check_same_dtype_device(q=q, q_mem=q_mem, k_mem=k_mem)
    eps = check_nonneg_float("eps", eps)
    if eps == 0.0:
        raise ValueError("eps must be > 0 (it keeps the empty-memory retrieval 0 / eps = 0), got 0")
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    if cu_seqlens is not None:
        mem = [x for x in (q_mem, k_mem) if x is not None]

        def one_document(q, k, v, *rest, **kw):
            qm = rest[0] if q_mem is not None else None
            km = rest[-1] if k_mem is not None else None
            return infini_attention(q, k, v, gate, segment_len=segment_len, update=update,
                                    scale=scale, q_mem=qm, k_mem=km, eps=eps, mode=mode, **kw)

        return run_packed(one_document, (q, k, v, *mem), cu_seqlens, initial_state,
                          output_final_state)
    cdtype = state_dtype(q.dtype)
    if isinstance(initial_state, InfiniRowsState):
        if T != 1:
            raise ValueError(f"an InfiniRowsState (rows at different places in their segments) "
                             f"continues one token per call, got T={T}")
        rows = InfiniRowsState.check(initial_state, B, H, Dk, Dv, N, q)
        qc = q.to(cdtype)
        o, final = infini_attention_rows(
            q=qc, k=k.to(cdtype), v=v.to(cdtype), q_mem=qc if q_mem is None else q_mem.to(cdtype),
            k_mem=k.to(cdtype) if k_mem is None else k_mem.to(cdtype),
            g=torch.sigmoid(gate.to(cdtype)), state=rows, segment_len=N, update=update,
            scale=scale, eps=eps)
        return o.to(q.dtype), (InfiniRowsState(*final) if output_final_state else None)
    M0, z0, *cache = InfiniSegmentState.carried(initial_state, B, H, Dk, Dv, N, q)

    qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    qmc = qc if q_mem is None else q_mem.to(cdtype)
    kmc = kc if k_mem is None else k_mem.to(cdtype)
    g = torch.sigmoid(gate.to(cdtype))
    if mode == "recurrent" or T == 1:
        # T = 1 in the parallel modes is a decoding step: the streaming form attends over the
        # cached open segment instead of re-running the segment with zero queries in front.
        o, M, z, *cache = infini_attention_recurrent(
            q=qc, k=kc, v=vc, q_mem=qmc, k_mem=kmc, g=g, M=M0, z=z0, k_seg=cache[0],
            v_seg=cache[1], k_mem_seg=cache[2], segment_len=N, update=update, scale=scale, eps=eps)
    else:
        # The parallel forms start at a segment boundary: prepend the open segment's cached
        # keys/values with zero queries (their outputs are dropped, the real queries of that
        # segment attend to the cached keys as usual).
        n = cache[0].shape[1]
        if n:
            qc, qmc = (torch.cat([x.new_zeros(B, n, H, Dk), x], dim=1) for x in (qc, qmc))
            kc, vc, kmc = (torch.cat([c, x], dim=1) for c, x in zip(cache, (kc, vc, kmc)))
        form = infini_attention_chunk if mode == "chunk" else infini_attention_naive
        o, M, z = form(q=qc, k=kc, v=vc, q_mem=qmc, k_mem=kmc, g=g, M=M0, z=z0, segment_len=N,
                       update=update, scale=scale, eps=eps)
        o = o[:, n:]
        open_len = (n + T) % N  # tokens of the new open segment
        cache = [x[:, x.shape[1] - open_len:] for x in (kc, vc, kmc)]
    if not output_final_state:
        return o.to(q.dtype), None
    M_all, z_all = M, z
    if cache[0].shape[1]:  # write the open segment too (docs/maths.md 5.1), keeping it open
        sk = sigma(cache[2]).transpose(1, 2)  # [B, H, n, Dk]
        M_all, z_all = write(sk, cache[1].transpose(1, 2), M, z, update, eps)
    return o.to(q.dtype), InfiniState(M_all, z_all, (M, z, *cache))


@float32_compute
def infini_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, *,
    state: InfiniSegmentState | InfiniRowsState | tuple[torch.Tensor, ...] | None = None,
    segment_len: int, update: str = "linear", scale: float | None = None,
    q_mem: torch.Tensor | None = None, k_mem: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, InfiniSegmentState | InfiniRowsState]:
    """One token of ``infini_attention`` (docs/maths.md 5.2, the streaming form): q, k, q_mem,
    k_mem [B, 1, H, Dk], v [B, 1, H, Dv], gate [H]; ``state`` an ``InfiniSegmentState`` (the
    memory of the complete segments and the open segment's cache; a plain (M, z) at a segment
    boundary; None: empty) or an ``InfiniRowsState`` (rows at their own places in their
    segments). Returns (o [B, 1, H, Dv] in q's dtype, the state after the token in the same
    form: the open segment stays in the cache, the memory holds complete segments only). Shapes
    are checked, nothing else (see ``linear_attn_step``); options as ``infini_attention``'s."""
    B, H, Dk, Dv = check_step_qkv(q, k, v)
    check_arg("gate", gate, (H,), "[H]", q)
    for name, x in (("q_mem", q_mem), ("k_mem", k_mem)):
        if x is not None:
            check_arg(name, x, tuple(q.shape), "[B, 1, H, Dk] as q", q)
    if scale is None:
        scale = Dk ** -0.5
    N, cdtype = segment_len, state_dtype(q.dtype)
    qc, kc = wide(q, cdtype), wide(k, cdtype)
    inputs = {"q": qc, "k": kc, "v": wide(v, cdtype),
              "q_mem": qc if q_mem is None else wide(q_mem, cdtype),
              "k_mem": kc if k_mem is None else wide(k_mem, cdtype),
              "g": torch.sigmoid(wide(gate, cdtype)), "segment_len": N, "update": update,
              "scale": scale, "eps": eps}
    if isinstance(state, InfiniRowsState):
        o, final = infini_attention_rows(**inputs, state=InfiniRowsState.check(
            state, B, H, Dk, Dv, N, q))
        final = InfiniRowsState(*final)
    else:
        M, z, k_seg, v_seg, k_mem_seg = InfiniSegmentState.carried(state, B, H, Dk, Dv, N, q)
        o, *rest = infini_attention_recurrent(**inputs, M=M, z=z, k_seg=k_seg, v_seg=v_seg,
                                              k_mem_seg=k_mem_seg)
        final = InfiniSegmentState(*rest)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), final
