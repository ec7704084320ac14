"""TRL's two masks of the policy term: the off-policy sequence mask and the top-entropy token mask,
with the quantile it needs, computed on the device (and over processes)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..parallel import comm_device, gather_padded
from .tokens import ObjectiveRows, seq_sum


def off_policy_keep(rows: ObjectiveRows, rollout: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """TRL get_off_policy_mask: keep a sequence's tokens if A >= 0 or the mean over its tokens of
    ``rollout`` log-probs (else old_logprobs) - logp is at most ``threshold``."""
    logp, old, adv, _, mask, seq, n_slots, count, _ = rows
    sampled = rollout if rollout is not None else old  # TRL: sampling_per_token_logps, else old
    drift = torch.nan_to_num(sampled - logp.detach(), nan=0.0)
    mean_drift = (seq_sum(drift * mask, seq, n_slots) / count.clamp(min=1.0))[seq]
    return (adv >= 0) | (mean_drift <= threshold)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, group: Any = None) -> torch.Tensor:
    """TRL get_high_entropy_mask: the counted tokens whose entropy is at least the batch's
    (1 - quantile)-quantile (over ``group``'s processes when given), in the entropy's own precision
    (a token at the threshold is kept), on the device."""
    values = entropy.detach()
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    threshold = masked_quantile(values, mask > 0, 1.0 - quantile, group)
    return ((values * mask) >= threshold) & (mask > 0)


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
    if group is not None and dist.get_world_size(group) > 1:
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


def high_entropy_metrics(entropy: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The top-entropy mask's share of the counted tokens, and the mean entropy of the tokens it
    keeps (what TRL's token-mean entropy bonus subtracts)."""
    with torch.no_grad():
        kept = high.to(mask.dtype) * mask
        n = kept.sum()
        return {"high_entropy/fraction": (n / mask.sum().clamp(min=1.0)).float(),
                "high_entropy/entropy": ((entropy.detach() * kept).sum() / n.clamp(min=1.0)).float()}
