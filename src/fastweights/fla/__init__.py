"""flash-linear-attention (fla) compatibility: fla's models on fastweights' ops, for fla
checkpoints on CPU.

fla publishes its models as Hugging Face folders whose every kernel is Triton, so they do not
run without a GPU. Here each family is rebuilt from a fastweights layer with fla's parameter
names, so the tensors of an fla checkpoint load unchanged, and the same arithmetic (equal in
float64 to fla's own model code run with its PyTorch references, tests/fla/test_*_reference.py).

- ``modules.py``: fla's building blocks (``ShortConvolution``, ``SwiGLU``, the head split
  ``FlaMixer``; fla's RMSNorm is ``fastweights.layers.RMSNorm``);
- ``model.py``: ``FlaConfig`` and ``FlaLM``, what every family's config and model share;
- ``deltanet.py``, ``retnet.py``, ``gated_deltanet.py``: one family each: the layer (``FlaDeltaNet``,
  ``FlaMultiScaleRetention``), the config (``FlaDeltaNetConfig``, ``FlaRetNetConfig``, with
  ``FLA_OPTIONS`` / ``FLA_RETNET_OPTIONS`` saying what each of fla's options does here:
  supported, accepted or refused) and the language model (``FlaDeltaNetLM``, ``FlaRetNetLM``);
  GatedDeltaNet's layer is the registry's ``gated-delta`` (``fastweights.layers.GatedDeltaNet``,
  fla's parameter names), with ``FlaGatedDeltaNetConfig`` and ``FlaGatedDeltaNetLM``;
- ``hf.py``: the families as ``transformers`` models (``FlaDeltaNetForCausalLM``, ...; needs
  the ``[hf]`` extra);
- ``load.py``: ``from_fla(folder)`` opens an fla checkpoint folder of any of these families
  (config.json's model_type "delta_net", "gated_deltanet" or "retnet") as such a ``transformers`` model.
"""

from .deltanet import FLA_OPTIONS, FlaDeltaNet, FlaDeltaNetConfig, FlaDeltaNetLM
from .gated_deltanet import FLA_GATED_DELTANET_OPTIONS, FlaGatedDeltaNetConfig, FlaGatedDeltaNetLM
from .load import from_fla
from .model import COMMON_FLA_OPTIONS, FlaConfig, FlaLM
from .modules import ShortConvolution, SwiGLU
from .retnet import FLA_RETNET_OPTIONS, FlaMultiScaleRetention, FlaRetNetConfig, FlaRetNetLM

__all__ = [
    "COMMON_FLA_OPTIONS",
    "FLA_GATED_DELTANET_OPTIONS",
    "FLA_OPTIONS",
    "FLA_RETNET_OPTIONS",
    "FlaConfig",
    "FlaDeltaNet",
    "FlaDeltaNetConfig",
    "FlaDeltaNetLM",
    "FlaGatedDeltaNetConfig",
    "FlaGatedDeltaNetLM",
    "FlaLM",
    "FlaMultiScaleRetention",
    "FlaRetNetConfig",
    "FlaRetNetLM",
    "ShortConvolution",
    "SwiGLU",
    "from_fla",
]
