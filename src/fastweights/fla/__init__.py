"""flash-linear-attention (fla) compatibility: fla's models on fastweights' ops, for fla
checkpoints on CPU.

fla publishes its models as Hugging Face folders whose every kernel is Triton, so they do not
run without a GPU. Here each family is rebuilt from a fastweights layer with fla's parameter
names, so the tensors of an fla checkpoint load unchanged, and the same arithmetic (equal in
float64 to fla's own model code run with its PyTorch references, tests/fla/test_*_reference.py).

- the layers are the registry's mixers, with fla's parameter names: ``fla-delta``
  (``fastweights.layers.FlaDeltaNet``), ``retnet`` (``fastweights.layers.FlaMultiScaleRetention``)
  and ``gated-delta`` (``fastweights.layers.GatedDeltaNet``); fla's RMSNorm is
  ``fastweights.layers.RMSNorm``;
- ``modules.py``: ``SwiGLU``, fla's MLP;
- ``model.py``: ``FlaConfig`` and ``FlaLM``, what every family's config and model share;
- ``deltanet.py``, ``retnet.py``, ``gated_deltanet.py``: one family each: the config
  (``FlaDeltaNetConfig``, ``FlaRetNetConfig``, ``FlaGatedDeltaNetConfig``, with ``FLA_OPTIONS``
  / ``FLA_RETNET_OPTIONS`` / ``FLA_GATED_DELTANET_OPTIONS`` saying what each of fla's options
  does here: supported, accepted or refused) and the language model (``FlaDeltaNetLM``,
  ``FlaRetNetLM``, ``FlaGatedDeltaNetLM``);
- ``hf.py``: the families as ``transformers`` models (``FlaDeltaNetForCausalLM``, ...; needs
  the ``[hf]`` extra);
- ``load.py``: ``from_fla(folder)`` opens an fla checkpoint folder of any of these families
  (config.json's model_type "delta_net", "gated_deltanet" or "retnet") as such a ``transformers`` model.
"""

from .deltanet import FLA_OPTIONS, FlaDeltaNetConfig, FlaDeltaNetLM
from .gated_deltanet import FLA_GATED_DELTANET_OPTIONS, FlaGatedDeltaNetConfig, FlaGatedDeltaNetLM
from .load import from_fla
from .model import COMMON_FLA_OPTIONS, FlaConfig, FlaLM
from .modules import SwiGLU
from .retnet import FLA_RETNET_OPTIONS, FlaRetNetConfig, FlaRetNetLM

__all__ = [
    "COMMON_FLA_OPTIONS",
    "FLA_GATED_DELTANET_OPTIONS",
    "FLA_OPTIONS",
    "FLA_RETNET_OPTIONS",
    "FlaConfig",
    "FlaDeltaNetConfig",
    "FlaDeltaNetLM",
    "FlaGatedDeltaNetConfig",
    "FlaGatedDeltaNetLM",
    "FlaLM",
    "FlaRetNetConfig",
    "FlaRetNetLM",
    "SwiGLU",
    "from_fla",
]
