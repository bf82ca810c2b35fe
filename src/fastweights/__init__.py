"""fastweights: linear-complexity sequence mixers behind one contract.

``fastweights.ops`` holds the mathematics, ``fastweights.layers`` the nn.Modules,
``fastweights.models`` the registry and language model; ``build_mixer`` builds any registered
mixer by name.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "build_mixer", "layers", "mixer_names", "models", "ops"]

# Imported on first use (PEP 562): the `fastweights` command then starts without torch, so
# that its start-up (a Ctrl-C there included) runs inside the command's own error handling.
_SUBMODULES = ("layers", "models", "ops")
_REGISTRY_NAMES = ("build_mixer", "mixer_names")

def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _REGISTRY_NAMES:
        return getattr(importlib.import_module(".models.registry", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
