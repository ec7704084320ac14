"""The launch fast path: after a variant's first launch, later launches reuse its compiled
launcher, keyed by Triton's own specialisation of the runtime arguments taken in one call over
their tuple. If that key merged two variants Triton tells apart, a kernel compiled for 16-byte
aligned pointers could run on unaligned ones: these tests compare the one-call key with the
per-argument specialisation Triton's binder computes, on this machine (no GPU needed)."""

from __future__ import annotations

import itertools

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from headloss.kernels.head import Geometry, PolicyRows


def one_call(args: tuple):
    return native_specialize_impl(BaseBackend, args, False, True, True)


def per_argument(args: tuple):
    """What Triton's binder computes: one specialisation per runtime argument."""
    return tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)


def _geo(**changes):
    base = dict(n_rows=8, n_out=8, V=32000, T=8, K=8, shift=0, stride_b=0, stride_t=32000, g_stride_b=0,
                g_stride_t=32000, t_stride_b=0, t_stride_t=0, ignore_index=-100, norm=0.0)
    return Geometry(**{**base, **changes})


def test_one_call_key_separates_exactly_what_the_binder_separates():
    t = torch.empty(64)
    candidates = [
        (t, None, _geo()),
        (t[1:], None, _geo()),  # unaligned pointer
        (t[4:], None, _geo()),  # 16-byte aligned again
        (t, t, _geo()),  # an optional input present
        (t, None, _geo(T=1, K=1)),  # ints equal to 1 are constexprs in Triton
        (t, None, _geo(V=32001, stride_t=32001)),  # not a multiple of 16
        (t, None, _geo(stride_b=2**33)),  # needs 64 bits
        (t.to(torch.bfloat16), None, _geo()),
        (t, PolicyRows(t, None, t, None, t), _geo()),
        (t, PolicyRows(t, t, t, None, t), _geo()),
        (t, None, _geo(norm=3.0)),  # floats: by type only
    ]
    for a, b in itertools.combinations(candidates, 2):
        assert (one_call(a) == one_call(b)) == (per_argument(a) == per_argument(b)), (a, b)
