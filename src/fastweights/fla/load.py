"""``from_fla``: open an fla checkpoint folder of any family fastweights runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .model import read_config_json


def from_fla(folder: str | Path, *, dtype: str | torch.dtype = "auto") -> Any:
    """Open an fla checkpoint folder (DeltaNet, GatedDeltaNet or RetNet) as a ``transformers`` model on CPU.

    ``folder`` holds fla's config.json (model_type "delta_net", "gated_deltanet" or
    "retnet") and its weights as
    model.safetensors or sharded (model.safetensors.index.json); ``dtype`` "auto" keeps the
    checkpoint's dtype (bfloat16 for fla's releases), or give e.g. ``torch.float32``.
    Returns the family's ``fastweights.fla.hf`` model (``FlaDeltaNetForCausalLM``,
    ``FlaGatedDeltaNetForCausalLM``, ``FlaRetNetForCausalLM``) in eval mode: ``generate()`` (greedy, sampling, beam search)
    decodes from the recurrent state; ``save_pretrained`` writes an fla checkpoint folder
    again. A model_type of another fla family is a ValueError naming the supported ones.
    Needs transformers (the ``[hf]`` extra).

    Why not ``AutoModelForCausalLM.from_pretrained(folder)``: fla registers its own classes for
    its model types when it is imported; registering fastweights' under the same names would
    replace fla's (or be replaced, depending on import order), so the entry point is explicit.
    ``<Family>ForCausalLM.from_pretrained(folder)`` of ``fastweights.fla.hf`` is the same.
    """
    from .hf import fla_model_class  # transformers is an optional extra

    if not isinstance(folder, (str, Path)) or not Path(folder).is_dir():
        raise ValueError(f"fla checkpoint folder {folder!r} does not exist")
    model_type = read_config_json(folder).get("model_type")
    return fla_model_class(model_type).from_pretrained(folder, dtype=dtype).eval()
