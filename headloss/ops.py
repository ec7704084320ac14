"""The kernels as ``torch.library`` ops under torch.compile: one decorator, and the fused gradient's hand-off.

:func:`kernel_op` turns a function whose arguments are tensors, numbers, strings and lists into a
custom op (Inductor treats it as an opaque kernel) and returns a callable that runs the function
directly in eager mode (the dispatcher costs ~30 us a call) and the op under torch.compile. The
fake is derived from the same allocation the function makes (``fake=``), so an op's output shapes
are written once. This is the one place that asks whether torch.compile is tracing to pick a path.

**The hand-off.** Saved for backward as a graph tensor, the fused gradient is an input of the
backward graph, and Inductor clones a backward input before an op mutates it (a full N x V copy:
2.54 ms against 1.55 eager for the full SFT case). So under compile the forward op hands the
gradient over beside the graph: it returns a one-element CPU "token" tensor holding the gradient
buffers, the Function saves the token, and backward's ``take_grad`` op takes each buffer back,
scales it in place (a no-op on the device when d loss == 1) and returns it as a fresh output.
Nothing in the graph aliases the buffer, so nothing is cloned; the buffers live exactly as long as
the token (the autograd graph). Under mode="reduce-overhead" these ops run outside the CUDA graphs
(tagged cudagraph_unsafe), so every call hands over its own buffers. ``HEADLOSS_COMPILE_HANDOFF=0``
saves the gradient as a graph tensor instead (headloss.env).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Iterable

import torch

from .kernels.head import scale_grad_
from .kernels.launch import Geometry
from .output import RETAIN_GRAPH_ERROR

BESIDE_GRAPH = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
"""Tags of the ops that hand a gradient over beside the graph: they must run on every call, so
Inductor's graph partitions keep them out of mode="reduce-overhead"'s CUDA graphs (a replay would
not run the hand-off)."""

def kernel_op(name: str, *, fake: Callable, tags: Iterable = (), mutates_args: Iterable[str] = ()) -> Callable:
    """Register the decorated function as the custom op ``name`` (its fake: ``fake``, called with
    the same arguments) and return a callable that runs the function itself in eager mode and the
    op while torch.compile traces."""

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(name, fn, mutates_args=tuple(mutates_args), tags=tuple(tags))
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        return call

    return wrap


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


@kernel_op("headloss::scale_grad_", fake=lambda grad, d_loss, geo: None, mutates_args=("grad",))
def scale_grad_op(grad: torch.Tensor, d_loss: torch.Tensor, geo: list[int]) -> None:
    """grad *= d_loss in place: the compiled backward with HEADLOSS_COMPILE_HANDOFF=0."""
    scale_grad_(grad, d_loss, geo_of(geo, 0.0))


def scale(grad: torch.Tensor, d_loss: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """grad *= d_loss in place (a no-op on the device when d_loss == 1); under torch.compile through
    the ``scale_grad_`` op (HEADLOSS_COMPILE_HANDOFF=0: Inductor clones ``grad`` before it)."""
    scale_grad_op(grad, d_loss.reshape(1), geo_ints(geo))
    return grad
