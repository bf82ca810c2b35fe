"""Data: the synthetic memory tasks (retrieval, MQAR, passkey), byte-level text corpora and
tokenized corpora (memory-mapped .bin token files, text tokenized by a local tokenizer)."""

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
from .tokens import (
    TextTokenizer,
    TokenData,
    load_token_bins,
    load_tokenizer,
    open_corpus,
    tokenize_corpus,
)

__all__ = [
    "PASSKEY_WORDS",
    "ByteTokenizer",
    "Corpus",
    "RetrievalBatch",
    "TextTokenizer",
    "TokenData",
    "eval_windows",
    "last_value",
    "load_corpus",
    "load_token_bins",
    "load_tokenizer",
    "mqar_batch",
    "open_corpus",
    "passkey_prompt",
    "passkey_word_ids",
    "random_windows",
    "retrieval_batch",
    "retrieval_eval_batch",
    "token_passkey",
    "token_passkey_vocab",
    "tokenize_corpus",
]
