"""Tokenized corpora (tasks/tokens.py) and training on them: memory-mapped ``.bin`` folders of
uint16/uint32 ids, text tokenized once by a local tokenizer into a reused cache, the id range
check, and run.json's record of the tokens that a resumed run must match."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastweights.models import LMConfig
from fastweights.tasks.text import corpus_documents, eval_windows, random_windows
from fastweights.tasks.tokens import (
    TextTokenizer,
    load_token_bins,
    load_tokenizer,
    open_corpus,
    tokenize_corpus,
)
from fastweights.train.trainer import RUN_FILE, TrainConfig, read_run, train

tokenizers = pytest.importorskip("tokenizers")

LINES = [f"the {a} sat on the mat {i}, said {b}.\n" for i in range(12)
         for a, b in (("cat", "Ann"), ("dog", "Bo"), ("owl", "Cy"))]


def make_tokenizer(path, vocab_size: int = 300, extra: str = "") -> str:
    """A byte-level BPE tokenizer.json trained on LINES (no download); ``extra`` lines make a
    different tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES + [extra] * 20 if extra else LINES, trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(5):
        (folder / f"note{i}.txt").write_text("".join(LINES[i::2]) + f"é ünïcode {i}\n")
    return folder


@pytest.fixture
def tokenizer(tmp_path):
    return make_tokenizer(tmp_path / "tokenizer.json")


def expected_ids(tok: TextTokenizer, docs) -> list[int]:
    """The documented rule: each document encoded on its own, a newline appended to all but
    the last of its split."""
    ids: list[int] = []
    for i, d in enumerate(docs):
        text = d.read().decode("utf-8", errors="replace") + ("" if i == len(docs) - 1 else "\n")
        ids += tok.encode(text).tolist()
    return ids


def test_memmap_windows_equal_the_tokenizers_ids(texts, tokenizer, tmp_path):
    corpus = tokenize_corpus(str(texts), tokenizer, tmp_path / "cache")
    tok = load_tokenizer(tokenizer)
    _, train_docs, val_docs = corpus_documents(str(texts))
    assert len(train_docs) == 4 and len(val_docs) == 1  # the byte corpora's split
    for stream, starts, docs in ((corpus.train, corpus.train_starts, train_docs),
                                 (corpus.val, corpus.val_starts, val_docs)):
        want = torch.tensor(expected_ids(tok, docs))
        assert stream.dtype == torch.uint16 and torch.equal(stream.long(), want)
        first = [tok.encode(d.read().decode() + "\n").numel() for d in docs[:-1]]
        assert starts.tolist() == np.cumsum([0, *first]).tolist()
    gen = torch.Generator().manual_seed(3)
    x, y = random_windows(corpus.train, 5, 7, gen)
    s = torch.randint(0, corpus.train.numel() - 7, (5,), generator=torch.Generator().manual_seed(3))
    full = corpus.train.long()
    for row in range(5):  # the window at each drawn start, and its next-token targets
        assert torch.equal(x[row], full[s[row]:s[row] + 7])
        assert torch.equal(y[row], full[s[row] + 1:s[row] + 8])
    xv, _ = eval_windows(corpus.val, 6, 2)
    assert torch.equal(xv.flatten(), corpus.val[:12].long())
    # The memory map reads the cache file: its bytes are the ids, little-endian uint16.
    raw = np.fromfile(os.path.join(corpus.tokens.cache, "train.bin"), dtype="<u2")
    assert raw.tolist() == full.tolist()
    assert corpus.tokens.vocab_size == tok.vocab_size == corpus.vocab_size
    assert corpus.tokens.tokenizer_sha256 == tok.sha256


def test_cache_is_reused_and_remade_when_the_corpus_or_tokenizer_changes(texts, tokenizer,
                                                                         tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = tokenize_corpus(str(texts), tokenizer, cache)
    folder, want = first.tokens.cache, first.train.clone()

    def no_encoding(self, texts):
        raise AssertionError("the cached corpus was tokenized again")

    with monkeypatch.context() as m:
        m.setattr(TextTokenizer, "encode_batch", no_encoding)
        again = tokenize_corpus(str(texts), tokenizer, cache)
    assert again.tokens.cache == folder and torch.equal(again.train, want)
    del first, again  # memory maps of the file truncated below
    # A damaged cache (truncated ids) is not trusted: it is made again, complete.
    with open(os.path.join(folder, "train.bin"), "r+b") as f:
        f.truncate(10)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = cache / f".{os.path.basename(folder)}.tmp-0a1b2c3d-{dead}"  # a killed writer's
    left.mkdir()
    remade = tokenize_corpus(str(texts), tokenizer, cache)
    assert not left.exists()
    assert remade.tokens.cache == folder and torch.equal(remade.train, want)
    # An edited document, or another tokenizer: another cache folder.
    (texts / "note1.txt").write_text("the owl said nothing at all\n")
    edited = tokenize_corpus(str(texts), tokenizer, cache)
    other = tokenize_corpus(str(texts), make_tokenizer(tmp_path / "t2.json", extra="zebra"), cache)
    assert len({folder, edited.tokens.cache, other.tokens.cache}) == 3
    assert sorted(p.name.startswith("tokens-") for p in cache.iterdir()) == [True] * 3  # no temporaries


def write_ids(path, ids, dtype):
    np.asarray(ids, dtype=dtype).tofile(path)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_folder_nanogpt_names(tmp_path, dtype):
    vocab = 70_000 if dtype == "uint32" else 1000
    rng = np.random.default_rng(0)
    train_ids, val_ids = rng.integers(0, vocab, 500), rng.integers(0, vocab, 60)
    train_ids[7] = vocab - 1  # the largest id is allowed
    write_ids(tmp_path / "train.bin", train_ids, dtype)
    write_ids(tmp_path / "val.bin", val_ids, dtype)
    (tmp_path / "meta.pkl").write_bytes(b"ignored")
    corpus = load_token_bins(tmp_path, vocab)  # dtype inferred from the vocabulary
    assert corpus.train.dtype == getattr(torch, dtype) and corpus.tokens.dtype == dtype
    assert corpus.train.long().tolist() == train_ids.tolist()
    assert corpus.val.long().tolist() == val_ids.tolist()
    assert corpus.vocab_size == vocab and corpus.tokens.tokenizer_sha256 is None
    x, y = random_windows(corpus.train, 3, 9, torch.Generator().manual_seed(1))
    s = torch.randint(0, 500 - 9, (3,), generator=torch.Generator().manual_seed(1))
    assert x[1].tolist() == train_ids[int(s[1]):int(s[1]) + 9].tolist()
    assert y[1].tolist() == train_ids[int(s[1]) + 1:int(s[1]) + 10].tolist()


def test_bin_folder_split_by_file_and_single_file(tmp_path):
    folder = tmp_path / "shards"
    (folder / "sub").mkdir(parents=True)
    files = {f"sub/s{i}.bin": np.arange(i * 100, i * 100 + 40 + i) for i in range(6)}
    for name, ids in files.items():
        write_ids(folder / name, ids, "uint16")
    names = sorted(files)
    _, train_docs, val_docs = corpus_documents(str(folder))  # the byte corpora's file rule
    corpus = load_token_bins(folder, 1000, "uint16")
    for stream, starts, docs in ((corpus.train, corpus.train_starts, train_docs),
                                 (corpus.val, corpus.val_starts, val_docs)):
        parts = [files[d.path.relative_to(folder).as_posix()] for d in docs]
        assert stream.long().tolist() == np.concatenate(parts).tolist()
        assert starts.tolist() == np.cumsum([0, *[p.size for p in parts[:-1]]]).tolist()
    assert len(train_docs) + len(val_docs) == len(names)
    one = load_token_bins(folder / "sub" / "s5.bin", 1000, "uint16")  # a single file: 95 / 5
    assert one.train.long().tolist() == files["sub/s5.bin"][:43].tolist()
    assert one.val.long().tolist() == files["sub/s5.bin"][43:].tolist()


def test_out_of_range_and_malformed_ids_are_refused(tmp_path):
    ids = np.arange(300) % 250
    ids[123] = 250
    write_ids(tmp_path / "train.bin", ids, "uint16")
    write_ids(tmp_path / "val.bin", np.arange(20), "uint16")
    with pytest.raises(ValueError, match=r"train.bin holds token id 250 at position 123, not below vocab_size 250"):
        load_token_bins(tmp_path, 250)
    assert load_token_bins(tmp_path, 251).train.numel() == 300
    # uint32 ids read as uint16: ids >= 65536 show up as out-of-range halves
    write_ids(tmp_path / "train.bin", np.full(10, 70_000), "uint32")
    with pytest.raises(ValueError, match=r"token id 4464 at position 0.*token dtype"):
        load_token_bins(tmp_path, 1000, "uint16")
    (tmp_path / "val.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="3 bytes, not a multiple of 2"):
        load_token_bins(tmp_path, 1000)
    with pytest.raises(ValueError, match="does not fit token_dtype uint16"):
        load_token_bins(tmp_path, 70_000, "uint16")
    with pytest.raises(ValueError, match="token_dtype must be one of"):
        load_token_bins(tmp_path, 100, "int8")
    (tmp_path / "train.bin").unlink()
    (tmp_path / "val.bin").unlink()
    with pytest.raises(ValueError, match=r"no non-empty \.bin token files"):
        load_token_bins(tmp_path, 100)
    write_ids(tmp_path / "train.bin", np.arange(20), "uint16")
    with pytest.raises(ValueError, match=r"no val\.bin"):
        load_token_bins(tmp_path, 100)
    with pytest.raises(ValueError, match=r"holds \.bin token files: give their vocab_size"):
        open_corpus(str(tmp_path))


TINY = dict(steps=2, batch_size=2, seq_len=8, eval_every=2, eval_windows=2, warmup=1)


def tiny_model(vocab_size: int) -> LMConfig:
    return LMConfig(vocab_size=vocab_size, d_model=8, n_layers=1, n_heads=2, mixer="delta")


def test_training_records_the_tokens_and_resume_refuses_other_ones(texts, tokenizer, tmp_path):
    corpus = tokenize_corpus(str(texts), tokenizer, tmp_path / "cache")
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="beyond the model's vocab_size 256"):
        train(run, tiny_model(256), TrainConfig(**TINY), corpus, progress=False)
    assert not (run / RUN_FILE).exists()  # refused before anything is written
    losses = train(run, tiny_model(corpus.vocab_size), TrainConfig(**TINY), corpus,
                   progress=False)
    assert len(losses) == 2
    record = read_run(run)
    assert record.tokens == corpus.tokens and record.model.vocab_size == corpus.vocab_size
    assert json.loads((run / RUN_FILE).read_text())["tokens"]["tokenizer_sha256"] == (
        load_tokenizer(tokenizer).sha256)
    other = tokenize_corpus(str(texts), make_tokenizer(tmp_path / "t2.json", extra="zebra"),
                            tmp_path / "cache")
    extend = TrainConfig(**{**TINY, "steps": 3})
    with pytest.raises(ValueError, match=r"resume: tokens \(uint16 ids below \d+ from tokenizer .*t2.json"):
        train(run, None, extend, other, resume=True, progress=False)
    before = (run / RUN_FILE).read_bytes()
    with pytest.raises(ValueError, match=r"tokens \(bytes, the run has"):
        train(run, None, extend, open_corpus(str(texts)), resume=True, progress=False)
    assert (run / RUN_FILE).read_bytes() == before
    assert len(train(run, None, extend, corpus, resume=True, progress=False)) == 1


def test_transformers_tokenizer_folder(texts, tokenizer, tmp_path):
    """A transformers tokenizer folder (saved from the same tokenizer.json) gives the same ids;
    its hash covers the folder's tokenizer files."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_file(tokenizer)).save_pretrained(folder)
    hf, raw = load_tokenizer(folder), load_tokenizer(tokenizer)
    assert hf.vocab_size == raw.vocab_size
    text = "the owl sat on the mat, said Cy.\nünï"
    assert torch.equal(hf.encode(text), raw.encode(text)) and hf.decode(hf.encode(text)) == text
    a = tokenize_corpus(str(texts), folder, tmp_path / "cache")
    b = tokenize_corpus(str(texts), tokenizer, tmp_path / "cache")
    assert torch.equal(a.train, b.train) and a.tokens.cache != b.tokens.cache
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"note": 1, ', 1))
    assert load_tokenizer(folder).sha256 != hf.sha256
    with pytest.raises(ValueError, match=r"holds none of tokenizer\.json"):
        load_tokenizer(texts)


def test_a_writer_that_finishes_second_keeps_the_complete_cache(texts, tokenizer, tmp_path):
    """Two processes (torchrun ranks) tokenizing the same corpus: the second rename finds the
    first's complete folder, keeps it and removes its own temporary folder."""
    from fastweights.tasks import tokens

    corpus = tokenize_corpus(str(texts), tokenizer, tmp_path / "cache")
    folder = tmp_path / "cache" / os.path.basename(corpus.tokens.cache)
    meta = json.loads((folder / tokens.META_FILE).read_text())
    before = (folder / "train.bin").stat().st_ino
    _, *splits = corpus_documents(str(texts))
    fresh = {k: meta[k] for k in ("version", "key", "data", "tokenizer", "tokenizer_sha256",
                                  "vocab_size", "dtype")}
    tokens._write_cache(folder, fresh, splits, load_tokenizer(tokenizer), progress=False)
    assert (folder / "train.bin").stat().st_ino == before
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]
