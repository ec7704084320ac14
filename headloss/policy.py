"""The GRPO family of policy objectives: inputs, aggregation, the sequence-level objective, metrics.

Token-level importance ratios make the objective row-local: the head kernel's epilogue computes it
(``policy_values`` in headloss/kernels/terms.py) in fused mode, from the row's log p(target), with the aggregation
given as per-token weights (:func:`aggregation_weights`). Sequence-level ratios (GSPO) need the
whole sequence: then the deferred mode's stats pass gives each token's ``logp`` (and entropy), the
objective runs on them (O(tokens): on [B, T] rows, a row-local objective by two kernels,
kernels.head.policy_sequence_kernel, see :func:`objective_in_kernel`; else :func:`policy_objective`
here in torch), and the backward kernel turns d loss / d logp into one gradient pass over the
logits. All follow the same formulas:

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
from dataclasses import dataclass
from typing import Any

import torch

from .spec import Policy


@dataclass
class PolicyInputs:
    """Per-call inputs of the policy term, flattened to rows (tokens) or sequences."""

    advantages: torch.Tensor  # (N,) per token (a per-sequence advantage repeated over its tokens)
    old_logprobs: torch.Tensor | None  # (N,); None: on-policy (ratio 1, with gradient)
    ref_logprobs: torch.Tensor | None  # (N,)
    importance_weights: torch.Tensor | None  # (N,)
    seq: torch.Tensor | None  # (N,) long, sequence of each row, in [0, n_slots); None: [B, T] rows, built by seq_of
    n_slots: int  # size of per-sequence buffers (B, or N for [N, V] logits)
    n_seq: int | torch.Tensor  # number of sequences (a device count for [N, V] logits)
    seq_len: int | torch.Tensor  # padded length T (verl's seq-mean-token-sum-norm divides by it)
    num_items_in_batch: float | torch.Tensor | None
    mask: torch.Tensor | None = None  # (N,) fp32, 1 where a token counts
    weight: torch.Tensor | None = None  # (N,) fp32 aggregation weight (aggregation_weights)
    sequence_ids: torch.Tensor | None = None  # (N,) as given, for the device-side range check
    rollout_logprobs: torch.Tensor | None = None  # (N,) fp32, 0 at masked tokens
    sequence_level: bool = False  # TRL's sequence-level ratios: clip fractions are means over sequences
    seq_advantages: torch.Tensor | None = None  # (B,) as given, when one per sequence of [B, T] tokens
    correction_metrics: dict | None = None  # lm_head base + correction (engine): the metrics the correction sets
    norm_length: int | None = None  # seq-mean-token-sum-norm's T when the rows are longer (padded)
    num_sequences_in_batch: float | torch.Tensor | None = None  # verl's global_batch_size (seq-mean modes)
    adv_span: int = 1  # tokens per entry of ``advantages`` (K: one per sequence of [B, K], kernel only)
    quantile_group: Any = None  # the processes whose tokens form the top-entropy quantile's batch
    raw: bool = False  # inputs as given (any float dtype, advantages by index: adv_span), read only at counted
    # tokens by the kernels (the fused epilogue, or deferred mode's objective kernel); else fp32 copies holding 0
    # at masked tokens, for torch


def seq_of(inp: PolicyInputs) -> torch.Tensor:
    """The sequence of each row, built on first use for [B, T] rows (the fused kernel needs none:
    two launches fewer per call)."""
    if inp.seq is None:
        inp.seq = torch.arange(inp.n_slots, device=inp.advantages.device).repeat_interleave(inp.seq_len)
    return inp.seq


def _seq_sum(values: torch.Tensor, seq: torch.Tensor, n_seq: int) -> torch.Tensor:
    return torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, seq, values)


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, policy: Policy) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs (verl kl_penalty):
    k1, k2, k3, abs; ``kl_clamp`` clamps k3's ref - logp to +-20 and its value to +-10 (verl's
    low_var_kl); ``kl_grad="k2"`` keeps the value with the k2 gradient (verl's "k3+")."""
    gap = logp - ref
    estimator = policy.kl_estimator
    if estimator == "k1":
        kl = gap
    elif estimator == "k2":
        kl = 0.5 * gap * gap
    elif estimator == "abs":
        kl = gap.abs()
    else:
        delta = ref - logp
        if policy.kl_clamp:
            delta = torch.clamp(delta, -20.0, 20.0)
        kl = torch.exp(delta) - delta - 1.0
        if policy.kl_clamp:
            kl = torch.clamp(kl, -10.0, 10.0)
    if policy.kl_grad == "k2" and estimator != "k2":
        k2 = 0.5 * gap * gap
        kl = k2 - k2.detach() + kl.detach()
    return kl


VERL_CLAMPED = ("clip", "cispo", "sapo", "dppo_tv", "dppo_kl")
"""Objectives whose log-ratio verl clamps to [-20, 20] before exp (convention="verl")."""


@dataclass
class TokenObjective:
    """One objective's per-token values (torch, differentiable through ``loss``)."""

    loss: torch.Tensor  # the surrogate per token, before rollout weights and KL
    ratio: torch.Tensor  # the importance ratio (token or sequence level)
    low: torch.Tensor  # clipped-low indicator (clip_ratio/low_mean)
    high: torch.Tensor  # clipped-high indicator (clip_ratio/high_mean)
    dual: torch.Tensor  # verl's pg_clipfrac_lower indicator (dual clip; DPPO: truncated and kept)
    ppo_kl: torch.Tensor  # per token, verl's ppo_kl is its mean: old - logp (kl_cov: |logp - old|)
    clipfrac: torch.Tensor | None = None  # verl's pg_clipfrac indicator where it is not low | high
    extra: dict | None = None  # metrics of the objective's own (already reduced)
    high_entropy: torch.Tensor | None = None  # the top-entropy mask's kept tokens (None: no such mask)


def token_objective(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, policy: Policy,
                    seq_log_ratio: torch.Tensor | None = None) -> TokenObjective:
    """The spec's objective per token (see :class:`headloss.spec.Policy`). ``seq_log_ratio``: with
    sequence-level importance sampling, each token's sequence log-ratio (with gradient)."""
    log_ratio = logp - old
    if policy.convention == "verl" and policy.objective in VERL_CLAMPED:
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
    ratio = torch.exp(log_ratio if seq_log_ratio is None else seq_log_ratio)
    lo, hi = 1.0 - policy.eps_low, 1.0 + policy.eps_high
    zero = torch.zeros_like(ratio, dtype=torch.bool)
    low, high, dual = zero, zero, zero
    objective = policy.objective
    if objective == "clip":
        r1 = torch.clamp(ratio, max=policy.delta) if policy.delta is not None else ratio
        loss = -torch.minimum(r1 * adv, torch.clamp(ratio, lo, hi) * adv)
        if policy.dual_clip_c is not None:
            floor = -adv * policy.dual_clip_c
            dual = (adv < 0) & (loss > floor)
            loss = torch.where(adv < 0, torch.minimum(loss, floor), loss)
        low, high = (ratio < lo) & (adv < 0), (ratio > hi) & (adv > 0)
    elif objective == "cispo":
        if policy.convention == "trl":
            coef = torch.clamp(ratio, max=policy.eps_high)
            high = (ratio > policy.eps_high) & (adv > 0)
        else:
            coef = torch.clamp(ratio, lo, hi)
            low, high = ratio < lo, ratio > hi
        loss = -coef.detach() * adv * logp
    elif objective == "sapo":
        tau = torch.where(adv > 0, policy.sapo_tau_pos, policy.sapo_tau_neg)
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    elif objective == "gpg":
        loss = -adv * logp
    elif objective == "dro":
        gap = logp - old
        loss = -(logp * adv - 0.5 * policy.dro_beta * gap * gap)
    else:  # dppo_tv, dppo_kl
        prob, old_prob = torch.exp(logp.detach()), torch.exp(old)
        if objective == "dppo_tv":
            keep_pos = prob - old_prob <= policy.eps_high
            keep_neg = prob - old_prob >= -policy.eps_low
        else:
            # verl's log((1 - old_p + 1e-8) / (1 - p + 1e-8)) as a log1p (accurate for tiny p)
            binary_kl = old_prob * (old - logp.detach()) + (1.0 - old_prob) * torch.log1p(
                (prob - old_prob) / (1.0 - prob + 1e-8))
            keep_pos = (binary_kl <= policy.eps_high) | (prob <= old_prob)
            keep_neg = (binary_kl <= policy.eps_low) | (prob >= old_prob)
        keep = torch.where(adv > 0, keep_pos, keep_neg)
        truncated = torch.clamp(ratio, max=policy.dppo_ratio_cap).detach()
        loss = -adv * truncated * logp * keep.to(logp.dtype)
        low, high = ~keep & (adv <= 0), ~keep & (adv > 0)
        dual = (ratio > policy.dppo_ratio_cap) & keep
    return TokenObjective(loss, ratio, low, high, dual, -log_ratio.detach())



def aggregation_weights(mask: torch.Tensor, policy: Policy, inp: PolicyInputs) -> torch.Tensor:
    """Per-token weight w with loss = sum(w * per_token), as TRL / verl aggregate each loss type.

    Depends on the mask and sequence layout only, so it is computed once, without gradient.
    """
    kind = policy.loss_type
    global_count = inp.num_sequences_in_batch
    if global_count is not None or (policy.convention == "verl" and kind.startswith("seq-mean")
                                    and policy.objective != "gmpo"):
        # verl's agg_loss: over global_batch_size / dp_size sequences when given, else over the
        # sequences with counted tokens (geo_mean's torch.mean counts every sequence)
        seq = seq_of(inp)
        tokens_per_seq = _seq_sum(mask, seq, inp.n_slots)
        if global_count is not None:
            n = global_count / policy.num_processes
        else:
            n = (tokens_per_seq > 0).sum().clamp(min=1).to(mask.dtype)
        if kind in ("grpo", "seq-mean-token-mean"):
            return mask / (tokens_per_seq.clamp(min=1.0)[seq] * n)
        if kind == "seq-mean-token-sum":
            return mask / n
        return mask / (n * (inp.norm_length or inp.seq_len))
    if isinstance(inp.n_seq, torch.Tensor):
        n_seq = inp.n_seq.clamp(min=1).to(mask.dtype)
    else:
        n_seq = float(max(inp.n_seq, 1))
    if kind in ("grpo", "seq-mean-token-mean"):
        seq = seq_of(inp)
        tokens_per_seq = _seq_sum(mask, seq, inp.n_slots).clamp(min=1.0)
        return mask / (tokens_per_seq[seq] * n_seq)
    if kind in ("bnpo", "token-mean") or (kind == "dapo" and inp.num_items_in_batch is None):
        return mask / mask.sum().clamp(min=1.0)
    if kind == "dr_grpo":
        return mask / (n_seq * policy.max_completion_length)
    if kind == "dapo":
        per_process = inp.num_items_in_batch
        if policy.num_processes != 1:
            per_process = per_process / policy.num_processes
        return mask / per_process
    if kind == "seq-mean-token-sum":
        return mask / n_seq
    if kind == "seq-mean-token-sum-norm":
        return mask / (inp.norm_length or inp.seq_len)
    raise ValueError(f"policy.loss_type: unknown {kind!r}")


def objective_of(logp: torch.Tensor, entropy: torch.Tensor | None, old: torch.Tensor, adv: torch.Tensor,
                 iw: torch.Tensor | None, mask: torch.Tensor, seq: torch.Tensor, n_slots: int,
                 policy: Policy, rollout: torch.Tensor | None = None, seq_adv: torch.Tensor | None = None,
                 quantile_group: Any = None) -> TokenObjective:
    """The objective per token (N,) on flat rows, with its sequence and batch statistics (``seq``:
    each row's sequence in [0, n_slots)), the rollout weights and the masks, without the KL. The
    torch path of deferred mode and the reference path both run it; the fused kernel's epilogue
    has the row-local objectives (:func:`token_objective`). ``quantile_group``: the top-entropy
    quantile is over the counted tokens of every process of this group (None: these rows)."""
    objective = policy.objective
    count = _seq_sum(mask, seq, n_slots)
    if objective == "gmpo":
        tok = _gmpo(logp, old, adv, iw, mask, seq, n_slots, count, policy)
    elif objective == "vespo":
        tok = _vespo(logp, old, adv, iw, mask, seq, n_slots, count, policy, seq_adv)
    elif objective in ("clip_cov", "kl_cov"):
        tok = _covariance(logp, old, adv, mask, policy)
    else:
        seq_log_ratio = None
        if policy.importance_sampling != "token":
            mean = (_seq_sum((logp - old) * mask, seq, n_slots) / count.clamp(min=1.0))[seq]
            if policy.importance_sampling == "sequence":  # TRL's GSPO
                seq_log_ratio = mean
            else:  # verl's gspo: the sequence's value, each token's own gradient
                seq_log_ratio = torch.clamp(logp - logp.detach() + mean.detach(), max=10.0)
        tok = token_objective(logp, old, adv, policy, seq_log_ratio)
    if iw is not None and objective not in ("gmpo", "vespo"):  # those two fold the weights in themselves
        tok.loss = tok.loss * iw
    keep = None
    if policy.off_policy_mask is not None:  # TRL get_off_policy_mask: a sequence-level mask
        sampled = rollout if rollout is not None else old  # TRL: sampling_per_token_logps, else old
        drift = torch.nan_to_num(sampled - logp.detach(), nan=0.0)
        mean_drift = (_seq_sum(drift * mask, seq, n_slots) / count.clamp(min=1.0))[seq]
        keep = (adv >= 0) | (mean_drift <= policy.off_policy_mask)
    if policy.top_entropy_quantile < 1.0:  # TRL get_high_entropy_mask (the batch's quantile)
        values = entropy.detach()
        if values.dtype not in (torch.float32, torch.float64):
            values = values.float()
        # the quantile in the entropy's own precision (a token at it is kept), on the device
        threshold = masked_quantile(values, mask > 0, 1.0 - policy.top_entropy_quantile, quantile_group)
        high = ((values * mask) >= threshold) & (mask > 0)
        keep = high if keep is None else keep & high
        tok.high_entropy = high
    if keep is not None:
        tok.loss = tok.loss * keep.to(tok.loss.dtype)
    return tok


def entropy_bonus_weight(policy: Policy, weight: torch.Tensor, mask: torch.Tensor, tok: TokenObjective
                         ) -> torch.Tensor:
    """Per-token weight of the entropy in the bonus: the loss's (verl), or TRL's mean over the counted
    tokens (those of the top-entropy mask when it is on: TRL's effective_mask)."""
    if policy.entropy_aggregation == "loss":
        return weight
    counted = mask if tok.high_entropy is None else mask * tok.high_entropy.to(mask.dtype)
    return counted / counted.sum().clamp(min=1.0)


def masked_quantile(values: torch.Tensor, keep: torch.Tensor, q: float, group: Any = None) -> torch.Tensor:
    """torch.quantile(values[keep], q) (linear interpolation) without reading the count on the host;
    +inf when nothing is kept (so nothing passes a >= test).

    ``group``: the quantile of the kept values of every process of this torch.distributed group
    (TRL's gather across processes; in fp32 or the values' wider dtype, so that every process
    compares its own values with the threshold it would get alone). Processes may hold different
    numbers of rows: parallel.gather_padded exchanges their counts first, which makes the host wait
    once (as TRL's pad_across_processes does), and pads with +inf (never kept); an all-reduce sums
    the kept counts. A process with no rows still takes part."""
    candidates = torch.where(keep, values, math.inf)
    n = keep.sum()
    if group is not None:
        import torch.distributed as dist

        from .parallel import comm_device, gather_padded

        if dist.get_world_size(group) > 1:
            wide = torch.promote_types(values.dtype, torch.float32)
            parts, _ = gather_padded(candidates.to(wide), group, math.inf)
            total = n.to(comm_device(group, values.device))
            dist.all_reduce(total, group=group)
            candidates, n = torch.cat(parts).to(values.device, values.dtype), total.to(values.device)
    if candidates.numel() == 0:  # no row anywhere
        return torch.tensor(math.inf, dtype=values.dtype, device=values.device)
    ordered = torch.sort(candidates).values
    rank = q * (n - 1).clamp(min=0).to(values.dtype)
    below = rank.floor()
    low = ordered.gather(0, below.long().reshape(1))
    high = ordered.gather(0, rank.ceil().long().reshape(1))
    return torch.where(n > 0, torch.lerp(low, high, rank - below), math.inf)[0]


def _gmpo(logp, old, adv, iw, mask, seq, n_slots, count, policy: Policy) -> TokenObjective:
    """verl compute_policy_loss_geo_mean: per sequence -mean(A) exp(mean of the sign-aware clipped
    log-ratios), as the same value on each of its tokens (the mean over sequences is the loss)."""
    log_ratio = logp - old
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -policy.eps_low, policy.eps_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    denominator = count + 1e-8
    seq_ratio = torch.exp(_seq_sum(chosen * mask, seq, n_slots) / denominator)
    seq_adv = _seq_sum(adv * mask, seq, n_slots) / denominator
    seq_loss = -seq_adv * seq_ratio
    if iw is not None:  # the rollout weights' geometric mean over the sequence
        seq_loss = seq_loss * torch.exp(_seq_sum(torch.log(iw + 1e-10) * mask, seq, n_slots) / denominator)
    clipped = log_ratio.detach() != clamped.detach()
    low, high = clipped & (adv < 0), clipped & (adv > 0)
    return TokenObjective(seq_loss[seq], seq_ratio[seq], low, high, low, -log_ratio.detach(), clipfrac=high)


def _vespo(logp, old, adv, iw, mask, seq, n_slots, count, policy: Policy, seq_adv: torch.Tensor | None = None
           ) -> TokenObjective:
    """TRL GRPOTrainer.get_gamma_weights: phi(w) of the sequence's ratio product w (rollout weights
    included: per token, their product; a sequence-level rollout weight, once), by the sign of each
    token's advantage; the loss -sg(phi) A logp. vespo/phi_seq_mean as TRL's global_masked_mean:
    over the sequences (an empty one has w = 1) with one advantage per sequence (``seq_adv``, as
    given: a masked token's advantage is 0 here), else over tokens."""
    with torch.no_grad():
        lower = math.log(1e-8)
        log_ratio = torch.clamp(logp - old, -20.0, 20.0)
        seq_log_ratio = _seq_sum(log_ratio * mask, seq, n_slots)
        if iw is not None:
            log_iw = _seq_sum(torch.clamp(torch.log(iw), lower, 20.0) * mask, seq, n_slots)
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


def cov_base_policy(policy: Policy) -> Policy:
    """The row-local objective under clip_cov / kl_cov before their selected tokens change: the clip
    objective (no dual clip, no cap, no +-20 clamp), for kl_cov unclipped (-A r)."""
    update = dict(objective="clip", convention="trl", delta=None, dual_clip_c=None)
    if policy.objective == "kl_cov":
        update.update(eps_low=1.0, eps_high=math.inf)  # clip(r, 0, inf) = r
    return policy.model_copy(update=update)


def _covariance(logp, old, adv, mask, policy: Policy) -> TokenObjective:
    """verl compute_policy_loss_clip_cov / _kl_cov: the tokens whose (A - mean A)(logp - mean logp)
    is largest (kl_cov: the top cov_ratio share; clip_cov: a random cov_ratio share of those with
    cov in (lb, ub) and not clipped already) lose the clip objective's gradient (clip_cov) or get
    kl_cov_coef |log r| added to -A r (kl_cov)."""
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


def policy_objective(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    mask: torch.Tensor,
    policy: Policy,
    inp: PolicyInputs,
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of the policy term from per-token log-probs ``logp`` (N,) with gradient
    (``with_metrics=False``: no metrics, an empty dict).

    Written for few device ops (each one is a launch on the host's critical path at 8K tokens).
    """
    old = inp.old_logprobs if inp.old_logprobs is not None else logp.detach()
    tok = objective_of(logp, entropy, old, inp.advantages, inp.importance_weights, mask, seq_of(inp), inp.n_slots,
                       policy, inp.rollout_logprobs, inp.seq_advantages, inp.quantile_group)
    per_token = tok.loss
    kl = None
    if policy.kl_beta != 0.0:
        kl = kl_estimate(logp, inp.ref_logprobs, policy)
        if policy.kl_importance_correction:
            kl = kl * tok.ratio
        per_token = per_token + policy.kl_beta * kl
    weight = inp.weight
    loss = (per_token * weight).sum()
    if policy.entropy_coef != 0.0:
        loss = loss - policy.entropy_coef * (entropy * entropy_bonus_weight(policy, weight, mask, tok)).sum()
    return loss, policy_metrics_of(logp, entropy, tok, kl, mask, inp) if with_metrics else {}


def policy_metrics_of(logp, entropy, tok: TokenObjective, kl, mask, inp: PolicyInputs) -> dict[str, torch.Tensor]:
    """TRL / verl metric names: means over masked tokens; clip_ratio/low_min and high_max over
    sequences (of each sequence's clipped fraction); ratio/min and max over masked tokens."""
    with torch.no_grad():
        low, high = tok.low.to(mask.dtype), tok.high.to(mask.dtype)
        names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "ratio/mean", "logprob/mean", "pg_clipfrac_lower",
                 "ppo_kl"]
        rows = [low, high, tok.ratio.detach(), logp.detach(), tok.dual.to(mask.dtype), tok.ppo_kl]
        if tok.clipfrac is not None:
            names.append("pg_clipfrac")
            rows.append(tok.clipfrac.to(mask.dtype))
        if entropy is not None:
            names.append("entropy")
            rows.append(entropy.detach())
        if kl is not None:
            names.append("kl")
            rows.append(kl.detach())
        count = mask.sum()
        means = (torch.stack(rows) * mask).sum(dim=1) / count.clamp(min=1.0)
    out = dict(zip(names, means.float().unbind()))
    if inp.sequence_level:  # TRL: one ratio per sequence, its clip fractions are means over sequences
        with torch.no_grad():
            seq = seq_of(inp)
            tokens = _seq_sum(mask, seq, inp.n_slots).clamp(min=1.0)
            n_seq = inp.n_seq.clamp(min=1) if isinstance(inp.n_seq, torch.Tensor) else max(inp.n_seq, 1)
            for name, t in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high)):
                out[name] = ((_seq_sum(t * mask, seq, inp.n_slots) / tokens).sum() / n_seq).float()
    clipfrac = out.pop("pg_clipfrac", None)
    out.update(policy_extremes(out, tok.ratio, low, high, mask, count, inp))
    if clipfrac is not None:
        out["pg_clipfrac"] = clipfrac
    out.update({k: v.float() for k, v in (tok.extra or {}).items()})
    if tok.high_entropy is not None and entropy is not None:
        out.update(high_entropy_metrics(entropy, tok.high_entropy, mask))
    return out


def high_entropy_metrics(entropy: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The top-entropy mask's share of the counted tokens, and the mean entropy of the tokens it
    keeps (what TRL's token-mean entropy bonus subtracts)."""
    with torch.no_grad():
        kept = high.to(mask.dtype) * mask
        n = kept.sum()
        return {"high_entropy/fraction": (n / mask.sum().clamp(min=1.0)).float(),
                "high_entropy/entropy": ((entropy.detach() * kept).sum() / n.clamp(min=1.0)).float()}


def policy_extremes(means: dict[str, torch.Tensor], ratio, low, high, mask, count, inp: PolicyInputs
                    ) -> dict[str, torch.Tensor]:
    """The metrics that are not token means: each sequence's clipped fractions (their min / max),
    the ratio's min / max over counted tokens, the clipped region; ratio/mean is 1 (not 0) when no
    token counts. ``means`` holds the token means (from the kernel's columns or from torch)."""
    if _extremes_in_kernel(ratio, mask, inp):
        from .kernels.head import launch_sequence_extremes  # (kernels.head imports this module, via plan)

        *extremes, region, ratio_mean = launch_sequence_extremes(
            ratio.detach(), low, high, mask, count, means["clip_ratio/low_mean"], means["clip_ratio/high_mean"],
            means["ratio/mean"], inp.n_slots, inp.seq_len).unbind()
    else:
        with torch.no_grad():
            ratio = ratio.detach()
            # per-sequence clipped fractions: one index_add over both indicators
            per_seq = torch.zeros(3, inp.n_slots, dtype=mask.dtype, device=mask.device).index_add_(
                1, seq_of(inp), torch.stack([low * mask, high * mask, mask])
            )
            has_tokens = per_seq[2] > 0
            frac = per_seq[:2] / per_seq[2].clamp(min=1.0)
            big = math.inf  # (as the reference and the kernel path: an infinite ratio is its own extreme)
            keep = mask > 0
            # no torch.tensor(python values) here: a host-to-device copy would sync the stream
            defaults = (torch.arange(4, device=mask.device) >= 2).to(mask.dtype)  # clipped 0, ratios 1
            if inp.n_slots and ratio.numel():
                values = torch.stack([
                    torch.where(has_tokens, frac[0], big).amin(),
                    torch.where(has_tokens, frac[1], -big).amax(),
                    torch.where(keep, ratio, big).amin(),
                    torch.where(keep, ratio, -big).amax(),
                ])
                values = torch.where(count > 0, values, defaults)  # nothing counted: never +-inf
            else:
                values = defaults
        extremes = values.float().unbind()
        region = means["clip_ratio/low_mean"] + means["clip_ratio/high_mean"]
        ratio_mean = torch.where(count > 0, means["ratio/mean"], 1.0)
    out = dict(zip(["clip_ratio/low_min", "clip_ratio/high_max", "ratio/min", "ratio/max"], extremes))
    out["clip_ratio/region_mean"] = out["pg_clipfrac"] = region  # (pg_clipfrac: verl's name)
    out["ratio/mean"] = ratio_mean
    return out


def objective_route(policy: Policy, token_shape: tuple[int, ...], sequence_ids: bool, device: torch.device) -> bool:
    """Whether deferred mode's policy term can run by Triton launches (kernels.head.launch_policy_objective)
    instead of policy_objective's ~100 small torch ops: a row-local objective (sequence-level ratios and
    the off-policy mask included; no top-entropy mask, a batch quantile) on tokens of [B, T] sequences
    (no sequence_ids), on the kernels' device, outside torch.compile."""
    from .inputs import resolve_backend  # (inputs imports this module)
    from .spec import ROW_LOCAL_OBJECTIVES

    return (policy.objective in ROW_LOCAL_OBJECTIVES and policy.top_entropy_quantile == 1.0
            and len(token_shape) == 2 and not sequence_ids and math.prod(token_shape) > 0
            and not torch.compiler.is_compiling() and resolve_backend("auto", device, torch.float32) == "triton")


def objective_in_kernel(policy: Policy, inp: PolicyInputs, rows: torch.Tensor) -> bool:
    """Deferred mode's policy term on ``rows`` (its packed per-token rows, fp32) by the kernels: inputs
    read as given (``inp.raw``: policy_inputs chose the kernels, see :func:`objective_route`), or the
    fp32 flat copies of a call on a route that allows it, none of them wanting a gradient (the kernels
    give d loss / d rows only)."""
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[0] != inp.n_slots * (
            inp.seq_len if isinstance(inp.seq_len, int) else -1):
        return False
    if inp.raw:
        return True
    if inp.sequence_ids is not None or not objective_route(policy, (inp.n_slots, inp.seq_len), False, rows.device):
        return False
    flat = (inp.advantages, inp.old_logprobs, inp.ref_logprobs, inp.importance_weights, inp.mask, inp.weight,
            inp.rollout_logprobs)
    return all(t is None or (t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous()
                             and t.shape[0] == rows.shape[0] and t.device == rows.device
                             and not (t.requires_grad and torch.is_grad_enabled())) for t in flat)


def _extremes_in_kernel(ratio: torch.Tensor, mask: torch.Tensor, inp: PolicyInputs) -> bool:
    """policy_extremes by two Triton launches: rows of [B, T] (no sequence_ids) on the kernels' device,
    outside torch.compile; the ~30 small torch ops cost a synchronised call more host time than its
    kernel at RL micro-batch shapes (benchmarks/bench_host.py)."""
    from .inputs import resolve_backend  # (inputs imports this module)

    return (inp.sequence_ids is None and isinstance(inp.seq_len, int) and inp.n_slots > 0 and inp.seq_len > 0
            and ratio.dim() == 1 and ratio.numel() == inp.n_slots * inp.seq_len and mask.is_contiguous()
            and mask.dtype == torch.float32 and resolve_backend("auto", mask.device, mask.dtype) == "triton"
            and not torch.compiler.is_compiling())


def policy_inputs(
    spec_policy: Policy | None,
    token_shape: tuple[int, ...],
    targets: torch.Tensor | None,
    ignore_index: int,
    num_items_in_batch: float | torch.Tensor | None,
    validate: str,
    given: dict[str, torch.Tensor | None],
    in_kernel: bool = False,
    norm_length: int | None = None,
    deferred_kernel: bool = False,
) -> tuple[PolicyInputs | None, torch.Tensor | None]:
    """Check and flatten the policy term's per-call inputs; returns (inputs, effective targets).

    Tokens outside ``loss_mask`` become ``ignore_index`` in the effective targets, so the kernel
    skips them and every term sees the same mask. Errors name the offending argument. No device
    value is read: sequence_ids in range is checked on the device with the targets (``validate``).
    ``in_kernel``: the token-level objective runs in the kernel, which reads the inputs as they are
    (any float dtype, per-sequence advantages by index) and never at a masked token: no copies.
    ``deferred_kernel``: the caller can run deferred mode's objective by its kernels (a scalar loss);
    it does, reading the inputs as they are, when :func:`objective_route` allows. Otherwise the
    objective runs in torch, on copies whose masked tokens hold 0.
    """
    present = {k: v for k, v in given.items() if v is not None}
    if spec_policy is None:
        if present:
            raise ValueError(f"{sorted(present)[0]}: given, but the spec has no policy term")
        return None, targets
    num_sequences = present.pop("num_sequences_in_batch", None)
    quantile_group = quantile_group_of(present.pop("entropy_quantile_group", None), spec_policy)
    if "advantages" not in present:
        raise ValueError("advantages: required by policy but not given")
    if spec_policy.kl_beta != 0.0 and "ref_logprobs" not in present:
        raise ValueError("ref_logprobs: required by policy.kl_beta > 0 but not given")
    device = targets.device
    num_sequences = sequences_in_batch(num_sequences, spec_policy, device)
    rows = math.prod(token_shape)
    if spec_policy.rollout_is is not None:
        for name in ("old_logprobs", "rollout_logprobs"):
            if name not in present:
                raise ValueError(f"{name}: required by policy.rollout_is but not given")
        if "importance_weights" in present:
            raise ValueError("importance_weights: given, but policy.rollout_is computes them (from old_logprobs "
                             "and rollout_logprobs); pass one or the other")
    for name in ("old_logprobs", "ref_logprobs", "loss_mask", "importance_weights", "rollout_logprobs"):
        t = present.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(token_shape):
            got = tuple(getattr(t, "shape", ()))
            raise ValueError(f"{name}: expected shape {tuple(token_shape)} (like targets), got {got}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, targets on {device}")
    sequence_ids = None
    seq_len = 0
    if len(token_shape) == 2:
        batch, seq_len = token_shape
        seq = None  # seq_of builds it when something needs it
        n_slots, n_seq = batch, batch
        if "sequence_ids" in present:
            raise ValueError("sequence_ids: only for [N, V] logits; [B, T, V] logits give the sequences")
    else:
        if "sequence_ids" not in present:
            raise ValueError("sequence_ids: required by policy for [N, V] logits (the sequence of each row)")
        sequence_ids = present["sequence_ids"]
        if (not isinstance(sequence_ids, torch.Tensor) or tuple(sequence_ids.shape) != (rows,)
                or sequence_ids.dtype not in (torch.int64, torch.int32)):
            got = f"{sequence_ids.dtype} {tuple(sequence_ids.shape)}" if isinstance(sequence_ids, torch.Tensor) \
                else type(sequence_ids).__name__
            raise ValueError(f"sequence_ids: expected integer shape ({rows},), got {got}")
        if sequence_ids.device != device:
            raise ValueError(f"sequence_ids: on {sequence_ids.device}, targets on {device}")
        if validate != "off" and device.type == "cpu" and rows and not torch.compiler.is_compiling() and bool(
            ((sequence_ids < 0) | (sequence_ids >= rows)).any()
        ):
            raise ValueError(f"sequence_ids: values must lie in [0, {rows})")
        seq = sequence_ids.long().clamp(0, max(rows - 1, 0))
        n_slots = rows
        counts = torch.zeros(rows, dtype=torch.int64, device=device).index_add_(0, seq, torch.ones_like(seq))
        n_seq = (counts > 0).sum()
        seq_len = counts.max() if rows else 0
    advantages = present["advantages"]
    if not isinstance(advantages, torch.Tensor) or advantages.device != device:
        raise ValueError(f"advantages: expected a tensor on {device}")
    per_sequence = len(token_shape) == 2 and tuple(advantages.shape) == (token_shape[0],)
    if not per_sequence and tuple(advantages.shape) != tuple(token_shape):
        per_seq = f"[{token_shape[0]}] per sequence or " if len(token_shape) == 2 else ""
        raise ValueError(
            f"advantages: expected {per_seq}{tuple(token_shape)} per token, got {tuple(advantages.shape)}"
        )
    # (the objective kernels give no gradient to the policy inputs: inputs that want one take torch's ops)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in present.values()
                                                 if isinstance(t, torch.Tensor))
    raw = in_kernel or (deferred_kernel and not wants_grad
                        and objective_route(spec_policy, token_shape, sequence_ids is not None, device))
    mask = targets != ignore_index
    if "loss_mask" in present:
        mask = mask & present["loss_mask"].bool()
    flat_mask = mask.reshape(-1)

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if raw:  # read as they are, never at a masked token
            return t.reshape(-1).contiguous()
        # masked tokens are skipped: whatever they hold (padding NaN, -inf) never reaches the loss
        return torch.where(flat_mask, t.reshape(-1).float(), 0.0)

    adv_span = 1
    if per_sequence and raw:
        adv_span = token_shape[1]
        advantages = advantages.contiguous()
    else:
        advantages = flat(advantages.repeat_interleave(token_shape[1]) if per_sequence else advantages)
    inputs = PolicyInputs(
        advantages=advantages,
        old_logprobs=flat(present.get("old_logprobs")),
        ref_logprobs=flat(present.get("ref_logprobs")),
        importance_weights=flat(present.get("importance_weights")),
        seq=seq,
        n_slots=n_slots,
        n_seq=n_seq,
        seq_len=seq_len,
        num_items_in_batch=num_items_in_batch,
        sequence_ids=sequence_ids,
        adv_span=max(adv_span, 1),
        raw=raw,
    )
    inputs.mask = flat_mask.float()
    inputs.norm_length = norm_length
    inputs.num_sequences_in_batch = num_sequences
    inputs.quantile_group = quantile_group
    inputs.weight = aggregation_weights(inputs.mask, spec_policy, inputs)
    inputs.sequence_level = spec_policy.importance_sampling == "sequence"
    inputs.seq_advantages = present["advantages"] if per_sequence else None
    if "rollout_logprobs" in present:
        masked = lambda t: torch.where(flat_mask, t.reshape(-1).float(), 0.0)  # noqa: E731
        inputs.rollout_logprobs = masked(present["rollout_logprobs"])
        if spec_policy.rollout_is is not None:
            seq = seq_of(inputs) if spec_policy.rollout_is == "sequence" else None  # token mode: no index
            inputs.importance_weights = rollout_weights(masked(present["old_logprobs"]), inputs.rollout_logprobs,
                                                        inputs.mask, seq, inputs.n_slots, spec_policy)
    return inputs, torch.where(mask, targets, ignore_index)


SEQUENCE_MEAN_TYPES = ("grpo", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def sequences_in_batch(value: Any, policy: Policy, device: torch.device) -> float | torch.Tensor | None:
    """Check num_sequences_in_batch (verl's global_batch_size: the sequences of the whole batch over
    the data-parallel ranks): a positive number or a one-element tensor (inputs.count_value), for a
    loss type that is a mean over sequences. The mean's denominator becomes it / num_processes
    (verl's dp_size)."""
    from .inputs import count_value  # (inputs imports this module)

    if value is None:
        return None
    name = "num_sequences_in_batch"
    if policy.loss_type not in SEQUENCE_MEAN_TYPES or (
            policy.loss_type == "seq-mean-token-sum-norm" and policy.convention != "verl"):
        raise ValueError(f"{name}: only for a mean over sequences (loss_type grpo, seq-mean-token-mean, "
                         f"seq-mean-token-sum, or seq-mean-token-sum-norm with convention='verl'), the spec has "
                         f"loss_type={policy.loss_type!r} and convention={policy.convention!r}")
    if policy.objective in ("gmpo",):
        raise ValueError(f"{name}: objective 'gmpo' is verl's geo_mean, a mean over this call's sequences")
    count = count_value(value, name, device)
    return count.float() if isinstance(count, torch.Tensor) else count


def quantile_group_of(group: Any, policy: Policy) -> Any:
    """Check entropy_quantile_group: a torch.distributed process group (or the default group's
    ``torch.distributed.group.WORLD``), for a spec with a top-entropy mask."""
    if group is None:
        return None
    name = "entropy_quantile_group"
    if policy.top_entropy_quantile == 1.0:
        raise ValueError(f"{name}: given, but the spec has no top-entropy mask (policy.top_entropy_quantile is 1)")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    return group


def rollout_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor | None,
                    n_slots: int, policy: Policy) -> torch.Tensor:
    """Rollout correction weights (N,), no gradient: exp(old - rollout) per token or exp of the
    sequence's masked sum (TRL's vLLM importance sampling ratio, verl's rollout_is; verl's
    convention clamps the log-ratio to +-20), truncated to [min, max] or zeroed outside it,
    optionally divided by the batch mean (verl's rollout_is_batch_normalize)."""
    with torch.no_grad():
        log_ratio = torch.nan_to_num((old - rollout) * mask, nan=0.0)
        if policy.rollout_is == "sequence":
            log_ratio = _seq_sum(log_ratio, seq, n_slots)[seq]
        if policy.convention == "verl":
            log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
        weights = torch.exp(log_ratio)
        low, high = policy.rollout_is_min, policy.rollout_is_max
        if policy.rollout_is_mode == "truncate":
            weights = torch.clamp(weights, min=low, max=high)
        else:
            keep = torch.ones_like(weights, dtype=torch.bool)
            if low is not None:
                keep = keep & (weights >= low)
            if high is not None:
                keep = keep & (weights <= high)
            weights = torch.where(keep, weights, 0.0)
        if policy.rollout_is_batch_normalize:
            if policy.rollout_is == "token":
                mean = (weights * mask).sum() / (mask.sum() + 1e-8)
            else:
                counts = _seq_sum(mask, seq, n_slots)
                per_seq = _seq_sum(weights * mask, seq, n_slots) / (counts + 1e-8)
                has = (counts > 0).to(weights.dtype)
                mean = (per_seq * has).sum() / has.sum().clamp_min(1e-8)
            weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights.contiguous()
