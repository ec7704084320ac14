"""The launch fast path: after a variant's first launch, later launches reuse its compiled
launcher, keyed by what Triton itself specialises on. If the key missed a specialisation, a
kernel compiled for 16-byte-aligned pointers could run on unaligned ones: these tests compare the
key with Triton's own specialisation, value by value, on this machine (no GPU needed)."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from headloss.kernels.head import Geometry, PolicyRows, _spec
from headloss.plan import Scalars


def triton_spec(value):
    return native_specialize_impl(BaseBackend, value, False, True, True)


def _assert_same_partition(values):
    """Equal fast-path keys must mean equal Triton specialisations (the key may split finer)."""
    seen = {}
    for value in values:
        key, native = _spec(value), triton_spec(value)
        if key in seen:
            assert seen[key] == native, f"{value!r}: key {key} maps to {seen[key]} and {native}"
        seen[key] = native


def test_int_keys_split_exactly_where_triton_specialises():
    edges = [0, 1, 2, 15, 16, 17, 32, -1, -16, -100, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
             -(2**31) - 1, -(2**31) - 16, 2**40, 2**62, 128256, 151936, 32000, 50257]
    _assert_same_partition(edges)
    # and in the other direction: values Triton tells apart get different keys
    for a, b in itertools.combinations(edges, 2):
        if triton_spec(a) != triton_spec(b):
            assert _spec(a) != _spec(b), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
def test_tensor_keys_split_on_alignment_like_triton(dtype):
    base = torch.empty(64, dtype=dtype)
    views = [base[i:] for i in range(16)]
    _assert_same_partition(views)
    aligned = [v for v in views if v.data_ptr() % 16 == 0]
    unaligned = [v for v in views if v.data_ptr() % 16 != 0]
    assert aligned and unaligned
    assert {_spec(v) for v in aligned}.isdisjoint({_spec(v) for v in unaligned})


def test_named_tuple_keys_recurse_like_triton():
    t = torch.empty(8)
    values = [
        PolicyRows(t, None, t, None, t),
        PolicyRows(t, t, t, None, t),
        PolicyRows(t[1:], None, t, None, t),
        Geometry(8, 8, 32000, 8, 8, 0, 0, 32000, 0, 32000, 0, 0, -100, 0.0),
        Geometry(8, 8, 32000, 8, 8, 1, 0, 32000, 0, 32000, 0, 0, -100, 0.0),
        Geometry(1, 1, 32001, 1, 1, 0, 0, 32001, 0, 32001, 0, 0, -100, 8.0),
        None,
    ]
    _assert_same_partition(values)
    assert len({_spec(v) for v in values}) == len(values)


def test_scalars_are_all_floats_so_their_key_is_their_type():
    """The key skips the scalars' values; that is right only while every field is a float."""
    scalars = Scalars(w_ce=0.5, smoothing=0.1)
    assert all(isinstance(v, float) for v in scalars)
    assert all(triton_spec(v) == ("fp32", None) for v in scalars)
    assert _spec(scalars) is Scalars
