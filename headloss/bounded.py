"""The one cache type of headloss: a dict that holds at most a fixed number of entries."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(dict[K, V]):
    """A dict of at most ``size`` entries: a new key beyond that drops the oldest one (insertion
    order). Every module-level cache of headloss is one, so a long run that sees many specs, shapes
    or process groups holds a bounded number of them."""

    def __init__(self, size: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"size: expected at least 1, got {size}")
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self and len(self) >= self.size:
            del self[next(iter(self))]
        super().__setitem__(key, value)
