"""Every policy objective in torch: per token, and with its sequence and batch statistics.

The deferred mode's torch route runs these (``[N, V]`` rows with sequence_ids, the sequence and
batch statistics, torch.compile, inputs that want a gradient); the lm_head's corrections take a
row-local objective's slope from :func:`token_objective`. The kernels have the row-local objectives
too (kernels/terms.py ``_objective``, the same formulas and the same derivatives at the kinks).

Each objective, KL estimator and importance-sampling level is one entry of a dispatch table below,
keyed by the names in :mod:`headloss.policy_tables`; a table that misses a name fails at import.

    ratio      exp(logp - old)             token level, or exp(masked mean of logp - old over the
                                           sequence) for sequence level (GSPO)
    surrogate  -min(r1 * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), r1 = min(ratio, delta)
    dual clip  for A < 0: min(surrogate, -A * c)                                  (verl)
    IS weight  surrogate * w  (rollout-engine truncated importance weights)
    KL         k1 logp - ref, k2 (logp - ref)**2 / 2, k3 exp(ref - logp) - (ref - logp) - 1,
               times the ratio when kl_importance_correction (DeepSeek-V3.2)
    per token  surrogate + beta * KL
    loss       aggregated as the trainers define it (``loss_type``), minus entropy_coef times the
               entropy aggregated the same way (verl's entropy bonus)

Rows are tokens; ``seq`` maps each row to its sequence (0..S-1), ``mask`` is 1.0 where a token
counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..policy_tables import IMPORTANCE_SAMPLING, KL_ESTIMATORS, OBJECTIVES
from ..spec import Policy, clamps_log_ratio
from .masks import high_entropy_mask, off_policy_keep
from .metrics import policy_metrics
from .tokens import ObjectiveRows, PolicyTokens, TokenObjective, seq_of, seq_sum
from .weights import entropy_bonus_weight


def _covers(table: dict[str, Any], names, what: str) -> None:
    missing, extra = set(names) - set(table), set(table) - set(names)
    if missing or extra:
        raise RuntimeError(f"headloss.policy.objectives: the {what} table lacks {sorted(missing)} or has extra "
                           f"{sorted(extra)}")


# --- KL estimators ----------------------------------------------------------------------------------


def _k3(logp: torch.Tensor, ref: torch.Tensor, policy: Policy) -> torch.Tensor:
    delta = ref - logp
    if policy.kl_clamp:
        delta = torch.clamp(delta, -20.0, 20.0)
    kl = torch.exp(delta) - delta - 1.0
    return torch.clamp(kl, -10.0, 10.0) if policy.kl_clamp else kl


KL_FORMULAS: dict[str, Callable[[torch.Tensor, torch.Tensor, Policy], torch.Tensor]] = {
    "k1": lambda logp, ref, policy: logp - ref,
    "k2": lambda logp, ref, policy: 0.5 * (logp - ref) ** 2,
    "k3": _k3,
    "abs": lambda logp, ref, policy: (logp - ref).abs(),
}
_covers(KL_FORMULAS, KL_ESTIMATORS, "KL estimator")


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, policy: Policy) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs (verl kl_penalty):
    k1, k2, k3, abs; ``kl_clamp`` clamps k3's ref - logp to +-20 and its value to +-10 (verl's
    low_var_kl); ``kl_grad="k2"`` keeps the value with the k2 gradient (verl's "k3+")."""
    kl = KL_FORMULAS[policy.kl_estimator](logp, ref, policy)
    if policy.kl_grad == "k2" and policy.kl_estimator != "k2":
        k2 = KL_FORMULAS["k2"](logp, ref, policy)
        kl = k2 - k2.detach() + kl.detach()
    return kl


# --- row-local objectives ---------------------------------------------------------------------------


class Surrogate(NamedTuple):
    """A row-local objective's per-token loss and its clip indicators (bool tensors)."""

    loss: torch.Tensor
    low: torch.Tensor | None = None  # clipped low (clip_ratio/low_mean); None: never
    high: torch.Tensor | None = None  # clipped high
    dual: torch.Tensor | None = None  # verl's pg_clipfrac_lower indicator


def _clip(logp, old, adv, ratio, policy: Policy) -> Surrogate:
    lo, hi = 1.0 - policy.eps_low, 1.0 + policy.eps_high
    r1 = torch.clamp(ratio, max=policy.delta) if policy.delta is not None else ratio
    loss = -torch.minimum(r1 * adv, torch.clamp(ratio, lo, hi) * adv)
    dual = None
    if policy.dual_clip_c is not None:
        floor = -adv * policy.dual_clip_c
        dual = (adv < 0) & (loss > floor)
        loss = torch.where(adv < 0, torch.minimum(loss, floor), loss)
    return Surrogate(loss, (ratio < lo) & (adv < 0), (r1 > hi) & (adv > 0), dual)  # (high: TRL's, on the capped ratio)


def _cispo(logp, old, adv, ratio, policy: Policy) -> Surrogate:
    if policy.convention == "trl":  # eps_high is the absolute cap
        coef = torch.clamp(ratio, max=policy.eps_high)
        return Surrogate(-coef.detach() * adv * logp, None, (ratio > policy.eps_high) & (adv > 0))
    lo, hi = 1.0 - policy.eps_low, 1.0 + policy.eps_high
    coef = torch.clamp(ratio, lo, hi)
    return Surrogate(-coef.detach() * adv * logp, ratio < lo, ratio > hi)


def _sapo(logp, old, adv, ratio, policy: Policy) -> Surrogate:
    tau = torch.where(adv > 0, policy.sapo_tau_pos, policy.sapo_tau_neg)
    return Surrogate(-torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv)


def _gpg(logp, old, adv, ratio, policy: Policy) -> Surrogate:
    return Surrogate(-adv * logp)


def _dro(logp, old, adv, ratio, policy: Policy) -> Surrogate:
    gap = logp - old
    return Surrogate(-(logp * adv - 0.5 * policy.dro_beta * gap * gap))


def _dppo(keep_of: Callable) -> Callable:
    """verl's DPPO: -A sg(min(r, cap)) logp on the tokens ``keep_of`` keeps."""

    def dppo(logp, old, adv, ratio, policy: Policy) -> Surrogate:
        prob, old_prob = torch.exp(logp.detach()), torch.exp(old)
        keep_pos, keep_neg = keep_of(logp.detach(), old, prob, old_prob, policy)
        keep = torch.where(adv > 0, keep_pos, keep_neg)
        truncated = torch.clamp(ratio, max=policy.dppo_ratio_cap).detach()
        return Surrogate(-adv * truncated * logp * keep.to(logp.dtype), ~keep & (adv <= 0), ~keep & (adv > 0),
                         (ratio > policy.dppo_ratio_cap) & keep)

    return dppo


def _total_variation(logp, old, prob, old_prob, policy: Policy):
    return prob - old_prob <= policy.eps_high, prob - old_prob >= -policy.eps_low


def _binary_kl(logp, old, prob, old_prob, policy: Policy):
    # verl's log((1 - old_p + 1e-8) / (1 - p + 1e-8)) as a log1p (accurate for tiny p)
    binary_kl = old_prob * (old - logp) + (1.0 - old_prob) * torch.log1p((prob - old_prob) / (1.0 - prob + 1e-8))
    return (binary_kl <= policy.eps_high) | (prob <= old_prob), (binary_kl <= policy.eps_low) | (prob >= old_prob)


def _reinforce(logp, old, adv, ratio, policy: Policy) -> Surrogate:
    weight = torch.clamp(torch.exp(torch.clamp(logp.detach() - old, -20.0, 20.0)), max=policy.reinforce_is_max)
    return Surrogate(-adv * weight * logp)


ROW_LOCAL: dict[str, Callable[..., Surrogate]] = {
    "clip": _clip,
    "cispo": _cispo,
    "sapo": _sapo,
    "gpg": _gpg,
    "dro": _dro,
    "dppo_tv": _dppo(_total_variation),
    "dppo_kl": _dppo(_binary_kl),
    "reinforce": _reinforce,
}
"""(logp, old, adv, ratio, policy) -> Surrogate of each row-local objective (tables: kernel code set)."""
_covers(ROW_LOCAL, [name for name, row in OBJECTIVES.items() if row.row_local], "row-local objective")


def token_objective(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, policy: Policy,
                    seq_log_ratio: torch.Tensor | None = None) -> TokenObjective:
    """A row-local objective per token (see :class:`headloss.spec.Policy`). ``seq_log_ratio``: with
    sequence-level importance sampling, each token's sequence log-ratio (with gradient)."""
    log_ratio = logp - old
    if clamps_log_ratio(policy):
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
    ratio = torch.exp(log_ratio if seq_log_ratio is None else seq_log_ratio)
    surrogate = ROW_LOCAL[policy.objective](logp, old, adv, ratio, policy)
    never = torch.zeros_like(ratio, dtype=torch.bool)
    low, high, dual = (never if t is None else t for t in surrogate[1:])
    return TokenObjective(surrogate.loss, ratio, low, high, dual, -log_ratio.detach())


# --- importance-sampling levels ---------------------------------------------------------------------


def _sequence_mean(logp, old, mask, seq, n_slots, count):
    return (seq_sum((logp - old) * mask, seq, n_slots) / count.clamp(min=1.0))[seq]


SEQUENCE_RATIOS: dict[str, Callable | None] = {
    "token": None,  # each token's own ratio
    # TRL's GSPO: the sequence's mean log-ratio, with gradient through every token
    "sequence": lambda logp, old, mask, seq, n_slots, count: _sequence_mean(logp, old, mask, seq, n_slots, count),
    # verl's gspo: the sequence's value (at most 10), each token's own gradient
    "sequence_token": lambda logp, old, mask, seq, n_slots, count: torch.clamp(
        logp - logp.detach() + _sequence_mean(logp, old, mask, seq, n_slots, count).detach(), max=10.0),
}
"""Each token's log-ratio as its importance-sampling level defines it (None: the token's own)."""
_covers(SEQUENCE_RATIOS, IMPORTANCE_SAMPLING, "importance-sampling level")


# --- objectives of sequence and batch statistics ----------------------------------------------------


def _gmpo(rows: ObjectiveRows, policy: Policy) -> TokenObjective:
    """verl compute_policy_loss_geo_mean: per sequence -mean(A) exp(mean of the sign-aware clipped
    log-ratios), as the same value on each of its tokens (the mean over sequences is the loss)."""
    logp, old, adv, iw, mask, seq, n_slots, count, seq_adv = rows
    log_ratio = logp - old
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -policy.eps_low, policy.eps_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    denominator = count + 1e-8
    seq_ratio = torch.exp(seq_sum(chosen * mask, seq, n_slots) / denominator)
    seq_adv_mean = seq_sum(adv * mask, seq, n_slots) / denominator
    seq_loss = -seq_adv_mean * seq_ratio
    if iw is not None:  # the rollout weights' geometric mean over the sequence
        seq_loss = seq_loss * torch.exp(seq_sum(torch.log(iw + 1e-10) * mask, seq, n_slots) / denominator)
    clipped = log_ratio.detach() != clamped.detach()
    low, high = clipped & (adv < 0), clipped & (adv > 0)
    return TokenObjective(seq_loss[seq], seq_ratio[seq], low, high, low, -log_ratio.detach(), clipfrac=high)


def _vespo(rows: ObjectiveRows, policy: Policy) -> TokenObjective:
    """TRL GRPOTrainer.get_gamma_weights: phi(w) of the sequence's ratio product w (rollout weights
    included: per token, their product; a sequence-level rollout weight, once), by the sign of each
    token's advantage; the loss -sg(phi) A logp. vespo/phi_seq_mean as TRL's global_masked_mean:
    over the sequences (an empty one has w = 1) with one advantage per sequence (``seq_adv``, as
    given: a masked token's advantage is 0 here), else over tokens."""
    logp, old, adv, iw, mask, seq, n_slots, count, seq_adv = rows
    with torch.no_grad():
        lower = math.log(1e-8)
        log_ratio = torch.clamp(logp - old, -20.0, 20.0)
        seq_log_ratio = seq_sum(log_ratio * mask, seq, n_slots)
        if iw is not None:
            log_iw = seq_sum(torch.clamp(torch.log(iw), lower, 20.0) * mask, seq, n_slots)
            if policy.rollout_is == "sequence":  # the sequence's weight sits on each of its tokens
                log_iw = log_iw / count.clamp(min=1.0)
            seq_log_ratio = seq_log_ratio + log_iw
        seq_log_w = torch.clamp(seq_log_ratio, lower, 20.0)

        def phi_of(log_w, a):
            nonneg = a >= 0
            k = torch.where(nonneg, policy.vespo_k_pos, policy.vespo_k_neg)
            lam = torch.where(nonneg, policy.vespo_lambda_pos, policy.vespo_lambda_neg).clamp(min=1e-4)
            return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

        phi = phi_of(seq_log_w[seq], adv)
        if seq_adv is not None:
            phi_mean = phi_of(seq_log_w, seq_adv.to(seq_log_w.dtype)).mean()
        else:
            phi_mean = (phi * mask).sum() / mask.sum().clamp(min=1.0)
    no = torch.zeros_like(mask, dtype=torch.bool)
    # the ratio keeps its gradient: TRL's bias-corrected KL multiplies by it
    return TokenObjective(-phi * adv * logp, torch.exp(logp - old), no, no, no, (old - logp).detach(),
                          extra={"vespo/phi_seq_mean": phi_mean})


def kl_cov_chosen(adv, logp, valid, policy: Policy) -> torch.Tensor:
    """verl compute_policy_loss_kl_cov's tokens: the top max(1, int(n * cov_ratio)) covariances
    (A - mean A)(logp - mean logp) over the n counted tokens; a sort, no host read."""
    n = valid.sum()
    weights = valid.to(adv.dtype)
    mean_adv = (adv.detach() * weights).sum() / n.clamp(min=1)
    mean_logp = (logp.detach() * weights).sum() / n.clamp(min=1)
    cov = torch.where(valid, (adv.detach() - mean_adv) * (logp.detach() - mean_logp), -math.inf)
    order = torch.sort(cov, descending=True, stable=True).indices
    k = torch.clamp((n.to(torch.float64) * policy.cov_ratio).floor().long(), min=1)
    return torch.zeros_like(valid).scatter_(0, order, torch.arange(order.numel(), device=order.device) < k) & valid


def clip_cov_chosen(adv, logp, old, valid, policy: Policy) -> torch.Tensor:
    """verl compute_policy_loss_clip_cov's tokens: a random max(1, int(n * cov_ratio)) of those
    not clipped already whose covariance lies in (clip_cov_lb, clip_cov_ub), drawn with
    torch.randperm on the default CPU generator, as verl draws them (one host read)."""
    ratio = torch.exp(logp.detach() - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - policy.eps_low, 1.0 + policy.eps_high)
    weights = valid.to(adv.dtype)
    mean_adv = (adv * weights).sum() / (weights.sum() + 1e-8)
    mean_logp = (logp.detach() * weights).sum() / (weights.sum() + 1e-8)
    cov = ((adv - mean_adv) * (logp.detach() - mean_logp)).masked_fill(~valid | ((pg2 > pg1) & valid), -math.inf)
    clip_num = max(int(policy.cov_ratio * float(weights.sum())), 1)
    candidates = torch.nonzero((cov < policy.clip_cov_ub) & (cov > policy.clip_cov_lb) & valid, as_tuple=True)[0]
    if candidates.numel():
        candidates = candidates[torch.randperm(candidates.numel())[:min(clip_num, candidates.numel())].to(
            candidates.device)]
    return torch.zeros_like(valid).index_fill_(0, candidates, True)


def _covariance(rows: ObjectiveRows, policy: Policy) -> TokenObjective:
    """verl compute_policy_loss_clip_cov / _kl_cov: the tokens whose (A - mean A)(logp - mean logp)
    is largest (kl_cov: the top cov_ratio share; clip_cov: a random cov_ratio share of those with
    cov in (lb, ub) and not clipped already) lose the clip objective's gradient (clip_cov) or get
    kl_cov_coef |log r| added to -A r (kl_cov)."""
    logp, old, adv, iw, mask, seq, n_slots, count, seq_adv = rows
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    valid = mask > 0
    no = torch.zeros_like(valid)
    pg1 = -adv * ratio
    if policy.objective == "kl_cov":
        chosen = kl_cov_chosen(adv, logp, valid, policy)
        loss = torch.where(chosen, pg1 + policy.kl_cov_coef * log_ratio.abs(), pg1)
        return TokenObjective(loss, ratio, no, no, no, log_ratio.abs().detach(), clipfrac=no)
    chosen = clip_cov_chosen(adv, logp, old, valid, policy)
    pg2 = -adv * torch.clamp(ratio, 1.0 - policy.eps_low, 1.0 + policy.eps_high)
    clip_by_origin = (pg2 > pg1) & valid
    low, high = clip_by_origin & (adv < 0), clip_by_origin & (adv > 0)
    return TokenObjective(torch.maximum(pg1, pg2) * (~chosen).to(ratio.dtype), ratio, low, high, no,
                          -log_ratio.detach(), clipfrac=chosen)


STATISTIC: dict[str, Callable[..., TokenObjective]] = {
    "gmpo": _gmpo,
    "vespo": _vespo,
    "clip_cov": _covariance,
    "kl_cov": _covariance,
}
"""(ObjectiveRows, policy) -> TokenObjective of each objective that needs its sequence's or the batch's
values."""
_covers(STATISTIC, [name for name, row in OBJECTIVES.items() if not row.row_local], "sequence or batch objective")


def objective_of(rows: ObjectiveRows, entropy: torch.Tensor | None, policy: Policy,
                 rollout: torch.Tensor | None = None, quantile_group: Any = None) -> TokenObjective:
    """The objective per token (N,) on flat ``rows`` (their ``count``: counted tokens per sequence), with
    its sequence and batch statistics, the rollout weights and the masks, without the KL. ``rollout``:
    the rollout's log-probs (the off-policy mask's); ``quantile_group``: the top-entropy quantile is
    over the counted tokens of every process of this group (None: these rows)."""
    logp, old, adv, iw, mask, seq, n_slots, count, _ = rows
    row = OBJECTIVES[policy.objective]
    if row.row_local:
        level = SEQUENCE_RATIOS[policy.importance_sampling]
        seq_log_ratio = None if level is None else level(logp, old, mask, seq, n_slots, count)
        tok = token_objective(logp, old, adv, policy, seq_log_ratio)
    else:
        tok = STATISTIC[policy.objective](rows, policy)
    if iw is not None and not row.folds_weights:
        tok.loss = tok.loss * iw
    keep = None
    if policy.off_policy_mask is not None:
        keep = off_policy_keep(rows, rollout, policy.off_policy_mask)
    if policy.top_entropy_quantile < 1.0:
        high = high_entropy_mask(entropy, mask, policy.top_entropy_quantile, quantile_group)
        keep = high if keep is None else keep & high
        tok.high_entropy = high
    if keep is not None:
        tok.loss = tok.loss * keep.to(tok.loss.dtype)
    return tok


def policy_objective(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    mask: torch.Tensor,
    policy: Policy,
    inp: PolicyTokens,
    with_metrics: bool = True,
    extremes_by_kernel: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of the policy term from per-token log-probs ``logp`` (N,) with gradient
    (``with_metrics=False``: no metrics, an empty dict). ``extremes_by_kernel``: the per-sequence
    metrics by kernels/policy.py's two launches ([B, T] rows on the kernels' device).

    Written for few device ops (each one is a launch on the host's critical path at 8K tokens).
    """
    old = inp.old_logprobs if inp.old_logprobs is not None else logp.detach()
    seq = seq_of(inp)
    rows = ObjectiveRows(logp, old, inp.advantages, inp.importance_weights, mask, seq, inp.n_slots,
                         seq_sum(mask, seq, inp.n_slots), inp.seq_advantages)
    tok = objective_of(rows, entropy, policy, rollout=inp.rollout_logprobs, quantile_group=inp.quantile_group)
    per_token = tok.loss
    weight = inp.weight
    aux_weight = weight if inp.kl_entropy_weight is None else inp.kl_entropy_weight
    kl = None
    if policy.kl_beta != 0.0:
        kl = kl_estimate(logp, inp.ref_logprobs, policy)
        if policy.kl_importance_correction:
            kl = kl * tok.ratio
        if inp.kl_entropy_weight is None:
            per_token = per_token + policy.kl_beta * kl
    loss = (per_token * weight).sum()
    if kl is not None and inp.kl_entropy_weight is not None:
        loss = loss + policy.kl_beta * (kl * aux_weight).sum()
    if policy.entropy_coef != 0.0:
        bonus = entropy_bonus_weight(policy, aux_weight, mask, tok.high_entropy, inp)
        loss = loss - policy.entropy_coef * (entropy * bonus).sum()
    if not with_metrics:
        return loss, {}
    return loss, policy_metrics(logp, entropy, tok, kl, mask, inp, extremes_by_kernel)
