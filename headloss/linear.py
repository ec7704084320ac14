"""The fused lm_head's chunk loop: hidden states x lm_head weight, chunk by chunk, without the full logits.

Per chunk of rows (headloss.chunks cuts them): one cuBLAS GEMM for the logits, the head kernel in place
on them, then ``dh_c = g_c @ W`` and ``dW += g_c.T @ h_c`` -- the three GEMMs of a plain lm_head
forward and backward. The call's route (headloss.routes) says how the rows are cut and what runs
between the chunks (:class:`headloss.routes.Chunks`):

* ``rows``            the fused kernel on each chunk (backward scales dh, dW, db by d loss); deferred
                      mode keeps the per-row values and :func:`linear_backward` recomputes each chunk's
                      logits (four GEMMs)
* ``sequences``       chunks of whole sequences: each chunk's sequence statistics give its d loss / d rows,
                      and its gradient pass runs in forward (three GEMMs)
* ``covariance``      the base objective fused; the covariance-selected rows corrected after
* ``entropy-guess``   fused under a top-entropy mask guessed chunk by chunk; the rows it got wrong
                      corrected once the batch quantile is known

(headloss.linear_policy holds the last three's pieces; headloss.linear_ops the torch.library ops.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .chunks import Grads, LinearRun, LmHead, accumulate, chunks_of, finish_grads, new_grads, rows_of, spread
from .engine import CallTensors, empty_outputs, no_rows, optional, shard_statistics, teacher_k
from .kernels.head import PolicyRows, launch_backward, launch_finish, launch_head, prepare
from .kernels.launch import Geometry
from .kernels.sparse import SparseRows, launch_check_teacher
from .linear_policy import cov_correction, entropy_mask_correction, guess_mask, sequence_chunk_grad
from .parallel import all_reduce_sum, handshake_verdict
from .plan import KernelPlan
from .routes import Chunks
from .validation import CheckContext, settle, verdict_slot


class LinearForward(NamedTuple):
    """What :func:`linear_forward` returns."""

    loss: torch.Tensor  # scalar, or token-shaped for reduction "none"
    rows: torch.Tensor  # [N, cols] per-row values of every row (ignored rows 0)
    rows_computed: torch.Tensor  # [computed, cols]: the rows of ``index`` (all rows when it is None)
    pred: torch.Tensor  # argmax per row (-1 at skipped rows), or empty
    means: torch.Tensor  # the metrics' column means
    scratch: torch.Tensor
    index: torch.Tensor | None  # the computed rows when ignored rows were skipped
    dh: torch.Tensor | None  # gradients computed in forward (fused and sequence chunks)
    dw: torch.Tensor | None
    db: torch.Tensor | None
    stats: torch.Tensor | None  # vocab-parallel deferred mode: each row's merged statistics, for backward


def chunk_geometry(rows: int, vocab: int, teacher: torch.Tensor | None, run: LinearRun) -> Geometry:
    shard = run.shard
    return Geometry(n_rows=rows, n_out=rows, V=vocab, T=rows, K=rows, shift=0, stride_b=0, stride_t=vocab,
                    g_stride_b=0, g_stride_t=vocab, t_stride_b=0,
                    t_stride_t=0 if teacher is None else teacher.stride(0), ignore_index=run.ignore_index,
                    norm=run.norm, vocab_start=0 if shard is None else shard.vocab_start,
                    V_total=0 if shard is None else shard.vocab_total)


def _compact_index(run: LinearRun, targets, scratch, rows: int, verdict):
    """The rows to compute when ignored rows are skipped: one host sync (nonzero's, for their count),
    after which the call's verdict is read in the call too (so validation costs nothing more). Never
    under CUDA-graph capture or torch.compile (row counts would be data-dependent)."""
    if not run.compact or targets is None or run.traced:
        return None
    if scratch.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    index = (targets != run.ignore_index).nonzero().squeeze(1)  # waits for the stream: prepare has run
    settle(verdict, "sync", scratch.device)
    return None if index.numel() == rows else index


def sparse_rows(tensors: CallTensors, index, start: int, stop: int) -> SparseRows | None:
    """The sparse teacher of the computed rows start:stop (``index``: the computed rows), or None."""
    sparse = tensors.sparse
    if sparse is None:
        return None
    return sparse._replace(ids=rows_of(sparse.ids, index, start, stop),
                           logprobs=rows_of(sparse.logprobs, index, start, stop))


def _pick_rows(policy: PolicyRows | None, index, start: int, stop: int) -> PolicyRows | None:
    if policy is None:
        return None
    return PolicyRows(*(rows_of(getattr(policy, name), index, start, stop) for name in ("old", "ref", "adv", "iw",
                                                                                         "weight")))


@dataclass
class _Loop:
    """The state of one forward chunk loop."""

    run: LinearRun
    index: torch.Tensor | None  # the computed rows (None: every row)
    targets: torch.Tensor | None  # of the computed rows
    scratch: torch.Tensor
    rows: torch.Tensor  # [computed, cols]
    pred: torch.Tensor
    loss: torch.Tensor
    means: torch.Tensor
    grads: Grads | None  # gradients computed in forward
    kept: list | None  # deferred + sharded: each chunk's merged statistics, for backward
    guess: torch.Tensor | None = None  # entropy-guess: the guessed top-entropy mask of the computed rows
    seen: torch.Tensor | None = None  # entropy-guess: the entropies of the rows seen so far (NaN: not counted)


def linear_forward(run: LinearRun, hidden, weight, bias, tensors: CallTensors, wants: tuple[bool, bool, bool]
                   ) -> LinearForward:
    """A chunked lm_head call's forward: each chunk's logits, its head kernel (and the gradient GEMMs
    where the gradient is computed in forward), then the finish and the route's corrections."""
    plan = run.plan
    rows, vocab = hidden.shape[0], weight.shape[0]
    whole = vocab if run.shard is None else run.shard.vocab_total  # targets are checked against all of V
    full = Geometry(n_rows=rows, n_out=rows, V=whole, T=rows, K=rows, shift=0, stride_b=0, stride_t=vocab,
                    g_stride_b=0, g_stride_t=vocab, t_stride_b=0, t_stride_t=0, ignore_index=run.ignore_index,
                    norm=run.norm)
    targets = tensors.targets
    sparse = tensors.sparse
    verdict = verdict_slot(run.validate, hidden.device, CheckContext(run.token_shape, whole, run.ignore_index,
                                                                     teacher_k(sparse)))
    scratch = prepare(targets, tensors.num_items, tensors.sequence_ids, full, hidden.device, verdict)
    if sparse is not None and verdict is not None and run.validate != "sync":  # ("sync": read on the host)
        launch_check_teacher(sparse, whole, verdict)
    if run.shard is not None and run.validate == "sync":
        handshake_verdict(run.shard, verdict, hidden.device)
    loop = _start_loop(run, hidden, weight, bias, tensors, scratch, verdict, wants)
    computed = loop.rows.shape[0]
    _run_chunks(loop, hidden, weight, bias, tensors)
    if computed == 0:
        no_rows(plan, loop.loss, loop.means)
    else:
        launch_finish(plan, rows=loop.rows, loss=loop.loss, means=loop.means, scratch=scratch,
                      num_items=tensors.num_items, geo=full._replace(n_out=computed))
    index = loop.index
    if run.chunks is Chunks.COVARIANCE and computed:  # after the finish, which writes the loss and the metrics
        cov_correction(run, LmHead(hidden, weight, bias, targets), spread(loop.rows, index, rows, 0.0), loop)
    if loop.guess is not None:  # with no row too: the quantile's collective (entropy_quantile_group) joins all
        entropy_mask_correction(run, LmHead(hidden, weight, bias, targets), spread(loop.rows, index, rows, 0.0),
                                spread(loop.guess, index, rows, 0.0), loop)
    settle(verdict, run.validate, hidden.device)
    dh, dw, db = finish_grads(loop.grads, weight, bias) if loop.grads is not None else (None, None, None)
    if run.shard is not None and run.reduce_hidden_grad and dh is not None:  # the column-parallel all-reduce
        dh = all_reduce_sum(dh, run.shard)
    loss = loop.loss
    if plan.reduction == "none" and index is not None:
        loss = torch.zeros(run.token_shape, dtype=loss.dtype, device=loss.device)
        loss.view(-1).index_copy_(0, index, loop.loss)
    pred = spread(loop.pred, index, rows, -1) if plan.flags.HAS_ARGMAX else loop.pred
    stats = torch.cat(loop.kept) if loop.kept else None
    return LinearForward(loss=loss, rows=spread(loop.rows, index, rows, 0.0), rows_computed=loop.rows, pred=pred,
                         means=loop.means, scratch=scratch, index=index, dh=dh, dw=dw, db=db, stats=stats)


def _start_loop(run: LinearRun, hidden, weight, bias, tensors: CallTensors, scratch, verdict, wants) -> _Loop:
    """The forward loop's buffers: the computed rows (ignored ones skipped when ``run.compact``), the
    per-row outputs, the gradients computed in forward, the entropy guess's state."""
    index = _compact_index(run, tensors.targets, scratch, hidden.shape[0], verdict)
    computed = hidden.shape[0] if index is None else index.numel()
    targets = tensors.targets
    y = targets if index is None or targets is None else targets.index_select(0, index)
    rows, pred, loss, means = empty_outputs(run.plan, computed, hidden.device,
                                            run.token_shape if index is None else (computed,))
    fused = run.grads_in_forward and any(wants)
    grads = new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed) if fused else None
    kept = [] if run.shard is not None and not fused else None
    loop = _Loop(run=run, index=index, targets=y, scratch=scratch, rows=rows, pred=pred, loss=loss, means=means,
                 grads=grads, kept=kept)
    if run.chunks is Chunks.ENTROPY_GUESS and tensors.adv is not None:  # also without gradient: it changes the loss
        loop.guess = torch.zeros(computed, dtype=torch.float32, device=hidden.device)
        loop.seen = torch.empty(computed, dtype=torch.float32, device=hidden.device)
    return loop


def _run_chunks(loop: _Loop, hidden, weight, bias, tensors: CallTensors) -> None:
    """Every chunk: its logits, the head kernel on each part (one, or a computed teacher's parts), the
    sequence chunks' gradient pass, the gradient GEMMs."""
    run, plan = loop.run, loop.run.plan
    fused = loop.grads is not None
    by_sequence = fused and run.chunks is Chunks.SEQUENCES  # the gradient pass after the sequence statistics
    policy = tensors.policy_rows()
    computed = loop.rows.shape[0]
    for start, stop, h_c, parts, logits in chunks_of(hidden, weight, bias, loop.index, tensors.teacher, computed,
                                                     run.chunk_rows, run.teacher_rows):
        for a, b, t_c in parts:
            lo, hi, part = start + a, start + b, logits[a:b]
            geo = chunk_geometry(hi - lo, weight.shape[0], t_c, run)
            y_c = None if loop.targets is None else loop.targets[lo:hi]
            stats = jsd = None
            sparse = sparse_rows(tensors, loop.index, lo, hi)
            if run.shard is not None:  # this chunk's statistics over every shard: one all_gather
                stats, jsd = shard_statistics(plan, part, y_c, t_c, geo, run.shard, sparse)
                if loop.kept is not None:
                    loop.kept.append(stats)
            chunk_policy = _pick_rows(policy, loop.index, lo, hi)
            if loop.guess is not None:
                chunk_policy = guess_mask(run, part, y_c, geo, chunk_policy, guess=loop.guess, seen=loop.seen,
                                          start=lo, stop=hi)
            launch_head(
                plan, logits=part, targets=y_c, teacher=t_c, grad=part if fused and not by_sequence else None,
                rows=loop.rows[lo:hi], pred=optional(loop.pred[lo:hi]), policy=chunk_policy,
                num_items=tensors.num_items, scratch=loop.scratch,
                loss=loop.loss.view(-1)[lo:hi] if plan.reduction == "none" else loop.loss, means=loop.means,
                geo=geo, finish=False, stats=stats, jsd=jsd, sparse=sparse,
            )
            if by_sequence:
                sequence_chunk_grad(run, part, y_c, t_c, rows=loop.rows[lo:hi], num_items=tensors.num_items,
                                    scratch=loop.scratch, geo=geo, start=lo, stop=hi, sparse=sparse)
        if fused:
            accumulate(loop.grads, logits, h_c, weight, loop.index, start, stop)


def chunk_head_(plan: KernelPlan, logits: torch.Tensor, targets: torch.Tensor | None) -> None:
    """The fused lm_head's per-chunk kernel on its own: the spec's kernel in place on one [C, V]
    chunk of logits, whose gradient overwrites it (benchmarks/profile_linear.py times it)."""
    run = LinearRun(plan, logits.shape[0], False, False, "off", (logits.shape[0],), plan.spec.ignore_index, 0.0)
    geo = chunk_geometry(logits.shape[0], logits.shape[1], None, run)
    scratch = prepare(targets, None, None, geo, logits.device, None)
    rows, pred, loss, means = empty_outputs(plan, logits.shape[0], logits.device, (logits.shape[0],))
    launch_head(plan, logits=logits, targets=targets, teacher=None, grad=logits, rows=rows, pred=optional(pred),
                policy=None, num_items=None, scratch=scratch, loss=loss, means=means, geo=geo)


class Saved(NamedTuple):
    """What deferred mode's backward reads of the forward: the computed rows and their statistics."""

    index: torch.Tensor | None
    rows: torch.Tensor  # [computed, cols]
    scratch: torch.Tensor
    stats: torch.Tensor | None  # vocab-parallel: each row's merged statistics


def linear_backward(run: LinearRun, wants, hidden, weight, bias, tensors: CallTensors, saved: Saved, d_loss, d_rows):
    """Deferred mode: recompute each chunk's logits, one gradient pass, the gradient GEMMs (4 GEMMs in all)."""
    plan = run.plan
    vocab = weight.shape[0]
    index = saved.index

    def compact(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.numel() == 1:
            return t
        t = t.float()
        return (t if index is None else t.index_select(0, index)).contiguous()

    if d_loss is not None:
        d_loss = compact(d_loss.reshape(-1) if plan.reduction == "none" else d_loss.reshape(1).float())
    d_rows = compact(d_rows)
    computed = hidden.shape[0] if index is None else index.numel()
    targets = tensors.targets
    y = targets if index is None or targets is None else targets.index_select(0, index)
    grads = new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed)
    for start, stop, h_c, parts, logits in chunks_of(hidden, weight, bias, index, tensors.teacher, computed,
                                                     run.chunk_rows, run.teacher_rows):
        for a, b, t_c in parts:
            lo, hi = start + a, start + b
            launch_backward(
                plan, logits=logits[a:b], targets=None if y is None else y[lo:hi], teacher=t_c, grad=logits[a:b],
                rows=saved.rows[lo:hi], d_loss=d_loss[lo:hi] if plan.reduction == "none" and d_loss is not None
                else d_loss,
                d_rows=None if d_rows is None else d_rows[lo:hi], num_items=tensors.num_items, scratch=saved.scratch,
                geo=chunk_geometry(hi - lo, vocab, t_c, run),
                stats=None if saved.stats is None else saved.stats[lo:hi], sparse=sparse_rows(tensors, index, lo, hi),
            )
        accumulate(grads, logits, h_c, weight, index, start, stop)
    dh, dw, db = finish_grads(grads, weight, bias)
    if run.shard is not None and run.reduce_hidden_grad and dh is not None:  # the column-parallel all-reduce
        dh = all_reduce_sum(dh, run.shard)
    return dh, dw, db
