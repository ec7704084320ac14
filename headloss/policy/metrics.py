"""The policy term's metrics, under TRL's and verl's names."""

from __future__ import annotations

import math

import torch

from ..kernels.policy import launch_sequence_extremes
from ..layouts import EXTREME_METRICS, EXTREMES
from ..ops import kernel_op
from .masks import high_entropy_metrics
from .tokens import PolicyTokens, TokenObjective, seq_of, seq_sum


def policy_metrics(logp, entropy, tok: TokenObjective, kl, mask, inp: PolicyTokens, extremes_by_kernel: bool = False
                   ) -> dict[str, torch.Tensor]:
    """TRL / verl metric names: means over masked tokens; clip_ratio/low_min and high_max over
    sequences (of each sequence's clipped fraction); ratio/min and max over masked tokens.
    ``extremes_by_kernel``: :func:`extremes` by its two launches."""
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
    empty = None
    if inp.sequence_level:  # TRL: one ratio and one advantage per sequence, clip fractions are means over sequences
        with torch.no_grad():
            seq = seq_of(inp)
            tokens = seq_sum(mask, seq, inp.n_slots)
            empty = (tokens == 0).any()
            n_seq = inp.n_seq.clamp(min=1) if isinstance(inp.n_seq, torch.Tensor) else max(inp.n_seq, 1)
            for name, t in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high)):
                out[name] = ((seq_sum(t * mask, seq, inp.n_slots) / tokens.clamp(min=1.0)).sum() / n_seq).float()
    clipfrac = out.pop("pg_clipfrac", None)
    high_entropy = {} if tok.high_entropy is None or entropy is None else \
        high_entropy_metrics(entropy, tok.high_entropy, mask)
    out.update(extremes(out, tok.ratio, low, high, mask, count, inp, extremes_by_kernel))
    if empty is not None:  # TRL's masked_seq_mean: a sequence without counted tokens enters nanmin as 0
        out["clip_ratio/low_min"] = torch.where(empty, 0.0, out["clip_ratio/low_min"])
    if clipfrac is not None:
        out["pg_clipfrac"] = clipfrac
    out.update({k: v.float() for k, v in (tok.extra or {}).items()})
    out.update(high_entropy)
    return out


def extremes(means: dict[str, torch.Tensor], ratio, low, high, mask, count, inp: PolicyTokens,
             by_kernel: bool = False) -> dict[str, torch.Tensor]:
    """The metrics that are not token means (layouts.EXTREME_METRICS): each sequence's clipped
    fractions (their min / max), the ratio's min / max over counted tokens, the clipped region;
    ratio/mean is 1 (not 0) when no token counts. ``means`` holds the token means (from the kernel's
    columns or from torch). ``by_kernel`` (the route allows the sequence kernels; [B, T] rows): two
    launches where torch takes about 30 small ops."""
    if by_kernel and inp.sequence_ids is None and inp.n_slots > 0 and inp.seq_len > 0:
        values = sequence_extremes(
            ratio.detach(), low, high, mask, count, low_mean=means["clip_ratio/low_mean"],
            high_mean=means["clip_ratio/high_mean"], ratio_mean=means["ratio/mean"], n_seq=inp.n_slots,
            seq_len=inp.seq_len).unbind()
        extreme = [values[EXTREMES.low_min], values[EXTREMES.high_max], values[EXTREMES.ratio_min],
                   values[EXTREMES.ratio_max]]
        region, ratio_mean = values[EXTREMES.region_mean], values[EXTREMES.ratio_mean]
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
        extreme = values.float().unbind()
        region = means["clip_ratio/low_mean"] + means["clip_ratio/high_mean"]
        ratio_mean = torch.where(count > 0, means["ratio/mean"], 1.0)
    out = dict(zip(EXTREME_METRICS[:4], extreme))
    out["clip_ratio/region_mean"] = out["pg_clipfrac"] = region  # (pg_clipfrac: verl's name)
    out["ratio/mean"] = ratio_mean
    return out


def _extremes_fake(ratio, low, high, mask, count, low_mean, high_mean, ratio_mean, n_seq, seq_len):
    return torch.empty(EXTREMES.N, dtype=torch.float32, device=mask.device)


@kernel_op("headloss::sequence_extremes", fake=_extremes_fake)
def sequence_extremes(ratio: torch.Tensor, low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor,
                      count: torch.Tensor, low_mean: torch.Tensor, high_mean: torch.Tensor, ratio_mean: torch.Tensor,
                      n_seq: int, seq_len: int) -> torch.Tensor:
    """kernels.policy.launch_sequence_extremes as an op (the same two launches under torch.compile)."""
    return launch_sequence_extremes(ratio, low, high, mask, count, low_mean=low_mean, high_mean=high_mean,
                                    ratio_mean=ratio_mean, n_seq=n_seq, seq_len=seq_len)
