"""Launching the kernels: one call site for every launch, its geometry, block sizes and warps.

* :class:`Geometry`   sizes and strides of one launch (runtime ints), read by name in the kernels
* :func:`launch`      ``kernel[(grid,)](**kwargs)``, after a variant's first launch straight into its
                      compiled C launcher (20-50 us of Triton's host time saved per launch)
* :func:`launch_config`  the vocabulary block and warps for a row of V logits
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
from triton._C.libtriton import native_specialize_impl

from .. import env
from ..bounded import BoundedDict
from ..plan import Scalars


class Geometry(NamedTuple):
    """Sizes and strides of one launch (runtime ints; Triton specializes 1 and multiples of 16)."""

    n_rows: int  # logits rows = programs (B * T)
    n_out: int  # slots: per-token outputs and inputs (B * K)
    V: int
    T: int  # logits rows per sequence
    K: int  # slots per sequence (K <= T; rows t >= K are not scored)
    shift: int  # the target of row t is targets[b, t + shift]
    stride_b: int
    stride_t: int
    g_stride_b: int  # gradient buffer strides
    g_stride_t: int
    t_stride_b: int  # teacher strides
    t_stride_t: int
    ignore_index: int
    norm: float  # num_items_in_batch given as a number (0: none)
    vocab_start: int = 0  # vocab-parallel: the global id of this shard's column 0
    V_total: int = 0  # vocab-parallel: the whole vocabulary (0: not sharded, V is all of it)


GEO_INTS = tuple(name for name in Geometry._fields if name != "norm")
"""Geometry's int fields, in order (the torch.library ops pass them as a list, norm apart)."""


_COMPILED: BoundedDict[tuple, tuple] = BoundedDict(4096)
"""Compiled C launchers by (kernel, device, warps, constexprs, Triton's own specialisation)."""


class _Params(NamedTuple):
    """A kernel's parameters, as C-level getters over a launch's keyword arguments."""

    runtime: operator.itemgetter  # -> tuple of the runtime arguments
    constexprs: operator.itemgetter  # -> tuple of the constexpr values
    every: operator.itemgetter  # -> tuple of every argument, in order
    runtime_at: tuple[int, ...]  # where the runtime arguments sit among every argument


_PARAMS: dict[object, _Params] = {}


def _getter(names: tuple[str, ...]) -> operator.itemgetter:
    """itemgetter that returns a tuple for any number of names (itemgetter of one name returns the item)."""
    if len(names) == 1:
        name = names[0]
        return lambda kwargs: (kwargs[name],)  # type: ignore[return-value]
    return operator.itemgetter(*names) if names else (lambda kwargs: ())  # type: ignore[return-value]


def _params_of(kernel) -> _Params:
    params = _PARAMS.get(kernel)
    if params is None:
        params = _PARAMS[kernel] = _Params(
            _getter(tuple(p.name for p in kernel.params if not p.is_constexpr)),
            _getter(tuple(p.name for p in kernel.params if p.is_constexpr)),
            _getter(tuple(p.name for p in kernel.params)),
            tuple(i for i, p in enumerate(kernel.params) if not p.is_constexpr),
        )
    return params


def _compiled_entry(compiled) -> tuple:
    """(C launch function, its fixed leading arguments) of a compiled variant: later launches call
    Triton's generated C launcher directly (its Python wrapper only allocates scratch, which these
    kernels never use), or (compiled.run, fixed arguments) when a variant does use scratch."""
    run = compiled.run
    fixed_meta = (compiled.packed_metadata, None, None, None)
    if getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0 \
            and hasattr(run, "launch"):
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, *fixed_meta)
    return run, (compiled.function, *fixed_meta)


_NORM_AT = Geometry._fields.index("norm")
SPECIALISED_BY: dict[type, Callable] = {
    Geometry: lambda arg: arg[:_NORM_AT] + arg[_NORM_AT + 1:],  # ints, and norm (a float: by its type)
    Scalars: lambda arg: Scalars,  # floats only: Triton specialises a float by its type, never its value
}
"""What Triton's specialisation of a launch argument of these types depends on (a kernel module adds
its own argument types, e.g. kernels.head's Prepare, whose nonce changes every call)."""


def _spec_of(arg):
    """What Triton's specialisation of one runtime argument depends on, cheaply: a tensor's dtype and
    16-byte alignment, an int's value, a float's type (see tests/kernels/test_launch.py)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    kind = type(arg)
    if kind is int or arg is None:
        return arg
    special = SPECIALISED_BY.get(kind)
    if special is not None:
        return special(arg)
    if kind is float:
        return float
    if isinstance(arg, tuple):
        return kind, tuple([_spec_of(a) for a in arg])
    return kind, arg  # bools and anything else: by type and value


def spec_key(args: tuple) -> tuple:
    """A key at least as fine as ``native_specialize_impl(args)``: equal keys, equal specialisations."""
    return tuple([_spec_of(a) for a in args])


def launch(kernel, grid: int, num_warps: int, **kwargs) -> None:
    """``kernel[(grid,)](**kwargs)``. After a variant's first launch, later launches of the same
    variant call its compiled C launcher directly, found by :func:`spec_key` over the runtime
    arguments (what Triton specialises on, computed in Python at a third of the cost of Triton's
    ``native_specialize_impl``; a new key falls back to that and to Triton's launch). Triton's own
    per-launch binding, cache key and launch metadata cost 20-50 us of host time per launch on an
    H200 host (benchmarks/bench_host.py). A profiler's launch hooks, the interpreter and
    ``HEADLOSS_FAST_LAUNCH=0`` take Triton's path."""
    hooks = triton.knobs.runtime.launch_enter_hook
    if not env.FAST_LAUNCH or not isinstance(kernel, _JIT) or (hooks is not None and getattr(hooks, "calls", True)):
        kernel[(grid,)](**kwargs, num_warps=num_warps)
        return
    params = _params_of(kernel)
    device = _current_device()
    args = list(params.every(kwargs))
    spec = []
    for i in params.runtime_at:  # spec_key, and a CUDA tensor's address as an int: the C launcher then
        arg = args[i]  # skips its cuPointerGetAttribute per tensor (inputs were checked to be on the device)
        if isinstance(arg, torch.Tensor) and arg.is_cuda:
            address = args[i] = arg.data_ptr()
            spec.append((arg.dtype, not address & 15))
        else:
            spec.append(_spec_of(arg))
    constexprs = params.constexprs(kwargs)
    fast_key = (kernel, device, num_warps, constexprs, tuple(spec))
    entry = _FAST.get(fast_key)
    if entry is None:
        runtime = params.runtime(kwargs)
        caches = kernel.device_caches.get(device) if kernel.device_caches else None
        if caches is None:  # first launch on this device: Triton builds its caches and the backend
            kernel[(grid,)](**kwargs, num_warps=num_warps)
            return
        key = (kernel, device, num_warps, constexprs, native_specialize_impl(caches[3], runtime, False, True, True))
        entry = _COMPILED.get(key)
        if entry is None:
            compiled = kernel[(grid,)](**kwargs, num_warps=num_warps)
            if compiled is not None:
                _COMPILED[key] = _compiled_entry(compiled)
            return
        _FAST[fast_key] = entry
    run, fixed = entry
    run(grid, 1, 1, _raw_stream(device), *fixed, *args)


_FAST: BoundedDict[tuple, tuple] = BoundedDict(4096)
"""Compiled C launchers by the cheap key of :func:`launch` (spec_key over the runtime arguments)."""
_JIT = triton.runtime.jit.JITFunction
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int
    num_warps: int


def launch_config(vocab: int, teacher: bool = False, rows: int | None = None) -> LaunchConfig:
    """Block and warps for a row of ``vocab`` logits, in a launch of ``rows`` rows (cached).

    2048 columns x 4 warps (16 per thread) was fastest on an H200 at V=128256 for every spec
    (benchmarks/profile_head.py --ablate, bench_head.py --tune): small enough per-thread state
    for high occupancy, which this latency-bound loop needs. With a teacher the per-lane state
    doubles, and 1024 x 4 was fastest (2996 vs 3216 us, profile_head.py --terms).
    A launch of fewer than 1024 rows (the fused lm_head's chunks) has too few programs to fill
    the GPU with 4 warps each: 4096 x 8 (the same 16 per thread) ran 256/320/512-row chunks at
    2.39/2.05/1.77 ms per 8192 rows against 2.97/2.96/2.10 (benchmarks/profile_linear.py); with a
    teacher in such launches (the lm_head's teacher parts of 256 rows) 2048 x 4 ran the fused
    distillation head (N 8192, V 128256) in 60.1 ms against 61.2 for 1024 x 4 and 61.0 for 4096 x 8 on
    an H100 (benchmarks/bench_compile.py --profile-distill).
    HEADLOSS_BLOCK_V / HEADLOSS_NUM_WARPS (read at import) or :data:`LAUNCH_OVERRIDES` (set by those
    sweeps) override it.
    """
    return _launch_config(vocab, teacher, rows is not None and rows < 1024, LAUNCH_OVERRIDES["block_v"],
                          LAUNCH_OVERRIDES["num_warps"])


LAUNCH_OVERRIDES: dict[str, int | None] = {
    "block_v": env.BLOCK_V,
    "num_warps": env.NUM_WARPS,
}
"""Block size and warps forced on every head launch (None: the measured defaults)."""


@functools.lru_cache(maxsize=1024)
def _launch_config(vocab: int, teacher: bool, few_rows: bool, block_v: int | None, num_warps: int | None
                   ) -> LaunchConfig:
    block = min(1 << (max(vocab, 16) - 1).bit_length(), 1024 if teacher else 2048)
    warps = 4 if block >= 1024 else (2 if block >= 256 else 1)
    if few_rows and vocab >= 16384:
        block, warps = (2048, 4) if teacher else (4096, 8)
    return LaunchConfig(block_v=block_v or block, num_warps=num_warps or warps)


def row_strides(t: torch.Tensor | None) -> tuple[int, int]:
    """(stride_b, stride_t) of a [N, V] (one sequence of N rows) or [B, T, V] tensor; (0, 0) for None."""
    if t is None:
        return 0, 0
    if t.dim() == 2:
        return 0, t.stride(0)
    return t.stride(0), t.stride(1)
