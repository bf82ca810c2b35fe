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
import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tokens import TokenData

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
    """Bytes of each row's stream in carried-state training: ``data`` cut into ``batch_size``
    contiguous shards of this length (the remainder at the end is not read)."""
    return data.numel() // batch_size


def stream_windows(data: torch.Tensor, batch_size: int, seq_len: int,
                   position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Carried-state training batches: row r reads shard r of ``data`` (``stream_shard_len``
    bytes from r times that length) at offset ``position``, so consecutive positions
    (``position + seq_len``, ...) give consecutive windows of one long stream per row. Inputs
    [N, T] and next-byte targets [N, T] (long); ``position + seq_len + 1`` must fit in a shard."""
    shard = stream_shard_len(data, batch_size)
    if not 0 <= position <= shard - seq_len - 1:
        raise ValueError(f"position must be in [0, {shard - seq_len - 1}] (shards of {shard} "
                         f"bytes, windows of seq_len + 1 = {seq_len + 1}), got {position}")
    return _windows(data, torch.arange(batch_size) * shard + position, seq_len)


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
