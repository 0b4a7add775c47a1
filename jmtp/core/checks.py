"""Argument checks shared by the config dataclasses (one message format for a bad choice) and by
request intake (the nesting depth of JSON values)."""
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


def json_depth(value: Any, limit: int | None = None) -> int:
    """Nesting depth of a JSON-like value: 0 for a scalar, 1 for ``{}`` / ``[]`` of scalars, one
    more per level of dicts and lists (tuples count as lists). Iterative, so any depth is safe to
    measure; with ``limit`` it stops at the first level past it and returns ``limit + 1``."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if d > depth:
            depth = d
            if limit is not None and depth > limit:
                return limit + 1
        stack.extend((child, d + 1) for child in children)
    return depth
