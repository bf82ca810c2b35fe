"""``fastweights export`` in a subprocess, as a user runs it: the .pt2 / .onnx it writes equal the
eager model, and its errors are one line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from fastweights.models import LanguageModel, LMConfig
from fastweights.state_tree import flatten


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastweights", "export", *args],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=31, d_model=12, n_layers=1, n_heads=2, mixer="delta"))
    folder = tmp_path_factory.mktemp("ckpt") / "delta"
    model.save_pretrained(folder)
    return folder, model.eval()


def test_export_step_pt2_and_onnx(checkpoint, tmp_path):
    folder, model = checkpoint
    out, onnx = tmp_path / "step.pt2", tmp_path / "step.onnx"
    res = _run(str(folder), "--out", str(out), "--step", "--seq-len", "5", "--batch-size", "2",
               "--dynamic", *(("--onnx", str(onnx)) if _has_onnx() else ()))
    assert res.returncode == 0, res.stderr
    program = torch.export.load(str(out)).module()
    ids = torch.randint(0, 31, (2, 7))
    with torch.no_grad():
        _, state = model(ids[:, :6])
        logits, new = model(ids[:, 6:], state)
    got = program(ids[:, 6:], *flatten(state)[0])
    torch.testing.assert_close(got[0], logits)
    for g, w in zip(got[1:], flatten(new)[0]):
        torch.testing.assert_close(g, w)
    with zipfile.ZipFile(out) as z:
        name = next(n for n in z.namelist() if n.endswith("fastweights.json"))
        meta = json.loads(z.read(name))
    assert meta["step"] and meta["reusable"] and len(meta["state_tensors"]) == 1
    if _has_onnx():
        import onnxruntime as ort
        feeds = {"input_ids": ids[:, 6:].numpy(), "state_0": flatten(state)[0][0].numpy()}
        logits_onnx = ort.InferenceSession(str(onnx)).run(None, feeds)[0]
        torch.testing.assert_close(torch.from_numpy(logits_onnx), logits, rtol=1e-5, atol=1e-6)


def test_export_forward_pt2(checkpoint, tmp_path):
    folder, model = checkpoint
    out = tmp_path / "sub" / "fwd.pt2"
    res = _run(str(folder), "--out", str(out), "--seq-len", "9")
    assert res.returncode == 0, res.stderr
    ids = torch.randint(0, 31, (1, 9))
    with torch.no_grad():
        logits, _ = model(ids)
    torch.testing.assert_close(torch.export.load(str(out)).module()(ids)[0], logits)


def test_export_errors_are_one_line(checkpoint, tmp_path):
    folder, _ = checkpoint
    existing = tmp_path / "keep.pt2"
    existing.write_text("mine")
    cases = [
        ((str(tmp_path / "nope"),), "does not exist"),
        ((str(folder), "--onnx", str(tmp_path / "x.onnx")), "--step"),
        ((str(folder), "--out", str(existing)), "already exists"),
        ((str(folder), "--seq-len", "0"), "--seq-len"),
        ((str(folder), "--dynamic", "--seq-len", "65"), "cannot export"),  # delta: chunk loop
    ]
    for args, needle in cases:
        res = _run(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert existing.read_text() == "mine"


def _has_onnx() -> bool:
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        return False
    return True
