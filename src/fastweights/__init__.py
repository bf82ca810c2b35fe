"""fastweights: linear-complexity sequence mixers behind one contract.

``fastweights.ops`` holds the mathematics, ``fastweights.layers`` the nn.Modules,
``fastweights.models`` the registry and language model; ``build_mixer`` builds any registered
mixer by name.
"""

from . import layers, models, ops
from .models.registry import build_mixer, mixer_names

__version__ = "0.1.0"

__all__ = ["__version__", "build_mixer", "layers", "mixer_names", "models", "ops"]
