"""Softmax attention, the quadratic baseline (``attention.py``); re-exports only."""

from .attention import check_kv_lengths, softmax_attention

__all__ = ["check_kv_lengths", "softmax_attention"]
