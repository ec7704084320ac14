"""The policy term's inputs as flat token rows, and sums over each row's sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch


@dataclass
class PolicyTokens:
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
    kl_entropy_weight: torch.Tensor | None = None  # (N,) the KL's and entropy bonus's, when apart (else weight)
    sequence_ids: torch.Tensor | None = None  # (N,) as given, for the device-side range check
    rollout_logprobs: torch.Tensor | None = None  # (N,) fp32, 0 at masked tokens
    sequence_level: bool = False  # TRL's sequence-level ratios with [B] advantages: clip fractions over sequences
    seq_advantages: torch.Tensor | None = None  # (B,) as given, when one per sequence of [B, T] tokens
    norm_length: int | None = None  # seq-mean-token-sum-norm's T when the rows are longer (padded)
    num_sequences_in_batch: float | torch.Tensor | None = None  # verl's global_batch_size (seq-mean modes)
    adv_span: int = 1  # tokens per entry of ``advantages`` (K: one per sequence of [B, K], kernel only)
    token_weights: torch.Tensor | None = None  # (N,) fp32 spec.TokenWeights' per token, 0 at masked tokens
    weights_by_count: bool = False  # the token weights multiply the aggregation (normalize "tokens"); else they
    # take the mask's place in its sums (normalize "weights")
    quantile_group: Any = None  # the processes whose tokens form the top-entropy quantile's batch
    raw: bool = False  # inputs as given (any float dtype, advantages by index: adv_span), read only at counted
    # tokens by the kernels (the fused epilogue, or deferred mode's objective kernel); else fp32 copies holding 0
    # at masked tokens, for torch


_CARRIED = tuple(f.name for f in fields(PolicyTokens) if f.name != "quantile_group")
_INT_FIELDS = frozenset({"n_slots", "n_seq", "seq_len", "norm_length", "adv_span"})
_BOOL_FIELDS = frozenset({"sequence_level", "raw", "weights_by_count"})


def policy_as_lists(inp: PolicyTokens | None) -> tuple[list[torch.Tensor | None], list[float]]:
    """``inp`` as a torch.library op takes it: each field a tensor (its value 0.0) or a number (its
    tensor None; NaN: None). Not carried: a process group (``quantile_group``)."""
    if inp is None:
        return [], []
    tensors: list[torch.Tensor | None] = []
    values: list[float] = []
    for name in _CARRIED:
        value = getattr(inp, name)
        tensors.append(value if isinstance(value, torch.Tensor) else None)
        values.append(0.0 if isinstance(value, torch.Tensor) else math.nan if value is None else float(value))
    return tensors, values


def policy_from_lists(tensors: list[torch.Tensor | None], values: list[float]) -> PolicyTokens | None:
    """The PolicyTokens that :func:`policy_as_lists` flattened (None for empty lists)."""
    if not tensors:
        return None
    kwargs: dict[str, Any] = {}
    for name, tensor, value in zip(_CARRIED, tensors, values, strict=True):
        if tensor is not None:
            kwargs[name] = tensor
        elif math.isnan(value):
            kwargs[name] = None
        else:
            kwargs[name] = int(value) if name in _INT_FIELDS else bool(value) if name in _BOOL_FIELDS else value
    return PolicyTokens(**kwargs)


def seq_of(inp: PolicyTokens) -> torch.Tensor:
    """The sequence of each row, built on first use for [B, T] rows (the fused kernel needs none:
    two launches fewer per call)."""
    if inp.seq is None:
        inp.seq = torch.arange(inp.n_slots, device=inp.advantages.device).repeat_interleave(inp.seq_len)
    return inp.seq


def seq_sum(values: torch.Tensor, seq: torch.Tensor, n_seq: int) -> torch.Tensor:
    """Per-sequence sums (n_seq,) of per-token ``values`` whose sequences are ``seq``."""
    return torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, seq, values)


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


class ObjectiveRows(NamedTuple):
    """An objective's per-token inputs on flat rows (N,), with each row's sequence: what the objectives of
    sequence or batch statistics and the off-policy mask read (policy.objectives.objective_of makes it)."""

    logp: torch.Tensor  # with gradient
    old: torch.Tensor
    adv: torch.Tensor
    iw: torch.Tensor | None  # rollout weights
    mask: torch.Tensor
    seq: torch.Tensor  # each row's sequence in [0, n_slots)
    n_slots: int
    count: torch.Tensor  # counted tokens per sequence (n_slots,)
    seq_adv: torch.Tensor | None = None  # one advantage per sequence, when given so
