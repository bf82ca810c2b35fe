"""``LMConfig``: the language model's configuration, validated on creation and stored as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._checks import is_int, is_number
from .registry import check_mixer, mixer_names, mixer_options

FFNS = ("mlp", "glu", "none")
NORMS = ("rmsnorm", "layernorm", "srmsnorm")
GLU_ACTIVATIONS = ("silu", "gelu", "identity")
POSITIONS = ("none", "learned", "sinusoidal")


def _positive_int(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")


@dataclass
class LMConfig:
    """A decoder-only language model: embedding, ``n_layers`` pre-norm blocks (mixer then
    feed-forward, each residual), a final norm and a (tied) output projection.

    ``mixer`` is one registered mixer name for every layer or a list with one name per layer
    (TransNormer's local-then-global schedule is ``["diag"] * 3 + ["norm"] * 3``);
    ``mixer_options`` is one dict of keyword options for every layer or a list of dicts, one per
    layer. ``ffn`` is ``"mlp"`` (Linear-GELU-Linear), ``"glu"`` (``fastweights.layers.GLU`` with
    the activation ``glu_activation``: ``"silu"`` by default, ``"identity"`` for the activation-free
    GLU the published TransNormer models trained, docs/maths.md 3.4, or ``"gelu"``) or ``"none"``;
    ``ffn_hidden`` defaults to 4 * d_model for ``mlp`` and to int(8/3 * d_model) for ``glu``
    (docs/maths.md 3.4; about the same parameter count). ``norm`` is the pre-norm: ``"rmsnorm"``
    (with a gain), ``"layernorm"`` or ``"srmsnorm"`` (TransNormer's gain-free SRMSNorm,
    docs/maths.md 3.1/3.4), each with ``norm_eps``.
    ``max_seq_len`` (optional) is the longest sequence the model accepts; it is passed on as the
    option ``max_len`` to mixers that take one (absolute position tables) and checked in
    ``forward``/``generate``. ``position`` adds an absolute position encoding to the token
    embeddings: ``"none"`` (the default; order comes from the mixers alone), ``"learned"``
    (a trained table of ``max_seq_len`` rows, which it requires; std 0.02 init) or ``"sinusoidal"``
    (Vaswani et al.'s fixed sin/cos of the position, no parameters, any length), multiplied by
    ``position_scale`` (default 1: unit amplitude; the embeddings start at std 0.02, so 0.02
    puts the two in the ratio of Vaswani et al., whose embeddings are scaled up to unit size
    instead). Positions count the tokens
    of each sequence since the start of its state: they continue across a carried state and in
    decoding, restart at every packed document.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mixer: str | list[str] = "delta"
    mixer_options: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)
    ffn: str = "mlp"
    ffn_hidden: int | None = None
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dropout: float = 0.0
    max_seq_len: int | None = None
    glu_activation: str = "silu"
    position: str = "none"
    position_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            _positive_int(name, getattr(self, name))
        if self.ffn_hidden is not None:
            _positive_int("ffn_hidden", self.ffn_hidden)
        if self.max_seq_len is not None:
            _positive_int("max_seq_len", self.max_seq_len)
        if self.ffn not in FFNS:
            raise ValueError(f"LMConfig.ffn must be one of {list(FFNS)}, got {self.ffn!r}")
        if self.glu_activation not in GLU_ACTIVATIONS:
            raise ValueError(f"LMConfig.glu_activation must be one of {list(GLU_ACTIVATIONS)}, "
                             f"got {self.glu_activation!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"LMConfig.position must be one of {list(POSITIONS)}, "
                             f"got {self.position!r}")
        if self.position == "learned" and self.max_seq_len is None:
            raise ValueError("LMConfig.position 'learned' needs max_seq_len (the rows of its "
                             "position table)")
        if not is_number(self.position_scale) or not 0 < self.position_scale < float("inf"):
            raise ValueError(f"LMConfig.position_scale must be a finite number > 0, got "
                             f"{self.position_scale!r}")
        if self.position_scale != 1.0 and self.position != "sinusoidal":
            raise ValueError("LMConfig.position_scale applies to position='sinusoidal' only, got "
                             f"position={self.position!r}")
        if self.norm not in NORMS:
            raise ValueError(f"LMConfig.norm must be one of {list(NORMS)}, got {self.norm!r}")
        if not is_number(self.norm_eps) \
                or not 0 < self.norm_eps < 1:
            raise ValueError(f"LMConfig.norm_eps must be a float in (0, 1), got {self.norm_eps!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LMConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LMConfig.dropout must be a float in [0, 1), got {self.dropout!r}")
        names = self.layer_mixers()
        options = self.layer_options()
        for i, (name, opts) in enumerate(zip(names, options)):
            unknown = sorted(set(opts) - set(mixer_options(name)))
            if unknown:
                raise ValueError(
                    f"LMConfig.mixer_options for layer {i} ({name!r}) has unknown option(s) "
                    f"{unknown}; valid options: {sorted(mixer_options(name))}"
                )
        # Option values and combinations (head split, sizes, choices) are the layers' own
        # checks: run them once per distinct layer (check_mixer: on the meta device) so a bad
        # config fails here, not in LanguageModel(config).
        seen: set[str] = set()
        for i, (name, opts) in enumerate(zip(names, options)):
            key = repr((name, sorted(opts.items())))
            if key in seen:
                continue
            seen.add(key)
            try:
                check_mixer(name, self.d_model, self.n_heads, **opts)
            except (ValueError, TypeError) as err:
                raise ValueError(f"LMConfig layer {i} ({name!r}): {err}") from None

    def layer_mixers(self) -> list[str]:
        """The mixer name of every layer (validated against the registry)."""
        if isinstance(self.mixer, str):
            names = [self.mixer] * self.n_layers
        elif isinstance(self.mixer, (list, tuple)) and all(isinstance(m, str) for m in self.mixer):
            names = list(self.mixer)
            if len(names) != self.n_layers:
                raise ValueError(
                    f"LMConfig.mixer lists {len(names)} mixers but n_layers is {self.n_layers}; "
                    "give one name per layer or a single name"
                )
        else:
            raise ValueError(f"LMConfig.mixer must be a name or a list of names, got {self.mixer!r}")
        for name in names:
            if name not in mixer_names():
                raise ValueError(
                    f"LMConfig.mixer: unknown mixer {name!r}; registered: {', '.join(mixer_names())}"
                )
        return names

    def layer_options(self) -> list[dict[str, Any]]:
        """The mixer options of every layer, with ``max_len = max_seq_len`` added where a mixer
        has a position table (``aft-full``, ``aft-local``) and the options do not set it."""
        opts = self.mixer_options
        if isinstance(opts, dict):
            per_layer = [dict(opts) for _ in range(self.n_layers)]
        elif isinstance(opts, (list, tuple)) and all(isinstance(o, dict) for o in opts):
            if len(opts) != self.n_layers:
                raise ValueError(
                    f"LMConfig.mixer_options lists {len(opts)} dicts but n_layers is "
                    f"{self.n_layers}; give one dict per layer or a single dict"
                )
            per_layer = [dict(o) for o in opts]
        else:
            raise ValueError(
                f"LMConfig.mixer_options must be a dict or a list of dicts, got {opts!r}"
            )
        if self.max_seq_len is not None:
            for name, o in zip(self.layer_mixers(), per_layer):
                if "max_len" in mixer_options(name):  # absolute position tables (AFT-full/local)
                    o.setdefault("max_len", self.max_seq_len)
        return per_layer

    def ffn_hidden_size(self) -> int:
        """The feed-forward hidden width (see the class docstring for the defaults)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.ffn == "glu":
            return int(8 / 3 * self.d_model)  # docs/maths.md 3.4
        return 4 * self.d_model

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LMConfig:
        """Build from a dict as written by ``to_dict``; unknown keys raise ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"LMConfig.from_dict needs a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown LMConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LMConfig:
        """Read a config.json; a missing or unreadable file raises ValueError naming it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"no model config at {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read model config {path}: {err}") from None
        return cls.from_dict(data)
