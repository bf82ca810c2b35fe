"""`fastweights train | eval | generate` on token ids: a folder of pre-tokenized .bin files
(--vocab-size) and text tokenized by a local tokenizer (--tokenizer), as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fastweights.cli import main
from fastweights.tasks.tokens import TextTokenizer
from tests.train.test_tokenized_data import LINES, make_tokenizer

pytest.importorskip("tokenizers")

TINY = ["--seq-len", "8", "--batch-size", "2", "--d-model", "8", "--n-heads", "2",
        "--n-layers", "1", "--eval-every", "2", "--eval-windows", "2", "--warmup", "1", "--quiet"]


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def bad(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(match, err), err


@pytest.fixture
def bins(tmp_path):
    folder = tmp_path / "bins"
    folder.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 300, 400).astype(np.uint16).tofile(folder / "train.bin")
    rng.integers(0, 300, 60).astype(np.uint16).tofile(folder / "val.bin")
    return folder


def test_train_on_a_bin_folder_end_to_end(bins, tmp_path, capsys):
    """`python -m fastweights train --data <folder> --vocab-size ...` in a subprocess; eval of the
    run reads the same ids; generate needs the tokenizer that made them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "fastweights", "train", "--data", "bins",
                          "--vocab-size", "300", "--steps", "2", "--out", "run", *TINY],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "run"
    record = json.loads((run / "run.json").read_text())
    assert record["model"]["vocab_size"] == 300 and record["data"] == str(bins.resolve())
    assert record["tokens"] == {"source": "bin", "vocab_size": 300, "dtype": "uint16",
                                "tokenizer": None, "tokenizer_sha256": None, "cache": None}
    assert main(["eval", "--checkpoint", str(run), "--seq-len", "8", "--windows", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bits_per_token"] > 0 and "bits_per_byte" not in result
    bad(["generate", "--checkpoint", str(run), "--max-new-tokens", "2"], capsys,
        "pass --tokenizer PATH")


def test_bin_data_refusals_write_nothing(bins, tmp_path, capsys):
    out = tmp_path / "o"
    bad(["train", "--data", str(bins), "--out", str(out), *TINY], capsys,
        r"holds \.bin token files: give --vocab-size")
    bad(["train", "--data", str(bins), "--token-dtype", "uint32", "--out", str(out), *TINY], capsys,
        "--token-dtype needs --vocab-size")
    bad(["train", "--data", str(bins), "--vocab-size", "299", "--out", str(out), *TINY], capsys,
        r"train\.bin holds token id 299 at position \d+, not below vocab_size 299")
    bad(["train", "--data", str(bins), "--tokenizer", str(tmp_path / "nope.json"), "--out",
         str(out), *TINY], capsys, r"--tokenizer .*nope\.json does not exist")
    assert not out.exists()  # every refusal comes before --out is made
    bad(["train", "--data", str(bins), "--tokenizer", str(bins / "train.bin"), "--token-dtype",
         "uint16", "--out", str(out), *TINY], capsys, "--token-dtype is for pre-tokenized")


def test_tokenizer_run_cache_resume_eval_generate(tmp_path, capsys, monkeypatch):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"t{i}.txt").write_text("".join(LINES[i::3]))
    (tmp_path / "tok").mkdir()
    tokenizer = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    vocab = TextTokenizer(tokenizer).vocab_size
    runs = tmp_path / "runs"
    common = ["--data", str(texts), *TINY]
    assert main(["train", "--tokenizer", tokenizer, "--steps", "2", "--save-every", "1",
                 "--out", str(runs / "a"), *common]) == 0
    record = json.loads((runs / "a" / "run.json").read_text())
    assert record["model"]["vocab_size"] == vocab
    assert record["tokens"]["tokenizer_sha256"] == TextTokenizer(tokenizer).sha256
    cache = runs / ".fastweights-cache"  # beside --out
    assert [p.name.startswith("tokens-") for p in cache.iterdir()] == [True]

    def no_encoding(self, texts):
        raise AssertionError("the cached corpus was tokenized again")

    with monkeypatch.context() as m:  # a second run on the same texts reuses the cache
        m.setattr(TextTokenizer, "encode_batch", no_encoding)
        assert main(["train", "--tokenizer", tokenizer, "--steps", "1", "--vocab-size",
                     str(vocab + 7), "--out", str(runs / "b"), *common]) == 0
        assert main(["train", "--resume", "--steps", "3", "--out", str(runs / "a"),
                     "--quiet"]) == 0
    assert json.loads((runs / "b" / "run.json").read_text())["model"]["vocab_size"] == vocab + 7
    bad(["train", "--tokenizer", tokenizer, "--vocab-size", str(vocab - 1), "--steps", "1",
         "--out", str(runs / "c"), *common], capsys, f"beyond the model's vocab_size {vocab - 1}")

    # Resume with another tokenizer, or the run's own changed in place: refused, nothing written.
    other = make_tokenizer(tmp_path / "other.json", extra="zebra crossing")
    before = snapshot(runs)
    bad(["train", "--resume", "--steps", "4", "--tokenizer", other, "--out", str(runs / "a")],
        capsys, r"--resume: --tokenizer .*other\.json \(the run has .*tokenizer\.json, sha256 ")
    bad(["train", "--resume", "--steps", "4", "--vocab-size", str(vocab + 1), "--out",
         str(runs / "a")], capsys, f"--vocab-size {vocab + 1} \\(the run has {vocab}\\)")
    original = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    (tmp_path / "tok" / "tokenizer.json").write_bytes((tmp_path / "other.json").read_bytes())
    bad(["train", "--resume", "--steps", "4", "--out", str(runs / "a")], capsys,
        r"tokenizer .*tokenizer\.json is not the run's \(sha256 ")
    bad(["generate", "--checkpoint", str(runs / "a")], capsys, "has changed since training")
    assert snapshot(runs) == before
    (tmp_path / "tok" / "tokenizer.json").write_bytes(original)

    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(runs / "a" / "checkpoints" / "step-0000001"),
                 "--seq-len", "8", "--windows", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["data"] == str(texts.resolve()) and result["bits_per_token"] > 0
    assert main(["generate", "--checkpoint", str(runs / "a"), "--prompt", "the owl",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the owl")  # decoded by the run's tokenizer


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m fastweights ARGS`` in a subprocess, as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fastweights", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def refused(res: subprocess.CompletedProcess, *patterns: str) -> None:
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for pattern in patterns:
        assert re.search(pattern, err), err


def test_an_exported_tokenized_model_is_scored_by_its_own_tokenizer(tmp_path, capsys):
    """export --consolidate carries the run's tokenizer; eval and generate of the exported folder
    read it, and give the run's numbers. A token model is never scored on bytes, nor by a
    tokenizer that is larger than its vocabulary or not its own: one line naming both, exit 2."""
    from fastweights.models import LanguageModel

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"t{i}.txt").write_text("".join(LINES[i::3]))
    tokenizer = make_tokenizer(tmp_path / "tok.json")
    vocab = TextTokenizer(tokenizer).vocab_size
    run, model = tmp_path / "run", tmp_path / "model"
    assert main(["train", "--data", str(texts), "--tokenizer", tokenizer, "--steps", "2",
                 "--out", str(run), *TINY]) == 0
    bad(["export", str(run), "--consolidate", "--step", "--out", str(model)], capsys,
        "--consolidate writes a new checkpoint folder, not a program: --step does not apply")
    res = cli("export", run, "--consolidate", "--out", model)
    assert res.returncode == 0 and "carrying tokenizer" in res.stdout, res.stderr
    assert (model / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    window = ["--seq-len", "8", "--windows", "2"]
    res = cli("eval", "--checkpoint", model, "--data", texts, *window)
    assert res.returncode == 0, res.stderr
    exported = json.loads(res.stdout)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), *window]) == 0
    own = json.loads(capsys.readouterr().out)
    assert "bits_per_byte" not in exported
    assert exported["bits_per_token"] == own["bits_per_token"] and exported["loss"] == own["loss"]
    assert main(["generate", "--checkpoint", str(model), "--prompt", "the owl",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the owl")  # decoded by the carried tokenizer

    # The same weights without the tokenizer (a folder from elsewhere): bytes are refused, and
    # --tokenizer scores it as the run did.
    bare = tmp_path / "bare"
    LanguageModel.from_pretrained(model).save_pretrained(bare)
    refused(cli("eval", "--checkpoint", bare, *window),
            rf"vocabulary \({vocab} ids\) does not fit --data stdlib \(bytes, 256 ids\)",
            "pass --tokenizer")
    bad(["eval", "--checkpoint", str(bare), "--data", str(texts), *window], capsys,
        rf"vocabulary \({vocab} ids\) does not fit --data .*texts \(bytes, 256 ids\)")
    assert main(["eval", "--checkpoint", str(bare), "--data", str(texts), "--tokenizer",
                 tokenizer, *window]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == own["loss"]
    small = make_tokenizer(tmp_path / "small.json", vocab_size=280)
    big = make_tokenizer(tmp_path / "big.json", vocab_size=400, extra="zebra crossing quickly")
    bad(["eval", "--checkpoint", str(bare), "--data", str(texts), "--tokenizer", big], capsys,
        rf"vocabulary \({vocab} ids\) does not fit tokenizer .*big\.json \(\d+ ids\)")
    bad(["generate", "--checkpoint", str(bare), "--tokenizer", big], capsys,
        rf"vocabulary \({vocab} ids\) does not fit tokenizer")
    bad(["eval", "--checkpoint", str(model), "--data", str(texts), "--tokenizer", small], capsys,
        r"--tokenizer .*small\.json is not the tokenizer .*tokenizer\.json the checkpoint carries")
    bad(["eval", "--checkpoint", str(run), "--tokenizer", small], capsys,
        r"small\.json is not the run's")
