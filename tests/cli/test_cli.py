"""The ``fastweights`` command end to end on tiny settings, its errors (exit 2, one line), and the
README's python examples run exactly as written."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastweights.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = "".join(f"class C{i}:\n    value = {i * 7 % 11}\n\n" for i in range(300))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text(TEXT)
    return str(path)


def test_python_m_fastweights_help():
    res = subprocess.run([sys.executable, "-m", "fastweights", "--help"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode == 0
    for cmd in ("recall", "train", "eval", "generate", "mixers"):
        assert cmd in res.stdout


def test_recall_end_to_end(tmp_path, capsys):
    out = tmp_path / "recall"
    rc = main(["recall", "--task", "capacity,update", "--mixers", "linear,delta:feature_map=dpfp",
               "--sizes", "3,5", "--d-key", "4", "--steps", "30", "--out", str(out), "--quiet"])
    assert rc == 0
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [(r["task"], r["mixer"], r["size"]) for r in rows] == [
        (t, m, s) for t in ("capacity", "update") for m in ("linear", "delta:feature_map=dpfp")
        for s in ("3", "5")]
    assert set(rows[0]) == {"task", "mixer", "size", "eval_loss", "accuracy", "steps", "seconds",
                            "state_size"}
    assert all(int(r["steps"]) == 30 and float(r["eval_loss"]) >= 0 for r in rows)
    printed = capsys.readouterr().out
    assert "eval loss" in printed and "delta:feature_map=dpfp" in printed
    pytest.importorskip("matplotlib")
    assert (out / "results.png").stat().st_size > 1000


def test_recall_mqar_uses_registered_mixers(tmp_path):
    out = tmp_path / "mqar"
    assert main(["recall", "--task", "mqar", "--mixers", "softmax,delta", "--sizes", "3",
                 "--d-key", "8", "--steps", "10", "--out", str(out), "--quiet"]) == 0
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [r["mixer"] for r in rows] == ["softmax", "delta"]


def test_train_resume_eval_generate(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    common = ["--data", text_file, "--seq-len", "16", "--batch-size", "4", "--d-model", "16",
              "--n-heads", "2", "--n-layers", "2", "--eval-every", "4", "--eval-windows", "3",
              "--out", str(run), "--quiet"]
    assert main(["train", "--mixer", "softmax,delta", "--steps", "4", "--save-every", "2",
                 "--recompute", *common]) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000004"
    assert json.loads((run / "run.json").read_text())["train"]["recompute"] is True
    assert main(["train", "--resume", "--steps", "6", *common]) == 0  # extend the finished run
    assert json.loads((run / "run.json").read_text())["train"]["steps"] == 6
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000006"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", text_file, "--seq-len", "16",
                 "--windows", "3"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "step-0000002"), "--data",
                 text_file, "--seq-len", "16", "--windows", "3", "--carry-state"]) == 0
    carried = json.loads(capsys.readouterr().out)
    assert carried["carry_state"] and plain["perplexity"] > 1 and carried["loss"] > 0
    assert main(["generate", "--checkpoint", str(run), "--prompt", "class ", "--max-new-tokens",
                 "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("class ")


def bad(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(match, err), err


def test_errors_exit_2_with_one_line(tmp_path, text_file, capsys):
    out = str(tmp_path / "o")
    bad(["recall", "--mixers", "nope", "--out", out], capsys, "unknown mixer 'nope'")
    bad(["recall", "--mixers", "dpfp:zz=1", "--out", out], capsys, "zz")
    bad(["recall", "--sizes", "0,3", "--out", out], capsys, "--sizes")
    bad(["recall", "--task", "sorting", "--out", out], capsys, "unknown --task")
    bad(["recall", "--task", "mqar", "--mixers", "dpfp:nu=x", "--out", out], capsys, "nu")
    bad(["train", "--mixer", "nope", "--out", out], capsys, "unknown mixer")
    bad(["train", "--data", str(tmp_path / "missing"), "--out", out], capsys, "does not exist")
    bad(["train", "--steps", "0", "--data", text_file, "--out", out], capsys, "steps")
    bad(["train", "--resume", "--out", str(tmp_path / "empty")], capsys, "no training run")
    bad(["eval", "--checkpoint", str(tmp_path / "nothing")], capsys, "does not exist")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text('{"vocab_size": 256, "colour": 1}')
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"xx")
    bad(["generate", "--checkpoint", str(tmp_path / "corrupt")], capsys, "unknown LMConfig field")
    (tmp_path / "corrupt" / "config.json").write_text('{"vocab_size": 256}')
    bad(["generate", "--checkpoint", str(tmp_path / "corrupt")], capsys, "cannot load weights")


def test_refuses_to_overwrite_an_earlier_run(tmp_path, text_file, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.csv").write_text("old")
    args = ["recall", "--sizes", "2", "--mixers", "linear", "--task", "capacity", "--steps", "2",
            "--d-key", "4", "--out", str(out), "--quiet"]
    bad(args, capsys, "--overwrite")
    assert (out / "results.csv").read_text() == "old"
    assert main([*args, "--overwrite"]) == 0


def test_sequence_longer_than_the_model_supports(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", text_file, "--steps", "1", "--seq-len", "8", "--batch-size", "2",
                 "--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--max-seq-len", "8",
                 "--eval-windows", "1", "--out", str(run), "--quiet"]) == 0
    bad(["eval", "--checkpoint", str(run), "--data", text_file, "--seq-len", "9"], capsys,
        "at most 8 tokens")
    bad(["generate", "--checkpoint", str(run), "--prompt", "abc", "--max-new-tokens", "6"], capsys,
        "max_seq_len 8")


def test_readme_harness_python_example_runs_as_written(tmp_path, monkeypatch):
    text = (README.parent / "docs" / "training.md").read_text()
    section = text[text.index("## Experiments and training"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "docs/training.md's harness section has no python example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_train_error_found_by_the_first_forward_writes_nothing(tmp_path, text_file, capsys):
    """A combination only a forward can check (a position table shorter than --seq-len) fails
    before run.json or metrics.csv exist, so the corrected command can reuse --out."""
    run = tmp_path / "run"
    common = ["--data", text_file, "--seq-len", "16", "--batch-size", "2", "--d-model", "16",
              "--n-heads", "2", "--n-layers", "1", "--steps", "2", "--eval-every", "2",
              "--eval-windows", "2", "--out", str(run), "--quiet"]
    assert main(["train", "--mixer", "aft-full:max_len=8", *common]) == 2
    assert "max_len" in capsys.readouterr().err
    assert not run.exists() or not any(run.iterdir())
    assert main(["train", "--mixer", "aft-full:max_len=32", *common]) == 0


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for args in (["train", "--steps", "1"], ["recall", "--quiet"], ["bench", "--quick"]):
        assert main([*args, "--out", str(blocker / "sub")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot create this folder" in err


def test_refused_commands_leave_no_folder(tmp_path, text_file, capsys):
    """Every check runs before anything is written: a refused train (outside torchrun with
    --fsdp, in a subprocess as a user runs it) or export leaves neither its --out nor a parent
    folder it would have made, nor a token cache."""
    out = tmp_path / "new" / "run"
    res = subprocess.run([sys.executable, "-m", "fastweights", "train", "--fsdp", "--out",
                          str(out), "--data", text_file, "--quiet"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 2 and "launch with torchrun" in res.stderr, res.stderr
    assert not out.parent.exists()
    tiny = ["--data", text_file, "--seq-len", "8", "--batch-size", "2", "--d-model", "8",
            "--n-heads", "2", "--n-layers", "1", "--steps", "1", "--quiet", "--out", str(out)]
    bad(["train", *tiny, "--context-parallel", "2"], capsys, "multiple of context_parallel 2")
    bad(["train", *tiny, "--fsdp-mixed", "bf16"], capsys, "it needs fsdp")
    bad(["train", *tiny, "--seq-len", "100000"], capsys, "fewer than seq_len")
    bad(["export", str(tmp_path / "nothing"), "--consolidate", "--out", str(out)], capsys,
        "does not exist")
    pytest.importorskip("tokenizers")
    from tests.train.test_tokenized_data import make_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tok.json")
    bad(["train", *tiny, "--tokenizer", tokenizer, "--fsdp"], capsys, "launch with torchrun")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt", "tok.json"]


@pytest.mark.parametrize("argv", [["decode", "--mixers", "delta", "nosuch"],
                                  ["recompute", "--mixers", "delta,nosuch"],
                                  ["recompute", "--mixers", "delta", "--d-model", "7"]])
def test_bench_model_mixers_are_checked_before_measuring(argv, capsys):
    """decode and recompute build one model per mixer: a bad one is one line, exit 2, before
    the first measurement (it was a traceback after the earlier mixers' runs)."""
    bad(["bench", *argv], capsys, r"^fastweights bench: error: --mixers (nosuch: mixer: unknown "
        r"mixer 'nosuch'|delta: .*d_model \(7\) must be divisible)")


def test_train_carry_state_and_positions(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    small = ["--data", text_file, "--steps", "2", "--seq-len", "8", "--batch-size", "2",
             "--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--eval-windows", "1",
             "--quiet"]
    assert main(["train", *small, "--carry-state", "--position", "sinusoidal",
                 "--out", str(run)]) == 0
    record = json.loads((run / "run.json").read_text())
    assert record["train"]["carry_state"] is True and record["model"]["position"] == "sinusoidal"
    bad(["train", *small, "--carry-state", "--pack", "--out", str(tmp_path / "p")], capsys,
        "pack and carry_state exclude each other")
    bad(["train", *small, "--carry-state", "--mixer", "softmax", "--out", str(tmp_path / "s")],
        capsys, "fixed-size state")
    bad(["train", *small, "--position", "learned", "--out", str(tmp_path / "l")], capsys,
        "needs max_seq_len")


def test_help_lists_every_registered_experiment_unbroken(monkeypatch):
    """The experiments register themselves; `fastweights --help` and `reproduce --help` list
    them from that registry, each name whole however narrow the terminal."""
    from fastweights.cli.main import build_parser
    from fastweights.reproduce import EXPERIMENTS

    monkeypatch.setenv("COLUMNS", "50")
    parser = build_parser()
    reproduce = parser._subparsers._group_actions[0].choices["reproduce"]
    for text in (parser.format_help(), reproduce.format_help()):
        words = set(text.replace(",", " ").replace("(", " ").replace(")", " ").split())
        assert set(EXPERIMENTS) <= words, text


def test_generate_refuses_what_it_cannot_do_on_this_machine(tmp_path, capsys):
    """--graph on needs a CUDA model; an unknown --device is one line."""
    from fastweights.models.config import LMConfig
    from fastweights.models.lm import LanguageModel

    LanguageModel(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2)).save_pretrained(
        tmp_path / "m")
    bad(["generate", "--checkpoint", str(tmp_path / "m"), "--graph", "on", "--max-new-tokens",
         "2"], capsys, "graph=True captures a CUDA graph")
    bad(["generate", "--checkpoint", str(tmp_path / "m"), "--device", "nowhere"], capsys,
        "--device")
