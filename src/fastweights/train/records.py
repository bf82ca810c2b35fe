"""A run folder's record: ``run.json`` (the model and training configs, the data's name and,
for token data, how the ids were made: ``tokens``, a ``tasks.tokens.TokenData``),
written when a run starts (``open_run``), read back to resume (``resume_run``, ``read_run``, ``resumed_config``, ``check_run_file``), and
the outputs an overwriting run sets aside and puts back if it fails (``set_aside``,
``put_back``).

Resuming takes every setting from ``run.json``; only the ``RESUMABLE`` training settings may
change (``steps`` extends a run). The learning-rate schedule is a function of the step and the
*current* total ``steps`` (``lr_factor``), so an extended run continues on the schedule of its
new total: its first new step uses that schedule's value at that step, not the old schedule's
final rate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._names import RESUMABLE
from ..models import LanguageModel, LMConfig
from ..tasks.text import Corpus
from ..tasks.tokens import TokenData, open_corpus, tokenizer_sha256
from .checkpoint import load_checkpoint, resume_point, write_atomic
from .config import TrainConfig
from .metrics import METRICS_FILE, Metrics

RUN_FILE = "run.json"
OUTPUTS = (RUN_FILE, METRICS_FILE, "checkpoints", "tensorboard")  # what a run writes in run_dir


@dataclass(frozen=True)
class RunRecord:
    """What a run folder's ``run.json`` records: the model and training configs, the name of
    the data (``Corpus.name``: ``stdlib`` or the path it was loaded from) and ``tokens``
    (``Corpus.tokens``: None for bytes)."""

    model: LMConfig
    train: TrainConfig
    data: str
    tokens: TokenData | None = None


def resume_run(run_dir: Path, model_config: LMConfig | None, train_config: TrainConfig | None,
               corpus: Corpus, *, report: bool
               ) -> tuple[TrainConfig, LMConfig, tuple[LanguageModel, dict[str, Any], dict[str, Any]] | None]:
    """The training and model configs of the run in ``run_dir`` resumed (``resumed_config``)
    and the checkpoint it continues from, loaded and checked against run.json (None when the
    run has none yet). ``report``: the problems met finding it go to stderr."""
    record = read_run(run_dir)
    cfg = resumed_config(record, model_config, train_config, corpus)
    ckpt, problems = resume_point(run_dir)
    if report:
        for problem in problems:
            print(f"warning: {problem}", file=sys.stderr)
        if ckpt is None:
            print(f"{run_dir} holds no checkpoint yet: training restarts from step 0",
                  file=sys.stderr)
        elif problems:
            print(f"resuming from the newest complete checkpoint, {ckpt}", file=sys.stderr)
    if ckpt is None:
        return cfg, record.model, None
    resumed = load_checkpoint(ckpt)
    check_run_file(run_dir / RUN_FILE, ckpt, record.model, cfg, resumed[0], resumed[2])
    return cfg, record.model, resumed


def read_run(run_dir: str | Path) -> RunRecord:
    """The record of the run in ``run_dir``; ValueError naming ``run.json`` when it is missing,
    truncated or not a run file."""
    path = Path(run_dir) / RUN_FILE
    try:
        saved = json.loads(path.read_text())
        data = saved["data"]
        if not isinstance(data, str):
            raise TypeError(f"data must be a string, got {data!r}")
        tokens = saved.get("tokens")
        return RunRecord(LMConfig.from_dict(saved["model"]), TrainConfig(**saved["train"]), data,
                         None if tokens is None else TokenData.from_dict(tokens))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: {path.parent} holds no training run to resume") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is corrupt or not a fastweights run file "
                         f"({type(err).__name__}: {err})") from None


def same_data(a: str, b: str) -> bool:
    """Whether two data names (``stdlib`` or paths, relative ones from the working folder) name
    the same corpus."""
    if a == b:
        return True
    return "stdlib" not in (a, b) and Path(a).resolve() == Path(b).resolve()


def same_tokens(a: TokenData | None, b: TokenData | None) -> bool:
    """Whether two token descriptions (None: bytes) give the same ids: same source, vocabulary,
    dtype and tokenizer hash (paths aside)."""
    return (a is None) == (b is None) and (a is None or a.identity() == b.identity())


def describe_tokens(tokens: TokenData | None) -> str:
    return "bytes" if tokens is None else tokens.describe()


def resumed_config(record: RunRecord, model_config: LMConfig | None,
                    train_config: TrainConfig | None, corpus: Corpus) -> TrainConfig:
    """The training config of a resumed run: the record's, with ``train_config``'s RESUMABLE
    fields when given. A ``model_config``, a ``train_config`` field outside RESUMABLE or a
    corpus that disagrees with the record is a ValueError naming every difference (resuming
    with other settings would not continue the same run)."""
    differ = []
    if model_config is not None:
        given = model_config.to_dict()
        differ += [f"model.{k} ({given[k]!r}, the run has {v!r})"
                   for k, v in record.model.to_dict().items() if given[k] != v]
    cfg = record.train
    if train_config is not None:
        differ += [f"train.{k} ({getattr(train_config, k)!r}, the run has {v!r})"
                   for k, v in dataclasses.asdict(cfg).items()
                   if k not in RESUMABLE and getattr(train_config, k) != v]
        cfg = dataclasses.replace(cfg, **{k: getattr(train_config, k) for k in RESUMABLE})
    if not same_data(corpus.name, record.data):
        differ.append(f"data ({corpus.name!r}, the run has {record.data!r})")
    if not same_tokens(corpus.tokens, record.tokens):
        differ.append(f"tokens ({describe_tokens(corpus.tokens)}, the run has "
                      f"{describe_tokens(record.tokens)})")
    if differ:
        raise ValueError(f"resume: {', '.join(differ)} differ from the run's {RUN_FILE}; only "
                         f"{', '.join(RESUMABLE)} may change when a run is resumed")
    return cfg


def check_run_file(path: Path, ckpt: Path, model_config: LMConfig, cfg: TrainConfig,
                    model: LanguageModel, state: dict[str, Any]) -> None:
    """``run.json`` must describe the checkpoint it resumes (whose files are checksummed): a
    disagreement means run.json was edited or corrupted, and resuming would not reproduce the
    run. The RESUMABLE fields may differ (a run can be extended, ...)."""
    differ = [f"model.{k}" for k, v in model.config.to_dict().items() if model_config.to_dict().get(k) != v]
    saved = state.get("train", {})
    differ += [f"train.{k}" for k, v in dataclasses.asdict(cfg).items()
               if k not in RESUMABLE and k in saved and saved[k] != v]
    if differ:
        raise ValueError(f"{path} disagrees with checkpoint {ckpt} on {', '.join(differ)}: "
                         "run.json was edited or corrupted")


def run_corpus(record: RunRecord, *, data: str | None = None, tokenizer: str | None = None,
               cache_root: str | Path | None = None, progress: bool = False) -> Corpus:
    """The corpus of a recorded run (``data``: another path read the same way, e.g. for
    evaluation): bytes, the run's pre-tokenized files, or text tokenized by its tokenizer (at
    ``tokenizer``, else at the recorded path) into ``cache_root`` (default: the folder holding
    the run's cache). A tokenizer whose hash is not the recorded one is a ValueError, before any
    tokenizing."""
    data = record.data if data is None else data
    tokens = record.tokens
    if tokens is None or tokens.source == "bin":
        return open_corpus(data, vocab_size=None if tokens is None else tokens.vocab_size,
                           token_dtype=None if tokens is None else tokens.dtype)
    path = tokenizer if tokenizer is not None else tokens.tokenizer
    if not Path(path).exists():
        raise ValueError(f"the run's tokenizer {path} does not exist; give the path of a copy")
    if tokenizer_sha256(path) != tokens.tokenizer_sha256:
        raise ValueError(f"tokenizer {path} is not the run's (sha256 {tokens.tokenizer_sha256[:12]}): "
                         "its ids would differ from the ones the run was trained on")
    if cache_root is None:
        if tokens.cache is None:
            raise ValueError("the run records no token cache folder; give cache_root")
        cache_root = Path(tokens.cache).parent
    return open_corpus(data, tokenizer=path, cache_root=cache_root, progress=progress)


def set_aside(run_dir: Path) -> Path | None:
    """Move the outputs of an earlier run (``OUTPUTS``) into a hidden folder of ``run_dir``, by
    renames (nothing copied or deleted yet); the folder, or None when there were none. Other
    files in ``run_dir`` stay where they are."""
    present = [n for n in OUTPUTS if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not present:
        return None
    aside = run_dir / f".replaced-{os.getpid()}"
    aside.mkdir()
    try:
        for name in present:
            os.rename(run_dir / name, aside / name)
    except BaseException:
        put_back(aside, run_dir)
        raise
    return aside


def open_run(run_dir: Path, model_config: LMConfig, cfg: TrainConfig, corpus: Corpus, *,
             overwrite: bool, resume_step: int | None) -> Metrics:
    """Start writing a run into ``run_dir`` (rank 0, once every check has passed): its
    ``run.json`` and its metrics (``Metrics``, continued after ``resume_step`` when resuming),
    returned open. With ``overwrite`` the earlier run's outputs are set aside first, deleted
    once both are written, put back if that fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    aside = set_aside(run_dir) if overwrite else None
    record = {"model": model_config.to_dict(), "train": dataclasses.asdict(cfg),
              "data": corpus.name}
    if corpus.tokens is not None:  # token data: how the ids were made
        record["tokens"] = corpus.tokens.to_dict()
    try:
        write_atomic(run_dir / RUN_FILE, (json.dumps(record, indent=2) + "\n").encode())
        metrics = Metrics(run_dir, resume_step)
    except BaseException:
        if aside is not None:
            put_back(aside, run_dir)
        raise
    if aside is not None:
        shutil.rmtree(aside)
    return metrics


def put_back(aside: Path, run_dir: Path) -> None:
    """Undo ``set_aside``: what the new run wrote in its place is removed."""
    for old in aside.iterdir():
        new = run_dir / old.name
        if new.is_dir() and not new.is_symlink():
            shutil.rmtree(new)
        elif new.exists() or new.is_symlink():
            new.unlink()
        os.rename(old, new)
    aside.rmdir()
