"""The lm_head routes' chunk loops beyond plain rows (chunks.ChunkLoop), with their policy pieces between
and after the chunks (:data:`LOOPS` names every loop):

* ``lm_head:sequences+...``  :class:`SequenceLoop`, :func:`sequence_chunk_grad`: a chunk of whole
                             sequences' d loss / d rows (its sequence statistics need nothing outside
                             the chunk), then its gradient pass in forward
* ``lm_head:covariance``     :class:`CovarianceLoop`, :func:`cov_correction`: the base objective ran
                             fused; the few covariance-selected rows change after
* ``lm_head:entropy-guess``  :class:`EntropyGuessLoop`: :func:`guess_mask` per chunk,
                             :func:`entropy_mask_correction` once the batch quantile is known

A correction recomputes the changed rows' logits by one GEMM over those rows only and carries the
change through log_softmax (and the logit transform) to dh, dW and db.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from . import ops
from .chunks import ROWS, ChunkCut, ChunkLoop, LinearRun, LmHead, budget_rows, linear_into, spread
from .dw_gemm import add_dw
from .head import Block
from .kernels.head import PolicyRows, launch_backward
from .kernels.shard import launch_shard_stats
from .layouts import STATS
from .objective import objective_launch
from .policy.masks import high_entropy_mask, high_entropy_metrics, masked_quantile
from .policy.objectives import clip_cov_chosen, kl_cov_chosen, policy_objective, token_objective
from .transform import transformed_logits


def sequence_chunk_grad(loop, block: Block, start: int, stop: int) -> None:
    """Sequence-chunked fused mode, one chunk of whole sequences (``block``, the rows start:stop of the
    forward ``loop``): d loss / d logp (and d entropy) per row of the chunk's policy objective (its
    sequence statistics need nothing outside the chunk) -- one launch of the objective kernel (route
    lm_head:sequences+kernels), else autograd over the torch ops -- then the deferred gradient pass over
    the chunk's logits, in place. Three GEMMs per chunk, as in fused mode; deferred mode recomputes the
    logits (four)."""
    run = loop.run
    plan, pol = run.plan, run.policy
    logits, rows = block.logits, loop.out.rows[start:stop]
    cols = plan.cols
    part = lambda t: None if t is None else t[start:stop]  # noqa: E731
    n_seq = (stop - start) // run.seq_len
    inp = replace(pol, advantages=pol.advantages[start:stop], old_logprobs=part(pol.old_logprobs),
                  ref_logprobs=part(pol.ref_logprobs), importance_weights=part(pol.importance_weights), seq=None,
                  n_slots=n_seq, n_seq=n_seq, mask=pol.mask[start:stop], weight=pol.weight[start:stop],
                  kl_entropy_weight=part(pol.kl_entropy_weight), token_weights=part(pol.token_weights),
                  rollout_logprobs=part(pol.rollout_logprobs), sequence_ids=None,
                  seq_advantages=None if pol.seq_advantages is None else
                  pol.seq_advantages[start // run.seq_len:stop // run.seq_len])
    policy = plan.spec.policy
    if run.loop.by_kernel:
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
    launch_backward(plan, logits=logits, targets=block.targets, teacher=block.teacher, grad=logits, rows=rows,
                    d_loss=torch.ones(1, dtype=torch.float32, device=logits.device), d_rows=d_rows,
                    num_items=loop.call.tensors.num_items, scratch=loop.call.scratch, geo=block.geo,
                    sparse=block.sparse, temperature=block.temperature, weights=block.weights, selected=block.selected)


def cov_correction(run: LinearRun, head: LmHead, rows, acc) -> dict[str, torch.Tensor]:
    """clip_cov / kl_cov on the lm_head: the chunks ran the base objective fused (three GEMMs); the
    few selected tokens (cov_ratio of them, verl's 2e-4 by default) then change: kl_cov adds
    coef |log r| to theirs, clip_cov drops the base objective's (:func:`correct_rows`). The metrics
    the base does not have are returned. ``rows``: every row's values (skipped rows hold 0); ``acc``: the
    forward's gradients and outputs (headloss.linear's loop)."""
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
        metrics = {"ppo_kl": ((log_ratio.abs() * mask).sum() / count).float()}
    else:
        chosen = clip_cov_chosen(adv, logp, old, valid, policy)
        d_base, base = _objective_slope(logp, old, adv, scale, plan.spec.policy)  # the base objective
        d_logp, added = -d_base, -base
        metrics = {"pg_clipfrac": ((chosen.to(mask.dtype) * mask).sum() / count).float()}
    # (clip_cov's draw already made a host read)
    correct_rows(run, head, chosen, torch.where(chosen, d_logp, 0.0), torch.where(chosen, added, 0.0).sum(), acc)
    return metrics


def _objective_slope(logp, old, adv, scale, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """(d / d logp, value) per token of the row-local objective ``policy`` times ``scale``."""
    with torch.enable_grad():
        x = logp.clone().requires_grad_()
        value = token_objective(x, old, adv, policy).loss * scale
        (slope,) = torch.autograd.grad(value.sum(), x)
    return slope, value.detach()


def correct_rows(run: LinearRun, head: LmHead, chosen, d_logp, added, acc) -> None:
    """Change the loss (and the 'loss' metric) by ``added`` and the gradient of the ``chosen`` rows by
    ``d_logp`` (per row, d loss / d logp): their logits recomputed by a GEMM over those rows only,
    the change carried through log_softmax (and the logit transform) to dh, dW and db. One host read
    (the number of chosen rows)."""
    plan, grads = run.plan, acc.grads
    hidden, weight, bias, targets = head
    acc.out.loss.add_(added)
    acc.out.means[plan.cols.N] += added  # the 'loss' metric
    if grads is None:
        return
    picked = torch.nonzero(chosen).squeeze(1)
    if picked.numel() == 0:
        return
    h = hidden.index_select(0, picked)
    with torch.no_grad():
        logits = linear_into(torch.empty(picked.numel(), weight.shape[0], dtype=hidden.dtype, device=hidden.device),
                              h, weight, bias)
    with torch.enable_grad():
        z = logits.float().requires_grad_()
        temperature = acc.call.tensors.temperature
        lp = torch.log_softmax(transformed_logits(z, plan.spec, torch.float32, None if temperature is None
                                                  else temperature.index_select(0, picked)), -1)
        lp = lp.gather(1, targets.index_select(0, picked)[:, None])[:, 0]
        (g,) = torch.autograd.grad((d_logp.index_select(0, picked) * lp).sum(), z)
    g = g.to(hidden.dtype)
    if grads.dh is not None:
        grads.dh.index_add_(0, picked, torch.mm(g, weight))
    if grads.dw is not None:  # in place: no V x H temporary
        add_dw(grads.dw, g, h)
    if grads.db is not None:
        grads.db += g.sum(dim=0, dtype=torch.float32)


def guess_mask(loop, block: Block, start: int, stop: int) -> PolicyRows:
    """The top-entropy mask on the lm_head, before its batch quantile is known: this chunk's
    entropies (one statistics pass over ``block``'s logits, the rows start:stop, no gradient) against the
    quantile of the rows seen so far. The guess multiplies the objective as importance weights do; the
    rows it gets wrong are corrected at the end (:func:`entropy_mask_correction`): a few percent of the
    rows, where deferred mode would recompute every chunk's logits. ``loop.seen`` holds the entropies of
    the counted rows so far (NaN elsewhere), ``loop.guess`` the guessed mask."""
    run, y_c, chunk, guess, seen = loop.run, block.targets, block.policy, loop.guess, loop.seen
    part = launch_shard_stats(run.plan, logits=block.logits, targets=y_c, geo=block.geo,
                              temperature=block.temperature, selected=block.selected)
    valid = y_c != run.ignore_index
    d = part[:, STATS.d].clamp(min=1e-30)
    # base-2 statistics (m2, sum 2^(x2 - m2), sum 2^(x2 - m2) x2) -> the entropy in nats
    entropy = torch.where(valid, math.log(2.0) * (part[:, STATS.m2] + torch.log2(d) - part[:, STATS.sum_ex2] / d),
                          math.nan)
    seen[start:stop] = entropy
    keep = (entropy >= _guess_threshold(seen[:stop], run.objective.top_entropy_quantile)) & valid
    guess[start:stop] = keep
    gate = keep.float() if chunk.iw is None else chunk.iw.float() * keep
    return chunk._replace(iw=gate)


def _guess_threshold(seen: torch.Tensor, quantile: float) -> torch.Tensor:
    """The guessed top-entropy threshold: the quantile of the entropies seen so far (NaN: not counted)."""
    return masked_quantile(seen, ~seen.isnan(), 1.0 - quantile)


def entropy_mask_correction(run: LinearRun, head: LmHead, rows, guess, acc) -> dict[str, torch.Tensor]:
    """The top-entropy mask on the lm_head: the chunks ran the objective fused with a guessed mask
    (:func:`guess_mask`); the batch quantile of the entropies (over ``entropy_quantile_group``
    when given) now gives the true mask, and the rows whose guess was wrong gain or lose their
    objective (:func:`correct_rows`). The KL and a loss-aggregated entropy bonus never depend on
    the mask. Returns the mask's metrics. ``rows`` and
    ``guess`` hold every row (skipped rows 0); ``acc`` as :func:`cov_correction`'s."""
    plan, pol, policy = run.plan, run.policy, run.objective
    logp = rows[:, plan.cols.logp].detach()
    entropy = rows[:, plan.cols.entropy].detach()
    mask = pol.mask
    high = high_entropy_mask(entropy, mask, policy.top_entropy_quantile, pol.quantile_group)
    delta = high.to(guess.dtype) - guess
    old = pol.old_logprobs if pol.old_logprobs is not None else logp
    scale = pol.weight * (pol.importance_weights if pol.importance_weights is not None else 1.0)
    d_base, base = _objective_slope(logp, old, pol.advantages, scale, plan.spec.policy)  # the unmasked one
    correct_rows(run, head, delta != 0, delta * d_base, (delta * base).sum(), acc)
    return high_entropy_metrics(entropy, high, mask)


# --- the chunk loops ----------------------------------------------------------------------------------


class SequenceLoop(ChunkLoop):
    """Chunks of whole sequences: each chunk's sequence statistics give its d loss / d rows (``by_kernel``:
    one launch of the objective kernel, else autograd over the torch ops), and its gradient pass runs in
    forward (:func:`sequence_chunk_grad`): three GEMMs."""

    compacts = False
    kernel_writes_grad = False  # the gradient pass after the chunk's sequence statistics
    takes_policy = True

    def __init__(self, by_kernel: bool):
        self.by_kernel = by_kernel
        self.name = "sequences+kernels" if by_kernel else "sequences+torch"

    def grads_in_forward(self, plan) -> bool:
        return True

    def cut(self, chunk_bytes: int, width: int, elem_bytes: int, computed_teacher: bool, seq_len: int,
            sharded: bool) -> ChunkCut:
        rows = budget_rows(chunk_bytes, width, elem_bytes, computed_teacher)
        return ChunkCut(max(seq_len, rows // seq_len * seq_len), 0, seq_len)  # whole sequences, contiguous

    def after_part(self, loop, block, start: int, stop: int) -> None:
        if loop.grads is not None:  # (a gradient wanted)
            sequence_chunk_grad(loop, block, start, stop)


class _CorrectingLoop(ChunkLoop):
    """Row chunks that run the base objective fused, then correct a few rows (one host read)."""

    takes_policy = True
    corrects = True

    def cut(self, chunk_bytes: int, width: int, elem_bytes: int, computed_teacher: bool, seq_len: int,
            sharded: bool) -> ChunkCut:
        return ChunkCut(budget_rows(chunk_bytes, width, elem_bytes, computed_teacher))

    @staticmethod
    def write_metrics(loop, metrics: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        """The loop's metrics into the room after the plan's means (read back by :meth:`ChunkLoop.metrics`)."""
        tail = loop.out.means[loop.run.plan.means_size:]
        for i, name in enumerate(names):
            tail[i] = metrics[name]


class CovarianceLoop(_CorrectingLoop):
    """clip_cov / kl_cov: the base objective fused, then the covariance-selected rows corrected
    (:func:`cov_correction`)."""

    name = "covariance"

    def metric_names(self, policy) -> tuple[str, ...]:
        return ("ppo_kl",) if policy.objective == "kl_cov" else ("pg_clipfrac",)

    def after_finish(self, loop, head: LmHead, rows: torch.Tensor) -> None:
        if loop.out.rows.shape[0]:
            metrics = cov_correction(loop.run, head, rows, loop)
            self.write_metrics(loop, metrics, self.metric_names(loop.run.objective))


class EntropyGuessLoop(_CorrectingLoop):
    """A row-local objective under the top-entropy mask: fused under a mask guessed chunk by chunk
    (:func:`guess_mask`), the rows guessed wrong corrected once the batch quantile is known
    (:func:`entropy_mask_correction`)."""

    name = "entropy-guess"

    def metric_names(self, policy) -> tuple[str, ...]:
        return ("high_entropy/fraction", "high_entropy/entropy")

    def start(self, loop, computed: int, device) -> None:
        if loop.call.tensors.adv is not None:  # (without gradient too: the guess changes the loss)
            loop.guess = torch.zeros(computed, dtype=torch.float32, device=device)
            loop.seen = torch.empty(computed, dtype=torch.float32, device=device)

    def part_policy(self, loop, block, start: int, stop: int):
        if loop.guess is None:
            return block.policy
        return guess_mask(loop, block, start, stop)

    def after_finish(self, loop, head: LmHead, rows: torch.Tensor) -> None:
        if loop.guess is None:  # with no row too: the quantile's collective (entropy_quantile_group) joins all
            return
        guess = spread(loop.guess, loop.index, rows.shape[0], 0.0)
        metrics = entropy_mask_correction(loop.run, head, rows, guess, loop)
        self.write_metrics(loop, metrics, self.metric_names(loop.run.objective))


LOOPS: dict[str, ChunkLoop] = {loop.name: loop for loop in (
    ROWS, SequenceLoop(by_kernel=True), SequenceLoop(by_kernel=False), CovarianceLoop(), EntropyGuessLoop())}
"""Every chunk loop by name (the routes' table; the ops carry a loop by its name)."""
