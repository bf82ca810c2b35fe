"""Checkpoint conversion between native folders (``LanguageModel.save_pretrained``, training
checkpoints and run folders) and Hugging Face ones (``FastWeightsForCausalLM.save_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .._files import CONFIG_FILE, WEIGHTS_FILE, resolve_checkpoint
from ..models.config import LMConfig
from .config import FastWeightsConfig
from .model import FastWeightsForCausalLM

PREFIX = "model."  # FastWeightsForCausalLM keeps the native LanguageModel as ``self.model``


def _empty_destination(dst_dir: str | Path) -> Path:
    dst = Path(dst_dir)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"dst_dir {dst} exists and is not an empty folder; refusing to overwrite")
    return dst


def _weights(src: Path, what: str) -> dict[str, torch.Tensor]:
    path = src / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"src_dir {src} is not a {what} checkpoint folder (no {WEIGHTS_FILE}; "
                         "sharded checkpoints are not supported)")
    return load_file(str(path))


def native_to_hf(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Convert a native checkpoint folder (``LanguageModel.save_pretrained``, a training
    checkpoint, or a training run folder, whose ``checkpoints/latest`` is taken as the CLI
    does) into a Hugging Face one loadable by ``AutoModelForCausalLM.from_pretrained``. A
    training checkpoint is verified against its manifest first. Tensors are copied unchanged
    (same dtype and values) under the names ``"model." + native name``; other files (optimizer,
    step) are not copied. Refuses a ``dst_dir`` that exists and is not empty. Returns dst_dir."""
    try:
        src = resolve_checkpoint(src_dir)
    except ValueError as err:
        raise ValueError(f"src_dir: {err}") from None
    if not (src / CONFIG_FILE).is_file():
        raise ValueError(f"src_dir {src} is not a native fastweights checkpoint (no {CONFIG_FILE})")
    dst = _empty_destination(dst_dir)
    config = FastWeightsConfig.from_lm_config(LMConfig.load(src / CONFIG_FILE))
    config.architectures = [FastWeightsForCausalLM.__name__]
    tensors = {PREFIX + k: v for k, v in _weights(src, "native").items()}
    dst.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dst)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    return dst


def hf_to_native(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Convert a Hugging Face folder (``FastWeightsForCausalLM.save_pretrained``) into a native
    checkpoint folder loadable by ``LanguageModel.from_pretrained`` without transformers.
    Tensors are copied unchanged with the ``"model."`` prefix removed. Refuses a ``dst_dir``
    that exists and is not empty. Returns dst_dir."""
    src = Path(src_dir)
    try:
        data = json.loads((src / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"src_dir {src}: cannot read {CONFIG_FILE}: {err}") from None
    if data.get("model_type") != FastWeightsConfig.model_type:
        raise ValueError(f"src_dir {src} holds model_type {data.get('model_type')!r}, "
                         f"expected {FastWeightsConfig.model_type!r}")
    dst = _empty_destination(dst_dir)
    lm_config = FastWeightsConfig.from_dict(data).to_lm_config()
    tensors = _weights(src, "Hugging Face")
    foreign = sorted(k for k in tensors if not k.startswith(PREFIX))
    if foreign:
        raise ValueError(f"src_dir {src} has weights outside {PREFIX!r}: {foreign[:5]}")
    dst.mkdir(parents=True, exist_ok=True)
    lm_config.save(dst / CONFIG_FILE)
    save_file({k[len(PREFIX):]: v for k, v in tensors.items()}, str(dst / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return dst
