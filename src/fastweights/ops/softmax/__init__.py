"""Softmax attention, the quadratic baseline (``attention.py``); re-exports only."""

from .attention import KVCache, check_kv_lengths, softmax_attention, softmax_attention_step

__all__ = ["KVCache", "check_kv_lengths", "softmax_attention", "softmax_attention_step"]
