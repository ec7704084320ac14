"""Autograd Functions and torch.library ops around the kernels: fused, deferred, chunked lm_head.

Both Functions take tensors and one frozen run object (``apply(logits, targets, ..., run)``,
backward returns the gradients then ``None`` for the rest) and return
``(loss, rows, pred, means, scratch)``: the loss (a fresh tensor, never a view), the packed per-row
buffer (per-token outputs are its columns), the argmax, the column means (the metrics) and the
call's scratch (scratch[0] is the number of counted tokens).

* fused     the gradient is written in forward (one launch); backward only scales it by d loss,
            which costs nothing when d loss == 1 (checked on the device).
* deferred  forward runs the stats pass; backward combines the upstream gradients of the loss and
            of the differentiable per-row values (token loss, lse, logp, entropy) in one pass.
* lm_head   the same, chunk by chunk over hidden x weight (see :class:`LinearFunction`).

In eager mode the Functions call the launchers directly (a torch.library op costs ~30 us of
dispatch per call); under torch.compile they call the same code through the ``headloss::`` ops,
which Inductor treats as opaque kernels (``register_fake`` gives their output shapes).
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from .inputs import CheckContext, Normaliser, settle, verdict_slot
from .kernels.head import (
    GEO_INTS,
    OBJECTIVE_OUT,
    SCRATCH,
    Geometry,
    PolicyRows,
    launch_backward,
    launch_finish,
    launch_head,
    launch_policy_objective,
    launch_shard_jsd,
    launch_shard_stats,
    prepare,
    row_strides,
    scale_grad_,
    scratch_size,
)
from .parallel import all_reduce_sum, gather_merged, handshake_verdict
from .plan import KernelPlan, objective_flags, plan_from_key
from .policy import (
    PolicyInputs,
    clip_cov_chosen,
    high_entropy_metrics,
    kl_cov_chosen,
    masked_quantile,
    objective_in_kernel,
    policy_objective,
    token_objective,
)

_RETAIN_GRAPH_ERROR = (
    "headloss: a second backward through the same fused-mode loss (retain_graph=True). The fused mode "
    "computes the gradient once, in forward, and hands that buffer to autograd on the first backward. Use "
    "differentiable_outputs=True or reduction='none' (deferred mode, which recomputes it per backward), or call "
    "the loss again."
)


def guard_second_backward(ctx) -> None:
    """One retain-graph guard for every fused-mode Function (eager; under torch.compile the handoff
    token carries it, see :func:`_hand_off`)."""
    if torch.compiler.is_compiling():
        return
    if getattr(ctx, "consumed", False):
        raise RuntimeError(_RETAIN_GRAPH_ERROR)
    ctx.consumed = True


# --- fused mode under torch.compile: the gradient reaches backward beside the graph ----------------
#
# Saved for backward as a graph tensor, the fused gradient is an input of the backward graph, and
# Inductor clones a backward input before an op mutates it (a full N x V copy: 2.54 ms against 1.55
# eager for the full SFT case). So under compile the forward op hands the gradient over beside the
# graph: it returns a one-element CPU "token" tensor holding the gradient buffers, the Function saves
# the token, and backward's ``take_grad`` op takes each buffer back, scales it in place (a no-op on the
# device when d loss == 1) and returns it as a fresh output. Nothing in the graph aliases the buffer,
# so nothing is cloned; the buffers live exactly as long as the token (the autograd graph). Under
# mode="reduce-overhead" these ops run outside the CUDA graphs (tagged cudagraph_unsafe), so every
# call hands over its own buffers.


class _Handed:
    """The buffers one forward op handed over; alive as long as its token (see _hand_off)."""

    __slots__ = ("grads", "__weakref__")

    def __init__(self, grads):
        self.grads = grads


_HANDED: weakref.WeakValueDictionary[int, _Handed] = weakref.WeakValueDictionary()
_HANDED_IDS = itertools.count(1)


COMPILE_HANDOFF = os.environ.get("HEADLOSS_COMPILE_HANDOFF", "1") != "0"
"""Under torch.compile, hand the fused gradient over beside the graph (default). Off
(``HEADLOSS_COMPILE_HANDOFF=0``): it is a saved graph tensor, which Inductor clones before the scale
in backward (one more pass over it), but which saved-tensor hooks that copy saved tensors
(offloading, ``torch.autograd.graph.save_on_cpu``) can carry."""


def _hand_off(grads: list[tuple[torch.Tensor, Geometry] | None]) -> torch.Tensor:
    """A one-element CPU int64 token naming ``grads`` (buffer, scale geometry); the token keeps them
    alive, and a copy of the token (a functional wrapper, a checker) still names them."""
    key = next(_HANDED_IDS)
    token = torch.tensor([key], dtype=torch.int64)
    token._headloss_handed = _HANDED[key] = _Handed(list(grads))
    return token


def _take(token: torch.Tensor, d_loss: torch.Tensor, index: int) -> torch.Tensor:
    handed = _HANDED.get(int(token[0])) if token.numel() == 1 and not token.is_cuda else None
    if handed is None:
        raise RuntimeError("headloss: take_grad got a token that holds no gradient (it was not made by a headloss "
                           "forward op, its autograd graph was freed, or a saved-tensor hook replaced it)")
    entry = handed.grads[index]
    if entry is None:
        raise RuntimeError(_RETAIN_GRAPH_ERROR)
    handed.grads[index] = None
    grad, geo = entry
    return scale_grad_(grad, d_loss, geo)


def _token_fake() -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


def _empty_outputs(plan: KernelPlan, n_out: int, device, token_shape: tuple[int, ...], empty_pred: bool = True,
                   extra_means: int = 0) -> tuple[torch.Tensor, ...]:
    """(rows, pred, loss, means); the loss of reduction 'none' is token-shaped from the start, so
    the Function never returns a view. Without argmax pred is empty, or None with ``empty_pred=False``
    (one allocation less per call)."""
    f32 = dict(dtype=torch.float32, device=device)
    rows = torch.empty(n_out, plan.cols.N, **f32)
    pred = torch.empty(n_out, dtype=torch.int64, device=device) if plan.flags.HAS_ARGMAX else \
        (torch.empty(0, dtype=torch.int64, device=device) if empty_pred else None)
    loss = torch.empty(token_shape if plan.reduction == "none" else (), **f32)
    means = torch.empty(plan.means_size + extra_means, **f32)  # column means, the loss ('loss' metric), policy
    return rows, pred, loss, means


def _no_rows(plan: KernelPlan, loss: torch.Tensor, means: torch.Tensor) -> None:
    """A call with no logits rows: the kernel never runs, the loss and every metric are 0 (ratios 1)."""
    loss.zero_()
    means.zero_()
    for name, index in plan.metric_index:
        if name.startswith("ratio/"):
            means[index] = 1.0


def _grad_geometry(geo: Geometry, grad: torch.Tensor) -> Geometry:
    g_b, g_t = row_strides(grad)
    return geo._replace(g_stride_b=g_b, g_stride_t=g_t)


def _opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.numel() else None


# --- the logits entry point ------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadRun:
    """Everything but tensors that a head_loss call runs with."""

    plan: KernelPlan
    geo: Geometry
    inplace: bool
    validate: str  # async, sync, off
    token_shape: tuple[int, ...]
    adv_span: int = 1  # policy: slots per advantage (K: one per sequence)
    seq_len: int = 0  # policy: K when sequences are the rows of [B, K] (see PolicyRows)
    shard: Any = None  # vocab-parallel: a headloss.parallel.VocabShard
    objective: Any = None  # deferred mode's policy term by its kernels, in this Function (a PolicyInputs)


INLINE_PREPARE_SLOTS = 1 << 14
"""Up to this many slots, head_forward leaves prepare's work (count the scored rows, check the
targets and sequence ids, zero the policy term's counters: O(slots), one program, 512 targets a step)
to the head kernel's program 0 instead of a launch of its own: one launch less, 20-40 us of host time
per call (benchmarks/bench_host.py). Other programs wait for it only before their policy values,
their gradient pass and their completion count, so with rows of any real vocabulary it is done long
before. Above this (and vocab-parallel), prepare_kernel (4096 targets a step, 8 warps) keeps one
program's longer serial pass off the critical path."""


def head_forward(plan: KernelPlan, geo: Geometry, logits, targets, teacher, policy: PolicyRows | None, num_items,
                 sequence_ids, grad_mode: str, validate: str, token_shape: tuple[int, ...], shard=None,
                 extra_means: int = 0):
    """The head kernel (its program 0 prepares, see INLINE_PREPARE_SLOTS; else prepare_kernel first):
    (loss, rows, pred, means, scratch, grad); grad_mode none/fresh/inplace.
    ``shard`` (a parallel.VocabShard): logits are this rank's vocabulary slice; the shard's
    statistics are exchanged with one all_gather before the head kernel (headloss.parallel).
    ``extra_means``: room after the plan's means (deferred mode's policy metrics)."""
    device = logits.device
    whole = geo._replace(V=geo.V_total) if shard is not None else geo  # targets are checked against all of V
    verdict = verdict_slot(validate, device, CheckContext(token_shape, whole.V, geo.ignore_index,
                                                          Normaliser(geo.norm, num_items)))
    # on one device, the head kernel's program 0 prepares (one launch fewer)
    inline = shard is None and 0 < geo.n_rows and geo.n_out <= INLINE_PREPARE_SLOTS
    n_seq = _sequences(geo, policy)
    if inline:
        scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=device)
    else:
        scratch = prepare(targets, num_items, sequence_ids, whole, device, verdict, n_seq)
    if shard is not None and validate == "sync":
        handshake_verdict(shard, verdict, device)
    stats = jsd = None
    if shard is not None and geo.n_rows:
        stats, jsd = _shard_statistics(plan, logits, targets, teacher, geo, shard)
    rows, pred, loss, means = _empty_outputs(plan, geo.n_out, device, token_shape, empty_pred=False,
                                             extra_means=extra_means)
    grad = None
    if grad_mode == "inplace":
        grad = logits.detach()  # a tensor of its own over the logits' storage: autograd adopts it as .grad
        geo = _grad_geometry(geo, grad)
    elif grad_mode == "fresh":
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=device)
    if geo.n_rows == 0:
        _no_rows(plan, loss, means)
    else:
        launch_head(plan, logits=logits, targets=targets, teacher=teacher, grad=grad, rows=rows, pred=_opt(pred),
                    policy=policy, num_items=num_items, scratch=scratch, loss=loss, means=means, geo=geo,
                    stats=stats, jsd=jsd, verdict=verdict, prepared=not inline, sequence_ids=sequence_ids,
                    n_seq=n_seq)
    settle(verdict, validate, device)
    if shard is not None:
        return loss, rows, pred, means, scratch, grad, stats
    return loss, rows, pred, means, scratch, grad


def _shard_statistics(plan: KernelPlan, logits, targets, teacher, geo: Geometry, shard):
    """Vocab-parallel: (merged statistics, summed mixture-JSD shares or None) of this shard's rows --
    one all_gather, and for the mixture JSD one all-reduce more."""
    part = launch_shard_stats(plan, logits=logits, targets=targets, geo=geo, teacher=teacher)
    stats = gather_merged(part, shard, plan.flags.OWN_TEMP)
    jsd = None
    if plan.flags.DISTILL_KIND == 2:
        jsd = launch_shard_jsd(plan, logits=logits, targets=targets, teacher=teacher, stats=stats, geo=geo)
        jsd = all_reduce_sum(jsd, shard, "jsd")
    return stats, jsd


def _sequences(geo: Geometry, policy: PolicyRows | None) -> int:
    """Sequences whose policy metrics the head kernel counts in scratch (rows of [B, K]), or 0."""
    return geo.n_out // policy.seq_len if policy is not None and policy.seq_len > 0 else 0


def head_backward(plan: KernelPlan, geo: Geometry, logits, targets, teacher, rows, d_loss, d_rows, num_items, scratch,
                  inplace: bool, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Deferred mode's gradient pass (``d_loss`` or ``d_rows`` None: that output took no gradient);
    ``stats``: a vocab-parallel forward's merged statistics."""
    grad = logits.detach() if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    launch_backward(plan, logits=logits, targets=targets, teacher=teacher, grad=grad, rows=rows,
                    d_loss=None if d_loss is None else d_loss.float().reshape(-1).contiguous(),
                    d_rows=None if d_rows is None else d_rows.float().contiguous(), num_items=num_items,
                    scratch=scratch, geo=_grad_geometry(geo, grad), stats=stats)
    return grad


class HeadFunction(torch.autograd.Function):
    """apply(logits, targets, teacher, old, ref, adv, iw, weight, num_items, sequence_ids, run)."""

    @staticmethod
    def forward(ctx, logits, targets, teacher, old, ref, adv, iw, weight, num_items, sequence_ids, run: HeadRun):
        plan = run.plan
        fused = plan.mode == "fused"
        grad_mode = "none"
        if fused and ctx.needs_input_grad[0]:
            grad_mode = "inplace" if run.inplace else "fresh"
            if torch.compiler.is_compiling():
                grad_mode = "handoff" if COMPILE_HANDOFF else "fresh"
        policy = PolicyRows(old, ref, adv, iw, weight, run.adv_span, run.seq_len) if adv is not None else None
        if torch.compiler.is_compiling():
            if run.shard is not None:
                raise NotImplementedError("group: a vocab-parallel head_loss is not traceable by torch.compile")
            loss, rows, pred, means, scratch, grad = torch.ops.headloss.head_forward(
                logits, targets, teacher, old, ref, adv, iw, weight, num_items, sequence_ids, plan.key,
                _geo_ints(run.geo), run.geo.norm, grad_mode, run.validate, list(run.token_shape),
                [run.adv_span, run.seq_len],
            )
            grad = grad if grad_mode != "none" else None  # the token (handoff), or the gradient
        else:
            loss, rows, pred, means, scratch, grad, *stats = head_forward(
                plan, run.geo, logits, targets, teacher, policy, num_items, sequence_ids, grad_mode, run.validate,
                run.token_shape, run.shard, extra_means=len(OBJECTIVE_OUT) if run.objective is not None else 0,
            )
        d_objective = None
        if run.objective is not None:  # the policy term: its loss added to ``loss``, its metrics after the means
            _, _, d_objective = _objective_launch(plan, rows, run.objective, base_loss=loss, total=loss,
                                                  out=means[plan.means_size:], grad=ctx.needs_input_grad[0])
        ctx.run = run
        ctx.set_materialize_grads(False)  # outputs without a gradient get None, not a zero tensor
        if fused:
            ctx.grad_geo = _grad_geometry(run.geo, grad) if grad_mode == "inplace" else run.geo
            ctx.grad_like = (tuple(logits.shape), logits.dtype)
            ctx.handoff = grad_mode == "handoff"
            ctx.save_for_backward(grad)
            ctx.mark_non_differentiable(rows, means, scratch, *(() if pred is None else (pred,)))
        else:
            ctx.save_for_backward(logits, targets, teacher, rows, num_items, scratch,
                                  stats[0] if run.shard is not None and not torch.compiler.is_compiling() else None,
                                  d_objective)
            ctx.mark_non_differentiable(means, scratch, *(() if pred is None else (pred,)))
        return loss, rows, pred, means, scratch

    @staticmethod
    def backward(ctx, d_loss, d_rows, *_):
        run: HeadRun = ctx.run
        nones = (None,) * 10
        if run.plan.mode == "fused":
            (grad,) = ctx.saved_tensors
            if grad is None or d_loss is None:
                return None, *nones
            if torch.compiler.is_compiling() and ctx.handoff:
                shape, dtype = ctx.grad_like
                return torch.ops.headloss.take_grad(grad, d_loss.float().reshape(1), 0, list(shape), dtype), *nones
            guard_second_backward(ctx)
            return _scale(grad, d_loss.float(), ctx.grad_geo), *nones
        if d_loss is None and d_rows is None:
            return None, *nones
        logits, targets, teacher, rows, num_items, scratch, stats, d_objective = ctx.saved_tensors
        if d_objective is not None and d_loss is not None:  # the policy term's d rows, for one unit of d loss
            scaled = d_objective * d_loss
            d_rows = scaled if d_rows is None else d_rows + scaled
        inplace = run.inplace and not torch.compiler.is_compiling()
        if torch.compiler.is_compiling():
            grad = torch.ops.headloss.head_backward(
                logits, targets, teacher, rows, d_loss if d_loss is not None else torch.zeros_like(scratch[:1]).float(),
                d_rows, num_items, scratch, run.plan.key, _geo_ints(run.geo), run.geo.norm,
            )
        else:
            grad = head_backward(run.plan, run.geo, logits, targets, teacher, rows, d_loss, d_rows, num_items, scratch,
                                 inplace, stats)
        return grad, *nones


def _scale(grad: torch.Tensor, d_loss: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """grad *= d_loss in place (a no-op on the device when d_loss == 1); under torch.compile through
    the ``scale_grad_`` op (HEADLOSS_COMPILE_HANDOFF=0: Inductor clones ``grad`` before it)."""
    if torch.compiler.is_compiling():
        torch.ops.headloss.scale_grad_(grad, d_loss.reshape(1), _geo_ints(geo))
        return grad
    return scale_grad_(grad, d_loss, geo)


# --- the deferred mode's policy term by kernels -----------------------------------------------------


def _objective_launch(plan: KernelPlan, rows: torch.Tensor, inp: PolicyInputs, **kwargs):
    """launch_policy_objective on the deferred mode's packed rows and flat policy inputs."""
    pol = plan.spec.policy
    cols = plan.cols
    flags = objective_flags(pol)
    entropy = rows[:, cols.entropy] if cols.entropy >= 0 else None
    return launch_policy_objective(
        flags, plan.scalars, logp=rows[:, cols.logp], entropy=entropy, old=inp.old_logprobs, ref=inp.ref_logprobs,
        adv=inp.advantages, iw=inp.importance_weights, mask=inp.mask, weight=inp.weight,
        sampled=inp.rollout_logprobs if inp.rollout_logprobs is not None else inp.old_logprobs,
        count=inp.mask.sum() if flags.ENT_TOKEN_MEAN else None, n_seq=inp.n_slots, seq_len=inp.seq_len,
        adv_span=inp.adv_span,
        off_policy=pol.off_policy_mask if pol.off_policy_mask is not None else 0.0, d_cols=cols.N,
        col_logp=cols.logp, col_ent=cols.entropy if flags.ENT_BONUS else -1, **kwargs)


class PolicyObjectiveFunction(torch.autograd.Function):
    """apply(loss, rows, plan, inp) -> (loss + the policy term, metrics (OBJECTIVE_OUT)): the deferred
    mode's policy objective on its packed rows, by two launches; the backward hands d loss / d rows
    (computed in forward, for one unit of upstream gradient) to the head's backward kernel."""

    @staticmethod
    def forward(ctx, loss, rows, plan: KernelPlan, inp: PolicyInputs):
        total, out, d_rows = _objective_launch(plan, rows, inp, base_loss=loss, grad=ctx.needs_input_grad[1])
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


def policy_objective_in_kernel(plan: KernelPlan, loss: torch.Tensor, rows: torch.Tensor, inp: PolicyInputs
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss + the policy term, its metrics) of deferred mode by kernels (policy.objective_in_kernel
    says when): the same values and metric names, in the same key order, as policy.policy_objective
    and api._policy_terms' "loss"."""
    total, out = PolicyObjectiveFunction.apply(loss, rows, plan, inp)
    return total, objective_metrics(plan, out)


def objective_metrics(plan: KernelPlan, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The policy metrics of the objective kernels' vector ``out`` (OBJECTIVE_OUT): policy_objective's
    names in its key order, then api._policy_terms' "loss"."""
    values = dict(zip(OBJECTIVE_OUT, out.unbind(), strict=True))
    names = _OBJECTIVE_NAMES.get(plan.key)
    if names is None:
        names = [name for name in OBJECTIVE_OUT[1:]
                 if (name != "entropy" or plan.cols.entropy >= 0) and (name != "kl" or plan.spec.policy.kl_beta)]
        names = _OBJECTIVE_NAMES[plan.key] = (*names, "pg_clipfrac", "loss")
    values["pg_clipfrac"] = values["clip_ratio/region_mean"]
    return {name: values[name] for name in names}


_OBJECTIVE_NAMES: dict[str, tuple[str, ...]] = {}


# --- the hidden-state entry point (fused lm_head) --------------------------------------------------


@dataclass(frozen=True)
class LinearRun:
    """Everything but tensors that a linear_head_loss call runs with."""

    plan: KernelPlan
    chunk_rows: int
    fp32_weight_grad: bool
    compact: bool  # skip ignored rows (one host sync for their count)
    validate: str
    token_shape: tuple[int, ...]
    ignore_index: int
    norm: float
    shard: Any = None  # vocab-parallel: a headloss.parallel.VocabShard (the weight's rows)
    # sequence-chunked fused mode (a deferred plan whose only need is a sequence statistic of the
    # policy term): chunks of whole sequences of seq_len rows; seq_policy is the call's PolicyInputs
    seq_len: int = 0
    seq_policy: Any = None
    # clip_cov / kl_cov, and the top-entropy mask of a row-local objective: ``plan`` runs the base
    # objective fused; corrected (the call's PolicyInputs) and corrected_objective (the spec's Policy)
    # drive the correction of the rows whose objective the batch statistic changes
    corrected: Any = None
    corrected_objective: Any = None

    @property
    def entropy_gate(self) -> bool:
        """The base runs with a guessed top-entropy mask (see engine._guess_mask)."""
        return self.corrected_objective is not None and self.corrected_objective.top_entropy_quantile < 1.0

    @property
    def grads_in_forward(self) -> bool:
        """The gradient is computed in forward (fused, or sequence-chunked) and scaled in backward."""
        return self.plan.mode == "fused" or self.seq_len > 0


@dataclass
class _Grads:
    dh: torch.Tensor | None  # (N, H) in the hidden dtype; rows never computed stay 0
    dw: torch.Tensor | None  # (V, H) in the weight dtype, or fp32 while accumulating
    db: torch.Tensor | None  # (V,) fp32 while accumulating


@dataclass(frozen=True)
class _Teacher:
    """Where a chunk's teacher logits come from: given logits [N, V], or teacher hidden states
    [N, Ht] x teacher weight [V, Ht] (+ bias), computed chunk by chunk like the student's."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def _chunk_geometry(rows: int, vocab: int, teacher: torch.Tensor | None, run: LinearRun) -> Geometry:
    shard = run.shard
    return Geometry(n_rows=rows, n_out=rows, V=vocab, T=rows, K=rows, shift=0, stride_b=0, stride_t=vocab,
                    g_stride_b=0, g_stride_t=vocab, t_stride_b=0,
                    t_stride_t=0 if teacher is None else teacher.stride(0), ignore_index=run.ignore_index,
                    norm=run.norm, vocab_start=0 if shard is None else shard.vocab_start,
                    V_total=0 if shard is None else shard.vocab_total)


def _rows_of(t: torch.Tensor | None, index: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    if t is None:
        return None
    return t[start:stop] if index is None else t.index_select(0, index[start:stop])


def _linear_into(out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def _chunks(hidden, weight, bias, index, teacher: _Teacher, computed: int, chunk_rows: int):
    """Yield (start, stop, h_c, teacher_c, logits_c) over the computed rows; logits_c (and a computed
    teacher_c) reuse one buffer each."""
    size = min(chunk_rows, max(computed, 1))
    buffer = torch.empty(size, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    t_buffer = None
    if teacher.hidden is not None:
        t_buffer = torch.empty(size, weight.shape[0], dtype=teacher.hidden.dtype, device=hidden.device)
    for start in range(0, computed, size):
        stop = min(start + size, computed)
        h_c = _rows_of(hidden, index, start, stop)
        logits = _linear_into(buffer[: stop - start], h_c, weight, bias)
        t_c = _rows_of(teacher.logits, index, start, stop)
        if teacher.hidden is not None:
            th_c = _rows_of(teacher.hidden, index, start, stop)
            t_c = _linear_into(t_buffer[: stop - start], th_c, teacher.weight, teacher.bias)
        yield start, stop, h_c, t_c, logits


def _new_grads(hidden, weight, bias, wants, fp32_weight_grad: bool, index, computed: int) -> _Grads:
    """Gradient buffers, uninitialised where a chunk overwrites them: the first chunk writes dW and
    db (no memset, no read), and dh rows are each written once unless ignored rows are skipped
    (then those stay 0). With no row to compute, dW and db are zeros."""
    want_h, want_w, want_b = wants
    fp32_w = fp32_weight_grad and weight.dtype != torch.float32
    alloc = torch.empty if computed > 0 else torch.zeros
    return _Grads(
        dh=(torch.empty_like(hidden) if index is None else torch.zeros_like(hidden)) if want_h else None,
        dw=alloc(weight.shape, dtype=torch.float32 if fp32_w else weight.dtype, device=weight.device)
        if want_w else None,
        db=alloc(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b and bias is not None else None,
    )


def _accumulate(grads: _Grads, g, h_c, weight, index, start: int, stop: int) -> None:
    """dh rows, dW and db contributions of one chunk's logits gradient ``g`` [C, V]."""
    if grads.dh is not None:
        if index is None:
            torch.mm(g, weight, out=grads.dh[start:stop])
        else:
            grads.dh.index_copy_(0, index[start:stop], torch.mm(g, weight))
    first = start == 0  # the first chunk overwrites dW and db
    if grads.dw is not None:
        _add_dw(grads.dw, g, h_c, beta=0.0 if first else 1.0)  # beta = 0: cuBLAS reads nothing from dw
    if grads.db is not None:
        if first:
            torch.sum(g, dim=0, dtype=torch.float32, out=grads.db)
        else:
            grads.db += g.sum(dim=0, dtype=torch.float32)


def _add_dw(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor, beta: float = 1.0) -> None:
    """dw = beta dw + g.T @ h in place (dw in the weight's dtype, or fp32 while accumulating)."""
    if dw.dtype == g.dtype:
        torch.addmm(dw, g.t(), h, beta=beta, out=dw)
    elif g.is_cuda:
        torch.addmm(dw, g.t(), h, beta=beta, out_dtype=torch.float32, out=dw)
    else:  # the CPU has no mixed-dtype addmm
        torch.addmm(dw, g.t().float(), h.float(), beta=beta, out=dw)


def _finish_grads(grads: _Grads, weight, bias) -> tuple:
    dw = grads.dw.to(weight.dtype) if grads.dw is not None and grads.dw.dtype != weight.dtype else grads.dw
    db = grads.db.to(bias.dtype) if grads.db is not None else None
    return grads.dh, dw, db


def _spread(t: torch.Tensor, index: torch.Tensor | None, rows: int, fill: float) -> torch.Tensor:
    """Per-row values over the computed rows -> over all rows (the others hold ``fill``)."""
    if index is None:
        return t
    return torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device).index_copy_(0, index, t)


def _compact_index(run: LinearRun, targets, scratch, rows: int, verdict):
    """The rows to compute when ignored rows are skipped: one host sync (nonzero's, for their count),
    after which the call's verdict is read in the call too (so validation costs nothing more). Never
    under CUDA-graph capture or torch.compile (row counts would be data-dependent)."""
    if not run.compact or targets is None or torch.compiler.is_compiling():
        return None
    if scratch.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    index = (targets != run.ignore_index).nonzero().squeeze(1)  # waits for the stream: prepare has run
    settle(verdict, "sync", scratch.device)
    return None if index.numel() == rows else index


def _sequence_chunk_grad(run: LinearRun, logits, targets, teacher, rows, num_items, scratch, geo: Geometry,
                         start: int, stop: int) -> None:
    """Sequence-chunked fused mode, one chunk of whole sequences: d loss / d logp (and d entropy) per row
    of the chunk's policy objective (its sequence statistics need nothing outside the chunk) -- one
    launch of the objective kernel (policy.objective_in_kernel), else autograd over the torch ops --
    then the deferred gradient pass over the chunk's logits, in place. Three GEMMs per chunk, as in
    fused mode; deferred mode recomputes the logits (four)."""
    plan, pol = run.plan, run.seq_policy
    cols = plan.cols
    part = lambda t: None if t is None else t[start:stop]  # noqa: E731
    n_seq = (stop - start) // run.seq_len
    inp = replace(pol, advantages=pol.advantages[start:stop], old_logprobs=part(pol.old_logprobs),
                  ref_logprobs=part(pol.ref_logprobs), importance_weights=part(pol.importance_weights), seq=None,
                  n_slots=n_seq, n_seq=n_seq, mask=pol.mask[start:stop], weight=pol.weight[start:stop],
                  rollout_logprobs=part(pol.rollout_logprobs), sequence_ids=None,
                  seq_advantages=None if pol.seq_advantages is None else
                  pol.seq_advantages[start // run.seq_len:stop // run.seq_len])
    policy = plan.spec.policy
    if objective_in_kernel(policy, inp, rows):
        _, _, d_rows = _objective_launch(plan, rows, inp, metrics=False)
    else:
        with torch.enable_grad():
            logp = rows[:, cols.logp].detach().requires_grad_()
            entropy = rows[:, cols.entropy].detach()
            wanted = [logp]
            if policy.entropy_coef != 0.0:
                entropy.requires_grad_()
                wanted.append(entropy)
            loss, _ = policy_objective(logp, entropy, inp.mask, policy, inp, with_metrics=False)
            found = torch.autograd.grad(loss, wanted, allow_unused=True)
        d_rows = torch.zeros(stop - start, cols.N, dtype=torch.float32, device=logits.device)
        for col, g in zip((cols.logp, cols.entropy), found):
            if g is not None:
                d_rows[:, col] = g
    launch_backward(plan, logits=logits, targets=targets, teacher=teacher, grad=logits, rows=rows,
                    d_loss=torch.ones(1, dtype=torch.float32, device=logits.device), d_rows=d_rows,
                    num_items=num_items, scratch=scratch, geo=geo)


def _cov_correction(run: LinearRun, hidden, weight, bias, targets, rows, grads: _Grads | None, loss, means) -> None:
    # rows, targets, hidden: every row of the call (ignored rows were skipped: their rows hold 0)
    """clip_cov / kl_cov on the lm_head: the chunks ran the base objective fused (three GEMMs); the
    few selected tokens (cov_ratio of them, verl's 2e-4 by default) then change: kl_cov adds
    coef |log r| to theirs, clip_cov drops the base objective's (:func:`_correct_rows`). The metrics
    the base does not have go on the call's PolicyInputs (``correction_metrics``)."""
    plan, pol, policy = run.plan, run.corrected, run.corrected_objective
    logp = rows[:, plan.cols.logp].detach()
    mask, adv = pol.mask, pol.advantages
    valid = mask > 0
    old = pol.old_logprobs if pol.old_logprobs is not None else logp
    scale = pol.weight * (pol.importance_weights if pol.importance_weights is not None else 1.0)
    log_ratio = logp - old
    count = mask.sum().clamp(min=1.0)
    if policy.objective == "kl_cov":
        chosen = kl_cov_chosen(adv, logp, valid, policy)
        d_logp = scale * policy.kl_cov_coef * torch.sign(log_ratio)
        added = scale * policy.kl_cov_coef * log_ratio.abs()
        pol.correction_metrics = {"ppo_kl": ((log_ratio.abs() * mask).sum() / count).float()}
    else:
        chosen = clip_cov_chosen(adv, logp, old, valid, policy)
        d_base, base = _objective_slope(logp, old, adv, scale, plan.spec.policy)  # the base objective
        d_logp, added = -d_base, -base
        pol.correction_metrics = {"pg_clipfrac": ((chosen.to(mask.dtype) * mask).sum() / count).float()}
    # (clip_cov's draw already made a host read)
    _correct_rows(run, hidden, weight, bias, targets, chosen, torch.where(chosen, d_logp, 0.0),
                  torch.where(chosen, added, 0.0).sum(), grads, loss, means)


def _objective_slope(logp, old, adv, scale, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """(d / d logp, value) per token of the row-local objective ``policy`` times ``scale``."""
    with torch.enable_grad():
        x = logp.clone().requires_grad_()
        value = token_objective(x, old, adv, policy).loss * scale
        (slope,) = torch.autograd.grad(value.sum(), x)
    return slope, value.detach()


def _correct_rows(run: LinearRun, hidden, weight, bias, targets, chosen, d_logp, added, grads: _Grads | None, loss,
                  means) -> None:
    """Change the loss (and the 'loss' metric) by ``added`` and the gradient of the ``chosen`` rows by
    ``d_logp`` (per row, d loss / d logp): their logits recomputed by a GEMM over those rows only,
    the change carried through log_softmax (and the logit transform) to dh, dW and db. One host read
    (the number of chosen rows)."""
    from .reference import transformed_logits  # (reference imports this module)

    plan = run.plan
    loss += added
    means[plan.cols.N] += added  # the 'loss' metric
    if grads is None:
        return
    picked = torch.nonzero(chosen).squeeze(1)
    if picked.numel() == 0:
        return
    h = hidden.index_select(0, picked)
    with torch.no_grad():
        logits = _linear_into(torch.empty(picked.numel(), weight.shape[0], dtype=hidden.dtype, device=hidden.device),
                              h, weight, bias)
    with torch.enable_grad():
        z = logits.float().requires_grad_()
        lp = torch.log_softmax(transformed_logits(z, plan.spec, torch.float32), -1)
        lp = lp.gather(1, targets.index_select(0, picked)[:, None])[:, 0]
        (g,) = torch.autograd.grad((d_logp.index_select(0, picked) * lp).sum(), z)
    g = g.to(hidden.dtype)
    if grads.dh is not None:
        grads.dh.index_add_(0, picked, torch.mm(g, weight))
    if grads.dw is not None:  # in place: no V x H temporary
        _add_dw(grads.dw, g, h)
    if grads.db is not None:
        grads.db += g.sum(dim=0, dtype=torch.float32)


LN2 = 0.6931471805599453


def _guess_mask(run: LinearRun, logits, y_c, geo: Geometry, chunk: PolicyRows, guess: torch.Tensor,
                seen: torch.Tensor, start: int, stop: int) -> PolicyRows:
    """The top-entropy mask on the lm_head, before its batch quantile is known: this chunk's
    entropies (one statistics pass over its logits, no gradient) against the quantile of the rows
    seen so far. The guess multiplies the objective as importance weights do; the rows it gets
    wrong are corrected at the end (:func:`_entropy_mask_correction`): a few percent of the rows,
    where deferred mode would recompute every chunk's logits. ``seen`` holds the entropies of the
    counted rows so far (NaN elsewhere), ``guess`` the guessed mask."""
    part = launch_shard_stats(run.plan, logits=logits, targets=y_c, geo=geo)
    valid = y_c != run.ignore_index
    d = part[:, 1].clamp(min=1e-30)
    # base-2 statistics (m2, sum 2^(x2 - m2), sum 2^(x2 - m2) x2) -> the entropy in nats
    entropy = torch.where(valid, LN2 * (part[:, 0] + torch.log2(d) - part[:, 3] / d), math.nan)
    seen[start:stop] = entropy
    keep = (entropy >= _guess_threshold(seen[:stop], run.corrected_objective.top_entropy_quantile)) & valid
    guess[start:stop] = keep
    gate = keep.float() if chunk.iw is None else chunk.iw.float() * keep
    return chunk._replace(iw=gate)


def _guess_threshold(seen: torch.Tensor, quantile: float) -> torch.Tensor:
    """The guessed top-entropy threshold: the quantile of the entropies seen so far (NaN: not counted)."""
    return masked_quantile(seen, ~seen.isnan(), 1.0 - quantile)


def _entropy_mask_correction(run: LinearRun, hidden, weight, bias, targets, rows, guess, grads: _Grads | None, loss,
                             means) -> None:
    # rows, targets, hidden, guess: every row of the call (ignored rows were skipped: their rows hold 0)
    """The top-entropy mask on the lm_head: the chunks ran the objective fused with a guessed mask
    (:func:`_guess_mask`); the batch quantile of the entropies (over ``entropy_quantile_group``
    when given) now gives the true mask, and the rows whose guess was wrong gain or lose their
    objective (:func:`_correct_rows`). The KL and a loss-aggregated entropy bonus never depend on
    the mask. The mask's metrics go on the call's PolicyInputs (``correction_metrics``)."""
    plan, pol, policy = run.plan, run.corrected, run.corrected_objective
    logp = rows[:, plan.cols.logp].detach()
    entropy = rows[:, plan.cols.entropy].detach()
    mask = pol.mask
    threshold = masked_quantile(entropy, mask > 0, 1.0 - policy.top_entropy_quantile, pol.quantile_group)
    high = ((entropy * mask) >= threshold) & (mask > 0)  # as policy.objective_of has it
    delta = high.to(guess.dtype) - guess
    old = pol.old_logprobs if pol.old_logprobs is not None else logp
    scale = pol.weight * (pol.importance_weights if pol.importance_weights is not None else 1.0)
    d_base, base = _objective_slope(logp, old, pol.advantages, scale, plan.spec.policy)  # the unmasked one
    pol.correction_metrics = high_entropy_metrics(entropy, high, mask)
    _correct_rows(run, hidden, weight, bias, targets, delta != 0, delta * d_base, (delta * base).sum(), grads, loss,
                  means)


def _pick_rows(policy: PolicyRows | None, index, start: int, stop: int) -> PolicyRows | None:
    if policy is None:
        return None
    tensors = (_rows_of(t, index, start, stop) for t in policy[:5])  # per-token rows of the chunk
    return PolicyRows(*tensors, adv_span=1, seq_len=0)


def linear_forward(run: LinearRun, hidden, weight, bias, targets, teacher: _Teacher, policy: PolicyRows | None,
                   num_items, sequence_ids, wants: tuple[bool, bool, bool]):
    """(loss, rows, rows_computed, pred, means, scratch, index, dh, dw, db) of a chunked lm_head call."""
    plan = run.plan
    rows, vocab = hidden.shape[0], weight.shape[0]
    whole = vocab if run.shard is None else run.shard.vocab_total  # targets are checked against all of V
    full = Geometry(n_rows=rows, n_out=rows, V=whole, T=rows, K=rows, shift=0, stride_b=0, stride_t=vocab,
                    g_stride_b=0, g_stride_t=vocab, t_stride_b=0, t_stride_t=0, ignore_index=run.ignore_index,
                    norm=run.norm)
    verdict = verdict_slot(run.validate, hidden.device, CheckContext(run.token_shape, whole, run.ignore_index,
                                                                     Normaliser(run.norm, num_items)))
    scratch = prepare(targets, num_items, sequence_ids, full, hidden.device, verdict)
    if run.shard is not None and run.validate == "sync":
        handshake_verdict(run.shard, verdict, hidden.device)
    index = _compact_index(run, targets, scratch, rows, verdict)
    computed = rows if index is None else index.numel()
    y = targets if index is None or targets is None else targets.index_select(0, index)
    rows_c, pred_c, loss_c, means = _empty_outputs(plan, computed, hidden.device,
                                                   run.token_shape if index is None else (computed,))
    fused = run.grads_in_forward and any(wants)
    by_sequence = fused and run.seq_len > 0  # the gradient pass after each chunk's sequence statistics
    grads = _new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed) if fused else None
    kept = [] if run.shard is not None and not fused else None  # deferred + sharded: the backward's statistics
    gate = run.entropy_gate and policy is not None  # also without gradient: the mask changes the loss
    if gate:  # the guessed top-entropy mask, and the entropies of the rows seen so far
        guess = torch.zeros(computed, dtype=torch.float32, device=hidden.device)
        seen = torch.empty(computed, dtype=torch.float32, device=hidden.device)
    for start, stop, h_c, t_c, logits in _chunks(hidden, weight, bias, index, teacher, computed, run.chunk_rows):
        geo = _chunk_geometry(stop - start, vocab, t_c, run)
        y_c = None if y is None else y[start:stop]
        stats = jsd = None
        if run.shard is not None:  # this chunk's statistics over every shard: one all_gather
            stats, jsd = _shard_statistics(plan, logits, y_c, t_c, geo, run.shard)
            if kept is not None:
                kept.append(stats)
        chunk_policy = _pick_rows(policy, index, start, stop)
        if gate:
            chunk_policy = _guess_mask(run, logits, y_c, geo, chunk_policy, guess, seen, start, stop)
        launch_head(
            plan, logits=logits, targets=y_c, teacher=t_c,
            grad=logits if fused and not by_sequence else None, rows=rows_c[start:stop],
            pred=_opt(pred_c[start:stop]),
            policy=chunk_policy, num_items=num_items, scratch=scratch,
            loss=loss_c.view(-1)[start:stop] if plan.reduction == "none" else loss_c, means=means,
            geo=geo, finish=False, stats=stats, jsd=jsd,
        )
        if by_sequence:
            _sequence_chunk_grad(run, logits, y_c, t_c, rows_c[start:stop], num_items, scratch, geo, start, stop)
        if fused:
            _accumulate(grads, logits, h_c, weight, index, start, stop)
    if computed == 0:
        _no_rows(plan, loss_c, means)
    else:
        launch_finish(plan, rows=rows_c, loss=loss_c, means=means, scratch=scratch, num_items=num_items,
                      geo=full._replace(n_out=computed))
        if not gate and run.corrected is not None:  # after the finish, which writes the loss and the metrics
            _cov_correction(run, hidden, weight, bias, targets, _spread(rows_c, index, rows, 0.0), grads, loss_c,
                            means)
    if gate:  # with no row too: the quantile's collective (entropy_quantile_group) joins every process's
        _entropy_mask_correction(run, hidden, weight, bias, targets, _spread(rows_c, index, rows, 0.0),
                                 _spread(guess, index, rows, 0.0), grads, loss_c, means)
    settle(verdict, run.validate, hidden.device)
    dh, dw, db = _finish_grads(grads, weight, bias) if grads is not None else (None, None, None)
    if run.shard is not None and dh is not None:  # each shard's share of dh: the column-parallel all-reduce
        dh = all_reduce_sum(dh, run.shard)
    loss = loss_c
    if plan.reduction == "none" and index is not None:
        loss = torch.zeros(run.token_shape, dtype=loss_c.dtype, device=loss_c.device)
        loss.view(-1).index_copy_(0, index, loss_c)
    pred = _spread(pred_c, index, rows, -1) if plan.flags.HAS_ARGMAX else pred_c
    stats = torch.cat(kept) if kept else None
    return loss, _spread(rows_c, index, rows, 0.0), rows_c, pred, means, scratch, index, dh, dw, db, stats


def chunk_head_(plan: KernelPlan, logits: torch.Tensor, targets: torch.Tensor | None) -> None:
    """The fused lm_head's per-chunk kernel on its own: the spec's kernel in place on one [C, V]
    chunk of logits, whose gradient overwrites it (benchmarks/profile_linear.py times it)."""
    run = LinearRun(plan, logits.shape[0], False, False, "off", (logits.shape[0],), plan.spec.ignore_index, 0.0)
    geo = _chunk_geometry(logits.shape[0], logits.shape[1], None, run)
    scratch = prepare(targets, None, None, geo, logits.device, None)
    rows, pred, loss, means = _empty_outputs(plan, logits.shape[0], logits.device, (logits.shape[0],))
    launch_head(plan, logits=logits, targets=targets, teacher=None, grad=logits, rows=rows, pred=_opt(pred),
                policy=None, num_items=None, scratch=scratch, loss=loss, means=means, geo=geo)


def linear_backward(run: LinearRun, wants, teacher: _Teacher, hidden, weight, bias, targets, index, rows_c, num_items,
                    scratch, d_loss, d_rows, stats: torch.Tensor | None = None):
    """Deferred mode: recompute each chunk's logits, one gradient pass, the gradient GEMMs (4 GEMMs in all)."""
    plan = run.plan
    vocab = weight.shape[0]

    def compact(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.numel() == 1:
            return t
        t = t.float()
        return (t if index is None else t.index_select(0, index)).contiguous()

    if d_loss is not None:
        d_loss = compact(d_loss.reshape(-1) if plan.reduction == "none" else d_loss.reshape(1).float())
    d_rows = compact(d_rows)
    computed = hidden.shape[0] if index is None else index.numel()
    y = targets if index is None or targets is None else targets.index_select(0, index)
    grads = _new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed)
    for start, stop, h_c, t_c, logits in _chunks(hidden, weight, bias, index, teacher, computed, run.chunk_rows):
        launch_backward(
            plan, logits=logits, targets=None if y is None else y[start:stop], teacher=t_c, grad=logits,
            rows=rows_c[start:stop], d_loss=d_loss[start:stop] if plan.reduction == "none" and d_loss is not None
            else d_loss,
            d_rows=None if d_rows is None else d_rows[start:stop], num_items=num_items, scratch=scratch,
            geo=_chunk_geometry(stop - start, vocab, t_c, run), stats=None if stats is None else stats[start:stop],
        )
        _accumulate(grads, logits, h_c, weight, index, start, stop)
    dh, dw, db = _finish_grads(grads, weight, bias)
    if run.shard is not None and dh is not None:  # the column-parallel all-reduce, in the backward here
        dh = all_reduce_sum(dh, run.shard)
    return dh, dw, db


def _flat_geometry(t: torch.Tensor) -> Geometry:
    """A contiguous [R, C] tensor as R rows of C columns, a [C] one as one row (for scale_grad_)."""
    rows, cols = (1, t.shape[0]) if t.dim() == 1 else t.shape
    return Geometry(n_rows=rows, n_out=rows, V=cols, T=rows, K=rows, shift=0, stride_b=0, stride_t=cols,
                    g_stride_b=0, g_stride_t=cols, t_stride_b=0, t_stride_t=0, ignore_index=0, norm=0.0)


class LinearFunction(torch.autograd.Function):
    """apply(hidden [N, H], weight [V, H], bias, targets [N], teacher_logits, teacher_hidden,
    teacher_weight, teacher_bias, old, ref, adv, iw, policy_weight, num_items, sequence_ids, run)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher_logits, teacher_hidden, teacher_weight, teacher_bias,
                old, ref, adv, iw, policy_weight, num_items, sequence_ids, run: LinearRun):
        teacher = (teacher_logits, teacher_hidden, teacher_weight, teacher_bias)
        policy = (old, ref, adv, iw, policy_weight)
        wants = tuple(ctx.needs_input_grad[:3])
        handoff = False
        if torch.compiler.is_compiling():
            if run.shard is not None:
                raise NotImplementedError("group: a vocab-parallel linear_head_loss is not traceable by torch.compile")
            handoff = run.plan.mode == "fused" and any(wants) and COMPILE_HANDOFF
            loss, rows, pred, means, scratch, dh, dw, db, token = torch.ops.headloss.linear_forward(
                hidden, weight, bias, targets, *teacher, *policy, num_items, sequence_ids, run.plan.key,
                run.chunk_rows, run.fp32_weight_grad, run.validate, list(run.token_shape), run.ignore_index,
                run.norm, list(wants), handoff,
            )
            rows_c, index, stats = rows, None, None
            dh, dw, db = (g if want else None for g, want in zip((dh, dw, db), wants))
            if handoff:
                ctx.grad_like = [(list(t.shape), t.dtype) if t is not None else None for t in (hidden, weight, bias)]
                dh, dw, db = token, None, None  # the token holds them (see _hand_off)
        else:
            loss, rows, rows_c, pred, means, scratch, index, dh, dw, db, stats = linear_forward(
                run, hidden, weight, bias, targets, _Teacher(*teacher),
                PolicyRows(*policy) if adv is not None else None, num_items, sequence_ids, wants,
            )
        ctx.run, ctx.wants = run, wants
        ctx.handoff = handoff
        ctx.set_materialize_grads(False)
        if run.grads_in_forward:
            ctx.save_for_backward(dh, dw, db)
            ctx.mark_non_differentiable(rows, pred, means, scratch)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, *teacher, index, rows_c, num_items, scratch, stats)
            ctx.mark_non_differentiable(pred, means, scratch)
        return loss, rows, pred, means, scratch

    @staticmethod
    def backward(ctx, d_loss, d_rows, *_):
        run: LinearRun = ctx.run
        nones = (None,) * 13
        if d_loss is None and d_rows is None:
            return None, None, None, *nones
        if run.grads_in_forward:
            d_loss = d_loss.float()
            if torch.compiler.is_compiling() and ctx.handoff:
                token = ctx.saved_tensors[0]
                return (*(torch.ops.headloss.take_grad(token, d_loss.reshape(1), i, *like) if want else None
                          for i, (want, like) in enumerate(zip(ctx.wants, ctx.grad_like))), *nones)
            guard_second_backward(ctx)
            return (*(None if g is None else _scale(g, d_loss, _flat_geometry(g)) for g in ctx.saved_tensors),
                    *nones)
        (hidden, weight, bias, targets, t_logits, t_hidden, t_weight, t_bias, index, rows_c, num_items, scratch,
         stats) = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dh, dw, db = torch.ops.headloss.linear_backward(
                hidden, weight, bias, targets, t_logits, t_hidden, t_weight, t_bias, rows_c, num_items, scratch,
                d_loss if d_loss is not None else torch.zeros_like(scratch[:1]).float(), d_rows, run.plan.key,
                run.chunk_rows, run.fp32_weight_grad, run.ignore_index, run.norm,
                list(ctx.wants),
            )
            dh, dw, db = (g if want else None for g, want in zip((dh, dw, db), ctx.wants))
        else:
            dh, dw, db = linear_backward(run, ctx.wants, _Teacher(t_logits, t_hidden, t_weight, t_bias), hidden, weight,
                                         bias, targets, index, rows_c, num_items, scratch, d_loss, d_rows, stats)
        return dh, dw, db, *nones


# --- torch.library ops (the torch.compile path) ----------------------------------------------------


def _geo(values: list[int], norm: float) -> Geometry:
    return Geometry(norm=norm, **dict(zip(GEO_INTS, values)))


def _geo_ints(geo: Geometry) -> list[int]:
    return [getattr(geo, name) for name in GEO_INTS]


# The ops that hand a gradient over beside the graph must run on every call: tagged
# cudagraph_unsafe, Inductor's graph partitions keep them out of mode="reduce-overhead"'s CUDA graphs
# (a replay would not run the hand-off).
_BESIDE_GRAPH = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("headloss::head_forward", mutates_args=(), tags=_BESIDE_GRAPH)
def _head_forward_op(
    logits: torch.Tensor, targets: torch.Tensor | None, teacher: torch.Tensor | None, old: torch.Tensor | None,
    ref: torch.Tensor | None, adv: torch.Tensor | None, iw: torch.Tensor | None, weight: torch.Tensor | None,
    num_items: torch.Tensor | None, sequence_ids: torch.Tensor | None, key: str, geo: list[int], norm: float,
    grad_mode: str, validate: str, token_shape: list[int], policy_layout: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_mode none / fresh (the gradient is the last output) / handoff (the last output is a token
    holding it, see _hand_off)."""
    policy = PolicyRows(old, ref, adv, iw, weight, *policy_layout) if adv is not None else None
    layout = _geo(geo, norm)
    loss, rows, pred, means, scratch, grad = head_forward(
        plan_from_key(key), layout, logits, targets, teacher, policy, num_items, sequence_ids,
        "fresh" if grad_mode != "none" else "none", validate, tuple(token_shape),
    )
    if grad_mode == "handoff":
        grad = _hand_off([(grad, layout)])
    elif grad is None:
        grad = logits.new_empty(0)
    if pred is None:
        pred = torch.empty(0, dtype=torch.int64, device=logits.device)
    return loss, rows, pred, means, scratch, grad


@_head_forward_op.register_fake
def _(logits, targets, teacher, old, ref, adv, iw, weight, num_items, sequence_ids, key, geo, norm, grad_mode,
      validate, token_shape, policy_layout):
    plan = plan_from_key(key)
    rows, pred, loss, means = _empty_outputs(plan, _geo(geo, norm).n_out, logits.device, tuple(token_shape))
    layout = _geo(geo, norm)
    n_seq = layout.n_out // policy_layout[1] if adv is not None and policy_layout[1] > 0 else 0
    scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=logits.device)
    if grad_mode == "handoff":
        return loss, rows, pred, means, scratch, _token_fake()
    grad = torch.empty(logits.shape if grad_mode != "none" else (0,), dtype=logits.dtype, device=logits.device)
    return loss, rows, pred, means, scratch, grad


@torch.library.custom_op("headloss::head_backward", mutates_args=())
def _head_backward_op(
    logits: torch.Tensor, targets: torch.Tensor | None, teacher: torch.Tensor | None, rows: torch.Tensor,
    d_loss: torch.Tensor, d_rows: torch.Tensor | None, num_items: torch.Tensor | None, scratch: torch.Tensor,
    key: str, geo: list[int], norm: float,
) -> torch.Tensor:
    return head_backward(plan_from_key(key), _geo(geo, norm), logits, targets, teacher, rows, d_loss, d_rows,
                         num_items, scratch, inplace=False)


@_head_backward_op.register_fake
def _(logits, targets, teacher, rows, d_loss, d_rows, num_items, scratch, key, geo, norm):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("headloss::scale_grad_", mutates_args=("grad",))
def _scale_grad_op(grad: torch.Tensor, d_loss: torch.Tensor, geo: list[int]) -> None:
    """grad *= d_loss in place: the compiled backward with HEADLOSS_COMPILE_HANDOFF=0."""
    scale_grad_(grad, d_loss, _geo(geo, 0.0))


@_scale_grad_op.register_fake
def _(grad, d_loss, geo):
    return None


@torch.library.custom_op("headloss::take_grad", mutates_args=(), tags=_BESIDE_GRAPH)
def _take_grad_op(token: torch.Tensor, d_loss: torch.Tensor, index: int, shape: list[int],
                  dtype: torch.dtype) -> torch.Tensor:
    """The fused gradient a forward op handed over in ``token`` (its ``index``-th buffer), scaled in
    place by ``d_loss``; ``shape`` and ``dtype`` are the buffer's (for the fake)."""
    return _take(token, d_loss, index)


@_take_grad_op.register_fake
def _(token, d_loss, index, shape, dtype):
    return torch.empty(shape, dtype=dtype, device=d_loss.device)


@torch.library.custom_op("headloss::linear_forward", mutates_args=(), tags=_BESIDE_GRAPH)
def _linear_forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor | None,
    teacher_logits: torch.Tensor | None, teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None, old: torch.Tensor | None, ref: torch.Tensor | None, adv: torch.Tensor | None,
    iw: torch.Tensor | None, policy_weight: torch.Tensor | None, num_items: torch.Tensor | None,
    sequence_ids: torch.Tensor | None, key: str, chunk_rows: int, fp32_weight_grad: bool, validate: str,
    token_shape: list[int], ignore_index: int, norm: float, wants: list[bool], handoff: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """Fused mode's (dh, dw, db), or with ``handoff`` empty ones and the last output a token holding
    them (see _hand_off); otherwise the token is an empty tensor."""
    run = LinearRun(plan_from_key(key), chunk_rows, fp32_weight_grad, False, validate, tuple(token_shape),
                    ignore_index, norm)
    policy = PolicyRows(old, ref, adv, iw, policy_weight) if adv is not None else None
    loss, rows, _, pred, means, scratch, _, dh, dw, db, _ = linear_forward(
        run, hidden, weight, bias, targets, _Teacher(teacher_logits, teacher_hidden, teacher_weight, teacher_bias),
        policy, num_items, sequence_ids, tuple(wants),
    )
    token = hidden.new_empty(0, dtype=torch.int64)
    if handoff:
        token = _hand_off([None if g is None else (g, _flat_geometry(g)) for g in (dh, dw, db)])
        dh = dw = db = None
    return (loss, rows, pred, means, scratch, *(g if g is not None else hidden.new_empty(0) for g in (dh, dw, db)),
            token)


@_linear_forward_op.register_fake
def _(hidden, weight, bias, targets, teacher_logits, teacher_hidden, teacher_weight, teacher_bias, old, ref, adv, iw,
      policy_weight, num_items, sequence_ids, key, chunk_rows, fp32_weight_grad, validate, token_shape,
      ignore_index, norm, wants, handoff):
    plan = plan_from_key(key)
    rows, pred, loss, means = _empty_outputs(plan, hidden.shape[0], hidden.device, tuple(token_shape))
    scratch = torch.empty(SCRATCH, dtype=torch.int64, device=hidden.device)
    fused = plan.mode == "fused" and not handoff
    dh, dw, db = (
        torch.empty(like.shape if fused and want else (0,), dtype=like.dtype, device=hidden.device)
        for like, want in zip((hidden, weight, bias if bias is not None else hidden.new_empty(0)), wants)
    )
    token = _token_fake() if handoff else hidden.new_empty(0, dtype=torch.int64)
    return loss, rows, pred, means, scratch, dh, dw, db, token


@torch.library.custom_op("headloss::linear_backward", mutates_args=())
def _linear_backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor | None,
    teacher_logits: torch.Tensor | None, teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None, rows: torch.Tensor, num_items: torch.Tensor | None, scratch: torch.Tensor,
    d_loss: torch.Tensor, d_rows: torch.Tensor | None, key: str, chunk_rows: int, fp32_weight_grad: bool,
    ignore_index: int, norm: float, wants: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    run = LinearRun(plan_from_key(key), chunk_rows, fp32_weight_grad, False, "off", (), ignore_index, norm)
    grads = linear_backward(run, tuple(wants), _Teacher(teacher_logits, teacher_hidden, teacher_weight, teacher_bias),
                            hidden, weight, bias, targets, None, rows, num_items, scratch, d_loss, d_rows)
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)


@_linear_backward_op.register_fake
def _(hidden, weight, bias, targets, teacher_logits, teacher_hidden, teacher_weight, teacher_bias, rows, num_items,
      scratch, d_loss, d_rows, key, chunk_rows, fp32_weight_grad, ignore_index, norm, wants):
    likes = (hidden, weight, bias if bias is not None else hidden.new_empty(0))
    return tuple(torch.empty(like.shape if want else (0,), dtype=like.dtype, device=hidden.device)
                 for like, want in zip(likes, wants))
