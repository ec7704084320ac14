"""The fused lm_head: hidden states x lm_head weight, chunk by chunk, without the full logits.

Per chunk of rows: one cuBLAS GEMM for the logits, the head kernel in place on them, then
``dh_c = g_c @ W`` and ``dW += g_c.T @ h_c`` -- the three GEMMs of a plain lm_head forward and
backward. How the chunks are cut and what runs between them is the call's route (headloss.routes):

* ``lm_head:fused``            the fused kernel on each chunk; backward scales dh, dW, db by d loss
* ``lm_head:deferred``         forward keeps the per-row values; backward recomputes each chunk's
                               logits (four GEMMs)
* ``lm_head:sequences+...``    chunks of whole sequences: each chunk's sequence statistics give its
                               d loss / d rows, and its gradient pass runs in forward (three GEMMs)
* ``lm_head:covariance``       the base objective fused; the covariance-selected rows corrected after
* ``lm_head:entropy-guess``    fused under a top-entropy mask guessed chunk by chunk; the rows it got
                               wrong corrected once the batch quantile is known

Under torch.compile the chunks run inside :func:`linear_forward_op` / :func:`linear_backward_op`
(plain and sequence chunks, without compaction; vocab-parallel, each chunk's all_gather inside the
op); the corrected routes read a count on the host and take deferred mode there, as under CUDA-graph
capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import ops
from .engine import empty_outputs, no_rows, objective_launch, optional, shard_statistics, stats_width
from .kernels.head import PolicyRows, launch_backward, launch_finish, launch_head, prepare
from .kernels.launch import Geometry
from .kernels.layouts import SCRATCH, STATS
from .kernels.shard import launch_shard_stats
from .ops import (
    BESIDE_GRAPH,
    flat_geometry,
    hand_off,
    kernel_op,
    take_grad,
    token_fake,
)
from .output import guard_second_backward
from .parallel import VocabShard, all_reduce_sum, handshake_verdict
from .plan import KernelPlan, plan_from_key
from .policy.masks import high_entropy_mask, high_entropy_metrics, masked_quantile
from .policy.objectives import clip_cov_chosen, kl_cov_chosen, policy_objective, token_objective
from .policy.tokens import PolicyInputs, policy_as_lists, policy_from_lists
from .reference import transformed_logits
from .spec import Policy
from .validation import CheckContext, settle, verdict_slot


@dataclass(frozen=True)
class LinearRun:
    """Everything but tensors that a linear_head_loss call runs with."""

    plan: KernelPlan  # the variant the chunks run: the call's, or its base objective's (corrected routes)
    chunk_rows: int
    fp32_weight_grad: bool
    compact: bool  # skip ignored rows (one host sync for their count)
    validate: str
    token_shape: tuple[int, ...]
    ignore_index: int
    norm: float
    chunks: str = "rows"  # the route's: rows, sequences, covariance, entropy-guess
    traced: bool = False  # under torch.compile (the route's)
    shard: Any = None  # vocab-parallel: a headloss.parallel.VocabShard (the weight's rows)
    seq_len: int = 0  # sequences: rows per sequence (each chunk holds whole sequences)
    policy: PolicyInputs | None = None  # sequences and the corrected routes: the call's policy inputs
    objective: Policy | None = None  # the corrected routes: the spec's policy (``plan`` runs its base)
    d_rows_by_kernel: bool = False  # sequences: each chunk's d loss / d rows by the objective kernel
    reduce_hidden_grad: bool = True  # vocab-parallel: dh summed over the group (else this rank's share)
    teacher_rows: int = 0  # a computed teacher's logits in parts of this many rows of a chunk (0: whole chunks)

    @property
    def grads_in_forward(self) -> bool:
        """The gradient is computed in forward (fused, or sequence-chunked) and scaled in backward."""
        return _grads_in_forward(self.plan, self.chunks)


def _grads_in_forward(plan: KernelPlan, chunks: str) -> bool:
    return plan.mode == "fused" or chunks == "sequences"


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


def _chunks(hidden, weight, bias, index, teacher: _Teacher, computed: int, chunk_rows: int,
            teacher_rows: int = 0):
    """Yield (start, stop, h_c, parts, logits_c) over the computed rows; logits_c reuses one buffer.
    ``parts`` yields (a, b, teacher rows a:b of the chunk) -- the head kernel's launches over the chunk:
    one, or with a computed teacher one per ``teacher_rows`` rows of it (0: the chunk's), each part's
    teacher logits computed into one buffer of that many rows (:func:`_teacher_parts`)."""
    size = min(chunk_rows, max(computed, 1))
    buffer = torch.empty(size, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    t_buffer = None
    if teacher.hidden is not None:
        t_size = size if teacher_rows <= 0 else min(teacher_rows, size)
        t_buffer = torch.empty(t_size, weight.shape[0], dtype=teacher.hidden.dtype, device=hidden.device)
    for start in range(0, computed, size):
        stop = min(start + size, computed)
        h_c = _rows_of(hidden, index, start, stop)
        logits = _linear_into(buffer[: stop - start], h_c, weight, bias)
        yield start, stop, h_c, _teacher_parts(teacher, index, start, stop, t_buffer), logits


def _teacher_parts(teacher: _Teacher, index, start: int, stop: int, t_buffer: torch.Tensor | None):
    """(a, b, teacher logits of rows start + a : start + b or None) covering one chunk: given teacher
    logits (or none) in one part; a computed teacher in parts of ``t_buffer``'s rows, each computed into
    it. A teacher buffer smaller than the student's chunk keeps the chunk (the rows its gradient GEMMs
    take) large under the same memory: the weight-gradient GEMM re-reads and re-writes dW once per
    chunk (benchmarks/bench_compile.py --profile-distill)."""
    if teacher.hidden is None:
        yield 0, stop - start, _rows_of(teacher.logits, index, start, stop)
        return
    step = t_buffer.shape[0]
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        th = _rows_of(teacher.hidden, index, lo, hi)
        yield lo - start, hi - start, _linear_into(t_buffer[: hi - lo], th, teacher.weight, teacher.bias)


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
    if not run.compact or targets is None or run.traced:
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
    launch of the objective kernel (route lm_head:sequences+kernels), else autograd over the torch ops --
    then the deferred gradient pass over the chunk's logits, in place. Three GEMMs per chunk, as in
    fused mode; deferred mode recomputes the logits (four)."""
    plan, pol = run.plan, run.policy
    cols = plan.cols
    part = lambda t: None if t is None else t[start:stop]  # noqa: E731
    n_seq = (stop - start) // run.seq_len
    inp = replace(pol, advantages=pol.advantages[start:stop], old_logprobs=part(pol.old_logprobs),
                  ref_logprobs=part(pol.ref_logprobs), importance_weights=part(pol.importance_weights), seq=None,
                  n_slots=n_seq, n_seq=n_seq, mask=pol.mask[start:stop], weight=pol.weight[start:stop],
                  kl_entropy_weight=part(pol.kl_entropy_weight),
                  rollout_logprobs=part(pol.rollout_logprobs), sequence_ids=None,
                  seq_advantages=None if pol.seq_advantages is None else
                  pol.seq_advantages[start // run.seq_len:stop // run.seq_len])
    policy = plan.spec.policy
    if run.d_rows_by_kernel:
        _, _, d_rows = objective_launch(plan, rows, inp, metrics=False)
    else:
        with ops.autograd_inside():  # (inside the compiled graph's op too)
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
    plan, pol, policy = run.plan, run.policy, run.objective
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
    d = part[:, STATS.d].clamp(min=1e-30)
    # base-2 statistics (m2, sum 2^(x2 - m2), sum 2^(x2 - m2) x2) -> the entropy in nats
    entropy = torch.where(valid, LN2 * (part[:, STATS.m2] + torch.log2(d) - part[:, STATS.sum_ex2] / d), math.nan)
    seen[start:stop] = entropy
    keep = (entropy >= _guess_threshold(seen[:stop], run.objective.top_entropy_quantile)) & valid
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
    plan, pol, policy = run.plan, run.policy, run.objective
    logp = rows[:, plan.cols.logp].detach()
    entropy = rows[:, plan.cols.entropy].detach()
    mask = pol.mask
    high = high_entropy_mask(entropy, mask, policy.top_entropy_quantile, pol.quantile_group)
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
    return PolicyRows(*(_rows_of(getattr(policy, name), index, start, stop) for name in ("old", "ref", "adv", "iw",
                                                                                         "weight")))


def linear_forward(run: LinearRun, hidden, weight, bias, targets, teacher: _Teacher, policy: PolicyRows | None,
                   num_items, sequence_ids, wants: tuple[bool, bool, bool]):
    """(loss, rows, rows_computed, pred, means, scratch, index, dh, dw, db) of a chunked lm_head call."""
    plan = run.plan
    rows, vocab = hidden.shape[0], weight.shape[0]
    whole = vocab if run.shard is None else run.shard.vocab_total  # targets are checked against all of V
    full = Geometry(n_rows=rows, n_out=rows, V=whole, T=rows, K=rows, shift=0, stride_b=0, stride_t=vocab,
                    g_stride_b=0, g_stride_t=vocab, t_stride_b=0, t_stride_t=0, ignore_index=run.ignore_index,
                    norm=run.norm)
    verdict = verdict_slot(run.validate, hidden.device, CheckContext(run.token_shape, whole, run.ignore_index))
    scratch = prepare(targets, num_items, sequence_ids, full, hidden.device, verdict)
    if run.shard is not None and run.validate == "sync":
        handshake_verdict(run.shard, verdict, hidden.device)
    index = _compact_index(run, targets, scratch, rows, verdict)
    computed = rows if index is None else index.numel()
    y = targets if index is None or targets is None else targets.index_select(0, index)
    rows_c, pred_c, loss_c, means = empty_outputs(plan, computed, hidden.device,
                                                  run.token_shape if index is None else (computed,))
    fused = run.grads_in_forward and any(wants)
    by_sequence = fused and run.chunks == "sequences"  # the gradient pass after each chunk's sequence statistics
    grads = _new_grads(hidden, weight, bias, wants, run.fp32_weight_grad, index, computed) if fused else None
    kept = [] if run.shard is not None and not fused else None  # deferred + sharded: the backward's statistics
    gate = run.chunks == "entropy-guess" and policy is not None  # also without gradient: the mask changes the loss
    if gate:  # the guessed top-entropy mask, and the entropies of the rows seen so far
        guess = torch.zeros(computed, dtype=torch.float32, device=hidden.device)
        seen = torch.empty(computed, dtype=torch.float32, device=hidden.device)
    for start, stop, h_c, parts, logits in _chunks(hidden, weight, bias, index, teacher, computed, run.chunk_rows,
                                                   run.teacher_rows):
        for a, b, t_c in parts:  # one part, or the parts of a computed teacher (plain chunks of rows only)
            lo, hi, part = start + a, start + b, logits[a:b]
            geo = _chunk_geometry(hi - lo, vocab, t_c, run)
            y_c = None if y is None else y[lo:hi]
            stats = jsd = None
            if run.shard is not None:  # this chunk's statistics over every shard: one all_gather
                stats, jsd = shard_statistics(plan, part, y_c, t_c, geo, run.shard)
                if kept is not None:
                    kept.append(stats)
            chunk_policy = _pick_rows(policy, index, lo, hi)
            if gate:
                chunk_policy = _guess_mask(run, part, y_c, geo, chunk_policy, guess, seen, lo, hi)
            launch_head(
                plan, logits=part, targets=y_c, teacher=t_c,
                grad=part if fused and not by_sequence else None, rows=rows_c[lo:hi],
                pred=optional(pred_c[lo:hi]),
                policy=chunk_policy, num_items=num_items, scratch=scratch,
                loss=loss_c.view(-1)[lo:hi] if plan.reduction == "none" else loss_c, means=means,
                geo=geo, finish=False, stats=stats, jsd=jsd,
            )
            if by_sequence:
                _sequence_chunk_grad(run, part, y_c, t_c, rows_c[lo:hi], num_items, scratch, geo, lo, hi)
        if fused:
            _accumulate(grads, logits, h_c, weight, index, start, stop)
    if computed == 0:
        no_rows(plan, loss_c, means)
    else:
        launch_finish(plan, rows=rows_c, loss=loss_c, means=means, scratch=scratch, num_items=num_items,
                      geo=full._replace(n_out=computed))
        if run.chunks == "covariance":  # after the finish, which writes the loss and the metrics
            _cov_correction(run, hidden, weight, bias, targets, _spread(rows_c, index, rows, 0.0), grads, loss_c,
                            means)
    if gate:  # with no row too: the quantile's collective (entropy_quantile_group) joins every process's
        _entropy_mask_correction(run, hidden, weight, bias, targets, _spread(rows_c, index, rows, 0.0),
                                 _spread(guess, index, rows, 0.0), grads, loss_c, means)
    settle(verdict, run.validate, hidden.device)
    dh, dw, db = _finish_grads(grads, weight, bias) if grads is not None else (None, None, None)
    if run.shard is not None and run.reduce_hidden_grad and dh is not None:  # the column-parallel all-reduce
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
    rows, pred, loss, means = empty_outputs(plan, logits.shape[0], logits.device, (logits.shape[0],))
    launch_head(plan, logits=logits, targets=targets, teacher=None, grad=logits, rows=rows, pred=optional(pred),
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
    for start, stop, h_c, parts, logits in _chunks(hidden, weight, bias, index, teacher, computed, run.chunk_rows,
                                                   run.teacher_rows):
        for a, b, t_c in parts:
            lo, hi = start + a, start + b
            launch_backward(
                plan, logits=logits[a:b], targets=None if y is None else y[lo:hi], teacher=t_c, grad=logits[a:b],
                rows=rows_c[lo:hi], d_loss=d_loss[lo:hi] if plan.reduction == "none" and d_loss is not None
                else d_loss,
                d_rows=None if d_rows is None else d_rows[lo:hi], num_items=num_items, scratch=scratch,
                geo=_chunk_geometry(hi - lo, vocab, t_c, run), stats=None if stats is None else stats[lo:hi],
            )
        _accumulate(grads, logits, h_c, weight, index, start, stop)
    dh, dw, db = _finish_grads(grads, weight, bias)
    if run.shard is not None and run.reduce_hidden_grad and dh is not None:  # the column-parallel all-reduce
        dh = all_reduce_sum(dh, run.shard)
    return dh, dw, db


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
        if run.traced:  # no compaction (the route's): the op
            nbytes = sum(t.numel() * t.element_size() for t, want in zip((hidden, weight, bias), wants) if want)
            handoff = run.grads_in_forward and any(wants) and ops.hands_off(nbytes)
            op = linear_forward_beside_op if handoff else linear_forward_op
            loss, rows, pred, means, scratch, dh, dw, db, token, stats = op(
                hidden, weight, bias, targets, *teacher, *policy, num_items, sequence_ids, run.plan.key,
                [run.chunk_rows, run.teacher_rows, run.seq_len, run.d_rows_by_kernel], run.chunks,
                *policy_as_lists(run.policy), run.fp32_weight_grad, run.validate, list(run.token_shape),
                run.ignore_index, run.norm, list(wants), handoff, *shard_as_args(run),
            )
            rows_c, index = rows, None
            stats = stats if run.shard is not None and not run.grads_in_forward else None
            dh, dw, db = (g if want else None for g, want in zip((dh, dw, db), wants))
            if handoff:
                ctx.grad_like = [(list(t.shape), t.dtype) if t is not None else None for t in (hidden, weight, bias)]
                dh, dw, db = token, None, None  # the token holds them (see ops.hand_off)
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
            if ctx.handoff:
                token = ctx.saved_tensors[0]
                return (*(take_grad(token, d_loss.reshape(1), i, *like) if want else None
                          for i, (want, like) in enumerate(zip(ctx.wants, ctx.grad_like))), *nones)
            guard_second_backward(ctx)
            return (*(None if g is None else ops.scale(g, d_loss, flat_geometry(g)) for g in ctx.saved_tensors),
                    *nones)
        (hidden, weight, bias, targets, t_logits, t_hidden, t_weight, t_bias, index, rows_c, num_items, scratch,
         stats) = ctx.saved_tensors
        if run.traced:
            dh, dw, db = linear_backward_op(
                hidden, weight, bias, targets, t_logits, t_hidden, t_weight, t_bias, rows_c, num_items, scratch,
                d_loss, d_rows, stats, run.plan.key, [run.chunk_rows, run.teacher_rows, run.seq_len, 0],
                run.fp32_weight_grad, run.ignore_index, run.norm, *shard_as_args(run), list(ctx.wants),
            )
            dh, dw, db = (g if want else None for g, want in zip((dh, dw, db), ctx.wants))
        else:
            dh, dw, db = linear_backward(run, ctx.wants, _Teacher(t_logits, t_hidden, t_weight, t_bias), hidden, weight,
                                         bias, targets, index, rows_c, num_items, scratch, d_loss, d_rows, stats)
        return dh, dw, db, *nones


# --- the lm_head as torch.library ops (the torch.compile path: whole chunks, no compaction) ---------


def shard_as_args(run: LinearRun) -> tuple[str, list[int]]:
    """A vocab-parallel run's shard as op arguments: (its group's name, [vocab_start, vocab_total, world,
    comm_cpu, reduce_hidden_grad]); ("", []) on one device. The ops' collectives (each chunk's statistics'
    all_gather, the hidden gradient's all-reduce) run inside them, on the group of that name."""
    shard = run.shard
    if shard is None:
        return "", []
    return shard.group.group_name, [shard.vocab_start, shard.vocab_total, shard.world, int(shard.comm_cpu),
                                    int(run.reduce_hidden_grad)]


def _shard_of_args(group_name: str, layout: list[int]) -> tuple[Any, bool]:
    """(VocabShard or None, reduce_hidden_grad) of :func:`shard_as_args`'s arguments."""
    if not group_name:
        return None, True
    from torch.distributed.distributed_c10d import _resolve_process_group

    start, total, world, comm_cpu, reduce = layout
    return VocabShard(_resolve_process_group(group_name), start, total, world, bool(comm_cpu)), bool(reduce)


def _stats_shape(plan: KernelPlan, chunks: str, sharded: bool, wants, has_teacher: bool, rows: int
                 ) -> tuple[int, ...]:
    """The shape of linear_forward_op's last output: [rows, width] where linear_forward keeps each
    row's merged statistics for the backward (deferred mode, vocab-parallel), else empty."""
    kept = sharded and not (_grads_in_forward(plan, chunks) and any(wants))
    return (rows, stats_width(has_teacher)) if kept else (0,)


def _linear_forward_outputs(hidden, weight, bias, targets, teacher_logits, teacher_hidden, teacher_weight,
                            teacher_bias, old, ref, adv, iw, policy_weight, num_items, sequence_ids, key, layout,
                            chunks, policy_tensors, policy_values, fp32_weight_grad, validate, token_shape,
                            ignore_index, norm, wants, handoff, group_name, shard_layout):
    """linear_forward_op's outputs, unfilled: its fake."""
    plan = plan_from_key(key)
    rows, pred, loss, means = empty_outputs(plan, hidden.shape[0], hidden.device, tuple(token_shape))
    scratch = torch.empty(SCRATCH.N, dtype=torch.int64, device=hidden.device)
    fused = _grads_in_forward(plan, chunks) and not handoff
    dh, dw, db = (
        torch.empty(like.shape if fused and want else (0,), dtype=like.dtype, device=hidden.device)
        for like, want in zip((hidden, weight, bias if bias is not None else hidden.new_empty(0)), wants)
    )
    token = token_fake() if handoff else hidden.new_empty(0, dtype=torch.int64)
    stats = torch.empty(_stats_shape(plan, chunks, bool(group_name), wants,
                                     teacher_logits is not None or teacher_hidden is not None, hidden.shape[0]),
                        dtype=torch.float32, device=hidden.device)
    return loss, rows, pred, means, scratch, dh, dw, db, token, stats


def _linear_forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor | None,
    teacher_logits: torch.Tensor | None, teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None, old: torch.Tensor | None, ref: torch.Tensor | None, adv: torch.Tensor | None,
    iw: torch.Tensor | None, policy_weight: torch.Tensor | None, num_items: torch.Tensor | None,
    sequence_ids: torch.Tensor | None, key: str, layout: list[int], chunks: str,
    policy_tensors: list[torch.Tensor | None], policy_values: list[float], fp32_weight_grad: bool, validate: str,
    token_shape: list[int], ignore_index: int, norm: float, wants: list[bool], handoff: bool, group_name: str,
    shard_layout: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_forward as an op: fused mode's (or sequence chunks') (dh, dw, db), or with ``handoff``
    (only through ``linear_forward_beside``, the op tagged to run beside mode="reduce-overhead"'s
    graphs) empty ones and a token holding them (see ops.hand_off; otherwise the token is an empty
    tensor); last, deferred mode's merged statistics of a vocab-parallel call (else empty).
    ``layout``: LinearRun's chunk_rows, teacher_rows, seq_len and d_rows_by_kernel; ``chunks``: its
    chunks; the policy lists: its ``policy`` (policy.tokens.policy_as_lists); ``group_name`` and
    ``shard_layout``: its shard (:func:`shard_as_args`)."""
    shard, reduce_hidden_grad = _shard_of_args(group_name, shard_layout)
    run = LinearRun(plan_from_key(key), layout[0], fp32_weight_grad, False, validate, tuple(token_shape),
                    ignore_index, norm, chunks=chunks, traced=True, shard=shard, seq_len=layout[2],
                    policy=policy_from_lists(policy_tensors, policy_values), d_rows_by_kernel=bool(layout[3]),
                    reduce_hidden_grad=reduce_hidden_grad, teacher_rows=layout[1])
    policy = PolicyRows(old, ref, adv, iw, policy_weight) if adv is not None else None
    teacher = _Teacher(teacher_logits, teacher_hidden, teacher_weight, teacher_bias)
    loss, rows, _, pred, means, scratch, _, dh, dw, db, stats = linear_forward(
        run, hidden, weight, bias, targets, teacher, policy, num_items, sequence_ids, tuple(wants),
    )
    token = hidden.new_empty(0, dtype=torch.int64)
    if handoff:
        token = hand_off([None if g is None else (g, flat_geometry(g)) for g in (dh, dw, db)])
        dh = dw = db = None
    if stats is None:  # kept, with no row to compute; or not kept
        stats = torch.empty(_stats_shape(run.plan, chunks, shard is not None, wants, teacher.logits is not None or
                                         teacher.hidden is not None, hidden.shape[0]),
                            dtype=torch.float32, device=hidden.device)
    return (loss, rows, pred, means, scratch, *(g if g is not None else hidden.new_empty(0) for g in (dh, dw, db)),
            token, stats)


linear_forward_op = kernel_op("headloss::linear_forward", fake=_linear_forward_outputs)(_linear_forward_op)
linear_forward_beside_op = kernel_op("headloss::linear_forward_beside", fake=_linear_forward_outputs,
                                     tags=BESIDE_GRAPH)(_linear_forward_op)


def _linear_backward_outputs(hidden, weight, bias, *rest):
    """linear_backward_op's outputs, unfilled: its fake (``wants`` is the last argument)."""
    wants = rest[-1]
    likes = (hidden, weight, bias if bias is not None else hidden.new_empty(0))
    return tuple(torch.empty(like.shape if want else (0,), dtype=like.dtype, device=hidden.device)
                 for like, want in zip(likes, wants))


@kernel_op("headloss::linear_backward", fake=_linear_backward_outputs)
def linear_backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor | None,
    teacher_logits: torch.Tensor | None, teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
    teacher_bias: torch.Tensor | None, rows: torch.Tensor, num_items: torch.Tensor | None, scratch: torch.Tensor,
    d_loss: torch.Tensor | None, d_rows: torch.Tensor | None, stats: torch.Tensor | None, key: str,
    chunk_rows: list[int], fp32_weight_grad: bool, ignore_index: int, norm: float, group_name: str,
    shard_layout: list[int], wants: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deferred mode's (dh, dw, db) over whole chunks (empty where not wanted; ``chunk_rows``: ``layout``
    of linear_forward_op; vocab-parallel: ``stats``, the forward's merged statistics, and the shard as
    there)."""
    shard, reduce_hidden_grad = _shard_of_args(group_name, shard_layout)
    run = LinearRun(plan_from_key(key), chunk_rows[0], fp32_weight_grad, False, "off", (), ignore_index, norm,
                    traced=True, shard=shard, reduce_hidden_grad=reduce_hidden_grad, teacher_rows=chunk_rows[1])
    grads = linear_backward(run, tuple(wants), _Teacher(teacher_logits, teacher_hidden, teacher_weight, teacher_bias),
                            hidden, weight, bias, targets, None, rows, num_items, scratch, d_loss, d_rows,
                            stats if shard is not None else None)
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)
