"""The policy objectives in plain torch, each transcribed from its source (TRL 1.16's
``GRPOTrainer._compute_loss``, verl's ``core_algos.py`` ``compute_policy_loss_*``), on one call's padded
[B, T] inputs (:class:`Batch`): per token, the objective's value and what the metrics read
(:class:`PerToken`). headloss.reference.policy aggregates them as the trainers do.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..spec import Policy, PolicyObjective

VERL_CLAMPED = ("clip", "cispo", "sapo", "dppo_tv", "dppo_kl")
"""verl's compute_policy_loss_{vanilla,cispo,sapo,dppo_*} clamp ``log_prob - old_log_prob`` to +-20."""


@dataclass
class Batch:
    """One call's policy inputs, padded to [B, T] (0 at masked tokens)."""

    logp: torch.Tensor  # with gradient
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor  # 1.0 where a token counts
    iw: torch.Tensor | None  # importance weights (given, or the rollout correction's)
    seq_adv: torch.Tensor | None  # [B] as given, when one advantage per sequence
    policy: Policy


@dataclass
class PerToken:
    """What an objective gives per token ([B, T], or [B, 1] broadcast)."""

    loss: torch.Tensor
    ratio: torch.Tensor  # the importance ratio (TRL's coef_1)
    ppo_kl: torch.Tensor  # verl's ppo_kl per token: -log r (kl_cov: |log r|)
    low: torch.Tensor | None = None  # clipped low
    high: torch.Tensor | None = None  # clipped high
    dual: torch.Tensor | None = None  # verl's pg_clipfrac_lower indicator
    clipfrac: torch.Tensor | None = None  # verl's pg_clipfrac where it is not low | high
    extra: dict | None = None


def _masked_mean(x, mask, dim=None):
    return (x * mask).sum() / mask.sum().clamp(min=1.0) if dim is None else \
        (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def _log_ratio(b: Batch) -> torch.Tensor:
    """``log_prob - old_log_prob``, clamped to +-20 where verl's token-level objective clamps it
    (compute_policy_loss_gspo's ppo_kl reads it unclamped)."""
    negative_approx_kl = b.logp - b.old
    if b.policy.convention == "verl" and b.policy.objective in VERL_CLAMPED and b.policy.importance_sampling == "token":
        negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    return negative_approx_kl


def _ratio(b: Batch) -> torch.Tensor:
    """The importance ratio at the spec's level: per token; TRL's GSPO (``log_importance_weights =
    (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)``, [B, 1]); verl's gspo
    (``log_prob - log_prob.detach() + negative_approx_kl_seq.detach()``, clamped at 10)."""
    level = b.policy.importance_sampling
    if level == "token":
        return torch.exp(_log_ratio(b))
    seq_mean = _masked_mean(b.logp - b.old, b.mask, dim=-1)[:, None]
    if level == "sequence":
        return torch.exp(seq_mean).expand_as(b.logp)
    if level == "sequence_token":
        return torch.exp(torch.clamp(b.logp - b.logp.detach() + seq_mean.detach(), max=10.0))
    raise ValueError(f"policy.importance_sampling: {level!r} has no reference formula")


# --- objectives ----------------------------------------------------------------------------------------


def _clip(b: Batch) -> PerToken:
    """TRL: ``coef_2 = clamp(coef_1, 1 - eps_low, 1 + eps_high)``; ``coef_1 = clamp(coef_1, max=delta)``;
    ``-min(coef_1 A, coef_2 A)``; verl's dual clip: ``where(A < 0, min(-A c, loss), loss)``."""
    p = b.policy
    coef_1 = _ratio(b)
    coef_2 = torch.clamp(coef_1, 1 - p.eps_low, 1 + p.eps_high)
    capped = torch.clamp(coef_1, max=p.delta) if p.delta is not None else coef_1
    loss = -torch.min(capped * b.adv, coef_2 * b.adv)
    dual = None
    if p.dual_clip_c is not None:
        floor = -b.adv * p.dual_clip_c
        dual = (loss > floor) & (b.adv < 0)
        loss = torch.where(b.adv < 0, torch.min(floor, loss), loss)
    low = (coef_1 < 1 - p.eps_low) & (b.adv < 0)
    high = (capped > 1 + p.eps_high) & (b.adv > 0)  # TRL reassigns coef_1 = clamp(coef_1, max=delta) first
    return PerToken(loss, coef_1, -_log_ratio(b).detach(), low, high, dual)


def _cispo(b: Batch) -> PerToken:
    """TRL: ``-clamp(coef_1, max=epsilon_high).detach() A logp``; verl: ``-clamp(ratio, 1 - eps_low,
    1 + eps_high).detach() A logp``."""
    p = b.policy
    ratio = _ratio(b)
    if p.convention == "trl":
        loss = -torch.clamp(ratio, max=p.eps_high).detach() * b.adv * b.logp
        return PerToken(loss, ratio, -_log_ratio(b).detach(), high=(ratio > p.eps_high) & (b.adv > 0))
    clipped = torch.clamp(ratio, 1 - p.eps_low, 1 + p.eps_high)
    return PerToken(-clipped.detach() * b.adv * b.logp, ratio, -_log_ratio(b).detach(), low=ratio < 1 - p.eps_low,
                     high=ratio > 1 + p.eps_high)


def _sapo(b: Batch) -> PerToken:
    """``-sigmoid(tau (r - 1)) 4 / tau A``, tau by the sign of A."""
    p = b.policy
    ratio = _ratio(b)
    tau = torch.where(b.adv > 0, p.sapo_tau_pos, p.sapo_tau_neg)
    return PerToken(-torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * b.adv, ratio, -_log_ratio(b).detach())


def _gpg(b: Batch) -> PerToken:
    """verl: ``-log_prob * advantages``."""
    return PerToken(-b.logp * b.adv, torch.exp(_log_ratio(b)), -_log_ratio(b).detach())


def _dro(b: Batch) -> PerToken:
    """verl: ``-(log_prob * advantages - 0.5 * beta * log_ratio.square())``."""
    log_ratio = b.logp - b.old
    return PerToken(-(b.logp * b.adv - 0.5 * b.policy.dro_beta * log_ratio.square()), torch.exp(_log_ratio(b)),
                     -_log_ratio(b).detach())


def _dppo(divergence: str) -> Callable[[Batch], PerToken]:
    def dppo(b: Batch) -> PerToken:
        """verl: ``-A sg(clamp(ratio, max=clip_ratio_c)) logp`` on the tokens whose total variation
        (or binary KL) stays within eps_high (A > 0) / eps_low (A <= 0)."""
        p = b.policy
        ratio = torch.exp(_log_ratio(b))
        prob, old_prob = torch.exp(b.logp.detach()), torch.exp(b.old)
        if divergence == "tv":
            valid_pos = (prob - old_prob) <= p.eps_high
            valid_neg = (prob - old_prob) >= -p.eps_low
        else:  # verl's log((1 - old_p + 1e-8) / (1 - p + 1e-8)), written as a log1p
            binary_kl = old_prob * (b.old - b.logp.detach()) + (1 - old_prob) * torch.log1p(
                (prob - old_prob) / (1.0 - prob + 1e-8))
            valid_pos = (binary_kl <= p.eps_high) | (prob <= old_prob)
            valid_neg = (binary_kl <= p.eps_low) | (prob >= old_prob)
        valid = torch.where(b.adv > 0, valid_pos, valid_neg)
        truncated = torch.clamp(ratio, max=p.dppo_ratio_cap).detach()
        loss = -b.adv * truncated * b.logp * valid.to(b.logp.dtype)
        return PerToken(loss, ratio, -_log_ratio(b).detach(), low=~valid & (b.adv <= 0), high=~valid & (b.adv > 0),
                         dual=(ratio > p.dppo_ratio_cap) & valid)

    return dppo


def _reinforce(b: Batch) -> PerToken:
    """verl bypass mode, ``loss_type="reinforce"``, ``rollout_is="token"``: the weights of
    rollout_corr_helper (``exp(clamp(log_prob - old_log_prob, -20, 20))`` truncated at
    ``rollout_is_threshold``, no gradient) in compute_policy_loss_reinforce's ``-advantages * log_prob *
    rollout_is_weights``; its ppo_kl is the unclamped ``old_log_prob - log_prob``."""
    with torch.no_grad():
        weights = torch.exp(torch.clamp(b.logp - b.old, min=-20.0, max=20.0)) * b.mask
        weights = weights.clamp(max=b.policy.reinforce_is_max)
    log_ratio = b.logp - b.old
    return PerToken(-b.adv * b.logp * weights, torch.exp(log_ratio), -log_ratio.detach())


def _geo_mean(b: Batch) -> PerToken:
    """verl compute_policy_loss_geo_mean: ``-advantage * exp(sum(sign A min(sign A log r, sign A
    clamp(log r)) mask) / (mask_sum + 1e-8))`` per sequence, the rollout weights' geometric mean."""
    p = b.policy
    negative_approx_kl = b.logp - b.old
    sgn = torch.sign(b.adv)
    clamped = torch.clamp(negative_approx_kl, -p.eps_low, p.eps_high)
    chosen = sgn * torch.min(sgn * negative_approx_kl, sgn * clamped)
    mask_sum = b.mask.sum(dim=-1)
    ratio = torch.exp((chosen * b.mask).sum(dim=-1) / (mask_sum + 1e-8))
    advantage = (b.adv * b.mask).sum(dim=-1) / (mask_sum + 1e-8)
    loss = -advantage * ratio
    if b.iw is not None:
        loss = loss * torch.exp((torch.log(b.iw + 1e-10) * b.mask).sum(dim=-1) / (mask_sum + 1e-8))
    clipped = torch.ne(negative_approx_kl, clamped).detach()
    low, high = clipped & (b.adv < 0), clipped & (b.adv > 0)
    shape = b.logp.shape
    return PerToken(loss[:, None].expand(shape), ratio[:, None].expand(shape), -negative_approx_kl.detach(), low,
                     high, dual=low, clipfrac=high)


def _vespo(b: Batch) -> PerToken:
    """TRL get_gamma_weights: phi(w) = exp(lambda + k log w - lambda w) of the sequence's clamped log
    ratio sum (plus the rollout weights' logs), by the sign of A; ``-phi A logp``."""
    p = b.policy
    with torch.no_grad():
        lower = math.log(1e-8)
        seq_log_ratio = (torch.clamp(b.logp - b.old, -20.0, 20.0) * b.mask).sum(-1, keepdim=True)
        if b.iw is not None:
            log_iw = (torch.clamp(torch.log(b.iw), lower, 20.0) * b.mask).sum(-1, keepdim=True)
            if p.rollout_is == "sequence":  # one weight per sequence, repeated on its tokens: count it once
                log_iw = log_iw / b.mask.sum(-1, keepdim=True).clamp(min=1.0)
            seq_log_ratio = seq_log_ratio + log_iw
        log_w = torch.clamp(seq_log_ratio, lower, 20.0)

        def phi(adv):
            nonneg = adv >= 0
            k = torch.where(nonneg, p.vespo_k_pos, p.vespo_k_neg)
            lam = torch.where(nonneg, p.vespo_lambda_pos, p.vespo_lambda_neg).clamp(min=1e-4)
            return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

        phi_tok = phi(b.adv)
        # TRL's global_masked_mean: over the sequences with [B, 1] values, else over the tokens
        phi_mean = phi(b.seq_adv[:, None].to(log_w.dtype)).mean() if b.seq_adv is not None else \
            _masked_mean(phi_tok, b.mask)
    return PerToken(-phi_tok * b.adv * b.logp, torch.exp(b.logp - b.old), (b.old - b.logp).detach(),
                     extra={"vespo/phi_seq_mean": phi_mean})


def _clip_cov(b: Batch) -> PerToken:
    """verl compute_policy_loss_clip_cov: a random ``clip_num`` of the tokens with cov in (lb, ub) and
    not clipped lose the gradient (``torch.randperm`` on the default generator)."""
    p = b.policy
    negative_approx_kl = b.logp - b.old
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -b.adv * ratio
    pg_losses2 = -b.adv * torch.clamp(ratio, 1 - p.eps_low, 1 + p.eps_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (b.mask > 0)
    mean_adv = (b.adv * b.mask).sum() / (b.mask.sum() + 1e-8)
    mean_logp = (b.logp.detach() * b.mask).sum() / (b.mask.sum() + 1e-8)
    cov_all = (b.adv - mean_adv) * (b.logp.detach() - mean_logp)
    cov_all = cov_all.masked_fill((b.mask == 0) | clip_by_origin, -torch.inf)
    clip_num = max(int(p.cov_ratio * b.mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < p.clip_cov_ub) & (cov_all > p.clip_cov_lb) & (b.mask > 0))
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))].to(top_k_idx.device)]
    corr = torch.ones_like(b.adv)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return PerToken(torch.maximum(pg_losses1, pg_losses2) * corr, ratio, -negative_approx_kl.detach(),
                     low=clip_by_origin & (b.adv < 0), high=clip_by_origin & (b.adv > 0), clipfrac=corr == 0)


def _kl_cov(b: Batch) -> PerToken:
    """verl compute_policy_loss_kl_cov: the top ``max(1, int(n kl_cov_ratio))`` covariances get
    ``ppo_kl_coef |log r|`` added to ``-A r``."""
    p = b.policy
    negative_approx_kl = b.logp - b.old
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -b.adv * ratio
    pg_losses_kl = pg_losses + p.kl_cov_coef * abs_kl
    valid = (b.mask > 0).reshape(-1)
    valid_idx = torch.nonzero(valid, as_tuple=True)[0]
    chosen = torch.zeros_like(valid)
    if valid_idx.numel():
        adv = b.adv.detach().reshape(-1)[valid_idx]
        logp = b.logp.detach().reshape(-1)[valid_idx]
        cov = (adv - adv.mean()) * (logp - logp.mean())
        large = torch.topk(cov, max(1, int(cov.numel() * p.cov_ratio)), largest=True).indices
        chosen[valid_idx[large]] = True
    chosen = chosen.reshape(b.mask.shape)
    return PerToken(torch.where(chosen, pg_losses_kl, pg_losses), ratio, abs_kl.detach(),
                     clipfrac=torch.zeros_like(chosen))


OBJECTIVES: dict[str, Callable[[Batch], PerToken]] = {
    "clip": _clip, "cispo": _cispo, "sapo": _sapo, "gpg": _gpg, "dro": _dro, "dppo_tv": _dppo("tv"),
    "dppo_kl": _dppo("kl"), "reinforce": _reinforce, "gmpo": _geo_mean, "vespo": _vespo, "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
}
FOLD_WEIGHTS = ("gmpo", "vespo")
"""The objectives that take the rollout weights in themselves (their sources fold them in)."""

_MISSING = set(typing.get_args(PolicyObjective)) - set(OBJECTIVES)
if _MISSING:
    raise RuntimeError(f"headloss.reference: the objectives {sorted(_MISSING)} have no reference formula")
