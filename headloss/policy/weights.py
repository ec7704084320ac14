"""The policy term's per-token weights: how each loss type aggregates (TRL's and verl's), the entropy
bonus's weight, and the rollout correction's importance weights. Each depends on the mask, the
sequence layout and the inputs only, so each is computed once per call, without gradient."""

from __future__ import annotations

import torch

from ..policy_tables import LOSS_TYPES
from ..spec import LossSpec, Policy, separate_kl_entropy
from .tokens import PolicyTokens, seq_of, seq_sum


def aggregation_weights(mask: torch.Tensor, policy: Policy, inp: PolicyTokens, kind: str | None = None
                        ) -> torch.Tensor:
    """Per-token weight w with loss = sum(w * per_token), as TRL / verl aggregate each loss type:
    the objective's (``policy.loss_type``), or ``kind`` (the KL penalty's and entropy bonus's
    kl_entropy_loss_type, aggregated as verl's agg_loss even beside geo_mean). With token weights
    (``inp.token_weights``, spec.TokenWeights), they take the mask's place in the loss type's sums
    (normalize "weights": a sequence whose weights are all 0 counts as one without tokens), or multiply
    its per-token weight (normalize "tokens").

    Depends on the mask, the token weights and the sequence layout only, so it is computed once,
    without gradient.
    """
    if inp.token_weights is None:
        return _aggregation_weights(mask, policy, inp, kind)
    if inp.weights_by_count:
        return inp.token_weights * _aggregation_weights(mask, policy, inp, kind)
    return _aggregation_weights(mask * inp.token_weights, policy, inp, kind)


def _aggregation_weights(mask: torch.Tensor, policy: Policy, inp: PolicyTokens, kind: str | None) -> torch.Tensor:
    own = kind is None
    kind = policy.loss_type if own else kind
    global_count = inp.num_sequences_in_batch if LOSS_TYPES[kind].over == "sequences" else None
    if global_count is not None or (policy.convention == "verl" and kind.startswith("seq-mean")
                                    and (policy.objective != "gmpo" or not own)):
        # verl's agg_loss: over global_batch_size / dp_size sequences when given, else over the
        # sequences with counted tokens (geo_mean's torch.mean counts every sequence)
        seq = seq_of(inp)
        tokens_per_seq = seq_sum(mask, seq, inp.n_slots)
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
        tokens_per_seq = seq_sum(mask, seq, inp.n_slots).clamp(min=1.0)
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


def kl_entropy_weights(mask: torch.Tensor, policy: Policy, inp: PolicyTokens) -> torch.Tensor | None:
    """The KL penalty's and the entropy bonus's per-token weights when they aggregate apart from the
    objective (Policy.separate_kl_entropy; else None: the objective's weights)."""
    if not separate_kl_entropy(policy):
        return None
    return aggregation_weights(mask, policy, inp, policy.kl_entropy_loss_type or policy.loss_type)


def entropy_bonus_weight(policy: Policy, weight: torch.Tensor, mask: torch.Tensor,
                         high_entropy: torch.Tensor | None, inp: PolicyTokens) -> torch.Tensor:
    """Per-token weight of the entropy in the bonus: the KL penalty's (``weight``; verl), or TRL's mean
    over the counted tokens (those the top-entropy mask keeps, ``high_entropy``, when it is on: TRL's
    effective_mask), weighted by the token weights as :func:`aggregation_weights` says."""
    if policy.entropy_aggregation == "loss":
        return weight
    return token_mean_weights(mask if high_entropy is None else mask * high_entropy.to(mask.dtype), inp)


def token_mean_weights(counted: torch.Tensor, inp: PolicyTokens) -> torch.Tensor:
    """Per-token weights of TRL's mean over the ``counted`` tokens, with the token weights as
    :func:`aggregation_weights` takes them (their sum as the divisor, or the count)."""
    if inp.token_weights is None:
        return counted / counted.sum().clamp(min=1.0)
    weighted = counted * inp.token_weights
    if inp.weights_by_count:
        return weighted / counted.sum().clamp(min=1.0)
    total = weighted.sum()
    return weighted / torch.where(total > 0, total, torch.ones_like(total))


def weigh_tokens(inp: PolicyTokens | None, spec: LossSpec, weights: torch.Tensor | None) -> None:
    """The token weights (``spec.token_weights``; ``weights`` flat like the mask) in the policy term's
    aggregation: its per-token weights made again with them (:func:`aggregation_weights`). Nothing without a
    policy term (``inp`` None) or without weights."""
    if inp is None or weights is None:
        return
    inp.token_weights = torch.where(inp.mask > 0, weights, 0.0)
    inp.weights_by_count = spec.token_weights.normalize == "tokens"
    inp.weight = aggregation_weights(inp.mask, spec.policy, inp)
    inp.kl_entropy_weight = kl_entropy_weights(inp.mask, spec.policy, inp)


def rollout_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor | None,
                    n_slots: int, policy: Policy) -> torch.Tensor:
    """Rollout correction weights (N,), no gradient: exp(old - rollout) per token or exp of the
    sequence's masked sum (TRL's vLLM importance sampling ratio, verl's rollout_is; verl's
    convention clamps the log-ratio to +-20), truncated to [min, max] or zeroed outside it,
    optionally divided by the batch mean (verl's rollout_is_batch_normalize). A NaN at a counted
    token stays NaN (its weight, so the loss, is NaN); masked tokens never count."""
    with torch.no_grad():
        log_ratio = torch.where(mask > 0, old - rollout, 0.0)
        if policy.rollout_is == "sequence":
            log_ratio = seq_sum(log_ratio, seq, n_slots)[seq]
        if policy.convention == "verl":
            log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
        weights = torch.exp(log_ratio)
        low, high = policy.rollout_is_min, policy.rollout_is_max
        if policy.rollout_is_mode == "truncate":
            weights = torch.clamp(weights, min=low, max=high)
        else:  # zero the weights outside [low, high] (a NaN weight is not outside: it stays NaN)
            drop = torch.zeros_like(weights, dtype=torch.bool)
            if low is not None:
                drop = drop | (weights < low)
            if high is not None:
                drop = drop | (weights > high)
            weights = weights.masked_fill(drop, 0.0)
        if policy.rollout_is_batch_normalize:
            if policy.rollout_is == "token":
                mean = (weights * mask).sum() / (mask.sum() + 1e-8)
            else:
                counts = seq_sum(mask, seq, n_slots)
                per_seq = seq_sum(weights * mask, seq, n_slots) / (counts + 1e-8)
                has = (counts > 0).to(weights.dtype)
                mean = (per_seq * has).sum() / has.sum().clamp_min(1e-8)
            weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights.contiguous()
