"""Megatron's gradient accumulation fusion for the lm_head's weight (``linear_head_loss(weight_grad="main_grad")``).

Megatron-core's DDP gives each parameter a ``main_grad`` (a view of its contiguous gradient buffer, fp32 when
gradients are reduced in fp32) and a ``grad_added_to_main_grad`` flag. A layer with
``gradient_accumulation_fusion`` adds its weight gradient straight into ``main_grad`` and hands autograd a
dummy gradient (``torch.empty``, or zeros where the parameter has ``zero_out_wgrad``) with the flag set, so
that the backward hook DDP registers on the parameter still fires but adds nothing
(megatron/core/tensor_parallel/layers.py, ``LinearWithGradAccumulationAndAsyncCommunication``;
megatron/core/distributed/distributed_data_parallel.py, ``_make_backward_post_hook``).

headloss follows the same protocol: where dW is computed in backward on the kernels' path (deferred mode,
the route a per-token loss takes) each chunk's ``g.T @ h`` is added into ``main_grad`` itself (no V x H dW
buffer, and fp32 accumulation when ``main_grad`` is fp32); where it is computed in forward (before the
loss's scale is known) backward adds it into ``main_grad`` times d loss in one pass (:func:`add_into`; that dW
is fp32 with ``fp32_weight_grad=True``, else in the weight's dtype); on
the plain-torch backend the weight goes through :class:`IntoMainGrad`, which adds the dW autograd computes.
Where the weight has no ``grad_added_to_main_grad`` autograd gets None, as Megatron gives it.
"""

from __future__ import annotations

import torch

from . import env
from .kernels.head import add_scaled_
from .parallel import is_dtensor


def check_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """The weight's ``main_grad`` for ``weight_grad="main_grad"``, or a ValueError naming the argument."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError("weight_grad: 'main_grad' adds dW into weight.main_grad (Megatron's gradient accumulation "
                         "fusion), but the weight has no main_grad tensor (Megatron's DDP gives it one)")
    if is_dtensor(weight) or is_dtensor(main_grad):
        raise ValueError("weight_grad: 'main_grad' takes a plain tensor weight and main_grad, got a DTensor")
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise ValueError(f"weight_grad: weight.main_grad must be shaped and placed as the weight "
                         f"({tuple(weight.shape)} on {weight.device}), got {tuple(main_grad.shape)} on "
                         f"{main_grad.device}")
    if main_grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"weight_grad: weight.main_grad must be fp32, bf16 or fp16, got {main_grad.dtype}")
    return main_grad


def handed_over(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """What autograd gets for a weight whose dW went into ``main_grad``: Megatron's dummy, flag set (None
    where the weight has no ``grad_added_to_main_grad``)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(weight.main_grad.shape, dtype=dtype, device=weight.device)
    weight.grad_added_to_main_grad = True
    return dummy


def add_into(main_grad: torch.Tensor, dw: torch.Tensor, d_loss: torch.Tensor) -> None:
    """main_grad += d_loss * dw (dW computed in forward, d loss its upstream gradient on the device): one
    kernel pass where both are contiguous on the kernels' device, torch elsewhere; no host sync."""
    scale = d_loss.reshape(1).float()
    if main_grad.is_contiguous() and dw.is_contiguous() and (dw.is_cuda or env.INTERPRETER):
        add_scaled_(main_grad.view(-1), dw.view(-1), scale)
    else:
        main_grad.add_(dw.float() * scale.reshape(()))


class IntoMainGrad(torch.autograd.Function):
    """apply(weight, (owner, main_grad)) -> the weight (a view); backward adds the dW it receives into
    ``main_grad`` (captured in forward, as Megatron captures it) and hands autograd :func:`handed_over`'s
    for ``owner``, the caller's parameter (``weight`` may be its autocast copy)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, into: tuple) -> torch.Tensor:
        ctx.owner, ctx.main_grad = into
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, dw: torch.Tensor | None):
        if dw is None:
            return None, None
        ctx.main_grad.add_(dw)
        return handed_over(ctx.owner, dw.dtype), None
