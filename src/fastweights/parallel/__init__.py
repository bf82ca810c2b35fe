"""Context parallelism: one sequence split across processes, exact for every mixer.

``context_parallel_forward(mixer, x_shard, group=...)`` runs a mixer on this rank's shard by
the strategy the layer declares (``Mixer.context_parallel``: associative scan, gather, relay or
independent blocks); ``strategy_name(mixer)`` says which. The mechanisms those strategies are
written with live in ``mechanisms`` (``Shard``), the collectives in ``comm`` (differentiable,
counted for the benchmark). Nothing here names a layer.
"""

from typing import Any

from .comm import TRAFFIC, Shards, counting
from .context import context_parallel_forward
from .mechanisms import Shard

__all__ = ["TRAFFIC", "Shard", "Shards", "context_parallel_forward", "counting", "strategy_name"]


def strategy_name(mixer: Any) -> str:
    """The strategy ``context_parallel_forward`` uses for ``mixer`` (TypeError if none)."""
    return mixer.context_parallel().name
