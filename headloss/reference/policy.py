"""The policy term in plain torch, on padded [B, T] tensors, written from TRL's and verl's own code.

This is the oracle of the kernels and of headloss.policy: it shares nothing with them but the spec.
Each objective, KL estimator, importance-sampling level and loss type is transcribed from its
source (TRL 1.16 ``GRPOTrainer._compute_loss`` and its helpers, verl ``core_algos.py``:
``compute_policy_loss_*``, ``kl_penalty``, ``agg_loss``, ``rollout_corr_helper``), in the
trainers' shapes: per-sequence values as [B, 1], masked means as sums over the mask.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..packed import Packed, packed_per_sequence
from ..spec import LossSpec, Policy, PolicyLossType, PolicyObjective

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


# --- KL estimators, rollout weights, masks ---------------------------------------------------------------


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, p: Policy) -> torch.Tensor:
    """verl kl_penalty (k1 ``kl``, k2 ``mse``, ``abs``, k3 ``low_var_kl`` with ``kl_clamp``), TRL's k3,
    and verl's ``+`` variants (``kl_grad="k2"``: the value with the k2 gradient)."""
    if p.kl_estimator == "k1":
        value = logp - ref
    elif p.kl_estimator == "k2":
        value = 0.5 * (logp - ref).square()
    elif p.kl_estimator == "abs":
        value = (logp - ref).abs()
    elif p.kl_estimator == "k3":
        kl = ref - logp
        if p.kl_clamp:
            kl = torch.clamp(kl, min=-20, max=20)
        value = torch.exp(kl) - kl - 1
        if p.kl_clamp:
            value = torch.clamp(value, min=-10, max=10)
    else:
        raise ValueError(f"policy.kl_estimator: {p.kl_estimator!r} has no reference formula")
    if p.kl_grad == "k2" and p.kl_estimator != "k2":
        backward = 0.5 * (logp - ref).square()
        value = backward - backward.detach() + value.detach()
    return value


def rollout_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, p: Policy) -> torch.Tensor:
    """TRL's vLLM importance sampling (the masked difference, per token or summed per sequence;
    truncate or mask) and verl's rollout_is (the log ratio clamped to +-20; batch normalisation).
    TRL's ``nan_to_num`` of the difference is kept at masked tokens only: a NaN rollout log-prob at a
    counted token makes its weight NaN, as any NaN input does."""
    with torch.no_grad():
        diff = torch.where(mask > 0, old - rollout, 0.0)
        if p.rollout_is == "sequence":
            diff = diff.sum(dim=-1, keepdim=True)
        if p.convention == "verl":
            diff = torch.clamp(diff, min=-20.0, max=20.0)
        ratio = torch.exp(diff)
        if p.rollout_is_mode == "truncate":
            ratio = torch.clamp(ratio, min=p.rollout_is_min, max=p.rollout_is_max)
        else:
            low = p.rollout_is_min if p.rollout_is_min is not None else -math.inf
            high = p.rollout_is_max if p.rollout_is_max is not None else math.inf
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        ratio = ratio.expand_as(mask)
        if p.rollout_is_batch_normalize:
            if p.rollout_is == "token":
                mean = (ratio * mask).sum() / (mask.sum() + 1e-8)
            else:
                counts = mask.sum(-1)
                per_seq = (ratio * mask).sum(-1) / (counts + 1e-8)
                has = (counts > 0).to(ratio.dtype)
                mean = (per_seq * has).sum() / has.sum().clamp(min=1e-8)
            ratio = torch.where(mean > 1e-8, ratio / mean, ratio)
    return ratio


def off_policy_mask(adv, logp, sampled, mask, threshold) -> torch.Tensor:
    """TRL get_off_policy_mask: keep a sequence when A >= 0 or its mean ``sampled - logp`` is at most
    the threshold."""
    kl_div = torch.nan_to_num(sampled - logp.detach(), nan=0.0)
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return (adv >= 0) | (avg_seq_kl <= threshold)


def high_entropy_mask(entropies, mask, threshold, group=None) -> torch.Tensor:
    """TRL get_high_entropy_mask: the counted tokens whose entropy is at least the ``threshold``
    quantile of every process's counted entropies (``group``: gathered as TRL's pad_across_processes
    and gather do)."""
    local = entropies[mask.bool()].detach()
    if group is not None and dist.get_world_size(group) > 1:
        device = local.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, torch.tensor([local.numel()], device=device), group=group)
        longest = max(int(s) for s in sizes)
        padded = torch.nn.functional.pad(local.to(device), (0, longest - local.numel()), value=math.nan)
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        local = torch.cat(parts).to(entropies.device)
        local = local[~local.isnan()]
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    return ((entropies.detach() * mask) >= entropy_threshold) & mask.bool()


# --- aggregation --------------------------------------------------------------------------------------------


def aggregate(loss_mat, mask, p: Policy, num_items_in_batch, num_sequences, kind: PolicyLossType | None = None
              ) -> torch.Tensor:
    """TRL's loss types (grpo, bnpo, dr_grpo, dapo) and verl's agg_loss (token-mean, seq-mean-*:
    over the sequences with counted tokens, or global_batch_size / dp_size). ``kind``: another loss
    type than the objective's (the KL penalty's and entropy bonus's), aggregated by agg_loss's rules
    even beside geo_mean (verl's ppo_loss: ``agg_loss(kld, response_mask, loss_agg_mode)``)."""
    batch, length = loss_mat.shape
    geo_mean = p.objective == "gmpo" and kind is None  # torch.mean over every sequence
    kind = p.loss_type if kind is None else kind
    if not kind.startswith("seq-mean") and kind != "grpo":
        num_sequences = None  # (given for the objective's mean over sequences)
    # a count given as a one-element tensor divides as a number: the loss stays a scalar
    num_items_in_batch, num_sequences = (c.reshape(()) if isinstance(c, torch.Tensor) else c
                                         for c in (num_items_in_batch, num_sequences))
    if num_sequences is not None or (p.convention == "verl" and kind.startswith("seq-mean") and not geo_mean):
        counts = mask.sum(-1)
        per_seq = (loss_mat * mask).sum(-1)
        if kind in ("grpo", "seq-mean-token-mean"):
            per_seq = per_seq / counts.clamp(min=1.0)
        n = num_sequences / p.num_processes if num_sequences is not None else (counts > 0).sum().clamp(min=1)
        loss = (per_seq * (counts > 0)).sum() / n
        return loss / length if kind == "seq-mean-token-sum-norm" else loss
    sequences = max(batch, 1)  # (no sequences: a zero loss, as the kernels give, not the NaN of an empty mean)
    if kind in ("grpo", "seq-mean-token-mean"):
        return ((loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / sequences
    if kind in ("bnpo", "token-mean"):
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1.0)
    if kind == "dr_grpo":
        return (loss_mat * mask).sum() / (batch * p.max_completion_length)
    if kind == "dapo":
        normalizer = mask.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch / p.num_processes
        return (loss_mat * mask).sum() / normalizer
    if kind == "seq-mean-token-sum":
        return (loss_mat * mask).sum(-1).sum() / sequences
    if kind == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum(-1).sum() / length
    raise ValueError(f"policy.loss_type: {kind!r} has no reference aggregation")


# --- the term ------------------------------------------------------------------------------------------------


def _padded(values: torch.Tensor, token_shape: torch.Size, sequence_ids):
    """Per-token values -> [B, T] padded the way trainers hold them (and a fill mask). ``sequence_ids``:
    each row's sequence, or packed rows' boundaries (headloss.packed.Packed: with cu_seqlens, sequence
    s is row s of the padded batch, a sequence of length 0 a row without tokens)."""
    if len(token_shape) == 2:
        return values.reshape(token_shape), torch.ones(token_shape, dtype=torch.bool, device=values.device)
    slots = None
    if isinstance(sequence_ids, Packed):
        slots = sequence_ids.n_slots if sequence_ids.per_sequence else None
        sequence_ids = sequence_ids.seq
    ids = sequence_ids.reshape(-1).tolist()
    order = sorted(set(ids)) if slots is None else list(range(slots))
    slot = {sid: b for b, sid in enumerate(order)}
    positions, seen = [], {}
    for sid in ids:
        positions.append(seen.get(sid, 0))
        seen[sid] = positions[-1] + 1
    batch, length = len(order), max(seen.values(), default=0)
    rows = torch.tensor([slot[s] for s in ids], device=values.device, dtype=torch.long)
    cols = torch.tensor(positions, device=values.device, dtype=torch.long)
    out = torch.zeros(batch, length, dtype=values.dtype, device=values.device).index_put((rows, cols), values)
    fill = torch.zeros(batch, length, dtype=torch.bool, device=values.device).index_put(
        (rows, cols), torch.ones_like(rows, dtype=torch.bool)
    )
    return out, fill


def reference_policy_loss(logp, entropy, valid, spec: LossSpec, token_shape, num_items_in_batch, inputs):
    """(loss, metrics) of the policy term: TRL GRPOTrainer._compute_loss / verl compute_policy_loss +
    agg_loss, on padded [B, T]."""
    pol = spec.policy
    seq_ids = inputs.get("sequence_ids")
    flat_valid = valid.reshape(-1)

    def pad(t: torch.Tensor) -> torch.Tensor:
        # a masked token's inputs (padding NaN, -inf) never reach the loss: 0 there
        t = torch.where(flat_valid, t.reshape(-1).to(logp.dtype), 0.0) if t.numel() == flat_valid.numel() else t
        return _padded(t.reshape(-1).to(logp.dtype), token_shape, seq_ids)[0]

    per_token_logps = pad(logp)
    mask = pad(valid.to(logp.dtype))
    adv = inputs["advantages"].to(logp.dtype)
    per_sequence_adv = adv.dim() == 1 and len(token_shape) == 2 and adv.shape[0] == token_shape[0]
    if per_sequence_adv:
        adv = adv[:, None].expand(token_shape)  # one per sequence
    elif isinstance(seq_ids, Packed) and seq_ids.per_sequence and packed_per_sequence(
            adv.shape, seq_ids.n_slots, seq_ids.seq.numel()):
        per_sequence_adv = True  # packed rows' advantages, one per sequence
        adv = adv.reshape(-1)[seq_ids.seq]
    advantages = pad(adv)
    old = pad(inputs["old_logprobs"]) if "old_logprobs" in inputs else per_token_logps.detach()
    iw = pad(inputs["importance_weights"]) if "importance_weights" in inputs else None
    rollout = pad(inputs["rollout_logprobs"]) if "rollout_logprobs" in inputs else None
    if pol.rollout_is is not None:
        iw = rollout_weights(old, rollout, mask, pol)
    batch = Batch(per_token_logps, old, advantages, mask, iw,
                  inputs["advantages"].reshape(-1) if per_sequence_adv else None, pol)
    tok = OBJECTIVES[pol.objective](batch)
    per_token_loss = tok.loss
    if iw is not None and pol.objective not in FOLD_WEIGHTS:
        per_token_loss = per_token_loss * iw
    ent = pad(entropy)
    keep = None
    if pol.off_policy_mask is not None:
        sampled = rollout if rollout is not None else old  # TRL: sampling_per_token_logps, else old
        keep = off_policy_mask(advantages, per_token_logps, sampled, mask, pol.off_policy_mask)
    high_entropy = None
    if pol.top_entropy_quantile < 1.0:
        high_entropy = high_entropy_mask(ent, mask, 1.0 - pol.top_entropy_quantile,
                                         inputs.get("entropy_quantile_group"))
        keep = high_entropy if keep is None else keep & high_entropy
    if keep is not None:
        per_token_loss = per_token_loss * keep.to(per_token_loss.dtype)
    coef_1 = tok.ratio
    # verl's ppo_loss aggregates its KL loss and entropy loss by loss_agg_mode apart from the policy
    # loss (gspo and sapo take seq-mean-token-mean, geo_mean its own mean): kl_entropy_loss_type
    apart = pol.kl_entropy_loss_type not in (None, pol.loss_type) or (pol.convention == "verl"
                                                                       and pol.objective == "gmpo")
    aux_kind = (pol.kl_entropy_loss_type or pol.loss_type) if apart else None
    num_sequences = inputs.get("num_sequences_in_batch")
    per_token_kl = None
    kl_loss = 0.0
    if pol.kl_beta != 0.0:
        per_token_kl = kl_penalty(per_token_logps, pad(inputs["ref_logprobs"]), pol)
        if pol.kl_importance_correction:
            per_token_kl = per_token_kl * coef_1
        if apart:
            kl_loss = pol.kl_beta * aggregate(per_token_kl, mask, pol, num_items_in_batch, num_sequences, aux_kind)
        else:  # TRL: per_token_loss = per_token_loss + self.beta * per_token_kl
            per_token_loss = per_token_loss + pol.kl_beta * per_token_kl

    loss = aggregate(per_token_loss, mask, pol, num_items_in_batch, num_sequences) + kl_loss
    if pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean":  # TRL: over its effective mask
        counted = mask if high_entropy is None else mask * high_entropy.to(mask.dtype)
        loss = loss - pol.entropy_coef * (ent * counted).sum() / counted.sum().clamp(min=1.0)
    elif pol.entropy_coef != 0.0:
        loss = loss - pol.entropy_coef * aggregate(ent, mask, pol, num_items_in_batch, num_sequences, aux_kind)
    return loss, _metrics(tok, per_token_logps, ent, per_token_kl, mask, high_entropy, pol,
                          pol.importance_sampling == "sequence" and per_sequence_adv)


def _metrics(tok: PerToken, per_token_logps, ent, per_token_kl, mask, high_entropy, pol: Policy,
             per_sequence: bool) -> dict:
    """TRL's metric names (clip_ratio/*, ratio/*, logprob/mean, entropy, kl) and verl's (pg_clipfrac,
    pg_clipfrac_lower, ppo_kl), branchless (no host reads). ``per_sequence``: TRL's [B, 1] clip
    indicators (sequence-level ratios, one advantage per sequence): global_masked_mean's
    ``x.sum() / x.shape[0]`` and masked_seq_mean's ``x.squeeze(1)``, every sequence counted (an empty
    one as 0); else its [B, T] branches, over counted tokens and over sequences with counted tokens."""
    never = torch.zeros_like(mask, dtype=torch.bool)
    with torch.no_grad():
        denom = mask.sum().clamp(min=1.0)
        ratio = tok.ratio.expand_as(mask).detach()
        low = (never if tok.low is None else tok.low).to(mask.dtype) * mask
        high = (never if tok.high is None else tok.high).to(mask.dtype) * mask
        dual = never if tok.dual is None else tok.dual
        ppo_kl = tok.ppo_kl
        # sequences without a counted token, and a batch without one, take TRL's defaults (clip fractions 0,
        # ratios 1)
        has = mask.sum(-1) > 0
        any_token = mask.sum() > 0
        frac = lambda t: t.sum(-1) / mask.sum(-1).clamp(min=1.0)  # noqa: E731
        inf = torch.full((1,), float("inf"), dtype=mask.dtype, device=mask.device)
        one = torch.ones((), dtype=mask.dtype, device=mask.device)
        lowest = lambda t: torch.cat([t.reshape(-1), inf]).amin()  # noqa: E731  (defined when empty)
        highest = lambda t: torch.cat([t.reshape(-1), -inf]).amax()  # noqa: E731
        seq_mean = lambda t: frac(t).sum() / max(mask.shape[0], 1)  # noqa: E731
        if per_sequence:
            has = torch.ones_like(has)
        metrics = {
            "clip_ratio/low_mean": seq_mean(low) if per_sequence else low.sum() / denom,
            "clip_ratio/low_min": torch.where(any_token, lowest(torch.where(has, frac(low), inf)), 0.0),
            "clip_ratio/high_mean": seq_mean(high) if per_sequence else high.sum() / denom,
            "clip_ratio/high_max": torch.where(any_token, highest(torch.where(has, frac(high), -inf)), 0.0),
        }
        metrics["clip_ratio/region_mean"] = metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"]
        metrics["pg_clipfrac"] = metrics["clip_ratio/region_mean"] if tok.clipfrac is None else \
            (tok.clipfrac.to(mask.dtype) * mask).sum() / denom
        metrics |= {
            "pg_clipfrac_lower": (dual.to(mask.dtype) * mask).sum() / denom,
            "ppo_kl": (ppo_kl * mask).sum() / denom,
            **(tok.extra or {}),
            "ratio/mean": torch.where(any_token, (ratio * mask).sum() / denom, one),
            "ratio/min": torch.where(any_token, lowest(torch.where(mask > 0, ratio, inf)), one),
            "ratio/max": torch.where(any_token, highest(torch.where(mask > 0, ratio, -inf)), one),
            "logprob/mean": (per_token_logps * mask).sum() / denom,
            "entropy": (ent * mask).sum() / denom,
        }
        if per_token_kl is not None:
            metrics["kl"] = (per_token_kl * mask).sum() / denom
        if high_entropy is not None:
            kept = high_entropy.to(mask.dtype) * mask
            metrics["high_entropy/fraction"] = kept.sum() / denom
            metrics["high_entropy/entropy"] = (ent * kept).sum() / kept.sum().clamp(min=1.0)
    return {k: v.detach().to(per_token_logps.dtype).to(per_token_logps.device) for k, v in metrics.items()}
