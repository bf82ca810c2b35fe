"""Test utilities for users and for the project's own tests: ``cuda_autocast_policy``, CUDA's
autocast dtype policy reproduced under CPU autocast, so that mixed-precision code paths that only
break on a GPU break on a CPU too.

Why: ``torch.autocast("cuda")`` runs a documented list of ops in float32 whatever their inputs
(reductions and pointwise functions whose range or accuracy half precision cannot hold: ``sum``,
``exp``, ``softmax``, ``layer_norm``, ``pow``, ``rsqrt``, ...), while ``torch.autocast("cpu")``
runs the same ops in their inputs' dtype. Code that mixes such an op's output with a half-precision
activation therefore sees float32 meet bfloat16 only on a GPU (``x / x.sum(-1)`` is float32 there,
bfloat16 on a CPU). ``cuda_autocast_policy()`` closes the gap: while it is active and CPU autocast
is on, the ops of CUDA's float32 list receive their floating inputs in float32 (as CUDA's autocast
casts them), and the matrix products of CUDA's lower-precision list that CPU autocast leaves alone
(``einsum``, ``addmv``, ...) receive the autocast dtype. Everything CPU autocast already casts
(``linear``, ``matmul``, ``bmm``, ``baddbmm``, convolutions) is left to it.

The lists are torch's documented CUDA autocast op reference ("CUDA Ops that can autocast to
float32" / "... to float16"), at the level of Python calls: a call is cast when the function or
Tensor method it makes has one of the listed names, and, as autocast does, only out-of-place calls
without an explicit ``dtype=`` are eligible. Calls made inside a region where autocast is switched
off (every fastweights op switches it off for its own body) are untouched, as on a GPU.

Use::

    from fastweights.testing import cuda_autocast_policy
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids).float().mean()
    loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["CUDA_FLOAT32_OPS", "CUDA_LOWER_PRECISION_EXTRA", "HOST_READS", "HostReads",
           "cuda_autocast_policy"]

# torch's documented "CUDA Ops that can autocast to float32", by the Python name of the call.
CUDA_FLOAT32_OPS = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
    "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
    "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
    "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
    "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
})
# CUDA's lower-precision ops that CPU autocast does not cast (CPU autocast already casts linear,
# matmul, mm, bmm, baddbmm, addmm, addbmm, convolutions, prelu and scaled_dot_product_attention).
CUDA_LOWER_PRECISION_EXTRA = frozenset({
    "addmv", "addr", "chain_matmul", "multi_dot", "einsum", "mv",
})
_HALF = (torch.float16, torch.bfloat16)


def _cast(dtype: torch.dtype, from_dtypes: tuple[torch.dtype, ...]) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in from_dtypes:
            return x.to(dtype)
        return x
    return cast


class _CudaAutocastPolicy(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if torch.is_autocast_enabled("cpu") and "dtype" not in kwargs and not kwargs.get("out"):
            if name in CUDA_FLOAT32_OPS:
                args, kwargs = tree_map(_cast(torch.float32, _HALF), (args, kwargs))
            elif name in CUDA_LOWER_PRECISION_EXTRA:
                low = torch.get_autocast_dtype("cpu")
                args, kwargs = tree_map(_cast(low, (torch.float32,)), (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While active, ``torch.autocast("cpu", dtype=...)`` casts as ``torch.autocast("cuda",
    dtype=...)`` would (see the module docstring). Outside CPU autocast it changes nothing. The
    autograd backward pass that follows a forward under it needs no policy: the casts are
    recorded in the graph."""
    with _CudaAutocastPolicy():
        yield


# The Tensor calls that read a tensor's values back to the host (a device synchronisation on a
# GPU): conversions to Python values, data-dependent shapes, truth tests.
HOST_READS = frozenset({"tolist", "item", "nonzero", "__bool__", "__int__", "__float__",
                        "__index__", "argwhere", "unique", "masked_select"})


class HostReads(TorchFunctionMode):
    """Counts the calls that read tensor values back to the host while it is active (the
    names in ``HOST_READS``, as ``torch.overrides`` reports them): ``reads`` lists them in
    order. What the library promises of a decoding step and of a packed forward
    (docs/design.md, "Host reads")::

        with HostReads() as seen:
            model(ids, cu_seqlens=cu)
        assert len(seen.reads) <= 1
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
