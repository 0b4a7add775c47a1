"""Argument checks shared by the config dataclasses: one message format for a bad choice."""
from __future__ import annotations

from typing import Any, Collection


def check_one_of(field: str, value: Any, allowed: Collection) -> Any:
    """Return ``value`` if it is in ``allowed``.

    Raises:
      ValueError: ``"{field} must be one of {allowed}, got {value!r}"``.
    """
    if value not in allowed:
        raise ValueError(f"{field} must be one of {tuple(allowed)}, got {value!r}")
    return value
