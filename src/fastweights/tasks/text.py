"""Text corpora as byte streams, and the byte-level tokenizer (vocabulary 256, no extra tokens).

``load_corpus("stdlib")`` reads the running Python's own standard library ``.py`` files
(``sysconfig.get_paths()["stdlib"]``, without site-packages), sorted by relative path; a file
goes to validation when the SHA-1 of its relative path is 0 mod 20 (about 5 %), so the split is
the same on every machine with the same Python. A folder is read the same way (every file,
undecodable bytes kept as they are); a single file is split into its first 95 % (train) and last
5 % (validation). Files are joined with a newline; there is no end-of-text token.
``corpus_documents`` names the same documents without reading them (the tokenized corpora of
``tokens.py`` are made from them). The window functions below take any 1-D integer stream:
bytes, or the uint16/uint32 token ids of ``tokens.py``, memory-mapped.

Dimension legend: N batch, T sequence length.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._checks import is_int
from .._names import TOKEN_DTYPES

VOCAB_SIZE = 256
VAL_EVERY = 20  # one file in VAL_EVERY (by path hash) is validation


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding replaces invalid sequences."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        """str -> [n] long."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return bytes(int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)).decode(
            "utf-8", errors="replace")


SOURCES = ("bin", "tokenizer")  # how a token corpus was made (TokenData.source)


@dataclass(frozen=True)
class TokenData:
    """What a token corpus is, as run.json records it under ``tokens``: ``source`` "bin"
    (pre-tokenized files) or "tokenizer" (text tokenized by the tokenizer at ``tokenizer``, of
    hash ``tokenizer_sha256``, into the cache folder ``cache``), ``vocab_size`` (every id is
    below it) and the ids' ``dtype``. ``identity`` leaves out the paths: a run moved with its
    tokenizer is the same run."""

    source: str
    vocab_size: int
    dtype: str
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None
    cache: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"tokens.source must be one of {SOURCES}, got {self.source!r}")
        if not is_int(self.vocab_size) or self.vocab_size < 1:
            raise ValueError(f"tokens.vocab_size must be a positive int, got {self.vocab_size!r}")
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"tokens.dtype must be one of {TOKEN_DTYPES}, got {self.dtype!r}")
        if (self.source == "tokenizer") != isinstance(self.tokenizer_sha256, str):
            raise ValueError("tokens.tokenizer_sha256 is required with source 'tokenizer' and "
                             "only then")

    def identity(self) -> tuple[str, int, str, str | None]:
        """What must agree for two runs to read the same ids."""
        return self.source, self.vocab_size, self.dtype, self.tokenizer_sha256

    def describe(self) -> str:
        """One line for messages."""
        where = ("pre-tokenized .bin files" if self.tokenizer_sha256 is None else
                 f"tokenizer {self.tokenizer} (sha256 {self.tokenizer_sha256[:12]})")
        return f"{self.dtype} ids below {self.vocab_size} from {where}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenData:
        """The inverse of ``to_dict``; TypeError for unknown or missing fields."""
        if not isinstance(d, dict):
            raise TypeError(f"tokens must be a JSON object, got {d!r}")
        return cls(**d)



@dataclass
class Corpus:
    """train, val: [n] uint8 byte streams, or token ids (uint16/uint32) when ``tokens``
    describes how they were made (``tokens.py``); name: what was loaded; train_starts,
    val_starts: int64 offsets where each document (file) begins in its stream (for packed
    training)."""

    name: str
    train: torch.Tensor
    val: torch.Tensor
    train_starts: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))
    val_starts: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))
    tokens: TokenData | None = None  # None: bytes

    @property
    def vocab_size(self) -> int:
        """Every id in the streams is below this: 256 for bytes."""
        return VOCAB_SIZE if self.tokens is None else self.tokens.vocab_size


def _is_val(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % VAL_EVERY == 0


@dataclass(frozen=True)
class Document:
    """One document of a corpus: bytes [start, stop) of the file ``path`` (``stop`` None: to
    its end). A folder's documents are whole files; a single file's two splits are parts of it."""

    path: Path
    start: int = 0
    stop: int | None = None

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read() if self.stop is None else f.read(self.stop - self.start)


def split_documents(name: str, root: Path, files: list[Path]) -> tuple[list[Document], list[Document]]:
    """The files under ``root`` as (training, validation) documents by the path-hash rule
    (module docstring); ValueError when no training file is left."""
    parts: dict[bool, list[Document]] = {False: [], True: []}
    for f in files:
        parts[_is_val(f.relative_to(root).as_posix())].append(Document(f))
    if not parts[True] and parts[False]:  # tiny folders: keep at least one validation file
        parts[True].append(parts[False].pop())
    if not parts[False]:
        raise ValueError(f"data {name} needs at least two non-empty files, found {len(files)}")
    return parts[False], parts[True]


def corpus_documents(spec: str) -> tuple[str, list[Document], list[Document]]:
    """The documents ``load_corpus(spec)`` reads, without reading them: (name, training
    documents, validation documents), each list in stream order (module docstring). A missing
    path or an empty corpus raises ValueError."""
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            (f for f in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts) and f.is_file()),
            key=lambda f: f.relative_to(root).as_posix())
        return "stdlib", *split_documents("stdlib", root, [f for f in files if f.stat().st_size])
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data path {spec} does not exist (use 'stdlib' or a text file or folder)")
    if path.is_dir():
        files = sorted((f for f in path.rglob("*") if f.is_file() and f.stat().st_size),
                       key=lambda f: f.relative_to(path).as_posix())
        return str(path), *split_documents(str(path), path, files)
    size = path.stat().st_size
    if size < 2:
        raise ValueError(f"data file {spec} is empty")
    cut = size - max(1, size // 20)
    return str(path), [Document(path, 0, cut)], [Document(path, cut)]


def _doc_starts(lengths: list[int]) -> torch.Tensor:
    """Offsets of each document in a stream of documents of ``lengths`` joined by one
    separator (a newline byte or token)."""
    return torch.tensor([0] + [n + 1 for n in lengths[:-1]], dtype=torch.long).cumsum(0)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def load_corpus(spec: str) -> Corpus:
    """``"stdlib"`` or a path to a text file or folder (see the module docstring) as bytes. A
    missing path or an empty corpus raises ValueError."""
    name, *splits = corpus_documents(spec)
    texts = [[d.read() for d in docs] for docs in splits]
    (train, val), (train_starts, val_starts) = ([_bytes(b"\n".join(t)) for t in texts],
                                                [_doc_starts([len(d) for d in t]) for t in texts])
    return Corpus(name, train, val, train_starts, val_starts)


def _unit(data: torch.Tensor) -> str:
    """What the ids of a stream are: bytes (uint8) or tokens."""
    return "bytes" if data.dtype == torch.uint8 else "tokens"


def _window_starts(data: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    if data.numel() < seq_len + 1:
        raise ValueError(f"the corpus has {data.numel()} {_unit(data)}, fewer than seq_len + 1 = {seq_len + 1}")
    return torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)


def _windows(data: torch.Tensor, start: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    win = data[start[:, None] + torch.arange(seq_len + 1)].long()
    return win[:, :-1], win[:, 1:]


def random_windows(data: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs [N, T] and next-byte targets [N, T] (long)."""
    return _windows(data, _window_starts(data, batch_size, seq_len, generator), seq_len)


def packed_windows(data: torch.Tensor, doc_starts: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator, rows: tuple[int, int] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The windows of ``random_windows`` (same draws), packed into one row for training with
    state resets at document boundaries: inputs [1, n*T], targets [1, n*T] and ``cu_seqlens``
    cutting at every row start and every document start inside a row, for the window rows
    ``rows = (first, stop)`` (default all N; a DDP rank takes its share). A target that would
    cross into the next document (the last byte of a document predicting the first byte of the
    next) is set to -100, the ignore index, so no prediction spans two documents."""
    row_starts = _window_starts(data, batch_size, seq_len, generator)
    first, stop = rows if rows is not None else (0, batch_size)
    x, y = _windows(data, row_starts[first:stop], seq_len)
    y = y.clone()  # x and y are views of one buffer; masking y must not touch x
    starts = doc_starts.tolist()
    cuts = [0]
    for row, s in enumerate(row_starts[first:stop].tolist()):
        # Row covers stream positions [s, s + T): x[row, i] is byte s + i, y[row, i] byte s + i + 1.
        i = bisect.bisect_right(starts, s)
        while i < len(starts) and starts[i] <= s + seq_len:
            d = starts[i] - s
            y[row, d - 1] = -100
            if d < seq_len:
                cuts.append(row * seq_len + d)
            i += 1
        cuts.append((row + 1) * seq_len)
    return x.reshape(1, -1), y.reshape(1, -1), torch.tensor(cuts, dtype=torch.long)


def stream_shard_len(data: torch.Tensor, batch_size: int) -> int:
    """Bytes of each row's share of ``data`` when it is cut into ``batch_size`` equal parts (the
    remainder at the end is not counted): ``TrainConfig.carry_state`` asks for at least one
    window in it."""
    return data.numel() // batch_size


def segment_windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int,
                    window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Carried-state training batches: row r reads its stream segment from ``starts[r]``; window
    ``window`` of it covers bytes ``starts[r] + window * seq_len`` onward, so windows 0, 1, ...
    are consecutive pieces of one stream per row. Inputs [N, T] and next-byte targets [N, T]
    (long); every row's window and its next byte must lie inside ``data``."""
    offsets = starts.long() + window * seq_len
    if starts.dim() != 1 or window < 0 or bool((offsets < 0).any()) or \
            bool((offsets > data.numel() - seq_len - 1).any()):
        raise ValueError(f"window {window} of the segments starting at {starts.tolist()} does not "
                         f"fit in the {data.numel()} {_unit(data)} of data (windows of seq_len + 1 "
                         f"= {seq_len + 1})")
    return _windows(data, offsets, seq_len)


def spread_starts(doc_starts: torch.Tensor, total: int, length: int, n: int) -> torch.Tensor:
    """Start offsets [n] of ``n`` stretches of ``length`` items spread over every document of a
    stream of ``total`` items whose documents begin at ``doc_starts`` (documents joined by one
    separator): each document that holds a stretch gets at least one (when ``n`` allows) and the
    rest in proportion to its size, evenly spaced inside it, every stretch within its document.
    Deterministic; in stream order. ValueError when no document holds ``length`` items or
    ``n`` stretches do not fit."""
    bounds = [*doc_starts.tolist(), total + 1]
    docs = [(a, b - 1 - a) for a, b in itertools.pairwise(bounds) if b - 1 - a >= length]
    if not docs:
        raise ValueError(f"no document holds {length} items")
    room = [size // length for _, size in docs]  # non-overlapping stretches each can take
    if n > sum(room):
        raise ValueError(f"{n} stretches of {length} items do not fit in the documents "
                         f"({sum(room)} fit)")
    if n < len(docs):  # fewer stretches than documents: every k-th document, evenly
        picked = [docs[round(i * (len(docs) - 1) / max(1, n - 1))] for i in range(n)] if n > 1 \
            else [docs[len(docs) // 2]]
        return torch.tensor([a + (size - length) // 2 for a, size in picked], dtype=torch.long)
    counts = [1] * len(docs)
    sizes = [size for _, size in docs]
    while sum(counts) < n:  # the next stretch to the document with the most items per stretch
        i = max((i for i in range(len(docs)) if counts[i] < room[i]),
                key=lambda i: sizes[i] / (counts[i] + 1))
        counts[i] += 1
    out = []
    for (a, size), k in zip(docs, counts):
        gap = (size - k * length) / k  # free items per stretch, spread around each
        out += [a + int(gap / 2 + i * (length + gap)) for i in range(k)]
    return torch.tensor(out, dtype=torch.long)


def spread_windows(data: torch.Tensor, doc_starts: torch.Tensor, seq_len: int,
                   n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` evaluation windows spread over every document of ``data`` (``spread_starts`` with
    stretches of seq_len + 1): inputs [n, T] and next-byte targets [n, T] (long). Unlike
    ``eval_windows`` (the start of the split) they sample every validation file."""
    return _windows(data, spread_starts(doc_starts, data.numel(), seq_len + 1, n), seq_len)


def eval_windows(data: torch.Tensor, seq_len: int, max_windows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive non-overlapping windows from the start of ``data`` (deterministic):
    inputs [n, T] and targets [n, T]; at most ``max_windows``."""
    n = (data.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"the validation data has {data.numel()} {_unit(data)}, fewer than seq_len + 1 = {seq_len + 1}")
    x = data[: n * seq_len].long().view(n, seq_len)
    y = data[1: n * seq_len + 1].long().view(n, seq_len)
    return x, y
