"""The distillation term from a sparse teacher, in plain torch (spec.Distillation's conventions).

``x`` are the transformed logits [rows, V], ``lse`` their logsumexp; a top-k teacher gives ``ids``
[rows, K] (-1: no entry) and ``logprobs`` [rows, K]; a per-token teacher ``logprobs`` [rows] at the
targets. Values follow 0 log 0 = 0; an id outside [0, V) (validation off) gives NaN in its row.
"""

from __future__ import annotations

import math

import torch

from ..spec import Distillation


def estimator(logp: torch.Tensor, lq: torch.Tensor, d: Distillation) -> torch.Tensor:
    """verl's kl_penalty of log p against the teacher's lq (k1, k2 'mse', abs, k3 'low_var_kl' with
    ``estimator_clamp``; ``estimator_grad='k2'``: the value with k2's gradient, verl's 'k3+')."""
    gap = logp - lq
    if d.estimator == "k1":
        value = gap
    elif d.estimator == "k2":
        value = 0.5 * gap * gap
    elif d.estimator == "abs":
        value = gap.abs()
    else:
        delta = lq - logp
        if d.estimator_clamp:
            delta = delta.clamp(-20.0, 20.0)
        value = delta.exp() - delta - 1.0
        if d.estimator_clamp:
            value = value.clamp(-10.0, 10.0)
    if d.estimator_grad == "k2" and d.estimator != "k2":
        k2 = 0.5 * gap * gap
        value = k2 - k2.detach() + value.detach()
    return value


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of p (log p - log q) where ``keep`` and p > 0."""
    on = keep & (log_p > float("-inf"))
    lp, lq = torch.where(on, log_p, 0.0), torch.where(on, log_q, 0.0)
    return torch.where(on, lp.exp() * (lp - lq), 0.0).sum(-1)


def _divergence(ls: torch.Tensor, lt: torch.Tensor, keep: torch.Tensor, d: Distillation) -> torch.Tensor:
    """The spec's divergence between outcomes with student log-probs ``ls`` and teacher ``lt``."""
    if d.kind == 0:
        return _kl(lt, ls, keep)
    if d.kind == 1:
        return _kl(ls, lt, keep)
    safe_s = torch.where(keep, ls, float("-inf"))
    safe_t = torch.where(keep, lt, float("-inf"))
    log_mix = torch.logaddexp(safe_s + math.log(1.0 - d.beta), safe_t + math.log(d.beta))
    log_mix = torch.where(log_mix > float("-inf"), log_mix, 0.0)
    return d.beta * _kl(lt, log_mix, keep) + (1.0 - d.beta) * _kl(ls, log_mix, keep)


def topk_distillation(x: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
                      d: Distillation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-row divergence from a top-k teacher, and its metrics (student / teacher mass on the ids,
    the student's argmax against the teacher's top id)."""
    vocab = x.shape[-1]
    ids = ids.long()
    given = ids != -1
    in_range = given & (ids >= 0) & (ids < vocab)
    xk = x.gather(-1, torch.where(in_range, ids, 0))
    xk = torch.where(given & ~in_range, float("nan"), xk)
    lq = torch.where(given, logprobs.to(x.dtype), 0.0)
    lps = xk - lse[:, None]
    with torch.no_grad():
        mass_s = torch.where(given, lps.exp(), 0.0).sum(-1)
        mass_t = torch.where(given, lq.exp(), 0.0).sum(-1)
        top = torch.where(given, lq, float("-inf")).argmax(-1, keepdim=True)
        agree = (given.any(-1) & (x.argmax(-1) == ids.gather(-1, top)[:, 0])).to(x.dtype)
    metrics = {"distill/student_mass": mass_s, "distill/teacher_mass": mass_t, "distill/top1_agreement": agree}
    if d.topk == "verl":
        if d.log_prob_min_clamp is not None:
            lps, lq = lps.clamp_min(d.log_prob_min_clamp), lq.clamp_min(d.log_prob_min_clamp)
        return _kl(lq, lps, given).clamp_min(0.0), metrics
    lse_k = torch.logsumexp(torch.where(given, xk, float("-inf")), dim=-1)
    if d.topk == "renormalized":
        lse_q = torch.logsumexp(torch.where(given, lq, float("-inf")), dim=-1)
        lse_k, lse_q = (torch.where(t > float("-inf"), t, 0.0) for t in (lse_k, lse_q))
        return _divergence(xk - lse_k[:, None], lq - lse_q[:, None], given, d), metrics
    # the ids plus one outcome for the rest of the vocabulary: student 1 - sum p_k = -expm1(lse_k - lse)
    p_rest = -torch.expm1(torch.clamp(lse_k - lse, max=0.0))
    q_rest = (1.0 - lq.exp().where(given, 0.0).sum(-1)).clamp_min(0.0)
    log_p_rest = torch.where(p_rest > 0, torch.log(torch.where(p_rest > 0, p_rest, 1.0)), float("-inf"))
    ls = torch.cat([lps, log_p_rest[:, None]], dim=-1)
    lt = torch.cat([lq, torch.log(q_rest)[:, None]], dim=-1)
    keep = torch.cat([given, torch.ones_like(given[:, :1])], dim=-1)
    return _divergence(ls, lt, keep, d), metrics
