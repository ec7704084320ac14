"""autograd Functions around the head kernels: fused and deferred modes.

Both take the same things: ``apply(logits, targets, teacher, policy, plan, options, grad_scale)`` and return
``(loss, *RowStats.fields())`` (None where not computed).

* fused     the gradient is written in forward (one launch); backward only scales it by
            d loss, which costs nothing when d loss == 1 (checked on the device).
* deferred  forward runs the stats pass and saves the logits; backward combines the upstream
            gradients of the loss and of the differentiable per-token outputs into one
            gradient pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.head import run_backward, run_forward, scale_grad_
from .plan import KernelPlan


@dataclass(frozen=True)
class ExecOptions:
    """How to run, not what to compute."""

    inplace_grad: bool = False  # write d loss / d logits over the logits (saves N*V memory)


def _reduce(stats, grad_scale: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return stats.token_loss.clone()
    loss = (stats.token_loss.sum() * grad_scale).reshape(())
    if stats.policy_loss is not None:  # already weighted by its aggregation
        loss = loss + stats.policy_loss.sum()
    return loss


def _grad_buffer(logits: torch.Tensor, options: ExecOptions) -> torch.Tensor:
    if options.inplace_grad:
        return logits.detach()
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


class FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, teacher, policy, plan: KernelPlan, options: ExecOptions, grad_scale):
        grad = _grad_buffer(logits, options) if ctx.needs_input_grad[0] else None
        stats = run_forward(plan, logits.detach(), targets, teacher, grad, grad_scale, policy=policy)
        loss = _reduce(stats, grad_scale, plan.reduction)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(*[t for t in stats.fields() if t is not None])
        return (loss, *stats.fields())

    @staticmethod
    def backward(ctx, d_loss, *unused):
        (grad,) = ctx.saved_tensors
        nones = (None,) * 6
        if grad is None:
            return None, *nones
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "headloss: a second backward through the same fused-mode loss (retain_graph=True). "
                "The fused mode computes the gradient once, in forward, and hands that buffer to "
                "autograd on the first backward. Use differentiable_outputs=True or reduction='none' "
                "(deferred mode, which recomputes it per backward), or call head_loss again."
            )
        ctx.consumed = True
        return scale_grad_(grad, d_loss), *nones


class DeferredHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, teacher, policy, plan: KernelPlan, options: ExecOptions, grad_scale):
        stats = run_forward(plan, logits.detach(), targets, teacher, None, grad_scale, policy=policy)
        loss = _reduce(stats, grad_scale, plan.reduction)
        ctx.plan, ctx.options = plan, options
        ctx.save_for_backward(logits.detach(), targets, teacher, stats.lse, stats.entropy, stats.dstats, grad_scale)
        ctx.mark_non_differentiable(*stats.constants())
        return (loss, *stats.fields())

    @staticmethod
    def backward(ctx, d_loss, d_token_loss, d_lse, _d_ce, d_entropy, d_logp, *_constants):
        logits, targets, teacher, lse, entropy, dstats, grad_scale = ctx.saved_tensors
        plan: KernelPlan = ctx.plan
        if plan.reduction == "none":
            d_token = d_loss.float().reshape(-1)
        else:
            d_token = (d_loss.float() * grad_scale).reshape(1)
        if d_token_loss is not None:
            d_token = d_token + d_token_loss.float().reshape(-1)
        grad = _grad_buffer(logits, ctx.options)
        run_backward(
            plan, logits, targets, teacher, grad, lse, entropy, dstats,
            d_token.contiguous(),
            *(t.float().reshape(-1).contiguous() if t is not None else None for t in (d_logp, d_entropy, d_lse)),
        )
        return grad, *(None,) * 6
