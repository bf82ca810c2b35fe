"""Tokenized corpora: token ids as raw little-endian ``uint16`` or ``uint32`` ``.bin`` files (no
header: nanoGPT's convention, and that of many pre-tokenization scripts), memory-mapped with
numpy, and text tokenized once into that form by a local tokenizer.

Pre-tokenized data (``load_token_bins``). A folder holding ``train.bin`` is split by name, as
nanoGPT writes it: ``train.bin`` is the training split and ``val.bin`` (required) the
validation split; other files are ignored. Any other folder: every ``*.bin`` file under it is a
document (files sorted by relative path) and the byte corpora's rule splits them (``text.py``: a
file is validation when the SHA-1 of its relative path is 0 mod 20, at least one file). A
single ``.bin`` file (given as the data, or alone in its folder) is cut into its first 95 % and
last 5 % of tokens. A split made of one file is a memory map of it (nothing is read into
memory); a split of several files is joined in memory (4 bytes a token at most). The dtype is
``uint16`` when ``vocab_size`` <= 65536, else ``uint32``, unless given: a file written with the
other width is read wrongly, and the range check below usually says so. Every id must be below
``vocab_size``: checked when the corpus is opened, by a max over the memory map in blocks of
16M tokens, and reported with the file and position of the first offending id.

Tokenized text (``tokenize_corpus``). The documents of ``text.corpus_documents`` (``stdlib``, a
text file or a folder, split exactly as for bytes) are decoded as UTF-8 (invalid bytes replaced)
and each encoded on its own, without special tokens, with a newline appended to every document
but the last of its split (the byte corpora join files with a newline). The ids go to
``train.bin`` / ``val.bin`` (+ ``*.starts.npy``, the document offsets for packing) in a cache
folder ``<cache_root>/tokens-<key>``, ``key`` the SHA-256 of the tokenizer's hash and the
corpus fingerprint (every document's path, byte range, size and modification time): another
tokenizer or an edited file makes another folder, an unchanged corpus reuses the folder while
its ``meta.json`` and file sizes agree. The folder is written under a temporary name
(``.tokens-<key>.tmp-<random>-<pid>``; those of killed processes are deleted by the next
writer) and renamed once complete, so it is complete or absent; concurrent writers (torchrun
ranks) each write their own and the first rename wins.

Tokenizers (``load_tokenizer``): a ``tokenizer.json`` file, read with the ``tokenizers``
package, or a transformers tokenizer folder, read with ``AutoTokenizer.from_pretrained(path,
local_files_only=True)`` (nothing is downloaded). ``tokenizer_sha256``: the SHA-256 of the file,
or of the names and contents of the folder's ``TOKENIZER_FILES``. A model folder may carry the
tokenizer its ids come from (``copy_tokenizer``, ``carried_tokenizer``): a file as
``tokenizer.json``, a folder's ``TOKENIZER_FILES`` in ``tokenizer/``; the copy has the
original's hash.

Dimension legend: n tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._checks import is_int
from .._files import file_digest, remove_dead_temporaries
from .._names import TOKEN_DTYPES
from .text import (  # TokenData and SOURCES live in text.py, which Corpus needs them in
    Corpus,
    Document,
    TokenData,
    corpus_documents,
    load_corpus,
    split_documents,
)

# The files of a transformers tokenizer folder that decide how text is encoded (hashed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")
CACHE_VERSION = 1  # bump when the cache's layout or the tokenization rule changes
META_FILE = "meta.json"
_BLOCK = 1 << 24  # tokens per block of the range check
_BATCH_BYTES = 1 << 22  # text per encode_batch call
_SPLITS = ("train", "val")


def dtype_for(vocab_size: int, dtype: str | None = None) -> str:
    """The dtype of ids below ``vocab_size``: ``dtype`` when given (it must hold them), else
    uint16 up to 65536 ids and uint32 beyond."""
    if not is_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if dtype is None:
        dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    bits = np.dtype(dtype).itemsize * 8
    if vocab_size > 1 << bits:
        raise ValueError(f"vocab_size {vocab_size} does not fit token_dtype {dtype} (ids up to "
                         f"{(1 << bits) - 1}); use uint32")
    return dtype


def _memmap(path: Path, dtype: str) -> np.ndarray:
    """[n] the ids of ``path`` (little-endian ``dtype``), memory-mapped copy-on-write (torch
    wants a writable array; nothing is ever written back to the file)."""
    item = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % item:
        raise ValueError(f"token file {path} has {size} bytes, not a multiple of {item}: it does "
                         f"not hold {dtype} ids (is token_dtype right?)")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="c")


def check_ids(name: str, ids: np.ndarray, vocab_size: int) -> None:
    """Every id of ``ids`` [n] must be below ``vocab_size``, else ValueError naming ``name`` and
    the first offending id's position. Reads the array once, in blocks (a memory map stays
    unloaded)."""
    if ids.size == 0 or vocab_size > np.iinfo(ids.dtype).max:
        return
    for first in range(0, ids.size, _BLOCK):
        block = ids[first:first + _BLOCK]
        if int(block.max()) >= vocab_size:
            at = first + int(np.argmax(block >= vocab_size))
            raise ValueError(f"{name} holds token id {int(ids[at])} at position {at}, not below "
                             f"vocab_size {vocab_size} (read as {ids.dtype.name}: is the "
                             "vocabulary size or the token dtype wrong?)")


def _join(parts: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream of ``parts`` one after the other (a view of the single part, else a copy) and
    the offsets where each begins: [n] ids, [len(parts)] int64."""
    lengths = [p.size for p in parts]
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
    stream = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return torch.from_numpy(stream), starts


def is_token_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder of ``.bin`` token files: it holds ``train.bin``, or every
    non-empty file under it is a ``.bin`` file (at least one)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / "train.bin").is_file():
        return True
    files = [f for f in path.rglob("*") if f.is_file() and f.stat().st_size]
    return bool(files) and all(f.suffix == ".bin" for f in files)


def _bin_splits(path: Path) -> tuple[list[Document], list[Document]] | Path:
    """The files of each split, or the one file to cut 95 / 5 (module docstring)."""
    if path.is_file():
        return path
    if (path / "train.bin").is_file():
        if not (path / "val.bin").is_file():
            raise ValueError(f"data {path} holds train.bin but no val.bin (the validation split)")
        return [Document(path / "train.bin")], [Document(path / "val.bin")]
    files = sorted((f for f in path.rglob("*.bin") if f.is_file() and f.stat().st_size),
                   key=lambda f: f.relative_to(path).as_posix())
    if not files:
        raise ValueError(f"data {path} holds no non-empty .bin token files")
    return files[0] if len(files) == 1 else split_documents(str(path), path, files)


def load_token_bins(spec: str | Path, vocab_size: int, token_dtype: str | None = None) -> Corpus:
    """The pre-tokenized corpus at ``spec`` (a folder of ``.bin`` files or one file; splits,
    dtype and checks in the module docstring): streams of ``token_dtype`` ids, every one below
    ``vocab_size`` (ValueError naming the file otherwise)."""
    dtype = dtype_for(vocab_size, token_dtype)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data path {spec} does not exist")
    splits = _bin_splits(path)
    if isinstance(splits, Path):
        ids = _memmap(splits, dtype)
        if ids.size < 2:
            raise ValueError(f"token file {splits} holds {ids.size} ids, fewer than 2")
        check_ids(str(splits), ids, vocab_size)
        cut = ids.size - max(1, ids.size // 20)
        parts: list[list[np.ndarray]] = [[ids[:cut]], [ids[cut:]]]
    else:
        parts = [[_memmap(d.path, dtype) for d in docs] for docs in splits]
        for docs, arrays in zip(splits, parts):
            for d, ids in zip(docs, arrays):
                check_ids(str(d.path), ids, vocab_size)
    (train, train_starts), (val, val_starts) = (_join(p) for p in parts)
    return Corpus(str(path), train, val, train_starts, val_starts,
                  tokens=TokenData("bin", vocab_size, dtype))


def tokenizer_sha256(path: str | Path) -> str:
    """The hash that identifies a tokenizer: SHA-256 of a ``tokenizer.json`` file, or of the
    names and contents of a folder's ``TOKENIZER_FILES`` (ValueError when it holds none)."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)[1]
    if not path.is_dir():
        raise ValueError(f"tokenizer {path} does not exist (a tokenizer.json file or a "
                         "transformers tokenizer folder)")
    h = hashlib.sha256()
    names = [n for n in TOKENIZER_FILES if (path / n).is_file()]
    if not names:
        raise ValueError(f"tokenizer folder {path} holds none of {', '.join(TOKENIZER_FILES)}")
    for name in names:
        h.update(f"{name}\0{file_digest(path / name)[1]}\0".encode())
    return h.hexdigest()


class TextTokenizer:
    """A local tokenizer with ``ByteTokenizer``'s interface (``encode``, ``decode``,
    ``vocab_size``) and ``encode_batch``; ``path`` (absolute) and ``sha256`` identify it. No
    special tokens are added on encoding."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        self.sha256 = tokenizer_sha256(self.path)
        self._hf = self.path.is_dir()  # a transformers folder, else a tokenizers file
        try:
            if self._hf:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
                self.vocab_size = len(self._tok)
            else:
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(self.path))
                self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        except ImportError as err:
            raise ValueError(f"reading tokenizer {path} needs the {err.name} package "
                             f"(pip install {err.name})") from None
        except Exception as err:  # the tokenizers / transformers loaders raise many kinds
            raise ValueError(f"cannot load tokenizer {path}: {type(err).__name__}: {err}") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, without special tokens."""
        if self._hf:
            return self._tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> torch.Tensor:
        """str -> [n] long."""
        return torch.tensor(self.encode_batch([text])[0], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer at ``path`` (module docstring); ValueError when it cannot be read."""
    return TextTokenizer(path)


CARRIED_FILE, CARRIED_FOLDER = "tokenizer.json", "tokenizer"  # a model folder's tokenizer


def carried_tokenizer(folder: str | Path) -> Path | None:
    """The tokenizer model folder ``folder`` carries (``copy_tokenizer``): its
    ``tokenizer.json`` file or its ``tokenizer/`` folder; None when it carries none."""
    folder = Path(folder)
    if (folder / CARRIED_FILE).is_file():
        return folder / CARRIED_FILE
    if (folder / CARRIED_FOLDER).is_dir():
        return folder / CARRIED_FOLDER
    return None


def copy_tokenizer(src: str | Path, folder: str | Path) -> list[str]:
    """Copy tokenizer ``src`` into model folder ``folder`` for ``carried_tokenizer``: a
    tokenizer.json file as ``tokenizer.json``, a transformers tokenizer folder's
    ``TOKENIZER_FILES`` into ``tokenizer/`` (nothing else: such a folder is often a whole model's).
    The copy has ``src``'s ``tokenizer_sha256``. Returns the files written, relative to
    ``folder``; ValueError for a ``src`` that is not a tokenizer (``tokenizer_sha256``'s)."""
    src, folder = Path(src), Path(folder)
    tokenizer_sha256(src)  # the checks of a tokenizer file or folder
    if src.is_file():
        names = [CARRIED_FILE]
        shutil.copyfile(src, folder / CARRIED_FILE)
    else:
        (folder / CARRIED_FOLDER).mkdir()
        names = [f"{CARRIED_FOLDER}/{n}" for n in TOKENIZER_FILES if (src / n).is_file()]
        for name in names:
            shutil.copyfile(src / name.split("/", 1)[1], folder / name)
    return names


def _fingerprint(splits: Sequence[Sequence[Document]]) -> list[list[Any]]:
    """What names a corpus's content without reading it: every document's path, byte range,
    size and modification time, split by split."""
    rows = []
    for split, docs in zip(_SPLITS, splits):
        for d in docs:
            st = d.path.stat()
            rows.append([split, str(d.path.resolve()), d.start, d.stop, st.st_size, st.st_mtime_ns])
    return rows


def _read_meta(folder: Path, key: str) -> dict[str, Any] | None:
    """The cache folder's meta.json when it is complete (its key, and files of the recorded
    sizes), else None."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if meta.get("key") != key:
            return None
        item = np.dtype(meta["dtype"]).itemsize
        for split in _SPLITS:
            if (folder / f"{split}.bin").stat().st_size != meta[f"{split}_tokens"] * item:
                return None
            if np.load(folder / f"{split}.starts.npy").shape != (meta[f"{split}_documents"],):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def _batches(docs: Sequence[Document]) -> Iterator[list[tuple[bytes, bool]]]:
    """Documents read in groups of about ``_BATCH_BYTES``: (bytes, is the last of the split)."""
    batch: list[tuple[bytes, bool]] = []
    size = 0
    for i, d in enumerate(docs):
        data = d.read()
        batch.append((data, i == len(docs) - 1))
        size += len(data)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_split(folder: Path, split: str, docs: Sequence[Document], tok: TextTokenizer,
                 dtype: str, bar: Any) -> tuple[int, int]:
    """Tokenize ``docs`` into ``folder/<split>.bin`` and ``<split>.starts.npy``, fsync'ed:
    (tokens, documents)."""
    lengths: list[int] = []
    with open(folder / f"{split}.bin", "wb") as f:
        for batch in _batches(docs):
            texts = [data.decode("utf-8", errors="replace") + ("" if last else "\n")
                     for data, last in batch]
            for ids in tok.encode_batch(texts):
                arr = np.asarray(ids, dtype=np.int64)
                check_ids(f"tokenizer {tok.path}'s output", arr, tok.vocab_size)
                arr.astype(np.dtype(dtype).newbyteorder("<")).tofile(f)
                lengths.append(arr.size)
            bar.update(sum(len(data) for data, _ in batch))
        f.flush()
        os.fsync(f.fileno())
    np.save(folder / f"{split}.starts.npy", np.cumsum([0, *lengths[:-1]], dtype=np.int64))
    return sum(lengths), len(lengths)


def _write_cache(folder: Path, meta: dict[str, Any], splits: Sequence[Sequence[Document]],
                 tok: TextTokenizer, progress: bool) -> None:
    """Tokenize into a temporary folder beside ``folder``, then rename it to ``folder``
    (replacing an incomplete one; kept if another process completed it first)."""
    from tqdm import tqdm

    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(folder.parent, f".{folder.name}.tmp-*")
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}-{os.getpid()}")
    tmp.mkdir()
    total = sum((d.stop if d.stop is not None else d.path.stat().st_size) - d.start
                for docs in splits for d in docs)
    try:
        with tqdm(total=total, desc="tokenize", unit="B", unit_scale=True,
                  disable=not progress) as bar:
            for split, docs in zip(_SPLITS, splits):
                meta[f"{split}_tokens"], meta[f"{split}_documents"] = _write_split(
                    tmp, split, docs, tok, meta["dtype"], bar)
        with open(tmp / META_FILE, "w") as f:  # written last: its presence means complete
            f.write(json.dumps(meta, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if folder.exists() and _read_meta(folder, meta["key"]) is None:
            shutil.rmtree(folder)  # an incomplete or damaged cache of this key
        try:
            os.rename(tmp, folder)
        except OSError:
            if _read_meta(folder, meta["key"]) is None:
                raise
            shutil.rmtree(tmp)  # another process (a torchrun rank) finished first
            return
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd = os.open(folder.parent, os.O_RDONLY)  # make the rename durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tokenize_corpus(spec: str, tokenizer: str | Path | TextTokenizer, cache_root: str | Path, *,
                    progress: bool = False) -> Corpus:
    """The text corpus ``spec`` (``load_corpus``'s: ``stdlib``, a file or a folder) as token ids
    of ``tokenizer``, from its cache folder in ``cache_root``, tokenized there first when absent
    or incomplete (with a progress bar when ``progress``; module docstring)."""
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)
    name, *splits = corpus_documents(spec)
    dtype = dtype_for(tok.vocab_size)
    key = hashlib.sha256(json.dumps(
        {"version": CACHE_VERSION, "tokenizer": tok.sha256, "documents": _fingerprint(splits)}
    ).encode()).hexdigest()
    folder = Path(cache_root) / f"tokens-{key[:32]}"
    meta = _read_meta(folder, key)
    if meta is None:
        meta = {"version": CACHE_VERSION, "key": key, "data": name, "tokenizer": str(tok.path),
                "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size, "dtype": dtype}
        _write_cache(folder, meta, splits, tok, progress)
    streams = [torch.from_numpy(_memmap(folder / f"{s}.bin", dtype)) for s in _SPLITS]
    starts = [torch.from_numpy(np.load(folder / f"{s}.starts.npy")) for s in _SPLITS]
    return Corpus(name, streams[0], streams[1], starts[0], starts[1],
                  tokens=TokenData("tokenizer", tok.vocab_size, dtype, str(tok.path), tok.sha256,
                                   str(folder.resolve())))


def open_corpus(data: str, *, vocab_size: int | None = None, token_dtype: str | None = None,
                tokenizer: str | Path | TextTokenizer | None = None,
                cache_root: str | Path | None = None, progress: bool = False) -> Corpus:
    """The corpus ``data`` names, in one of three forms: with ``tokenizer``, text tokenized into
    ``cache_root`` (``tokenize_corpus``; the vocabulary is the tokenizer's); with
    ``vocab_size``, pre-tokenized ``.bin`` files (``load_token_bins``, ``token_dtype``
    optional); else bytes (``load_corpus``). A folder of ``.bin`` files without ``vocab_size``
    is refused rather than read as bytes."""
    if tokenizer is not None:
        if vocab_size is not None or token_dtype is not None:
            raise ValueError("vocab_size and token_dtype are for pre-tokenized .bin data; with a "
                             "tokenizer the ids and their dtype follow its vocabulary")
        if cache_root is None:
            raise ValueError("a tokenizer needs cache_root, the folder of tokenized corpora")
        return tokenize_corpus(data, tokenizer, cache_root, progress=progress)
    if vocab_size is not None:
        return load_token_bins(data, vocab_size, token_dtype)
    if token_dtype is not None:
        raise ValueError("token_dtype needs vocab_size (pre-tokenized .bin data)")
    if data != "stdlib" and is_token_folder(data):
        raise ValueError(f"data {data} holds .bin token files: give their vocab_size (every id "
                         "is below it) to train on the token ids")
    return load_corpus(data)
