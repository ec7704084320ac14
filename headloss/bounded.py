"""Every module-level cache of headloss, each bounded and registered here by name.

* :func:`cache`         a new :class:`BoundedDict` of at most ``bound`` entries, registered by name
* :func:`memoize`       a function's answers by its arguments (``functools.lru_cache``), registered by name
* :func:`caches`        every registered cache: name, entries, bound, what it holds
* :func:`is_registered` whether a dict or a memoized function is one of them
* :func:`clear_caches`  empties them all (a long run, a test, after changing what a cache was built from)

A long run that sees many specs, shapes or process groups holds a bounded number of each; a cache
is always safe to clear (the next call rebuilds what it needs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

K = TypeVar("K")
V = TypeVar("V")
F = TypeVar("F", bound=Callable)


class BoundedDict(dict[K, V]):
    """A dict of at most ``size`` entries: a new key beyond that drops the oldest one (insertion order)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"size: expected at least 1, got {size}")
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self and len(self) >= self.size:
            del self[next(iter(self))]
        super().__setitem__(key, value)


class CacheInfo(NamedTuple):
    """One registered cache, as :func:`caches` lists it."""

    name: str
    size: int  # entries now
    bound: int  # entries at most
    doc: str  # what it holds, by what key


class _Entry(NamedTuple):
    cache: object  # the BoundedDict, or the memoized function
    bound: int
    doc: str
    length: Callable[[], int]
    clear: Callable[[], None]


_REGISTRY: dict[str, _Entry] = {}


def _register(name: str, entry: _Entry) -> None:
    _REGISTRY[name] = entry  # a name registered again (a reloaded module) is replaced


def cache(name: str, bound: int, doc: str) -> BoundedDict:
    """A new empty :class:`BoundedDict` of at most ``bound`` entries, registered as ``name``
    with ``doc``, one line saying what it holds by what key."""
    store: BoundedDict = BoundedDict(bound)
    _register(name, _Entry(store, bound, doc, store.__len__, store.clear))
    return store


def memoize(name: str, bound: int, doc: str) -> Callable[[F], F]:
    """Decorator: ``functools.lru_cache(maxsize=bound)`` over the function, registered as ``name``
    (its arguments must be hashable; ``cache_clear`` and ``cache_info`` stay available)."""
    if bound < 1:
        raise ValueError(f"bound: expected at least 1, got {bound}")

    def wrap(fn: F) -> F:
        memoized = functools.lru_cache(maxsize=bound)(fn)
        _register(name, _Entry(memoized, bound, doc, lambda: memoized.cache_info().currsize, memoized.cache_clear))
        return memoized  # type: ignore[return-value]

    return wrap


def caches() -> list[CacheInfo]:
    """Every registered cache, in registration order."""
    return [CacheInfo(name, entry.length(), entry.bound, entry.doc) for name, entry in _REGISTRY.items()]


def is_registered(obj: object) -> bool:
    """Whether ``obj`` (a BoundedDict or a memoized function) is one of the registered caches."""
    return any(entry.cache is obj for entry in _REGISTRY.values())


def clear_caches() -> None:
    """Empty every registered cache."""
    for entry in _REGISTRY.values():
        entry.clear()
