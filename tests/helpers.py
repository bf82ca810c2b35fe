"""Shared test helpers: float64 comparison, readable ids, interpreted kernel modules and their
launch counts."""

from __future__ import annotations

from collections import Counter

import torch

ATOL64 = 1e-10


def assert_close64(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL64, what: str = "") -> None:
    """Max abs difference within atol (float64 oracle comparisons)."""
    assert a.shape == b.shape, f"{what} shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"{what} max abs diff {err:.3e} > {atol:.1e}"


def shape_id(B: int, T: int, H: int, Dk: int, Dv: int | None = None, dtype: torch.dtype = torch.float64) -> str:
    dv = "" if Dv is None else f"-Dv{Dv}"
    return f"B{B}-T{T}-H{H}-Dk{Dk}{dv}-{str(dtype).removeprefix('torch.')}"


def assert_pieces_and_steps_equal_whole(layer, x: torch.Tensor, split: int) -> None:
    """A mixer layer fed ``x`` [B, T, d] in two pieces (cut at ``split``) and token by token,
    with its state carried, gives the outputs and the final state (a tuple of tensors) of
    feeding it whole."""
    y, state = layer(x)
    y1, s = layer(x[:, :split])
    y2, s = layer(x[:, split:], s)
    assert_close64(torch.cat([y1, y2], 1), y, what="pieces")
    steps, s = [], None
    for t in range(x.shape[1]):
        yt, s = layer(x[:, t:t + 1], s)
        steps.append(yt)
    assert_close64(torch.cat(steps, 1), y, what="one-token steps")
    assert len(s) == len(state)
    for a, b in zip(s, state):
        assert_close64(a, b, what="final state")


def steps_from(layer, x: torch.Tensor, start: int = 0, state=None):
    """A mixer layer fed ``x[:, :start]`` whole (from ``state``), then the rest one token at a
    time with its state carried: (the steps' outputs [B, T - start, d], the final state)."""
    if start:
        state = layer(x[:, :start], state)[1]
    ys = []
    for t in range(start, x.shape[1]):
        y, state = layer(x[:, t:t + 1], state)
        ys.append(y)
    return torch.cat(ys, 1), state


# The generation settings whose forwards differ in what transformers passes (cache or not, beams,
# sampling, a left-padded batch with its attention mask, dict outputs with hidden states).
GENERATE_SETTINGS = {
    "greedy": {"do_sample": False},
    "no-cache": {"do_sample": False, "use_cache": False},
    "beam": {"do_sample": False, "num_beams": 2},
    "sample": {"do_sample": True, "top_k": 5},
    "dict": {"do_sample": False, "return_dict_in_generate": True, "output_scores": True,
             "output_logits": True},
}


def assert_generate_passes_declared_keywords(model, ids: torch.Tensor, **generate_kwargs) -> None:
    """Drive a real ``model.generate(ids, ...)`` and check that every keyword transformers passes
    to ``forward`` is one that ``forward`` declares. A new transformers release that renames or
    adds an argument then fails here with its name, instead of as a TypeError deep inside
    generation."""
    import inspect

    import transformers

    passed: set[str] = set()
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: passed.update(kwargs), with_kwargs=True)
    error = None
    try:
        model.generate(ids, max_new_tokens=3, **generate_kwargs)
    except TypeError as err:  # reported below with the keywords' names when that is the cause
        error = err
    finally:
        handle.remove()
    declared = set(inspect.signature(type(model).forward).parameters) - {"self"}
    unknown = sorted(passed - declared)
    assert not unknown, (
        f"transformers {transformers.__version__} passes {unknown} to "
        f"{type(model).__name__}.forward during generate({generate_kwargs}), which does not "
        "declare them: add each to forward, honoured or refused with an error")
    if error is not None:
        raise error
    assert passed, "generate() never called forward"


def interpreted_kernels(module_name: str, kernel: str):
    """The Triton kernel module ``module_name``, failing the test unless its ``kernel`` runs
    under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
    imported; the CPU tests need it)."""
    import importlib

    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, kernel), InterpretedFunction):
        pytest.fail("triton was imported before tests/conftest.py set TRITON_INTERPRET=1 "
                    "(or it is set to 0): these CPU tests need the Triton interpreter")
    return module


class CountedKernel:
    """A Triton kernel that counts its launches (``kernel[grid](...)``) into ``counts``."""

    def __init__(self, fn, name: str, counts: Counter):
        self.fn, self.name, self.counts = fn, name, counts

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.fn[grid]


def count_launches(module, monkeypatch) -> Counter[str]:
    """Every ``*_kernel`` of ``module`` replaced (through ``monkeypatch``) by a
    ``CountedKernel``, which counts its launches into the returned Counter under its name
    without the underscores and ``_kernel``."""
    counts: Counter = Counter()
    for name in [n for n in vars(module) if n.endswith("_kernel")]:
        monkeypatch.setattr(module, name, CountedKernel(getattr(module, name),
                                                        name.strip("_").removesuffix("_kernel"),
                                                        counts))
    return counts
