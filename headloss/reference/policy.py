"""The policy term in plain torch, on padded [B, T] tensors, written from TRL's and verl's own code.

This is the oracle of the kernels and of headloss.policy: it shares nothing with them but the spec.
Each objective, KL estimator, importance-sampling level and loss type is transcribed from its
source (TRL 1.16 ``GRPOTrainer._compute_loss`` and its helpers, verl ``core_algos.py``:
``compute_policy_loss_*``, ``kl_penalty``, ``agg_loss``, ``rollout_corr_helper``), in the
trainers' shapes: per-sequence values as [B, 1], masked means as sums over the mask.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..packed import Packed, packed_per_sequence
from ..spec import LossSpec, Policy, PolicyLossType
from .objectives import FOLD_WEIGHTS, OBJECTIVES, Batch, PerToken

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


def reference_policy_loss(logp, entropy, valid, spec: LossSpec, token_shape, num_items_in_batch, inputs,
                          token_weights=None):
    """(loss, metrics) of the policy term: TRL GRPOTrainer._compute_loss / verl compute_policy_loss +
    agg_loss, on padded [B, T]. ``token_weights`` (spec.TokenWeights, one per row): in every aggregation
    they take the mask's place (normalize "weights") or multiply the per-token values (normalize "tokens")."""
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
    w, by_count = (None, False) if token_weights is None else (pad(token_weights[0]), token_weights[1])

    def weighed(values, kind):
        """aggregate() with the token weights: in the mask's place, or on the values."""
        if w is None:
            return aggregate(values, mask, pol, num_items_in_batch, num_sequences, kind)
        if by_count:
            return aggregate(values * w, mask, pol, num_items_in_batch, num_sequences, kind)
        return aggregate(values, mask * w, pol, num_items_in_batch, num_sequences, kind)

    per_token_kl = None
    kl_loss = 0.0
    if pol.kl_beta != 0.0:
        per_token_kl = kl_penalty(per_token_logps, pad(inputs["ref_logprobs"]), pol)
        if pol.kl_importance_correction:
            per_token_kl = per_token_kl * coef_1
        if apart:
            kl_loss = pol.kl_beta * weighed(per_token_kl, aux_kind)
        else:  # TRL: per_token_loss = per_token_loss + self.beta * per_token_kl
            per_token_loss = per_token_loss + pol.kl_beta * per_token_kl

    loss = weighed(per_token_loss, None) + kl_loss
    if pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean":  # TRL: over its effective mask
        counted = mask if high_entropy is None else mask * high_entropy.to(mask.dtype)
        divisor = counted.sum().clamp(min=1.0)
        if w is not None:
            divisor = divisor if by_count else (counted * w).sum()
            counted = counted * w
            divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
        loss = loss - pol.entropy_coef * (ent * counted).sum() / divisor
    elif pol.entropy_coef != 0.0:
        loss = loss - pol.entropy_coef * weighed(ent, aux_kind)
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
