"""Fused lm_head: hidden states x weight in, every output and gradient out, no full logits.

Rows are processed in chunks whose logits fit a byte budget. Per chunk (fused mode):

1. ``logits_c = h_c @ W.T (+ b)``                      cuBLAS, into one reused [C, V] buffer
2. the head kernel of the spec, in place on that buffer: per-row outputs, and d loss / d logits_c
   written over logits_c (2 reads + 1 write of the chunk)
3. ``dh_c = g_c @ W``, ``dW += g_c.T @ h_c``, ``db += sum_rows g_c``   cuBLAS

so the whole call is the 3 GEMMs of a plain lm_head forward + backward, plus ~3 chunk-sized
passes of the kernel, and holds one [C, V] chunk at a time. Backward only scales dh, dW, db by
d loss (skipped on the device when d loss == 1). In deferred mode (``reduction="none"``,
differentiable per-token outputs) forward runs steps 1-2 without the gradient and backward
recomputes the logits per chunk: 4 GEMMs.

Rows whose target is ``ignore_index`` are skipped entirely (``compact=True``): the non-ignored
rows are gathered chunk by chunk, which costs one host sync to learn their count (shared with
target validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .api import (
    KERNEL_DTYPES,
    Backend,
    SpecLike,
    assemble_output,
    check_inputs,
    check_teacher,
    denominator,
    resolve_backend,
    target_range_error,
    targets_out_of_range,
    validation_default,
)
from .kernels.head import RowStats, run_backward, run_forward, scale_grad_
from .output import HeadLossOutput
from .plan import KernelPlan, compile_plan
from .policy import PolicyRows, policy_inputs
from .reference import reference_head_loss
from .spec import LossSpec

DEFAULT_CHUNK_BYTES = 256 << 20
"""Logits per chunk: 256 MiB = 1024 rows of a 128256-word bf16 vocabulary.

Measured on an H200 at N=8192, H=4096, V=128256 (benchmarks/bench_linear.py, "chunks" rows):
32/64/96/128/192/256/512 MiB ran at 2.34/1.45/1.27/1.19/1.13/1.11/1.06 x the 3 bare GEMMs with a
peak of 1.10/1.13/1.16/1.20/1.26/1.32/1.56 GiB (dW, dh and cuBLAS's workspace included). Every
chunk re-reads and re-writes dW, and below ~1024 rows cuBLAS runs the weight-gradient and logits
GEMMs well under their large-K speed (benchmarks/profile_linear.py); 1024 rows is the smallest
chunk within 1.1x. Pass ``chunk_bytes=128 << 20`` where memory matters more than time.
"""


@dataclass(frozen=True)
class LinearOptions:
    chunk_rows: int
    fp32_weight_grad: bool


@dataclass(frozen=True)
class Teacher:
    """Where a chunk's teacher logits come from: given logits [N, V], or teacher hidden states
    [N, Ht] x teacher weight [V, Ht] (+ bias), computed chunk by chunk like the student's."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


NO_TEACHER = Teacher()


@dataclass
class _Grads:
    dh: torch.Tensor | None  # (N, H) in the hidden dtype; rows never computed stay 0
    dw: torch.Tensor | None  # (V, H) in the weight dtype, or fp32 while accumulating
    db: torch.Tensor | None  # (V,) fp32 while accumulating


ROW_TILE = 128
"""Chunks of 256 rows or more are cut to a multiple of this: cuBLAS tiles the chunk's rows by 128
(or 256), and a partial last tile costs a whole one. On an H200 (N=8192, H=4096, V=128256) 544-row
chunks ran the step in 49.6 ms against 45.0 ms for 512-row chunks (benchmarks/profile_linear.py)."""


def chunk_rows_for(budget_bytes: int, vocab: int, elem_bytes: int) -> int:
    """Rows per chunk so that one [rows, vocab] logits buffer fits ``budget_bytes`` (at least 1),
    cut to a multiple of ROW_TILE from 2 * ROW_TILE rows up."""
    rows = max(1, budget_bytes // max(1, vocab * elem_bytes))
    return rows - rows % ROW_TILE if rows >= 2 * ROW_TILE else rows


def linear_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None = None,
    spec: SpecLike | None = None,
    *,
    bias: torch.Tensor | None = None,
    shift: bool = False,
    teacher_logits: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fp32_weight_grad: bool = False,
    compact: bool = True,
    validate: bool | None = None,
    backend: Backend = "auto",
) -> HeadLossOutput:
    """:func:`headloss.head_loss` of ``hidden @ weight.T + bias`` without materialising the logits.

    Args:
        hidden: [N, H] or [B, T, H] (fp32/bf16/fp16).
        weight: [V, H], same dtype and device (may be tied to the input embedding).
        targets: [N] or [B, T] ids, or None when the spec needs none.
        bias: optional [V].
        shift: next-token targets as HF causal LMs do: position t is scored against
            ``targets[:, t + 1]``, the last position of each sequence is ignored. Needs [B, T] targets.
        chunk_bytes: budget for one chunk of logits (default 256 MiB, see DEFAULT_CHUNK_BYTES;
            128 MiB where memory is tight); rows per chunk are cut to a multiple of 128 from 256
            up. Peak extra memory is about this plus the gradients dW (V x H), dh (N x H) and
            O(N) per-row buffers.
        fp32_weight_grad: accumulate dW over chunks in fp32 and round once at the end (costs a
            V x H fp32 buffer); default bf16/fp16 accumulation in the weight's dtype.
        compact: skip ignored rows entirely (gather the others chunk by chunk); costs one host
            sync for their count. ``compact=False, validate=False`` makes the call sync-free.
        teacher_logits: [N, V] / [B, T, V] teacher logits for the distillation term, or instead
            teacher_hidden [.., Ht] with teacher_weight [V, Ht] (and teacher_bias): the teacher's
            logits are then computed chunk by chunk too (and recomputed in a deferred backward).
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights, sequence_ids:
            the policy term's inputs, as in :func:`headloss.head_loss`.
        validate, backend, num_items_in_batch: as in :func:`headloss.head_loss`.
    """
    spec = LossSpec() if spec is None else LossSpec.coerce(spec)
    _check_linear_inputs(hidden, weight, bias, targets, shift)
    if isinstance(targets, torch.Tensor) and targets.dtype in (torch.int16, torch.int8, torch.uint8):
        targets = targets.long()  # before the shift: narrow ints cannot hold ignore_index
    if shift:
        targets = F.pad(targets[:, 1:], (0, 1), value=spec.ignore_index)
    token_shape = hidden.shape[:-1]
    rows, width = token_shape.numel(), hidden.shape[-1]
    vocab = weight.shape[0]
    if targets is not None and isinstance(targets, torch.Tensor) and targets.device != hidden.device:
        raise ValueError(f"targets: on {targets.device}, hidden on {hidden.device}")
    # the head's own checks see the [N, V] logits we never build: a meta tensor stands in
    meta_logits = torch.empty(token_shape + (vocab,), device="meta", dtype=hidden.dtype)
    meta_targets = targets.to("meta") if isinstance(targets, torch.Tensor) else targets
    check_inputs(meta_logits, meta_targets, spec, num_items_in_batch)
    teacher = _teacher_source(spec, meta_logits, hidden, teacher_logits, teacher_hidden, teacher_weight, teacher_bias)
    validate = validation_default() if validate is None else validate
    given = dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask,
                 importance_weights=importance_weights, sequence_ids=sequence_ids)
    policy, policy_targets = policy_inputs(
        spec.policy, token_shape, targets, spec.ignore_index, num_items_in_batch, validate, given
    )

    if backend == "triton" and hidden.dtype not in KERNEL_DTYPES:
        raise TypeError(f"hidden: the Triton kernel takes float32, bfloat16 or float16, got {hidden.dtype}")
    if resolve_backend(backend, torch.empty(0, device=hidden.device, dtype=hidden.dtype)) == "reference":
        if validate and targets is not None and bool(targets_out_of_range(targets, vocab, spec.ignore_index)):
            raise target_range_error(targets, vocab, spec.ignore_index)
        logits = F.linear(hidden, weight, bias)
        if teacher.hidden is not None:
            teacher_logits = F.linear(teacher_hidden, teacher_weight, teacher_bias)
        return reference_head_loss(
            logits, targets, spec, teacher_logits=teacher_logits, num_items_in_batch=num_items_in_batch,
            **{k: v for k, v in given.items() if v is not None},
        )

    targets = policy_targets
    h2d = hidden.reshape(rows, width)
    flat_targets = targets.reshape(-1).contiguous() if targets is not None else None
    valid = flat_targets != spec.ignore_index if flat_targets is not None else None
    index = None
    if flat_targets is not None and (compact or validate):
        checks = [valid.sum()]
        if validate:
            checks.append(targets_out_of_range(flat_targets, vocab, spec.ignore_index).long())
        host = torch.stack(checks).tolist()  # the one host sync: count and verdict together
        if validate and host[1]:
            raise target_range_error(targets, vocab, spec.ignore_index)
        if compact and host[0] < rows:
            index = valid.nonzero().squeeze(1)
    n_tokens, grad_scale = denominator(spec, valid, rows, num_items_in_batch, hidden.device)

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    plan = compile_plan(
        spec, has_targets=flat_targets is not None, needs_grad=needs_grad,
        has_old_logprobs=policy is not None and policy.old_logprobs is not None,
        has_importance_weights=policy is not None and policy.importance_weights is not None,
    )
    # a computed teacher chunk shares the budget with the student's
    elem = hidden.element_size() * (2 if teacher.hidden is not None else 1)
    options = LinearOptions(chunk_rows_for(chunk_bytes, vocab, elem), fp32_weight_grad)
    outs = LinearHead.apply(h2d, weight, bias, flat_targets, index, teacher, policy, plan, options, grad_scale)
    return assemble_output(spec, token_shape, outs, n_tokens, valid, flat_targets, policy)


def _teacher_source(spec, meta_logits, hidden, logits, t_hidden, t_weight, t_bias) -> Teacher:
    """Check the teacher inputs and say where its logits come from (errors name the argument)."""
    if t_hidden is None and (t_weight is not None or t_bias is not None):
        raise ValueError("teacher_hidden: required with teacher_weight / teacher_bias")
    if t_hidden is not None:
        if logits is not None:
            raise ValueError("teacher_logits: give either teacher_logits or teacher_hidden + teacher_weight, not both")
        if t_weight is None:
            raise ValueError("teacher_weight: required with teacher_hidden")
        if spec.distillation is None:
            raise ValueError("teacher_hidden: given, but the spec has no distillation term")
        if tuple(t_hidden.shape[:-1]) != tuple(hidden.shape[:-1]) or t_hidden.device != hidden.device:
            raise ValueError(f"teacher_hidden: expected {tuple(hidden.shape[:-1])} + (Ht,) on {hidden.device}, "
                             f"got {tuple(t_hidden.shape)} on {t_hidden.device}")
        if t_weight.dim() != 2 or t_weight.shape != (meta_logits.shape[-1], t_hidden.shape[-1]):
            raise ValueError(f"teacher_weight: expected [V, Ht] = {(meta_logits.shape[-1], t_hidden.shape[-1])}, "
                             f"got {tuple(t_weight.shape)}")
        if t_weight.dtype != t_hidden.dtype or (t_bias is not None and t_bias.shape != (t_weight.shape[0],)):
            raise ValueError("teacher_weight: dtype must match teacher_hidden, teacher_bias shape must be [V]")
        rows = t_hidden.shape[:-1].numel()
        return Teacher(hidden=t_hidden.detach().reshape(rows, -1), weight=t_weight.detach(),
                       bias=None if t_bias is None else t_bias.detach())
    check_teacher(meta_logits, None if logits is None else logits.to("meta"), spec)
    if logits is None:
        return NO_TEACHER
    if logits.device != hidden.device:
        raise ValueError(f"teacher_logits: on {logits.device}, hidden on {hidden.device}")
    return Teacher(logits=logits.detach().reshape(-1, logits.shape[-1]))


class LinearHeadLoss(torch.nn.Module):
    """Module form: ``LinearHeadLoss(spec)(hidden, lm_head.weight, labels)``."""

    def __init__(self, spec: SpecLike | None = None, **options: Any) -> None:
        super().__init__()
        self.spec = LossSpec() if spec is None else LossSpec.coerce(spec)
        self.options = options

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        bias: torch.Tensor | None = None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
    ) -> HeadLossOutput:
        return linear_head_loss(
            hidden, weight, targets, self.spec, bias=bias, num_items_in_batch=num_items_in_batch, **self.options
        )


def _check_linear_inputs(hidden, weight, bias, targets, shift: bool) -> None:
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected [V, H] with H = {hidden.shape[-1]} (hidden's last dim), got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary dimension V is 0")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, hidden on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {getattr(bias, 'shape', bias)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(f"bias: expected {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")
    if shift:
        if targets is None:
            raise ValueError("targets: shift=True needs targets")
        if hidden.dim() != 3 or targets.dim() != 2:
            raise ValueError("shift: needs hidden [B, T, H] and targets [B, T] (sequence boundaries)")


class LinearHead(torch.autograd.Function):
    """apply(hidden [N, H], weight [V, H], bias [V] | None, targets [N] | None, index [M] | None,
    teacher, plan, options, grad_scale) -> (loss, *RowStats.fields()) over all N rows.

    ``index`` lists the rows to compute (the non-ignored ones); None means all.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, index, teacher: Teacher, policy, plan: KernelPlan,
                options: LinearOptions, grad_scale):
        rows = hidden.shape[0]
        computed = _computed_rows(hidden, index)
        y = targets if index is None or targets is None else targets.index_select(0, index)
        stats = RowStats.empty(computed, plan, hidden.device)
        wants = ctx.needs_input_grad[:3]
        grads = _new_grads(hidden, weight, bias, wants, options, index) if plan.flags.FUSED_GRAD else None
        for start, stop, h_c, y_c, t_c, logits in _chunks(hidden, weight, bias, y, index, teacher, options):
            fused = grads is not None
            rows_c = None
            if plan.flags.HAS_POLICY:
                rows_c = PolicyRows.select(policy, lambda t, a=start, b=stop: _rows_of(t, index, a, b))
            run_forward(plan, logits, y_c, t_c, logits if fused else None, grad_scale, out=stats.rows(start, stop),
                        policy=rows_c)
            if fused:
                _accumulate(grads, logits, h_c, weight, index, start, stop, options)
        full = _scatter_rows(stats, index, rows)
        loss = full.token_loss.clone() if plan.reduction == "none" else (full.token_loss.sum() * grad_scale)[0]
        if full.policy_loss is not None:  # already weighted by its aggregation
            loss = loss + full.policy_loss.sum()
        ctx.plan, ctx.options, ctx.wants, ctx.teacher = plan, options, wants, teacher
        if grads is not None:
            _finish_grads(grads, weight, bias)
            ctx.save_for_backward(grads.dh, grads.dw, grads.db)
            ctx.mark_non_differentiable(*[t for t in full.fields() if t is not None])
        else:
            ctx.save_for_backward(hidden, weight, bias, y, index, stats.lse, stats.entropy, stats.dstats, grad_scale)
            ctx.mark_non_differentiable(*full.constants())
        return (loss, *full.fields())

    @staticmethod
    def backward(ctx, d_loss, d_token_loss, d_lse, _d_ce, d_entropy, d_logp, *_constants):
        plan: KernelPlan = ctx.plan
        nones = (None,) * 7
        if plan.flags.FUSED_GRAD:
            if getattr(ctx, "consumed", False):
                raise RuntimeError(
                    "headloss: a second backward through the same fused-mode loss (retain_graph=True); "
                    "use differentiable_outputs=True or reduction='none' (deferred mode), or call again"
                )
            ctx.consumed = True
            dh, dw, db = ctx.saved_tensors
            return (
                scale_grad_(dh, d_loss) if dh is not None else None,
                scale_grad_(dw, d_loss) if dw is not None else None,
                scale_grad_(db.view(1, -1), d_loss).view(-1) if db is not None else None,
                *nones,
            )
        hidden, weight, bias, y, index, lse, entropy, dstats, grad_scale = ctx.saved_tensors
        d_token = d_loss.float().reshape(-1) if plan.reduction == "none" else (d_loss.float() * grad_scale).reshape(1)
        if d_token_loss is not None:
            d_token = d_token + d_token_loss.float().reshape(-1)

        def compact(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.numel() == 1:
                return t
            t = t.float().reshape(-1)
            return (t if index is None else t.index_select(0, index)).contiguous()

        d_token, d_logp, d_entropy, d_lse = (compact(t) for t in (d_token, d_logp, d_entropy, d_lse))
        grads = _new_grads(hidden, weight, bias, ctx.wants, ctx.options, index)
        for start, stop, h_c, y_c, t_c, logits in _chunks(hidden, weight, bias, y, index, ctx.teacher, ctx.options):
            run_backward(
                plan, logits, y_c, t_c, logits, lse[start:stop],
                *(_rows(t, start, stop) for t in (entropy, dstats, d_token, d_logp, d_entropy, d_lse)),
            )
            _accumulate(grads, logits, h_c, weight, index, start, stop, ctx.options)
        _finish_grads(grads, weight, bias)
        return grads.dh, grads.dw, grads.db, *nones


def _rows(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """Rows [start, stop) of a per-row tensor; None and 1-element (broadcast) tensors pass through."""
    return t if t is None or t.numel() == 1 else t[start:stop]


def _rows_of(t: torch.Tensor, index, start: int, stop: int) -> torch.Tensor:
    return t[start:stop] if index is None else t.index_select(0, index[start:stop])


def _linear_into(out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def _chunks(hidden, weight, bias, y, index, teacher: Teacher, options: LinearOptions):
    """Yield (start, stop, h_c, y_c, teacher_c, logits_c) over the computed rows; logits_c (and a
    computed teacher_c) reuse one buffer each."""
    computed = _computed_rows(hidden, index)
    size = min(options.chunk_rows, max(computed, 1))
    buffer = torch.empty(size, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    t_buffer = None
    if teacher.hidden is not None:
        t_buffer = torch.empty(size, weight.shape[0], dtype=teacher.hidden.dtype, device=hidden.device)
    for start in range(0, computed, size):
        stop = min(start + size, computed)
        h_c = _rows_of(hidden, index, start, stop)
        logits = _linear_into(buffer[: stop - start], h_c, weight, bias)
        t_c = None
        if teacher.logits is not None:
            t_c = _rows_of(teacher.logits, index, start, stop)
        elif teacher.hidden is not None:
            th_c = _rows_of(teacher.hidden, index, start, stop)
            t_c = _linear_into(t_buffer[: stop - start], th_c, teacher.weight, teacher.bias)
        yield start, stop, h_c, (None if y is None else y[start:stop]), t_c, logits


def _computed_rows(hidden: torch.Tensor, index: torch.Tensor | None) -> int:
    """How many rows the chunks cover: all of them, or the listed (non-ignored) ones."""
    return hidden.shape[0] if index is None else index.numel()


def _new_grads(hidden, weight, bias, wants, options: LinearOptions, index) -> _Grads:
    """Gradient buffers, uninitialised where a chunk overwrites them: the first chunk writes dW and
    db (no memset, no read), and dh rows are each written once unless ignored rows are skipped
    (then those stay 0). With no row to compute, dW and db are zeros."""
    want_h, want_w, want_b = wants
    fp32_w = options.fp32_weight_grad and weight.dtype != torch.float32
    alloc = torch.empty if _computed_rows(hidden, index) > 0 else torch.zeros
    return _Grads(
        dh=(torch.empty_like(hidden) if index is None else torch.zeros_like(hidden)) if want_h else None,
        dw=alloc(weight.shape, dtype=torch.float32 if fp32_w else weight.dtype, device=weight.device)
        if want_w else None,
        db=alloc(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b and bias is not None
        else None,
    )


def _accumulate(grads: _Grads, g, h_c, weight, index, start: int, stop: int, options: LinearOptions) -> None:
    """dh rows, dW and db contributions of one chunk's logits gradient ``g`` [C, V]."""
    if grads.dh is not None:
        if index is None:
            torch.mm(g, weight, out=grads.dh[start:stop])
        else:
            grads.dh.index_copy_(0, index[start:stop], torch.mm(g, weight))
    first = start == 0  # the first chunk overwrites dW and db
    if grads.dw is not None:
        dw = grads.dw
        beta = 0.0 if first else 1.0  # beta = 0: cuBLAS reads nothing from the uninitialised dw
        if dw.dtype == g.dtype:
            torch.addmm(dw, g.t(), h_c, beta=beta, out=dw)
        elif g.is_cuda:
            torch.addmm(dw, g.t(), h_c, beta=beta, out_dtype=torch.float32, out=dw)
        else:  # the CPU has no mixed-dtype addmm
            torch.addmm(dw, g.t().float(), h_c.float(), beta=beta, out=dw)
    if grads.db is not None:
        if first:
            torch.sum(g, dim=0, dtype=torch.float32, out=grads.db)
        else:
            grads.db += g.sum(dim=0, dtype=torch.float32)


def _finish_grads(grads: _Grads, weight, bias) -> None:
    if grads.dw is not None and grads.dw.dtype != weight.dtype:
        grads.dw = grads.dw.to(weight.dtype)
    if grads.db is not None:
        grads.db = grads.db.to(bias.dtype)


def _scatter_rows(stats: RowStats, index, rows: int) -> RowStats:
    """Per-row buffers over the computed rows -> over all rows (ignored rows: 0, pred -1)."""
    if index is None:
        return stats

    def spread(t: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device).index_copy_(0, index, t)

    return RowStats(
        *(spread(t, -1 if t is stats.pred or t is stats.t_pred else 0) for t in stats.fields())
    )
