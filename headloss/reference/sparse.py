"""The distillation term from a sparse teacher, in plain torch (spec.Distillation's conventions).

``x`` are the transformed logits [rows, V], ``lse`` their logsumexp; a top-k teacher gives ``ids``
[rows, K] and ``logprobs`` [rows, K] (an entry with id -1 or log-prob -inf is no entry, TRL's ``valid``
mask); a per-token teacher ``logprobs`` [rows] at the targets. Values follow 0 log 0 = 0; an id outside
[0, V) (validation off) gives NaN in its row. ``rest`` is TRL's tail bucket: each side's tail
1 - sum_k is at least REST_FLOOR (TRL clamps the log top-k mass at -1e-7), a clamped tail is a constant,
and the student's tail is the mass of the other columns (no 1 - sum p_k).
"""

from __future__ import annotations

import math

import torch

from ..spec import Distillation

REST_FLOOR = -math.expm1(-1e-7)
"""The least tail of ``topk: rest`` (TRL's ``_add_tail_bucket`` clamps log sum_k p_k at -1e-7)."""


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
    lp = logprobs.to(x.dtype)
    given = (ids != -1) & (lp != float("-inf"))
    in_range = given & (ids >= 0) & (ids < vocab)
    xk = x.gather(-1, torch.where(in_range, ids, 0))
    xk = torch.where(given & ~in_range, float("nan"), xk)
    lq = torch.where(given, lp, 0.0)
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
    if d.topk == "renormalized":
        lse_k = torch.logsumexp(torch.where(given, xk, float("-inf")), dim=-1)
        lse_q = torch.logsumexp(torch.where(given, lq, float("-inf")), dim=-1)
        lse_k, lse_q = (torch.where(t > float("-inf"), t, 0.0) for t in (lse_k, lse_q))
        return _divergence(xk - lse_k[:, None], lq - lse_q[:, None], given, d), metrics
    # the ids plus one outcome for the rest of the vocabulary: the student's, the mass of the other columns
    off = torch.ones(x.shape[0], vocab + 1, dtype=torch.bool, device=x.device)
    off.scatter_(-1, torch.where(in_range, ids, vocab), False)
    log_p_rest = torch.logsumexp(torch.where(off[:, :vocab], x, float("-inf")), dim=-1) - lse
    q_rest = 1.0 - torch.where(given, lq.double().exp(), 0.0).sum(-1)
    floor = math.log(REST_FLOOR)
    ls = torch.cat([lps, log_p_rest.clamp_min(floor)[:, None]], dim=-1)
    lt = torch.cat([lq, torch.log(q_rest.clamp_min(REST_FLOOR)).to(x.dtype)[:, None]], dim=-1)
    keep = torch.cat([given, torch.ones_like(given[:, :1])], dim=-1)
    return _divergence(ls, lt, keep, d), metrics
