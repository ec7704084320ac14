"""Launching the kernels: one call site for every launch, its geometry, block sizes and warps.

* :class:`Geometry`   sizes and strides of one launch (runtime ints), read by name in the kernels
* :func:`launch`      ``kernel[(grid,)](**kwargs)``, after a variant's first launch straight into its
                      compiled C launcher (skipping Triton's per-launch binding in Python)
* :func:`launch_config`  the vocabulary block and warps for a row of V logits
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from .. import bounded, env
from ..layouts import views_fingerprint
from ..registry import Scalars

try:  # Triton's private C binder: the fast path needs it, launch() works without it
    from triton._C.libtriton import native_specialize_impl as _native_specialize
except ImportError:
    _native_specialize = None

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The logits (and hidden states') dtypes the kernels read."""


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


_COMPILED = bounded.cache("launch.compiled", 4096,
                          "compiled C launchers by (kernel, device, warps, constexprs, Triton's specialisation)")


class _Params(NamedTuple):
    """A kernel's parameters, as C-level getters over a launch's keyword arguments."""

    runtime: operator.itemgetter  # -> tuple of the runtime arguments
    constexprs: operator.itemgetter  # -> tuple of the constexpr values
    every: operator.itemgetter  # -> tuple of every argument, in order
    runtime_at: tuple[int, ...]  # where the runtime arguments sit among every argument


_PARAMS = bounded.cache("launch.params", 256, "a kernel's parameter getters (_Params) by kernel")


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
    """A key at least as fine as :func:`triton_specialisation` of ``args``: equal keys, equal specialisations."""
    return tuple([_spec_of(a) for a in args])


def triton_specialisation(backend, args: tuple) -> tuple | None:
    """How Triton specialises a launch's runtime arguments, from its private C binder
    (``triton._C.libtriton.native_specialize_impl``); None where this Triton has no such function or
    calls it otherwise. :func:`launch` then takes Triton's own path: the fast path is an optimisation."""
    if _native_specialize is None:
        return None
    try:
        return _native_specialize(backend, args, False, True, True)
    except Exception:  # another signature; an argument Triton rejects raises again on its own path
        return None


def launch(kernel, grid: int, num_warps: int, registers_of: Callable[[], dict | None] | None = None,
           fit_spills: int = 0, **kwargs) -> None:
    """``kernel[(grid,)](**kwargs)``. After a variant's first launch, later launches of the same
    variant call its compiled C launcher directly, found by :func:`spec_key` over the runtime
    arguments (what Triton specialises on, computed in Python more cheaply than Triton's binder; a
    new key falls back to :func:`triton_specialisation` and to Triton's launch). This skips Triton's
    per-launch binding, cache key and launch metadata. A profiler's launch hooks, the interpreter,
    ``HEADLOSS_FAST_LAUNCH=0`` and a Triton without the private binder take Triton's path.
    ``registers_of``: gives the arguments of a sibling variant whose registers per thread this one should
    keep to where its build at them spills at most ``fit_spills`` (:func:`_fitted`), or None; called only
    where the fast path compiles a new variant (not on every launch)."""
    if id(kernel) not in _KEYED:  # first, before anything hashes the kernel (a JITFunction by its cache key)
        keyed(kernel)
    hooks = triton.knobs.runtime.launch_enter_hook
    if not env.FAST_LAUNCH or not isinstance(kernel, _JIT) or (hooks is not None and getattr(hooks, "calls", True)):
        with interpreter_noise_ignored() if env.INTERPRETER else contextlib.nullcontext():
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
        specialisation = triton_specialisation(caches[3], runtime)
        if specialisation is None:
            kernel[(grid,)](**kwargs, num_warps=num_warps)
            return
        key = (kernel, device, num_warps, constexprs, specialisation)
        entry = _COMPILED.get(key)
        if entry is None:
            compiled = kernel[(grid,)](**kwargs, num_warps=num_warps)
            if compiled is not None:
                sibling = registers_of() if registers_of is not None else None
                if sibling is not None:
                    compiled = _fitted(kernel, grid, num_warps, kwargs, sibling, compiled, fit_spills)
                _COMPILED[key] = _compiled_entry(compiled)
            return
        _FAST[fast_key] = entry
    run, fixed = entry
    run(grid, 1, 1, _raw_stream(device), *fixed, *args)


_KEYED: dict[int, object] = {}


def keyed(kernel) -> None:
    """Add the layouts' fingerprint (layouts.views_fingerprint) to a Triton kernel's cache key, once,
    before its first compile: the positions it reads through the kernel views then key its binaries
    as its source does (Triton's own key leaves module attributes out). Under the interpreter: nothing."""
    if isinstance(kernel, _JIT):
        kernel.hash = hashlib.sha256((kernel.cache_key + views_fingerprint()).encode()).hexdigest()
    _KEYED[id(kernel)] = kernel  # (by id: a JITFunction hashes by its cache key)


def _fitted(kernel, grid: int, num_warps: int, kwargs: dict, registers_of: dict, compiled, spills: int = 0):
    """``compiled``, or the same variant compiled with ``maxnreg`` at the registers per thread of the
    sibling variant of ``registers_of``, where it takes more than that sibling and the capped build
    spills at most ``spills`` (Triton's count). ptxas gives a variant that holds a few per-row values in
    registers (a per-row temperature: 1 / t and its products, where the spec's temperature is a kernel
    parameter) more registers than it needs: the GRPO head kernel 80 where 64 spill nothing, one program
    fewer per SM (docs/performance.md, "What a teacher's probabilities and a per-row temperature cost");
    the student's top-k likewise (FIT_SPILLS)."""
    try:
        sibling = kernel.warmup(grid=(grid,), num_warps=num_warps, **registers_of)
        sibling._init_handles()
        compiled._init_handles()
        if not 0 < sibling.n_regs < compiled.n_regs:
            return compiled
        capped = kernel.warmup(grid=(grid,), num_warps=num_warps, maxnreg=sibling.n_regs, **kwargs)
        capped._init_handles()
    except Exception as exc:  # an optimisation: a build that fails here leaves the call its own variant
        warnings.warn(f"headloss: fitting {kernel.fn.__name__}'s registers failed ({type(exc).__name__}: {exc}); "
                      "it runs as compiled", RuntimeWarning, stacklevel=3)
        return compiled
    return capped if capped.n_spills <= spills else compiled


FIT_SPILLS = 32
"""The most spills (Triton's count) a launch with the student's top-k accepts to keep to the registers of the
same launch without it: the top-64 head kernel at 63 registers (the plain call's) spills 10 (bench_topk_registers'
build at 64: 8) and ran 1.25x the plain CE call against 1.56x as ptxas allocates it (124 registers; a build that
spilled 20 was refused at 16 and ran 1.55x); top-8 at 63, 10 spills (docs/performance.md, "What the student's
top-k costs")."""


@contextlib.contextmanager
def interpreter_noise_ignored():
    """numpy's warnings from Triton's interpreter (CPU) on values a kernel computes and then discards
    with tl.where (-inf - -inf in a masked column, say; compiled kernels do the same arithmetic
    silently): ignored inside headloss's launches only, the caller's filters restored after. The
    same warnings pyproject.toml's pytest filterwarnings lists."""
    with warnings.catch_warnings():
        for message, category in _INTERPRETER_NOISE:
            warnings.filterwarnings("ignore", message, category, r"triton\.runtime\.interpreter")
        yield


_INTERPRETER_NOISE = (("invalid value encountered", RuntimeWarning), ("overflow encountered", RuntimeWarning),
                      ("", DeprecationWarning))

_FAST = bounded.cache("launch.fast", 4096, "compiled C launchers by launch()'s cheap key (spec_key over the arguments)")
_JIT = triton.runtime.jit.JITFunction
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int
    num_warps: int


def launch_config(vocab: int, teacher: bool = False, rows: int | None = None) -> LaunchConfig:
    """Block and warps for a row of ``vocab`` logits, in a launch of ``rows`` rows (cached).

    16 columns per thread (2048 x 4 warps): per-thread state small enough for the occupancy this
    latency-bound loop needs; 1024 x 4 with a teacher, whose per-lane state doubles. A launch of
    fewer than 1024 rows (the lm_head's chunks) has too few programs to fill the GPU: wider ones,
    4096 x 8 (2048 x 4 with a teacher). The measurements: docs/performance.md, "Launch settings".
    HEADLOSS_BLOCK_V / HEADLOSS_NUM_WARPS (read at import) or :data:`LAUNCH_OVERRIDES` (set by tuning
    sweeps) override it.
    """
    return _launch_config(vocab, teacher, rows is not None and rows < 1024, LAUNCH_OVERRIDES["block_v"],
                          LAUNCH_OVERRIDES["num_warps"])


LAUNCH_OVERRIDES: dict[str, int | None] = {
    "block_v": env.BLOCK_V,
    "num_warps": env.NUM_WARPS,
}
"""Block size and warps forced on every head launch (None: the measured defaults)."""


@bounded.memoize("launch.config", 1024, "launch_config's answers by (vocab, teacher, few rows, overrides)")
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
