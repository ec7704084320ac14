"""The kernels as ``torch.library`` ops under torch.compile: one decorator, and the fused gradient's hand-off.

:func:`kernel_op` turns a function whose arguments are tensors, numbers, strings and lists into a
custom op (Inductor treats it as an opaque kernel) and returns a callable that runs the function
directly in eager mode and the op under torch.compile. The fake is derived from the same
allocation the function makes (``fake=``), so an op's output shapes are written once. This is the
one place that asks whether torch.compile is tracing to pick a path.

**The fused gradient under compile.** Fused mode writes the gradient in forward; backward scales
it by d loss. Two ways, by its size (:func:`hands_off`):

* below :data:`HANDOFF_MIN_BYTES` (an RL micro-batch's logits) the gradient is a graph output,
  saved for backward, where a pointwise ``grad * d_loss`` makes the returned gradient (one pass over
  it). Every op of the call is then graph-safe: under ``mode="reduce-overhead"`` the whole call is
  inside Inductor's CUDA graphs, and the host's cost of a step is a graph replay.
* from it up (8192 x 128256 logits: a pass is ~1 ms) the gradient reaches backward beside the
  graph. Saved as a graph tensor it would be an input of the backward graph, which Inductor clones
  before an op mutates it; so the forward op returns a one-element CPU "token" tensor holding the
  gradient buffers, the Function saves the token, and backward's ``take_grad`` op takes each buffer
  back, scales it in place (a no-op on the device when d loss == 1) and returns it as a fresh
  output. Nothing in the graph aliases the buffer, so nothing is cloned; the buffers live exactly
  as long as the token (the autograd graph). These ops are tagged ``cudagraph_unsafe``: under
  mode="reduce-overhead" they run between the CUDA graphs (a replay would not run the hand-off),
  where a call this size is bound by the device, not the host.

``HEADLOSS_COMPILE_HANDOFF=0`` keeps every gradient in the graph (a saved-tensor hook that copies
saved tensors cannot carry a token).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterable

import torch

from . import env
from .kernels.head import scale_grad_
from .kernels.launch import Geometry
from .output import RETAIN_GRAPH_ERROR

HANDOFF_MIN_BYTES = 256 << 20
"""Under torch.compile a fused gradient of this many bytes or more (all of a call's gradient
buffers together) reaches backward beside the graph; a smaller one stays in the graph (see above).
From this size the backward graph's pass over an in-graph gradient costs more than the hand-off's
graph break, and a step is bound by the device (docs/performance.md, "Launch settings")."""

BESIDE_GRAPH = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
"""Tags of the ops that hand a gradient over beside the graph: they must run on every call, so
Inductor's graph partitions keep them out of mode="reduce-overhead"'s CUDA graphs (a replay would
not run the hand-off)."""

_LIBRARY = torch.library.Library("headloss", "DEF")


def kernel_op(name: str, *, fake: Callable, tags: Iterable = (), mutates_args: Iterable[str] = ()) -> Callable:
    """Register the decorated function as the custom op ``name`` (its fake: ``fake``, called with
    the same arguments) and return a callable that runs the function itself in eager mode and the
    op while torch.compile traces.

    The op is defined on a ``torch.library.Library`` (its schema inferred from the annotations), its
    function registered for every device (CompositeExplicitAutograd) and the Autograd key a
    fallthrough: the op is never differentiated (the autograd Functions around the kernels are),
    and a compiled graph calls it through the dispatcher alone: ``torch.library.custom_op``'s
    Python autograd and output-aliasing layers cost more host time per call than the kernels of a
    small call (docs/performance.md, "Launch settings")."""

    def wrap(fn: Callable) -> Callable:
        namespace, op_name = name.split("::")
        if namespace != _LIBRARY.ns:
            raise ValueError(f"kernel_op: {name!r} is not in the {_LIBRARY.ns!r} namespace")
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIBRARY.define(op_name + schema, tags=tuple(tags))
        _LIBRARY.impl(op_name, fn, "CompositeExplicitAutograd")
        _LIBRARY.impl(op_name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(name, fake, lib=_LIBRARY)
        op = getattr(getattr(torch.ops, namespace), op_name).default

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        return call

    return wrap


@contextlib.contextmanager
def autograd_inside():
    """Autograd for a block of an op's function. A compiled graph runs its ops below autograd (their
    autograd dispatch keys excluded, grad mode off); a route whose kernels take a gradient by autograd
    over torch ops (the lm_head's ``sequences+torch``) turns it back on for that block."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "ADInplaceOrView"):
        excluded = excluded.remove(getattr(torch._C.DispatchKey, key))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


_NORM_AT = Geometry._fields.index("norm")


def geo_ints(geo: Geometry) -> list[int]:
    """A Geometry's ints, in GEO_INTS order (an op's ``geo`` argument; ``norm`` travels apart)."""
    return [*geo[:_NORM_AT], *geo[_NORM_AT + 1:]]


def geo_of(values: list[int], norm: float) -> Geometry:
    """The Geometry of an op's ``geo`` argument and ``norm``."""
    return Geometry._make([*values[:_NORM_AT], norm, *values[_NORM_AT:]])


def flat_geometry(t: torch.Tensor) -> Geometry:
    """A contiguous [R, C] tensor as R rows of C columns, a [C] one as one row (for scale_grad_)."""
    rows, cols = (1, t.shape[0]) if t.dim() == 1 else t.shape
    return Geometry(n_rows=rows, n_out=rows, V=cols, T=rows, K=rows, shift=0, stride_b=0, stride_t=cols,
                    g_stride_b=0, g_stride_t=cols, t_stride_b=0, t_stride_t=0, ignore_index=0, norm=0.0)


# --- the hand-off -------------------------------------------------------------------------------------


class _Handed:
    """The buffers one forward op handed over; alive as long as its token (see hand_off)."""

    __slots__ = ("grads", "__weakref__")

    def __init__(self, grads):
        self.grads = grads


_HANDED: weakref.WeakValueDictionary[int, _Handed] = weakref.WeakValueDictionary()
_HANDED_IDS = itertools.count(1)


def hand_off(grads: list[tuple[torch.Tensor, Geometry] | None]) -> torch.Tensor:
    """A one-element CPU int64 token naming ``grads`` (buffer, scale geometry); the token keeps them
    alive, and a copy of the token (a functional wrapper, a checker) still names them."""
    key = next(_HANDED_IDS)
    token = torch.tensor([key], dtype=torch.int64)
    token._headloss_handed = _HANDED[key] = _Handed(list(grads))
    return token


def token_fake() -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


def take(token: torch.Tensor, d_loss: torch.Tensor, index: int) -> torch.Tensor:
    """The ``index``-th buffer a forward op handed over in ``token``, scaled in place by ``d_loss``."""
    handed = _HANDED.get(int(token[0])) if token.numel() == 1 and not token.is_cuda else None
    if handed is None:
        raise RuntimeError("headloss: take_grad got a token that holds no gradient (it was not made by a headloss "
                           "forward op, its autograd graph was freed, or a saved-tensor hook replaced it)")
    entry = handed.grads[index]
    if entry is None:
        raise RuntimeError(RETAIN_GRAPH_ERROR)
    handed.grads[index] = None
    grad, geo = entry
    return scale_grad_(grad, d_loss, geo)


@kernel_op("headloss::take_grad", fake=lambda token, d_loss, index, shape, dtype: torch.empty(
    shape, dtype=dtype, device=d_loss.device), tags=BESIDE_GRAPH)
def take_grad(token: torch.Tensor, d_loss: torch.Tensor, index: int, shape: list[int],
              dtype: torch.dtype) -> torch.Tensor:
    """The fused gradient a forward op handed over in ``token`` (its ``index``-th buffer), scaled in
    place by ``d_loss``; ``shape`` and ``dtype`` are the buffer's (for the fake)."""
    return take(token, d_loss, index)


def hands_off(nbytes: int) -> bool:
    """Whether a fused gradient of ``nbytes`` reaches backward beside the graph under torch.compile."""
    return env.COMPILE_HANDOFF and nbytes >= HANDOFF_MIN_BYTES


def scale(grad: torch.Tensor, d_loss: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """grad * d_loss: in eager in place (a no-op on the device when d_loss == 1); under
    torch.compile a pointwise op of the backward graph, into a fresh buffer (Inductor may reuse
    the saved one)."""
    if torch.compiler.is_compiling():
        return (grad.float() * d_loss.float().reshape(())).to(grad.dtype)
    return scale_grad_(grad, d_loss.reshape(1), geo)
