"""The logits entry point's autograd Function (fused and deferred mode) and deferred mode's policy term.

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
policy.objectives), see :func:`policy_terms`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from .batch import Teacher
from .bounded import cache
from .kernels.head import PolicyRows, launch_backward, launch_head, prepare
from .kernels.launch import Geometry, row_strides
from .kernels.policy import launch_policy_objective
from .kernels.shard import launch_merge, launch_shard_jsd, launch_shard_stats
from .kernels.sparse import SparseRows, block_of, launch_check_teacher
from .layouts import JSD_SHARES, OBJECTIVE_METRICS, OBJECTIVE_OUT, STATS, scratch_size
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
from .output import column, guard_second_backward
from .parallel import all_reduce_sum, gather_merged, handshake_verdict
from .plan import KernelPlan, plan_from_key
from .policy.metrics import extremes
from .policy.objectives import policy_objective
from .policy.tokens import PolicyTokens
from .registry import objective_flags
from .routes import PolicyAt, Route
from .validation import VALIDATE_MODES, CheckContext, settle, verdict_slot


def empty_outputs(plan: KernelPlan, n_out: int, device, token_shape: tuple[int, ...], extra_means: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    """(rows, pred, loss, means) of a call with ``n_out`` slots; the loss of reduction 'none' is
    token-shaped from the start, so the Function never returns a view; pred is empty without argmax."""
    f32 = dict(dtype=torch.float32, device=device)
    rows = torch.empty(n_out, plan.cols.N, **f32)
    pred = torch.empty(n_out if plan.flags.HAS_ARGMAX else 0, dtype=torch.int64, device=device)
    loss = torch.empty(token_shape if plan.reduction == "none" else (), **f32)
    means = torch.empty(plan.means_size + extra_means, **f32)  # column means, the loss ('loss' metric), policy
    return rows, pred, loss, means


def no_rows(plan: KernelPlan, loss: torch.Tensor, means: torch.Tensor) -> None:
    """A call with no logits rows: the kernel never runs, the loss and every metric are 0 (ratios 1)."""
    loss.zero_()
    means.zero_()
    for name, index in plan.metric_index:
        if name.startswith("ratio/"):
            means[index] = 1.0


def grad_geometry(geo: Geometry, grad: torch.Tensor) -> Geometry:
    g_b, g_t = row_strides(grad)
    return geo._replace(g_stride_b=g_b, g_stride_t=g_t)


def optional(t: torch.Tensor | None) -> torch.Tensor | None:
    """An empty tensor stands for an absent one (an op's output cannot be None)."""
    return t if t is None or t.numel() else None


_GEO_WIDTH = len(Geometry._fields) - 1  # geo_ints' length


class GradMode(str, enum.Enum):
    """What the fused forward does with the logits' gradient."""

    NONE = "none"  # no gradient wanted
    FRESH = "fresh"  # into a new buffer
    INPLACE = "inplace"  # over the logits (eager only)
    HANDOFF = "handoff"  # into a new buffer handed to backward beside the compiled graph (ops.hand_off)


class CallTensors(NamedTuple):
    """A call's tensors besides its rows (logits, or hidden states, weight and bias), checked and flat, in
    the one order in which they cross the autograd and torch.library boundaries (``*tensors``)."""

    targets: torch.Tensor | None = None  # [N] ids or ignore_index
    teacher_logits: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None  # the lm_head's computed teacher
    teacher_weight: torch.Tensor | None = None
    teacher_bias: torch.Tensor | None = None
    old: torch.Tensor | None = None  # the fused epilogue's policy rows (kernels.head.PolicyRows)
    ref: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    iw: torch.Tensor | None = None
    policy_weight: torch.Tensor | None = None
    num_items: torch.Tensor | None = None  # the normaliser, when a tensor
    sequence_ids: torch.Tensor | None = None  # [N] rows' sequences
    teacher_ids: torch.Tensor | None = None  # a top-k teacher's ids [n_out, K] (kernels.sparse.SparseRows)
    teacher_logprobs: torch.Tensor | None = None  # its log-probs [n_out, K], or a per-token teacher's [n_out]

    @classmethod
    def of(cls, targets, teacher: Teacher, epilogue: PolicyTokens | None, num_items, sequence_ids,
           sparse: SparseRows | None = None) -> CallTensors:
        """The tensors of a call; ``epilogue``: the policy inputs the fused epilogue reads (else None);
        ``sparse``: a top-k or per-token teacher, laid out per slot."""
        rows = (None,) * 5 if epilogue is None else (
            epilogue.old_logprobs, epilogue.ref_logprobs, epilogue.advantages, epilogue.importance_weights,
            epilogue.weight)
        old, ref, adv, iw, weight = rows
        ids, logprobs = (None, None) if sparse is None else (sparse.ids, sparse.logprobs)
        return cls(targets, teacher.logits, teacher.hidden, teacher.weight, teacher.bias, old=old, ref=ref, adv=adv,
                   iw=iw, policy_weight=weight, num_items=num_items, sequence_ids=sequence_ids, teacher_ids=ids,
                   teacher_logprobs=logprobs)

    @property
    def sparse(self) -> SparseRows | None:
        """The sparse teacher as the kernels take it, or None."""
        if self.teacher_logprobs is None:
            return None
        return SparseRows(self.teacher_ids, self.teacher_logprobs,
                          1 if self.teacher_ids is None else self.teacher_ids.shape[-1])


    @property
    def teacher(self) -> Teacher:
        return Teacher(self.teacher_logits, self.teacher_hidden, self.teacher_weight, self.teacher_bias)

    def policy_rows(self, adv_span: int = 1, seq_len: int = 0) -> PolicyRows | None:
        if self.adv is None:
            return None
        return PolicyRows(self.old, self.ref, self.adv, self.iw, self.policy_weight, adv_span, seq_len)


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


INLINE_PREPARE_SLOTS = 1 << 14
"""Up to this many slots, head_forward leaves prepare's work (count the scored rows, check the
targets and sequence ids, zero the policy term's counters: O(slots), one program, 512 targets a step)
to the head kernel's first program to take the call's ticket instead of a launch of its own: one
launch less, 20-40 us of host time per call (benchmarks/bench_host.py; more on a slower host, where
a vocab-parallel call's host time can exceed its GPU time: benchmarks/profile_parallel.py). Other
programs wait for it only before their policy values, their gradient pass and their completion count,
so with rows of any real vocabulary it is done long before. Above this, prepare_kernel (4096 targets
a step, 8 warps) keeps one program's longer serial pass off the critical path; so it does for a
vocab-parallel call with validate="sync", whose verdict every rank learns before the statistics."""


def head_forward(run: HeadRun, logits, tensors: CallTensors, grad_mode: GradMode, extra_means: int = 0,
                 stats: torch.Tensor | None = None, jsd: torch.Tensor | None = None):
    """The head kernel (one of its programs prepares, see INLINE_PREPARE_SLOTS; else prepare_kernel first):
    (loss, rows, pred, means, scratch, grad, stats). ``run.shard``: logits are this rank's vocabulary
    slice; the shard's statistics are exchanged with one all_gather before the head kernel and
    returned as ``stats`` for a deferred backward. ``extra_means``: room after the plan's means
    (deferred mode's policy metrics). ``stats`` / ``jsd``: the merged statistics of a vocab-parallel
    call exchanged already (under torch.compile, by a functional collective), with no ``run.shard``."""
    plan, geo, shard, validate = run.plan, run.geo, run.shard, run.validate
    policy = tensors.policy_rows(run.adv_span, run.seq_len)
    device = logits.device
    sharded = shard is not None or stats is not None
    whole = geo._replace(V=geo.V_total) if sharded else geo  # targets are checked against all of V
    sparse = tensors.sparse
    verdict = verdict_slot(validate, device, CheckContext(run.token_shape, whole.V, geo.ignore_index,
                                                          teacher_k(sparse)))
    # one of the head kernel's programs prepares (one launch fewer); not where validate="sync" exchanges
    # the verdict of a vocab-parallel call before its statistics (prepare_kernel's, read on the host)
    inline = (not sharded or validate != "sync") and 0 < geo.n_rows and geo.n_out <= INLINE_PREPARE_SLOTS
    n_seq = geo.n_out // policy.seq_len if policy is not None and policy.seq_len > 0 else 0
    if inline:
        scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=device)
    else:
        scratch = prepare(tensors.targets, tensors.num_items, tensors.sequence_ids, whole, device, verdict, n_seq)
    if shard is not None and validate == "sync":
        handshake_verdict(shard, verdict, device)
    if shard is not None and geo.n_rows:
        stats, jsd = shard_statistics(plan, logits, tensors.targets, tensors.teacher_logits, geo, shard,
                                      tensors.sparse, merged=False)
    rows, pred, loss, means = empty_outputs(plan, geo.n_out, device, run.token_shape, extra_means=extra_means)
    grad = None
    if grad_mode is GradMode.INPLACE:
        grad = logits.detach()  # a tensor of its own over the logits' storage: autograd adopts it as .grad
        geo = grad_geometry(geo, grad)
    elif grad_mode is not GradMode.NONE:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=device)
    if geo.n_rows == 0:
        no_rows(plan, loss, means)
    else:
        launch_head(plan, logits=logits, targets=tensors.targets, teacher=tensors.teacher_logits, grad=grad, rows=rows,
                    pred=optional(pred), policy=policy, num_items=tensors.num_items, scratch=scratch, loss=loss,
                    means=means, geo=geo, stats=stats, jsd=jsd, verdict=verdict, prepared=not inline,
                    sequence_ids=tensors.sequence_ids, n_seq=n_seq, sparse=sparse)
    if sparse is not None and verdict is not None and validate != "sync":  # ("sync": read on the host, in inputs)
        launch_check_teacher(sparse, whole.V, verdict)
    settle(verdict, validate, device)
    return loss, rows, pred, means, scratch, grad, stats


def shard_statistics(plan: KernelPlan, logits, targets, teacher, geo: Geometry, shard, sparse=None,
                     merged: bool = True):
    """Vocab-parallel: (merged statistics, summed mixture-JSD shares or None) of this shard's rows --
    one all_gather, and for the mixture JSD one all-reduce more. ``sparse``: a top-k teacher, whose K
    logits per row follow the merged statistics (the same all_gather). ``merged=False``: statistics
    that are the student's alone stay as gathered, (world, rows, N), and the head kernels merge each
    row's (kernels.shard.gathered_stats: one launch fewer; the rows are not cut after)."""
    topk = sparse is not None and sparse.ids is not None
    part = launch_shard_stats(plan, logits=logits, targets=targets, geo=geo, teacher=teacher,
                              sparse=sparse if topk else None)
    student_only = teacher is None and not topk
    stats = gather_merged(part, shard, plan.flags.OWN_TEMP, topk, merge=merged or not student_only)
    jsd = None
    if plan.flags.DISTILL_KIND == 2:
        jsd = launch_shard_jsd(plan, logits=logits, targets=targets, teacher=teacher, stats=stats, geo=geo)
        jsd = all_reduce_sum(jsd, shard, "jsd")
    return stats, jsd


def traced_shard_statistics(plan: KernelPlan, logits, targets, teacher, geo: Geometry, shard, sparse=None):
    """:func:`shard_statistics` under torch.compile: the kernels as ops, the all_gather (and the mixture
    JSD's all-reduce) as functional collectives the graph holds."""
    import torch.distributed._functional_collectives as funcol

    ids, logprobs = (sparse.ids, sparse.logprobs) if sparse is not None and sparse.ids is not None else (None, None)
    part = shard_stats_op(logits, targets, teacher, ids, logprobs, plan.key, geo_ints(geo), geo.norm)
    width = part.shape[1]
    mine = part.cpu() if shard.comm_cpu else part
    gathered = funcol.all_gather_tensor(mine, 0, shard.group).to(part.device)
    stats = merge_stats_op(gathered.view(shard.world, -1, width), plan.flags.OWN_TEMP, ids is not None)
    jsd = None
    if plan.flags.DISTILL_KIND == 2:
        jsd = shard_jsd_op(logits, targets, teacher, stats, plan.key, geo_ints(geo), geo.norm)
        jsd = funcol.all_reduce(jsd.cpu() if shard.comm_cpu else jsd, "sum", shard.group).to(part.device)
    return stats, jsd


def teacher_k(sparse: SparseRows | None) -> int:
    """CheckContext.teacher_k of a call's sparse teacher."""
    return 0 if sparse is None else (-1 if sparse.ids is None else sparse.K)


def stats_width(has_teacher: bool, teacher_ids: torch.Tensor | None = None) -> int:
    """Columns of a row's vocab-parallel statistics (layouts.Stats), and a top-k teacher's K logits."""
    topk = 0 if teacher_ids is None else block_of(teacher_ids.shape[-1])
    return (STATS.N_TEACHER if has_teacher else STATS.N) + topk


@kernel_op("headloss::shard_stats", fake=lambda logits, targets, teacher, ids, logprobs, key, geo, norm: torch.empty(
    geo_of(geo, norm).n_rows, stats_width(teacher is not None, ids), dtype=torch.float32, device=logits.device))
def shard_stats_op(logits: torch.Tensor, targets: torch.Tensor | None, teacher: torch.Tensor | None,
                   ids: torch.Tensor | None, logprobs: torch.Tensor | None, key: str, geo: list[int],
                   norm: float) -> torch.Tensor:
    """kernels.shard.launch_shard_stats as an op (a vocab-parallel call under torch.compile)."""
    sparse = None if ids is None else SparseRows(ids, logprobs, ids.shape[-1])
    return launch_shard_stats(plan_from_key(key), logits=logits, targets=targets, geo=geo_of(geo, norm),
                              teacher=teacher, sparse=sparse)


@kernel_op("headloss::merge_stats", fake=lambda parts, own_temp, topk: parts.new_empty(parts.shape[1:]))
def merge_stats_op(parts: torch.Tensor, own_temp: bool, topk: bool) -> torch.Tensor:
    """kernels.shard.launch_merge as an op."""
    return launch_merge(parts, own_temp, topk)


@kernel_op("headloss::shard_jsd", fake=lambda logits, targets, teacher, stats, key, geo, norm: torch.empty(
    geo_of(geo, norm).n_rows, JSD_SHARES.N, dtype=torch.float32, device=logits.device))
def shard_jsd_op(logits: torch.Tensor, targets: torch.Tensor | None, teacher: torch.Tensor, stats: torch.Tensor,
                 key: str, geo: list[int], norm: float) -> torch.Tensor:
    """kernels.shard.launch_shard_jsd as an op."""
    return launch_shard_jsd(plan_from_key(key), logits=logits, targets=targets, teacher=teacher, stats=stats,
                            geo=geo_of(geo, norm))


def _head_forward_outputs(logits, tensors, key, ints, norm, grad_mode, extra_means):
    """head_forward_op's outputs, unfilled: its fake."""
    run = HeadRun.from_op_args(key, ints, norm)
    call = CallTensors(*tensors[:len(CallTensors._fields)])
    rows, pred, loss, means = empty_outputs(run.plan, run.geo.n_out, logits.device, run.token_shape, extra_means)
    n_seq = run.geo.n_out // run.seq_len if call.adv is not None and run.seq_len > 0 else 0
    scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=logits.device)
    if grad_mode == GradMode.HANDOFF.value:
        return loss, rows, pred, means, scratch, token_fake()
    grad = torch.empty(logits.shape if grad_mode != GradMode.NONE.value else (0,), dtype=logits.dtype,
                       device=logits.device)
    return loss, rows, pred, means, scratch, grad


def _head_forward_op(logits: torch.Tensor, tensors: list[torch.Tensor | None], key: str, ints: list[int],
                     norm: float, grad_mode: str, extra_means: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_forward on one device as an op (``tensors``: CallTensors, then a vocab-parallel call's merged
    ``stats`` and ``jsd``; ``key, ints, norm``: HeadRun.op_args). The last output: the gradient (empty
    for grad_mode none), or a token holding it for ``handoff`` (see ops.hand_off: only through
    ``head_forward_beside``, the op tagged to run beside mode="reduce-overhead"'s graphs)."""
    run = HeadRun.from_op_args(key, ints, norm)
    n = len(CallTensors._fields)
    mode = GradMode(grad_mode)
    loss, rows, pred, means, scratch, grad, _ = head_forward(
        run, logits, CallTensors(*tensors[:n]), GradMode.FRESH if mode is GradMode.HANDOFF else mode,
        extra_means=extra_means, stats=tensors[n], jsd=tensors[n + 1])
    if mode is GradMode.HANDOFF:
        grad = hand_off([(grad, run.geo)])
    elif grad is None:
        grad = logits.new_empty(0)
    return loss, rows, pred, means, scratch, grad


head_forward_op = kernel_op("headloss::head_forward", fake=_head_forward_outputs)(_head_forward_op)
head_forward_beside_op = kernel_op("headloss::head_forward_beside", fake=_head_forward_outputs,
                                   tags=BESIDE_GRAPH)(_head_forward_op)


def head_backward(run: HeadRun, logits, tensors: CallTensors, rows, d_loss, d_rows, scratch,
                  stats: torch.Tensor | None = None, inplace: bool = False) -> torch.Tensor:
    """Deferred mode's gradient pass (``d_loss`` or ``d_rows`` None: that output took no gradient);
    ``stats``: a vocab-parallel forward's merged statistics."""
    grad = logits.detach() if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    launch_backward(run.plan, logits=logits, targets=tensors.targets, teacher=tensors.teacher_logits, grad=grad,
                    rows=rows, d_loss=None if d_loss is None else d_loss.float().reshape(-1).contiguous(),
                    d_rows=None if d_rows is None else d_rows.float().contiguous(), num_items=tensors.num_items,
                    scratch=scratch, geo=grad_geometry(run.geo, grad), stats=stats, sparse=tensors.sparse)
    return grad


@kernel_op("headloss::head_backward", fake=lambda logits, *rest: torch.empty(logits.shape, dtype=logits.dtype,
                                                                              device=logits.device))
def head_backward_op(logits: torch.Tensor, tensors: list[torch.Tensor | None], key: str, ints: list[int],
                     norm: float) -> torch.Tensor:
    """head_backward as an op (``tensors``: targets, teacher logits, rows, d_loss, d_rows, num_items,
    scratch, stats, the sparse teacher's ids and log-probs; ``key, ints, norm``: HeadRun.op_args; in
    place: eager only)."""
    targets, teacher, rows, d_loss, d_rows, num_items, scratch, stats, ids, logprobs = tensors
    run = HeadRun.from_op_args(key, ints, norm)
    call = CallTensors(targets, teacher, num_items=num_items, teacher_ids=ids, teacher_logprobs=logprobs)
    return head_backward(run, logits, call, rows, d_loss, d_rows, scratch, stats, inplace=run.inplace)


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
            loss, rows, pred, means, scratch, grad, stats = head_forward(run, logits, call, grad_mode, extra_means)
        else:
            stats = jsd = None
            if run.shard is not None and run.geo.n_rows:  # compiled vocab-parallel: the collective in the graph
                stats, jsd = traced_shard_statistics(plan, logits, call.targets, call.teacher_logits, run.geo,
                                                     run.shard, call.sparse)
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
                            d_objective, call.teacher_ids, call.teacher_logprobs), (means, scratch, pred))
        return loss, rows, pred, means, scratch

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
        logits, targets, teacher, rows, num_items, scratch, stats, d_objective, ids, logprobs = ctx.saved_tensors
        if d_objective is not None and d_loss is not None:  # the policy term's d rows, for one unit of d loss
            scaled = d_objective * d_loss
            d_rows = scaled if d_rows is None else d_rows + scaled
        if run.shard is not None and not run.traced:
            call = CallTensors(targets, teacher, num_items=num_items, teacher_ids=ids, teacher_logprobs=logprobs)
            grad = head_backward(run, logits, call, rows, d_loss, d_rows, scratch, stats, inplace=run.inplace)
        else:
            eager = replace(run, inplace=run.inplace and not run.traced)
            grad = head_backward_op(logits, [targets, teacher, rows, d_loss, d_rows, num_items, scratch, stats, ids,
                                             logprobs], *eager.op_args())
        return grad, *nones


def _grad_mode(run: HeadRun, logits: torch.Tensor, wanted: bool) -> GradMode:
    """Where the fused forward writes the logits' gradient."""
    if run.plan.mode != "fused" or not wanted:
        return GradMode.NONE
    if run.traced:
        return GradMode.HANDOFF if hands_off(logits.numel() * logits.element_size()) else GradMode.FRESH
    return GradMode.INPLACE if run.inplace else GradMode.FRESH


# --- deferred mode's policy term -------------------------------------------------------------------


class ObjectiveTensors(NamedTuple):
    """The policy objective kernels' per-token inputs (flat, from PolicyTokens), in op order."""

    old: torch.Tensor | None
    ref: torch.Tensor | None
    adv: torch.Tensor
    iw: torch.Tensor | None
    mask: torch.Tensor
    weight: torch.Tensor
    sampled: torch.Tensor | None  # the rollout's log-probs (else the old ones): the off-policy mask's

    @classmethod
    def of(cls, inp: PolicyTokens) -> ObjectiveTensors:
        sampled = inp.rollout_logprobs if inp.rollout_logprobs is not None else inp.old_logprobs
        return cls(inp.old_logprobs, inp.ref_logprobs, inp.advantages, inp.importance_weights, inp.mask, inp.weight,
                   sampled)


def _objective_layout(inp: PolicyTokens) -> list[int]:
    """sequence_level, n_seq, seq_len, adv_span: the objective kernels' layout of ``inp``'s rows."""
    return [int(inp.sequence_level), inp.n_slots, inp.seq_len, inp.adv_span]


def objective_launch(plan: KernelPlan, rows: torch.Tensor, inp: PolicyTokens, *, traced: bool = False, **kwargs):
    """kernels.policy.launch_policy_objective on the deferred mode's packed rows and flat policy inputs;
    ``traced`` (under torch.compile): through the ``policy_objective`` op, into fresh outputs (``total``
    and ``out`` are not taken)."""
    tensors, layout = ObjectiveTensors.of(inp), _objective_layout(inp)
    if traced:
        metrics, grad = kwargs.get("metrics", True), kwargs.get("grad", True)
        total, out, d_rows = policy_objective_op(rows, [*tensors, kwargs.get("base_loss")], plan.key,
                                                 [*layout, int(metrics), int(grad)])
        return (total if metrics else None), (out if metrics else None), (d_rows if grad else None)
    return _launch_objective(plan, rows, tensors, layout, **kwargs)


def _launch_objective(plan: KernelPlan, rows, tensors: ObjectiveTensors, layout: list[int], **kwargs):
    pol = plan.spec.policy
    cols = plan.cols
    sequence_level, n_seq, seq_len, adv_span = layout
    flags = objective_flags(pol, bool(sequence_level))
    entropy = rows[:, cols.entropy] if cols.entropy >= 0 else None
    return launch_policy_objective(
        flags, plan.scalars, logp=rows[:, cols.logp], entropy=entropy, **tensors._asdict(),
        count=tensors.mask.sum() if flags.ENT_TOKEN_MEAN else None, n_seq=n_seq, seq_len=seq_len, adv_span=adv_span,
        off_policy=pol.off_policy_mask if pol.off_policy_mask is not None else 0.0, d_cols=cols.N,
        col_logp=cols.logp, col_ent=cols.entropy if flags.ENT_BONUS else -1, **kwargs)


def _objective_outputs(rows, tensors, key, layout):
    """policy_objective_op's outputs, unfilled: its fake."""
    _, n_seq, seq_len, _, metrics, grad = layout
    f32 = dict(dtype=torch.float32, device=rows.device)
    return (torch.empty(() if metrics else (0,), **f32), torch.empty(OBJECTIVE_OUT.N if metrics else 0, **f32),
            torch.empty((n_seq * seq_len, rows.shape[1]) if grad else (0,), **f32))


@kernel_op("headloss::policy_objective", fake=_objective_outputs)
def policy_objective_op(rows: torch.Tensor, tensors: list[torch.Tensor | None], key: str, layout: list[int]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deferred mode's policy term by its two launches as an op (``tensors``: ObjectiveTensors, then the
    base loss; ``layout``: the objective layout, then whether metrics and a gradient are wanted): (base loss
    + the term, metrics (OBJECTIVE_OUT), d loss / d rows), each an empty tensor where not asked for."""
    metrics, grad = bool(layout[4]), bool(layout[5])
    total, out, d_rows = _launch_objective(plan_from_key(key), rows, ObjectiveTensors(*tensors[:-1]), layout[:4],
                                           base_loss=tensors[-1], metrics=metrics, grad=grad)
    empty = lambda t: rows.new_empty(0, dtype=torch.float32) if t is None else t  # noqa: E731
    return empty(total), empty(out), empty(d_rows)


class PolicyObjectiveFunction(torch.autograd.Function):
    """apply(loss, rows, plan, inp) -> (loss + the policy term, metrics (OBJECTIVE_OUT)): the deferred
    mode's policy objective on its packed rows, by two launches, in a node of its own (the lm_head's
    rows); the backward hands d loss / d rows (computed in forward, for one unit of upstream
    gradient) to the head's backward."""

    @staticmethod
    def forward(ctx, loss, rows, plan: KernelPlan, inp: PolicyTokens):
        total, out, d_rows = objective_launch(plan, rows, inp, base_loss=loss, grad=ctx.needs_input_grad[1],
                                              traced=torch.compiler.is_compiling())
        ctx.save_for_backward(d_rows)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(out)
        return total, out

    @staticmethod
    def backward(ctx, d_total, _):
        if d_total is None:
            return None, None, None, None
        (d_rows,) = ctx.saved_tensors
        return d_total, None if d_rows is None else d_rows * d_total, None, None


def objective_metrics(plan: KernelPlan, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The policy metrics of the objective kernels' vector ``out`` (layouts.OBJECTIVE_METRICS):
    policy.objectives.policy_objective's names in its key order, then "loss"."""
    values = dict(zip(OBJECTIVE_METRICS, out.unbind(), strict=True))
    names = _OBJECTIVE_NAMES.get(plan.key)
    if names is None:
        names = [name for name in OBJECTIVE_METRICS[1:]
                 if (name != "entropy" or plan.cols.entropy >= 0) and (name != "kl" or plan.spec.policy.kl_beta)]
        names = _OBJECTIVE_NAMES[plan.key] = (*names, "pg_clipfrac", "loss")
    values["pg_clipfrac"] = values["clip_ratio/region_mean"]
    return {name: values[name] for name in names}


_OBJECTIVE_NAMES: dict[str, tuple[str, ...]] = cache("engine.objective_names", 1024,
                                                     "objective_metrics' metric names by plan key")


def policy_terms(route: Route, plan: KernelPlan, loss, rows, means, scratch, pol: PolicyTokens | None,
                 kernel_sequences: bool = False) -> tuple[torch.Tensor, dict]:
    """The policy term's share outside the head kernel, as ``route`` says: after the fused epilogue
    the metrics the kernel did not reduce (per-sequence clip fractions of rows with sequence_ids, or
    of the chunked lm_head; none when ``kernel_sequences``: the kernel's last program reduced them);
    in deferred mode the whole objective on the per-token log-probs, by the sequence kernels
    (``+kernels``: in a node of its own) or torch ops (``+torch``)."""
    spec = plan.spec
    if spec.policy is None:
        return loss, {}
    if route.policy is PolicyAt.KERNELS:
        total, out = PolicyObjectiveFunction.apply(loss, rows, plan, pol)
        return total, objective_metrics(plan, out)
    if route.policy is PolicyAt.TORCH:
        entropy = column(rows, plan, "entropy")
        policy_loss, metrics = policy_objective(column(rows, plan, "logp"), entropy, pol.mask, spec.policy, pol,
                                                extremes_by_kernel=route.sequence_kernels)
        loss = loss + policy_loss
        metrics["loss"] = loss.detach().clone()
        return loss, metrics
    if route.policy is PolicyAt.EPILOGUE:
        if kernel_sequences:
            return loss, {}
        token_means = {name: means[index] for name, index in plan.metric_index}
        return loss, extremes(token_means, column(rows, plan, "ratio"), column(rows, plan, "clip_low"),
                              column(rows, plan, "clip_high"), pol.mask, scratch[0], pol, route.sequence_kernels)
    raise ValueError(f"route: {route.name!r} runs no policy term, but the spec has one")
