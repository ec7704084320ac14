"""The logits entry point's autograd Function (fused and deferred mode): the logits as one block of the
head (headloss.head).

``HeadFunction.apply(logits, run, *tensors)`` (a :class:`HeadRun` and the :class:`CallTensors`) returns
``(loss, rows, pred, means, scratch)``: the loss (a fresh tensor, never a view), the packed per-row
buffer (per-token outputs are its columns), the argmax, the column means (the metrics) and the call's
scratch (layouts.Scratch). Its backward returns the logits' gradient, then ``None`` for the rest.

* fused     the gradient is written in forward (one launch); backward only scales it by d loss,
            which costs nothing when d loss == 1 (checked on the device).
* deferred  forward runs the stats pass; backward combines the upstream gradients of the loss and
            of the differentiable per-row values (token loss, lse, logp, entropy) in one pass.

The kernels run through :func:`head_forward_op` / :func:`head_backward_op`, which are
``torch.library`` ops under torch.compile (headloss.ops). Deferred mode's policy term runs where the
call's route says (``deferred+kernels``: two launches inside this Function's node; ``deferred+torch``:
policy.objectives), see headloss.objective.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch

from .head import Block, CallTensors, HeadCall, traced_shard_statistics
from .kernels.head import launch_backward
from .kernels.launch import Geometry, row_strides
from .layouts import OBJECTIVE_OUT, scratch_size
from .objective import objective_launch
from .ops import (
    BESIDE_GRAPH,
    geo_ints,
    geo_of,
    hand_off,
    hands_off,
    kernel_op,
    scale,
    take_grad,
    token_fake,
)
from .output import FunctionOutputs, HeadOutputs, guard_second_backward
from .plan import KernelPlan, plan_from_key
from .policy.tokens import PolicyTokens
from .validation import VALIDATE_MODES


def grad_geometry(geo: Geometry, grad: torch.Tensor) -> Geometry:
    g_b, g_t = row_strides(grad)
    return geo._replace(g_stride_b=g_b, g_stride_t=g_t)


_GEO_WIDTH = len(Geometry._fields) - 1  # geo_ints' length


class GradMode(str, enum.Enum):
    """What the fused forward does with the logits' gradient."""

    NONE = "none"  # no gradient wanted
    FRESH = "fresh"  # into a new buffer
    INPLACE = "inplace"  # over the logits (eager only)
    HANDOFF = "handoff"  # into a new buffer handed to backward beside the compiled graph (ops.hand_off)


@dataclass(frozen=True)
class HeadRun:
    """Everything but tensors that a head_loss call runs with."""

    plan: KernelPlan
    geo: Geometry
    inplace: bool
    validate: str  # async, sync, off
    token_shape: tuple[int, ...]
    traced: bool = False  # under torch.compile (the route's)
    adv_span: int = 1  # policy: slots per advantage (K: one per sequence of [B, K])
    seq_len: int = 0  # policy: K when sequences are the rows of [B, K] (see PolicyRows)
    shard: Any = None  # vocab-parallel: a headloss.parallel.VocabShard
    objective: PolicyTokens | None = None  # deferred+kernels: the policy term's inputs, run in this Function

    def op_args(self) -> tuple[str, list[int], float]:
        """The run as a head op takes it (:meth:`from_op_args`): the plan's key, ints, the normaliser."""
        return (self.plan.key, [*geo_ints(self.geo), self.adv_span, self.seq_len, int(self.inplace),
                                VALIDATE_MODES.index(self.validate), *self.token_shape], self.geo.norm)

    @classmethod
    def from_op_args(cls, key: str, ints: list[int], norm: float) -> HeadRun:
        g = _GEO_WIDTH
        adv_span, seq_len, inplace, validate = ints[g:g + 4]
        return cls(plan_from_key(key), geo_of(ints[:g], norm), bool(inplace), VALIDATE_MODES[validate],
                   tuple(ints[g + 4:]), adv_span=adv_span, seq_len=seq_len)


def head_forward(run: HeadRun, logits, tensors: CallTensors, grad_mode: GradMode, extra_means: int = 0,
                 gathered: tuple | None = None) -> tuple[HeadOutputs, torch.Tensor, torch.Tensor | None, Any]:
    """The logits as one block of the head (headloss.head): (outputs, scratch, grad, stats). ``run.shard``:
    logits are this rank's vocabulary slice; the shard's statistics are exchanged with one all_gather
    before the head kernel and returned as ``stats`` for a deferred backward. ``extra_means``: room after
    the plan's means (deferred mode's policy metrics). ``gathered``: the (stats, jsd) of a vocab-parallel
    call exchanged already (under torch.compile, by a functional collective), with no ``run.shard``."""
    geo, device = run.geo, logits.device
    policy = tensors.policy_rows(run.adv_span, run.seq_len)
    n_seq = geo.n_out // policy.seq_len if policy is not None and policy.seq_len > 0 else 0
    call = HeadCall.open(run, tensors, geo, device, one_block=True, n_seq=n_seq)
    out = HeadOutputs.empty(run.plan, geo.n_out, device, run.token_shape, extra_means)
    grad = None
    if grad_mode is GradMode.INPLACE:
        grad = logits.detach()  # a tensor of its own over the logits' storage: autograd adopts it as .grad
        geo = grad_geometry(geo, grad)
    elif grad_mode is not GradMode.NONE:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=device)
    block = Block(logits, geo, tensors.targets, tensors.teacher_logits, tensors.sparse, policy, tensors.temperature,
                  weights=tensors.weights, selected=tensors.selected)
    stats = call.block(block, out, grad, gathered=gathered)
    call.close()
    return out, call.scratch, grad, stats


def _fake_head_forward(logits, tensors, key, ints, norm, grad_mode, extra_means):
    """head_forward_op's outputs, unfilled."""
    run = HeadRun.from_op_args(key, ints, norm)
    call = CallTensors(*tensors[:len(CallTensors._fields)])
    out = HeadOutputs.empty(run.plan, run.geo.n_out, logits.device, run.token_shape, extra_means)
    n_seq = run.geo.n_out // run.seq_len if call.adv is not None and run.seq_len > 0 else 0
    scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=logits.device)
    if grad_mode == GradMode.HANDOFF.value:
        return (*out, scratch, token_fake())
    grad = torch.empty(logits.shape if grad_mode != GradMode.NONE.value else (0,), dtype=logits.dtype,
                       device=logits.device)
    return (*out, scratch, grad)


def _head_forward_op(logits: torch.Tensor, tensors: list[torch.Tensor | None], key: str, ints: list[int],
                     norm: float, grad_mode: str, extra_means: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_forward on one device as an op (``tensors``: CallTensors, then a vocab-parallel call's merged
    ``stats`` and ``jsd``; ``key, ints, norm``: HeadRun.op_args): (loss, rows, pred, means, scratch, grad).
    The last output: the gradient (empty for grad_mode none), or a token holding it for ``handoff`` (see
    ops.hand_off: only through ``head_forward_beside``, the op tagged to run beside mode="reduce-overhead"'s
    graphs)."""
    run = HeadRun.from_op_args(key, ints, norm)
    n = len(CallTensors._fields)
    mode = GradMode(grad_mode)
    out, scratch, grad, _ = head_forward(run, logits, CallTensors(*tensors[:n]),
                                         GradMode.FRESH if mode is GradMode.HANDOFF else mode,
                                         extra_means=extra_means, gathered=(tensors[n], tensors[n + 1]))
    if mode is GradMode.HANDOFF:
        grad = hand_off([(grad, run.geo)])
    elif grad is None:
        grad = logits.new_empty(0)
    return (*out, scratch, grad)


head_forward_op = kernel_op("headloss::head_forward", fake=_fake_head_forward)(_head_forward_op)
head_forward_beside_op = kernel_op("headloss::head_forward_beside", fake=_fake_head_forward,
                                   tags=BESIDE_GRAPH)(_head_forward_op)


def head_backward(run: HeadRun, logits, tensors: CallTensors, rows, d_loss, d_rows, scratch,
                  stats: torch.Tensor | None = None) -> torch.Tensor:
    """Deferred mode's gradient pass (``d_loss`` or ``d_rows`` None: that output took no gradient);
    ``stats``: a vocab-parallel forward's merged statistics; ``run.inplace``: over the logits."""
    grad = logits.detach() if run.inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    launch_backward(run.plan, logits=logits, targets=tensors.targets, teacher=tensors.teacher_logits, grad=grad,
                    rows=rows, d_loss=None if d_loss is None else d_loss.float().reshape(-1).contiguous(),
                    d_rows=None if d_rows is None else d_rows.float().contiguous(), num_items=tensors.num_items,
                    scratch=scratch, geo=grad_geometry(run.geo, grad), stats=stats, sparse=tensors.sparse,
                    temperature=tensors.temperature, weights=tensors.weights, selected=tensors.selected)
    return grad


@kernel_op("headloss::head_backward", fake=lambda logits, *rest: torch.empty(logits.shape, dtype=logits.dtype,
                                                                              device=logits.device))
def head_backward_op(logits: torch.Tensor, tensors: list[torch.Tensor | None], key: str, ints: list[int],
                     norm: float) -> torch.Tensor:
    """head_backward as an op (``tensors``: targets, teacher logits, rows, d_loss, d_rows, num_items,
    scratch, stats, the sparse teacher's ids and log-probs, the per-row temperatures, the token weights, the
    selected ids; ``key, ints, norm``: HeadRun.op_args; in place: eager only)."""
    targets, teacher, rows, d_loss, d_rows, num_items, scratch, stats, ids, logprobs, temperature, weights, \
        selected = tensors
    run = HeadRun.from_op_args(key, ints, norm)
    call = CallTensors(targets, teacher, num_items=num_items, teacher_ids=ids, teacher_logprobs=logprobs,
                       temperature=temperature, weights=weights, selected=selected)
    return head_backward(run, logits, call, rows, d_loss, d_rows, scratch, stats)


NO_GRADS = (None,) * (1 + len(CallTensors._fields))
"""backward's None for the run and each of CallTensors (an autograd Function's inputs after its rows)."""


def keep(ctx, run, saved: tuple, non_differentiable: tuple) -> None:
    """What an autograd Function's forward leaves for backward: the run, the tensors ``saved``; outputs
    without a gradient get None in backward, not a zero tensor."""
    ctx.run = run
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(*non_differentiable)


class HeadFunction(torch.autograd.Function):
    """apply(logits, run, *tensors) -> (loss, rows, pred, means, scratch); ``tensors``: CallTensors."""

    @staticmethod
    def forward(ctx, logits, run: HeadRun, *tensors):
        plan = run.plan
        call = CallTensors(*tensors)
        grad_mode = _grad_mode(run, logits, ctx.needs_input_grad[0])
        extra_means = OBJECTIVE_OUT.N if run.objective is not None and not run.traced else 0
        if run.shard is not None and not run.traced:  # vocab-parallel: the collective inside head_forward
            out, scratch, grad, stats = head_forward(run, logits, call, grad_mode, extra_means)
            loss, rows, pred, means = out
        else:
            stats = jsd = None
            if run.shard is not None and run.geo.n_rows:  # compiled vocab-parallel: the collective in the graph
                block = Block(logits, run.geo, call.targets, call.teacher_logits, call.sparse,
                              temperature=call.temperature, selected=call.selected)
                stats, jsd = traced_shard_statistics(plan, block, run.shard)
            op = head_forward_beside_op if grad_mode is GradMode.HANDOFF else head_forward_op
            loss, rows, pred, means, scratch, grad = op(logits, [*call, stats, jsd], *run.op_args(), grad_mode.value,
                                                        extra_means)
        d_objective = None
        if run.objective is not None and run.traced:  # the policy term: the loss with it, its metrics after the means
            loss, out, d_objective = objective_launch(plan, rows, run.objective, base_loss=loss,
                                                      grad=ctx.needs_input_grad[0], traced=True)
            means = torch.cat((means, out))
        elif run.objective is not None:  # the same, written into ``loss`` and the means' room for them
            _, _, d_objective = objective_launch(plan, rows, run.objective, base_loss=loss, total=loss,
                                                 out=means[plan.means_size:], grad=ctx.needs_input_grad[0])
        if plan.mode == "fused":
            ctx.grad_geo = grad_geometry(run.geo, grad) if grad_mode is GradMode.INPLACE else run.geo
            ctx.grad_like = (list(logits.shape), logits.dtype)
            ctx.handoff = grad_mode is GradMode.HANDOFF
            keep(ctx, run, (grad if grad_mode is not GradMode.NONE else None,), (rows, means, scratch, pred))
        else:
            keep(ctx, run, (logits, call.targets, call.teacher_logits, rows, call.num_items, scratch, stats,
                            d_objective, call.teacher_ids, call.teacher_logprobs, call.temperature, call.weights,
                            call.selected),
                 (means, scratch, pred))
        return FunctionOutputs(loss, rows, pred, means, scratch)

    @staticmethod
    def backward(ctx, d_loss, d_rows, *_):
        run: HeadRun = ctx.run
        nones = NO_GRADS
        if run.plan.mode == "fused":
            (grad,) = ctx.saved_tensors
            if grad is None or d_loss is None:
                return None, *nones
            if ctx.handoff:
                return take_grad(grad, d_loss.float().reshape(1), 0, *ctx.grad_like), *nones
            guard_second_backward(ctx)
            return scale(grad, d_loss.float(), ctx.grad_geo), *nones
        if d_loss is None and d_rows is None:
            return None, *nones
        logits, targets, teacher, rows, num_items, scratch, stats, d_objective, ids, logprobs, temperature, weights, \
            selected = ctx.saved_tensors
        if d_objective is not None and d_loss is not None:  # the policy term's d rows, for one unit of d loss
            scaled = d_objective * d_loss
            d_rows = scaled if d_rows is None else d_rows + scaled
        if run.shard is not None and not run.traced:
            call = CallTensors(targets, teacher, num_items=num_items, teacher_ids=ids, teacher_logprobs=logprobs,
                               temperature=temperature, weights=weights, selected=selected)
            grad = head_backward(run, logits, call, rows, d_loss, d_rows, scratch, stats)
        else:
            eager = replace(run, inplace=run.inplace and not run.traced)
            grad = head_backward_op(logits, [targets, teacher, rows, d_loss, d_rows, num_items, scratch, stats, ids,
                                             logprobs, temperature, weights, selected], *eager.op_args())
        return grad, *nones


def _grad_mode(run: HeadRun, logits: torch.Tensor, wanted: bool) -> GradMode:
    """Where the fused forward writes the logits' gradient."""
    if run.plan.mode != "fused" or not wanted:
        return GradMode.NONE
    if run.traced:
        return GradMode.HANDOFF if hands_off(logits.numel() * logits.element_size()) else GradMode.FRESH
    return GradMode.INPLACE if run.inplace else GradMode.FRESH
