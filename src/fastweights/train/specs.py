"""Parsing of command-line mixer specifications: ``name`` or ``name:opt=value:opt=value``,
several separated by commas (``dpfp:nu=2,favor:m=128,delta:feature_map=dpfp``)."""

from __future__ import annotations

from typing import Any


class SpecError(ValueError):
    """A malformed specification string."""


def parse_value(text: str) -> Any:
    """``true``/``false``/``none`` (any case), ints, floats, else the string itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_mixer_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"dpfp:nu=2"`` -> ``("dpfp", {"nu": 2})``."""
    name, *opts = spec.strip().split(":")
    if not name:
        raise SpecError(f"empty mixer name in {spec!r}")
    options: dict[str, Any] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or not key:
            raise SpecError(f"mixer option {opt!r} in {spec!r} must look like name=value")
        options[key.strip()] = parse_value(value.strip())
    return name, options


def parse_mixer_list(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Comma-separated specs, in order."""
    specs = [s for s in text.split(",") if s.strip()]
    if not specs:
        raise SpecError(f"no mixer given in {text!r}")
    return [parse_mixer_spec(s) for s in specs]


def parse_int_list(name: str, text: str) -> list[int]:
    """``"20,40,60"`` -> [20, 40, 60], every item a positive int."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SpecError(f"{name} must be comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SpecError(f"{name} must be comma-separated positive integers, got {text!r}")
    return values
