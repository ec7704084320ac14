"""headloss.bounded: every module-level cache is registered there with a bound, and clear_caches()
empties them all without breaking the next call."""

from __future__ import annotations

import functools
import importlib
import pkgutil

import pytest
import torch
from conftest import make_logits, make_targets, needs_kernel

import headloss
from headloss import LossSpec, bounded, head_loss

REGISTERED = {"launch.compiled", "launch.fast", "launch.params", "launch.config", "head.tiles",
              "registry.objective_flags", "plan.compile_plan", "plan.by_key", "plan.by_id", "plan.by_data",
              "routes", "logits.recipes", "objective.names", "parallel.shards",
              "policy.unread_inputs", "verl.head_spec"}
"""Caches registered by the modules that import with headloss (and its verl integration)."""

def _modules():
    """Every module of headloss that imports here (integrations whose framework is missing are skipped)."""
    found = [headloss]
    for info in pkgutil.walk_packages(headloss.__path__, "headloss."):
        if info.name == "headloss.__main__":
            continue
        try:
            found.append(importlib.import_module(info.name))
        except ImportError:
            continue
    return found


@pytest.fixture
def scratch_registry(monkeypatch):
    """Caches a test registers are dropped from the registry afterwards."""
    monkeypatch.setattr(bounded, "_REGISTRY", dict(bounded._REGISTRY))


def test_every_registered_cache_has_a_bound_and_a_doc_and_holds_no_more():
    _modules()
    listed = bounded.caches()
    assert REGISTERED <= {c.name for c in listed}
    for c in listed:
        assert isinstance(c.bound, int) and c.bound >= 1, c
        assert c.doc.strip() and "\n" not in c.doc, c
        assert 0 <= c.size <= c.bound, c


def test_every_module_level_cache_of_headloss_is_registered():
    unregistered = set()
    for module in _modules():
        for name, value in vars(module).items():
            memoized = isinstance(value, functools._lru_cache_wrapper) and value.__module__ == module.__name__
            if (memoized or isinstance(value, bounded.BoundedDict)) and not bounded.is_registered(value):
                unregistered.add(f"{module.__name__}.{name}")
    assert not unregistered, f"not made by bounded.cache / bounded.memoize: {unregistered}"


def test_a_registered_cache_keeps_at_most_its_bound_and_refuses_none(scratch_registry):
    store = bounded.cache("test.store", 2, "a test's store")
    for key in "abc":
        store[key] = key
    assert list(store) == ["b", "c"]  # the oldest went

    calls = []

    @bounded.memoize("test.memo", 2, "a test's memo")
    def square(x: int) -> int:
        calls.append(x)
        return x * x

    assert [square(x) for x in (1, 2, 3, 3)] == [1, 4, 9, 9] and calls == [1, 2, 3]
    sizes = {c.name: (c.size, c.bound) for c in bounded.caches()}
    assert sizes["test.store"] == (2, 2) and sizes["test.memo"] == (2, 2)
    with pytest.raises(ValueError, match="at least 1"):
        bounded.cache("test.unbounded", 0, "no")
    with pytest.raises(ValueError, match="at least 1"):
        bounded.memoize("test.unbounded", 0, "no")


@needs_kernel
def test_clear_caches_empties_them_all_and_the_next_call_gives_the_same_answer():
    spec = LossSpec(z_loss={"weight": 1e-2}, token_accuracy=True, entropy={"weight": 0.0})
    logits = make_logits((2, 3, 29), seed=7)
    targets = make_targets((2, 3), 29, seed=7, ignore_frac=0.3)
    x = logits.clone().requires_grad_()
    before = head_loss(x, targets, spec)
    before.loss.backward()
    filled = {c.name for c in bounded.caches() if c.size}
    assert {"plan.compile_plan", "launch.config", "head.tiles"} <= filled, filled

    bounded.clear_caches()
    assert {c.name: c.size for c in bounded.caches() if c.size} == {}

    y = logits.clone().requires_grad_()
    after = head_loss(y, targets, spec)
    after.loss.backward()
    assert torch.equal(after.loss, before.loss) and torch.equal(y.grad, x.grad)
    assert {name: torch.equal(after.metrics[name], value) for name, value in before.metrics.items()} == \
        {name: True for name in before.metrics}
