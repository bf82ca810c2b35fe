"""Data: the synthetic memory tasks (retrieval, MQAR, passkey) and byte-level text corpora."""

from .mqar import mqar_batch
from .passkey import (
    PASSKEY_WORDS,
    passkey_prompt,
    passkey_word_ids,
    token_passkey,
    token_passkey_vocab,
)
from .retrieval import RetrievalBatch, last_value, retrieval_batch, retrieval_eval_batch
from .text import ByteTokenizer, Corpus, eval_windows, load_corpus, random_windows

__all__ = [
    "PASSKEY_WORDS",
    "ByteTokenizer",
    "Corpus",
    "RetrievalBatch",
    "eval_windows",
    "last_value",
    "load_corpus",
    "mqar_batch",
    "passkey_prompt",
    "passkey_word_ids",
    "random_windows",
    "retrieval_batch",
    "retrieval_eval_batch",
    "token_passkey",
    "token_passkey_vocab",
]
