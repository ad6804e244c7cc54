"""The extra-config dict an engine hands its hiqcache adapter, validated key by key.

Both engine adapters take their options as a JSON-like dict (vLLM's kv_connector_extra_config,
SGLang's --hicache-storage-backend-extra-config). An unknown key or a value of the wrong type or
range raises ValueError naming the key, so a typo fails engine start-up instead of being ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from hiqcache.spec import Codec


class ExtraConfig:
    """`extra` checked against `accepted` (an unknown key raises at construction); the accessors
    return typed values or raise ValueError naming `where[key]`."""

    def __init__(self, extra: dict[str, Any] | None, where: str, accepted: Iterable[str]):
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"hiqcache: {where} must be a JSON object, got "
                             f"{type(extra).__name__}")
        self.extra = dict(extra or {})
        self.where = where
        self.accepted = tuple(accepted)
        unknown = sorted(str(k) for k in self.extra if k not in self.accepted)
        if unknown:
            raise ValueError(f"hiqcache: unknown {where} key {unknown[0]!r}; accepted: "
                             f"{', '.join(self.accepted)}")

    def _name(self, key: str) -> str:
        return f"hiqcache: {self.where}[{key!r}]"

    def text(self, key: str, default: str = "") -> str:
        v = self.extra.get(key, default)
        if not isinstance(v, str):
            raise ValueError(f"{self._name(key)} must be a string, got {type(v).__name__}")
        if any(c in v for c in "\0\n\r"):
            raise ValueError(f"{self._name(key)} holds a control character")
        return v

    def integer(self, key: str, default: int, low: int, high: int) -> int:
        v = self.extra.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ValueError(f"{self._name(key)} must be an integer in [{low}, {high}], got {v!r}")
        return v

    def rope_theta(self, key: str = "rope_theta") -> float:
        """A model's RoPE base for Geometry.rope_theta: 0 (none; the default) or a finite number
        in [1, 1e12]."""
        v = self.extra.get(key, 0.0)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or (v != 0 and not 1 <= v <= 1e12)):
            raise ValueError(f"{self._name(key)} must be 0 or a number in [1, 1e12], got {v!r}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        """A boolean; 0 and 1 pass too (SGLang reads its own flags with bool())."""
        v = self.extra.get(key, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        raise ValueError(f"{self._name(key)} must be true or false, got {v!r}")

    def choice(self, key: str, default: str, allowed: Iterable[str]) -> str:
        allowed = tuple(allowed)
        v = self.text(key, default)
        if v not in allowed:
            raise ValueError(f"{self._name(key)} must be one of {', '.join(map(repr, allowed))}, "
                             f"got {v!r}")
        return v

    def codec(self, key: str = "codec") -> Codec:
        try:
            return Codec.parse(self.text(key) or Codec.INT8_PER_HEAD.value)
        except ValueError as err:
            raise ValueError(f"{self._name(key)}: {err}") from None

    def target(self, key: str = "target") -> str:
        """A daemon address as hiqcache.Client takes it ("" = the default socket)."""
        target = self.text(key)
        if target:
            from hiqcache.client import normalize_target

            try:
                normalize_target(target)
            except ValueError as err:
                raise ValueError(f"{self._name(key)}: {err}") from None
        return target
