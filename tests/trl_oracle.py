"""fp64 oracles of TRL 1.16's top-k distillation, transcribed from its own source (not from headloss.reference).

``trl/experimental/server_distillation/server_distillation_trainer.py``:

* ``_add_tail_bucket`` (lines 72-82): log S = logsumexp of the K log-probs, clamped at -1e-7 (``max``), and
  one more outcome log(-expm1(log S)) -- the tail, on the student's side and on the teacher's.
* ``_jsd_divergence`` with a support mask (lines 34-53): per outcome, beta 0 the forward KL q (lt - ls),
  beta 1 the reverse KL p (ls - lt), else beta KL(q || M) + (1 - beta) KL(p || M), M = (1 - beta) p + beta q
  (log M clamped at the dtype's tiny); masked outcomes give 0; ``nan_to_num`` of each product.
* ``_compute_server_forward_kl_loss`` (lines 503-540): ``valid = teacher_topk_logprobs > -inf``; the
  student's gathered log-softmax and the teacher's log-probs set to -inf off ``valid``; with
  ``loss_add_tail`` the tail bucket on both sides, else both renormalised by their logsumexp; the
  divergence summed over the outcomes per token. ``_reduce_divergence_loss`` (``batchmean``): the sum over
  the tokens whose label is not -100, divided by their count.

headloss's ``topk: rest`` is ``loss_add_tail=True``, ``renormalized`` is ``loss_add_tail=False``; an id of -1
is no entry as a -inf log-prob is; its divergences map to TRL's beta (forward_kl 0, reverse_kl 1, jsd beta).
"""

from __future__ import annotations

import math

import torch


def tail_bucket(log_probs: torch.Tensor) -> torch.Tensor:
    """``_add_tail_bucket``: the K log-probs and log(1 - their mass), the mass's log clamped at -1e-7."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True)
    log_sum = torch.clamp(log_sum, max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_sum))], dim=-1)


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, support: torch.Tensor) -> torch.Tensor:
    """``_jsd_divergence`` with a support mask: per outcome."""
    safe_s = torch.where(support, student, torch.zeros_like(student))
    safe_t = torch.where(support, teacher, torch.zeros_like(teacher))
    p = torch.where(support, student.exp(), torch.zeros_like(student))
    q = torch.where(support, teacher.exp(), torch.zeros_like(teacher))
    if beta == 0:
        return torch.nan_to_num(q * (safe_t - safe_s), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(p * (safe_s - safe_t), nan=0.0)
    tiny = torch.finfo(p.dtype).tiny
    mixture = (1 - beta) * p + beta * q
    safe_m = torch.where(support, torch.log(mixture.clamp_min(tiny)), torch.zeros_like(student))
    return beta * torch.nan_to_num(q * (safe_t - safe_m), nan=0.0) + \
        (1 - beta) * torch.nan_to_num(p * (safe_s - safe_m), nan=0.0)


def beta_of(divergence_name: str, beta: float = 0.5) -> float:
    """TRL's beta of a headloss divergence."""
    return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(divergence_name, beta)


def token_divergence(x: torch.Tensor, ids: torch.Tensor, lq: torch.Tensor, topk: str, beta: float) -> torch.Tensor:
    """Per-row divergence [N] of student logits x [N, V] (fp64, gradients flow) against a top-k teacher ids
    [N, K] (-1: no entry), lq [N, K], as ``_compute_server_forward_kl_loss`` computes it (``topk`` "rest":
    loss_add_tail, "renormalized": without)."""
    lq = lq.detach().double()
    valid = (ids >= 0) & (lq > float("-inf"))
    neg_inf = torch.full((), float("-inf"), dtype=torch.float64)
    student_log_probs = torch.log_softmax(x, dim=-1)
    student = torch.where(valid, student_log_probs.gather(-1, ids.long().clamp_min(0)), neg_inf)
    teacher = torch.where(valid, lq, neg_inf)
    if topk == "rest":
        student, teacher = tail_bucket(student), tail_bucket(teacher)
        support = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
        support = valid
    return divergence(student, teacher, beta, support).sum(-1)


def batchmean(values: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """``_reduce_divergence_loss(reduction="batchmean")``: the sum over counted tokens by their count."""
    if labels is None:
        return values.sum() / max(values.numel(), 1)
    mask = labels.reshape(-1) != -100
    return values[mask].sum() / mask.sum().clamp_min(1)


REST_FLOOR = -math.expm1(-1e-7)
"""The least tail: -expm1 of TRL's clamp."""
