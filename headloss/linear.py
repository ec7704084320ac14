"""The fused lm_head's chunk loop: hidden states x lm_head weight, chunk by chunk, without the full logits.

Per chunk of rows (headloss.chunks cuts them): one cuBLAS GEMM for the logits, the head kernel in place
on them, then ``dh_c = g_c @ W`` and ``dW += g_c.T @ h_c`` -- the three GEMMs of a plain lm_head
forward and backward. The call's route (headloss.routes) gives the chunk loop (chunks.ChunkLoop): how
the rows are cut and what runs between and after the chunks:

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
from .head import Block, CallTensors, HeadCall
from .kernels.head import PolicyRows, launch_backward
from .kernels.launch import Geometry
from .kernels.sparse import SparseRows
from .output import HeadOutputs
from .parallel import all_reduce_sum
from .plan import KernelPlan
from .validation import settle


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


def unscored_row(plan: KernelPlan, device) -> torch.Tensor | float:
    """What the packed row buffer holds at a row that is not scored: 0, and the student's top-k ids -1 (their
    int32 bits) where the plan has them."""
    k = plan.flags.STUDENT_TOPK
    if not k:
        return 0.0
    row = torch.zeros(plan.cols.N, dtype=torch.float32, device=device)
    row[plan.cols.topk_ids:plan.cols.topk_ids + k] = torch.tensor(-1, dtype=torch.int32).view(torch.float32)
    return row


COMPACT_MIN_SHARE = 1 / 64
"""Ignored rows are skipped where they are at least this share of the call's rows: below it computing them
costs less than gathering the others (each chunk's hidden rows, targets and per-row inputs, and scattering
dh back); a shifted batch's one unscored row per sequence stays in."""


def skips_ignored(rows: int, ignored: int) -> bool:
    """Whether a call of ``rows`` rows, ``ignored`` of them ignored, skips them (COMPACT_MIN_SHARE)."""
    return ignored >= rows * COMPACT_MIN_SHARE


def _compact_index(run: LinearRun, targets, scratch, rows: int, verdict):
    """The rows to compute when ignored rows are skipped (None: every row; see COMPACT_MIN_SHARE): the
    ScoredRows' where the call has them (headloss.scored: a wait for their count's copy only), else one
    host sync (nonzero's, for their count), after which the call's verdict is read in the call too (so
    validation costs nothing more). Never under CUDA-graph capture or torch.compile (row counts would be
    data-dependent)."""
    if not run.compact or targets is None or run.traced:
        return None
    if scratch.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if run.ahead is not None:
        index = run.ahead.index()
    else:
        index = (targets != run.ignore_index).nonzero().squeeze(1)  # waits for the stream: prepare has run
        settle(verdict, "sync", scratch.device)
    return index if index is not None and skips_ignored(rows, rows - index.numel()) else None


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
    call: HeadCall
    index: torch.Tensor | None  # the computed rows (None: every row)
    targets: torch.Tensor | None  # of the computed rows
    out: HeadOutputs  # of the computed rows
    grads: Grads | None  # gradients computed in forward
    kept: list | None  # deferred + sharded: each chunk's merged statistics, for backward
    guess: torch.Tensor | None = None  # entropy-guess: the guessed top-entropy mask of the computed rows
    seen: torch.Tensor | None = None  # entropy-guess: the entropies of the rows seen so far (NaN: not counted)


def linear_forward(run: LinearRun, hidden, weight, bias, tensors: CallTensors, wants: tuple[bool, bool, bool]
                   ) -> LinearForward:
    """A chunked lm_head call's forward: the head call opened (headloss.head), each chunk's logits and the
    head on them (and the gradient GEMMs where the gradient is computed in forward), then the finish
    and the route's corrections."""
    plan = run.plan
    rows, vocab = hidden.shape[0], weight.shape[0]
    whole = vocab if run.shard is None else run.shard.vocab_total  # targets are checked against all of V
    full = Geometry(n_rows=rows, n_out=rows, V=whole, T=rows, K=rows, shift=0, stride_b=0, stride_t=vocab,
                    g_stride_b=0, g_stride_t=vocab, t_stride_b=0, t_stride_t=0, ignore_index=run.ignore_index,
                    norm=run.norm)
    targets = tensors.targets
    call = HeadCall.open(run, tensors, full, hidden.device)
    loop = _start_loop(run, call, hidden, weight, bias, wants)
    _run_chunks(loop, hidden, weight, bias, tensors)
    call.finish(loop.out)
    index, out = loop.index, loop.out
    every_row = spread(out.rows, index, rows, unscored_row(plan, hidden.device))
    run.loop.after_finish(loop, LmHead(hidden, weight, bias, targets), every_row)  # (the route's corrections)
    call.close()
    # (dW computed here for a main_grad stays fp32 under fp32_weight_grad: backward adds it there times d loss)
    dh, dw, db = finish_grads(loop.grads, weight, bias, keep_fp32=run.main_grad is not None) \
        if loop.grads is not None else (None, None, None)
    if run.shard is not None and run.reduce_hidden_grad and dh is not None:  # the column-parallel all-reduce
        dh = all_reduce_sum(dh, run.shard)
    loss = out.loss
    if plan.reduction == "none" and index is not None:
        loss = torch.zeros(run.token_shape, dtype=loss.dtype, device=loss.device)
        loss.view(-1).index_copy_(0, index, out.loss)
    pred = spread(out.pred, index, rows, -1) if plan.flags.HAS_ARGMAX else out.pred
    stats = torch.cat(loop.kept) if loop.kept else None
    return LinearForward(loss=loss, rows=every_row, rows_computed=out.rows, pred=pred,
                         means=out.means, scratch=call.scratch, index=index, dh=dh, dw=dw, db=db, stats=stats)


def _start_loop(run: LinearRun, call: HeadCall, hidden, weight, bias, wants) -> _Loop:
    """The forward loop's buffers: the computed rows (ignored ones skipped when ``run.compact``), the
    per-row outputs, the gradients computed in forward, the entropy guess's state."""
    index = _compact_index(run, call.tensors.targets, call.scratch, hidden.shape[0], call.verdict)
    computed = hidden.shape[0] if index is None else index.numel()
    targets = call.tensors.targets
    y = targets if index is None or targets is None else targets.index_select(0, index)
    out = HeadOutputs.empty(run.plan, computed, hidden.device, run.token_shape if index is None else (computed,),
                            extra_means=len(run.loop.metric_names(run.objective)))
    fused = run.grads_in_forward and any(wants)
    grads = new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed) if fused else None
    kept = [] if run.shard is not None and not fused else None
    loop = _Loop(run=run, call=call, index=index, targets=y, out=out, grads=grads, kept=kept)
    run.loop.start(loop, computed, hidden.device)
    return loop


def _run_chunks(loop: _Loop, hidden, weight, bias, tensors: CallTensors) -> None:
    """Every chunk: its logits, the head on each part (one, or a computed teacher's parts), the sequence
    chunks' gradient pass, the gradient GEMMs."""
    run, call = loop.run, loop.call
    fused = loop.grads is not None
    policy = tensors.policy_rows()
    computed = loop.out.rows.shape[0]
    # a verdict from a chunk names the call's row (a teacher given as probabilities: its rows' mass)
    row_ids = None
    if run.plan.flags.TEACHER_PROBS and call.verdict is not None:
        row_ids = torch.arange(hidden.shape[0], device=hidden.device)
    for start, stop, h_c, parts, logits in chunks_of(hidden, weight, bias, loop.index, tensors.teacher, computed,
                                                     run.chunk_rows, run.teacher_rows):
        for a, b, t_c in parts:
            lo, hi, part = start + a, start + b, logits if a == 0 and b == logits.shape[0] else logits[a:b]
            block = Block(part, chunk_geometry(hi - lo, weight.shape[0], t_c, run),
                          None if loop.targets is None else loop.targets[lo:hi], t_c,
                          sparse_rows(tensors, loop.index, lo, hi), _pick_rows(policy, loop.index, lo, hi),
                          rows_of(tensors.temperature, loop.index, lo, hi), rows_of(row_ids, loop.index, lo, hi),
                          rows_of(tensors.weights, loop.index, lo, hi), rows_of(tensors.selected, loop.index, lo, hi))
            policy_c = run.loop.part_policy(loop, block, lo, hi)
            block = block if policy_c is block.policy else block._replace(policy=policy_c)
            stats = call.block(block, loop.out.of_rows(lo, hi),
                               grad=part if fused and run.loop.kernel_writes_grad else None)
            if loop.kept is not None and stats is not None:  # this chunk's merged statistics, for backward
                loop.kept.append(stats)
            run.loop.after_part(loop, block, lo, hi)
        if fused:
            accumulate(loop.grads, logits, h_c, weight, loop.index, start, stop)


def chunk_head_(plan: KernelPlan, logits: torch.Tensor, targets: torch.Tensor | None) -> None:
    """The fused lm_head's per-chunk kernel on its own: the spec's kernel in place on one [C, V]
    chunk of logits, whose gradient overwrites it, as the chunk loop runs it (the rows left unreduced,
    no validation; benchmarks/profile_linear.py times it)."""
    run = LinearRun(plan=plan, chunk_rows=logits.shape[0], fp32_weight_grad=False, compact=False, validate="off",
                    token_shape=(logits.shape[0],), ignore_index=plan.spec.ignore_index, norm=0.0)
    geo = chunk_geometry(logits.shape[0], logits.shape[1], None, run)
    call = HeadCall.open(run, CallTensors(targets), geo, logits.device)
    out = HeadOutputs.empty(plan, logits.shape[0], logits.device, (logits.shape[0],))
    call.block(Block(logits, geo, targets, None), out, grad=logits)


class Saved(NamedTuple):
    """What deferred mode's backward reads of the forward: the computed rows and their statistics."""

    index: torch.Tensor | None
    rows: torch.Tensor  # [computed, cols]
    scratch: torch.Tensor
    stats: torch.Tensor | None  # vocab-parallel: each row's merged statistics


def linear_backward(run: LinearRun, wants, head: LmHead, tensors: CallTensors, saved: Saved, d_loss, d_rows):
    """Deferred mode: recompute each chunk's logits, one gradient pass, the gradient GEMMs (4 GEMMs in all);
    ``head``: the hidden states, weight and bias (its targets unread: ``tensors``' are)."""
    hidden, weight, bias, _ = head
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
    grads = new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed,
                      main_grad=None if run.main_grad is None else run.main_grad[1])
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
                temperature=rows_of(tensors.temperature, index, lo, hi),
                weights=rows_of(tensors.weights, index, lo, hi), selected=rows_of(tensors.selected, index, lo, hi),
            )
        accumulate(grads, logits, h_c, weight, index, start, stop)
    dh, dw, db = finish_grads(grads, weight, bias)
    if run.shard is not None and run.reduce_hidden_grad and dh is not None:  # the column-parallel all-reduce
        dh = all_reduce_sum(dh, run.shard)
    return dh, dw, db
