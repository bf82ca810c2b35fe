"""``FastWeightsCache``: the layer states of ``FastWeightsForCausalLM``, per group of batch rows.

Left padding. A padded position would still write into a recurrent state, so pads cannot simply
be fed through the layers. With an ``attention_mask`` (zeros = left pads), the first forward
(prefill) runs the rows of each distinct pad length together (``row_groups``), each row starting
from its first real token with a fresh state; the rows then carry exactly the state of their
unpadded sequence. If all those states have the same structure (recurrent mixers: same shapes),
they are concatenated and decoding runs the whole batch in one forward per token; otherwise
(softmax KV caches of different lengths) each pad-length group keeps its own state and is
decoded by its own forward. Logits at pad positions are zero and their labels are ignored by
the loss.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache

from .. import state_tree
from ..models.lm import LMState

# One group of batch rows run together: (rows [b] long, (left, right) pad lengths, state).
Group = tuple[torch.Tensor, tuple[int, int], LMState | None]


def _take_rows(t: torch.Tensor, local: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``local`` of a group state tensor whose leading dim is the group's batch ``n``
    (tensors without that leading dim are shared by the rows and kept)."""
    return t.index_select(0, local.to(t.device)) if t.dim() and t.shape[0] == n else t


class FastWeightsCache(Cache):
    """The cache of ``FastWeightsForCausalLM`` (``cache=``, ``past_key_values=`` before
    transformers 5.24): the native per-layer states.

    The batch rows are split into groups (one per distinct left-pad length at prefill, merged
    into one group whenever their states have the same structure, see the module docstring);
    ``groups`` is a list of ``(rows [b] long, state)`` with ``state`` the ``LanguageModel``
    state list of those rows, in that order. ``get_seq_length()`` counts the positions consumed
    (pads included, as ``generate`` expects), ``state_bytes()`` the bytes of state held.
    """

    is_compileable = False  # the state is a Python structure; no static shapes to compile for

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.groups: list[tuple[torch.Tensor, LMState]] = []
        self.seen_tokens = 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(groups={len(self.groups)}, batch={self.batch_size}, "
                f"seen_tokens={self.seen_tokens}, state_bytes={self.state_bytes()})")

    @property
    def batch_size(self) -> int:
        return sum(len(rows) for rows, _ in self.groups) if self.groups else -1

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back

    @property
    def is_initialized(self) -> bool:
        return bool(self.groups)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def state_bytes(self) -> int:
        """Bytes of every tensor held (all layers, all rows)."""
        return sum(state_tree.nbytes(s) for _, s in self.groups)

    def reset(self) -> None:
        self.groups = []
        self.seen_tokens = 0

    def set_groups(self, groups: list[tuple[torch.Tensor, LMState]]) -> None:
        """Store the groups, concatenated into one when their states allow it."""
        if len(groups) > 1:
            try:
                state = state_tree.cat_rows([s for _, s in groups], "cache",
                                            [len(r) for r, _ in groups])
                groups = [(torch.cat([r for r, _ in groups]), state)]
            except ValueError:  # structures differ (softmax caches of other lengths)
                pass
        self.groups = groups

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (new row j is old row indices[j]); rows may repeat."""
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
        new_groups = []
        for rows, state in self.groups:
            rows = rows.cpu()
            hit = (indices[:, None] == rows[None, :])  # [new, b]
            new_rows = hit.any(dim=1).nonzero().flatten()
            if new_rows.numel() == 0:
                continue
            local = hit[new_rows].float().argmax(dim=1)  # position of each kept row in the group
            state = state_tree.map_tensors(partial(_take_rows, local=local, n=len(rows)), state)
            new_groups.append((new_rows, state))
        self.set_groups(new_groups)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        n = max(self.batch_size, 0)
        self.batch_select_indices(torch.arange(n).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a recurrent state cannot be cropped")


def row_groups(cache: FastWeightsCache, pads: torch.Tensor, right: torch.Tensor) -> list[Group]:
    """The groups of batch rows a forward runs together: the cache's groups (decoding), or at
    prefill the rows sharing their left and right pad lengths ([B] each), which start together
    from a fresh state on their tokens only."""
    if cache.groups:
        return [(rows, (0, 0), state) for rows, state in cache.groups]
    spans = torch.stack([pads, right], dim=1).unique(dim=0).tolist()
    return [(((pads == p) & (right == r)).nonzero().flatten(), (p, r), None) for p, r in spans]
