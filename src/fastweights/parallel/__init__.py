"""Context parallelism: one sequence split across processes, exact for every mixer.

``context_parallel_forward(mixer, x_shard, group=...)`` runs a mixer on this rank's shard;
``strategy_name(mixer)`` says how (associative scan, gather, relay or independent blocks; see
``strategies``). Collectives live in ``comm`` (differentiable, counted for the benchmark).
"""

from .comm import TRAFFIC, Shards, counting
from .context import context_parallel_forward
from .strategies import strategy_name

__all__ = ["TRAFFIC", "Shards", "context_parallel_forward", "counting", "strategy_name"]
