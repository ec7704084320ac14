"""The policy term's per-call inputs: checked (errors name the argument) and flattened to tokens."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import bounded
from ..packed import Packed, marked, packed_per_sequence
from ..policy_tables import LOSS_TYPES
from ..spec import Policy, separate_kl_entropy
from ..validation import NOT_BINARY, count_value
from .tokens import PolicyTokens, seq_of
from .weights import aggregation_weights, kl_entropy_weights, rollout_weights


def policy_inputs(
    spec_policy: Policy | None,
    targets: torch.Tensor | None,
    ignore_index: int,
    num_items_in_batch: float | torch.Tensor | None,
    validate: str,
    given: dict[str, torch.Tensor | None],
    raw: bool = False,
    norm_length: int | None = None,
) -> tuple[PolicyTokens | None, torch.Tensor | None]:
    """Check and flatten the policy term's per-call inputs; returns (inputs, effective targets).

    Tokens outside ``loss_mask`` become ``ignore_index`` in the effective targets: every term sees the
    same mask. No device value is read (sequence_ids' range is checked on the device with the targets).
    ``raw``: the route's kernels read the inputs as they are (any float dtype, per-sequence advantages by
    index, never at a masked token); otherwise fp32 copies whose masked tokens hold 0.
    """
    present = {k: v for k, v in given.items() if v is not None}
    if spec_policy is None:
        if present:
            raise ValueError(f"{sorted(present)[0]}: given, but the spec has no policy term, the only one that "
                             "reads it; drop it or add spec.policy")
        return None, targets
    warn_unread(present, spec_policy)
    token_shape = tuple(targets.shape)  # (row-aligned: the policy inputs' shape)
    num_sequences = present.pop("num_sequences_in_batch", None)
    quantile_group = quantile_group_of(present.pop("entropy_quantile_group", None), spec_policy)
    if "advantages" not in present:
        raise ValueError("advantages: required by policy but not given")
    if spec_policy.kl_beta != 0.0 and "ref_logprobs" not in present:
        raise ValueError("ref_logprobs: required by policy.kl_beta > 0 but not given")
    device = targets.device
    num_sequences = sequences_in_batch(num_sequences, spec_policy, device)
    rows = math.prod(token_shape)
    _check_token_inputs(present, spec_policy, token_shape, device)
    seq, n_slots, n_seq, seq_len, sequence_ids, packed = _sequences(present, token_shape, rows, device, validate)
    advantages, per_sequence = _check_advantages(present, token_shape, rows, device, packed)
    mask, not_binary = _token_mask(targets, ignore_index, present.get("loss_mask"), validate)
    flat_mask = mask.reshape(-1)

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if raw:  # read as they are, never at a masked token
            return t.reshape(-1).contiguous()
        # masked tokens are skipped: whatever they hold (padding NaN, -inf) never reaches the loss
        return torch.where(flat_mask, t.reshape(-1).float(), 0.0)

    adv_span = 1
    if per_sequence and packed is not None:
        advantages = flat(advantages.reshape(-1)[packed.seq])
    elif per_sequence and raw:
        adv_span = token_shape[1]
        advantages = advantages.contiguous()
    else:
        advantages = flat(advantages.repeat_interleave(token_shape[1]) if per_sequence else advantages)
    inputs = PolicyTokens(
        advantages=advantages, old_logprobs=flat(present.get("old_logprobs")),
        ref_logprobs=flat(present.get("ref_logprobs")), importance_weights=flat(present.get("importance_weights")),
        seq=seq, n_slots=n_slots, n_seq=n_seq, seq_len=seq_len, num_items_in_batch=num_items_in_batch,
        sequence_ids=sequence_ids, adv_span=max(adv_span, 1), raw=raw,
    )
    inputs.mask = flat_mask.float()
    inputs.norm_length = norm_length
    inputs.num_sequences_in_batch = num_sequences
    inputs.quantile_group = quantile_group
    inputs.weight = aggregation_weights(inputs.mask, spec_policy, inputs)
    inputs.kl_entropy_weight = kl_entropy_weights(inputs.mask, spec_policy, inputs)
    # TRL's [B, 1] ratios with [B] advantages: its clip indicators are one per sequence
    inputs.sequence_level = spec_policy.importance_sampling == "sequence" and per_sequence
    inputs.seq_advantages = present["advantages"].reshape(-1) if per_sequence else None
    if "rollout_logprobs" in present:
        _rollout_inputs(inputs, present, flat_mask, spec_policy)
    effective = torch.where(mask, targets, ignore_index)
    if not_binary is not None:
        effective = torch.where(not_binary, NOT_BINARY, effective.long())
    if packed is not None:  # a malformed cu_seqlens is reported whatever loss_mask says
        effective = marked(effective, packed, validate)
    return inputs, effective


def _token_mask(targets: torch.Tensor, ignore_index: int, loss_mask: torch.Tensor | None, validate: str):
    """(the tokens that count, the loss_mask values neither 0 nor 1 or None): checked on the device with
    the targets."""
    mask = targets != ignore_index
    if loss_mask is None:
        return mask, None
    not_binary = (loss_mask != 0) & (loss_mask != 1) if validate != "off" and loss_mask.dtype != torch.bool else None
    return mask & loss_mask.bool(), not_binary


def _rollout_inputs(inputs: PolicyTokens, present: dict[str, Any], flat_mask: torch.Tensor, policy: Policy) -> None:
    """The rollout's log-probs (fp32, 0 at masked tokens) and, with policy.rollout_is, the importance
    weights they give."""
    masked = lambda t: torch.where(flat_mask, t.reshape(-1).float(), 0.0)  # noqa: E731
    inputs.rollout_logprobs = masked(present["rollout_logprobs"])
    if policy.rollout_is is not None:
        seq = seq_of(inputs) if policy.rollout_is == "sequence" else None  # token mode: no index
        inputs.importance_weights = rollout_weights(masked(present["old_logprobs"]), inputs.rollout_logprobs,
                                                    inputs.mask, seq, inputs.n_slots, policy)


def _check_token_inputs(present: dict[str, Any], policy: Policy, token_shape: tuple[int, ...],
                        device: torch.device) -> None:
    """The per-token inputs' presence (rollout correction), shapes and devices."""
    if policy.rollout_is is not None:
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


class _Sequences(NamedTuple):
    """The rows' sequences: each row's (None: the rows of [B, T], seq_of builds it when something needs it),
    the slots and sequences, the longest sequence, the sequence_ids as given, the packed layout."""

    seq: torch.Tensor | None
    n_slots: int
    n_seq: Any  # an int, or a device count ([N] rows with sequence_ids)
    seq_len: Any
    sequence_ids: torch.Tensor | None
    packed: Packed | None


def _sequences(present: dict[str, Any], token_shape: tuple[int, ...], rows: int, device: torch.device,
               validate: str) -> _Sequences:
    """The rows' sequences -- the rows of [B, T] tokens, packed rows' boundaries, or [N] rows'
    sequence_ids."""
    if len(token_shape) == 2:
        if "sequence_ids" in present:
            raise ValueError("sequence_ids: only for [N, V] logits; [B, T, V] logits give the sequences")
        batch, seq_len = token_shape
        return _Sequences(None, batch, batch, seq_len, None, None)
    if isinstance(present.get("sequence_ids"), Packed):  # packed rows: their boundaries are the sequences
        packed = present["sequence_ids"]
        return _Sequences(packed.seq, packed.n_slots, packed.n_seq, packed.max_len, None, packed)
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
    counts = torch.zeros(rows, dtype=torch.int64, device=device).index_add_(0, seq, torch.ones_like(seq))
    return _Sequences(seq, rows, (counts > 0).sum(), counts.max() if rows else 0, sequence_ids, None)


def _check_advantages(present: dict[str, Any], token_shape: tuple[int, ...], rows: int, device: torch.device,
                      packed: Packed | None) -> tuple[torch.Tensor, bool]:
    """(advantages, whether one per sequence), checked."""
    advantages = present["advantages"]
    if not isinstance(advantages, torch.Tensor) or advantages.device != device:
        raise ValueError(f"advantages: expected a tensor on {device}")
    per_sequence = (len(token_shape) == 2 and tuple(advantages.shape) == (token_shape[0],)) or (
        packed is not None and packed.per_sequence and packed_per_sequence(advantages.shape, packed.n_slots, rows))
    if not per_sequence and tuple(advantages.shape) != tuple(token_shape):
        per_seq = f"[{token_shape[0]}] per sequence or " if len(token_shape) == 2 else \
            f"[{packed.n_slots}, 1] or [{packed.n_slots}] per sequence or " if packed is not None and \
            packed.per_sequence else ""
        raise ValueError(
            f"advantages: expected {per_seq}{tuple(token_shape)} per token, got {tuple(advantages.shape)}"
        )
    return advantages, per_sequence


UNREAD: dict[str, tuple[Callable[[Policy], bool], str]] = {
    "ref_logprobs": (lambda p: p.kl_beta != 0.0,
                     "the spec's policy has kl_beta=0, so no KL term reads it; drop it or set policy.kl_beta"),
    "rollout_logprobs": (lambda p: p.rollout_is is not None or p.off_policy_mask is not None,
                         "the spec's policy has neither rollout_is nor off_policy_mask, the terms that read it; drop "
                         "it or set one of them"),
}
"""Policy inputs a spec's policy may leave unread, each with whether it reads it and why not: a call
that passes one it does not read is warned (trainers pass the rollout's and the reference model's
log-probs along with every batch; refusing them would break such loops, ignoring them silently
would hide a KL term or a rollout correction that was meant to be on)."""

_WARNED = bounded.cache("policy.unread_inputs", 256, "(argument, Policy) pairs already warned about an unread input")


def warn_unread(present: dict[str, Any], policy: Policy) -> None:
    """Warn, once per (argument, policy), that the call passes an input the policy does not read
    (at the caller's line; not while torch.compile traces the call)."""
    for name, (reads, why) in UNREAD.items():
        if name not in present or reads(policy) or torch.compiler.is_compiling() or (name, policy) in _WARNED:
            continue
        _WARNED[(name, policy)] = True
        warnings.warn(f"{name}: {why}", UserWarning, stacklevel=_outside_headloss())


def _outside_headloss() -> int:
    """The stacklevel of the first frame outside headloss, as seen from warn_unread's warnings.warn."""
    frame, level = sys._getframe(2), 2  # (warn_unread's caller)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "headloss":
        frame, level = frame.f_back, level + 1
    return level


def sequences_in_batch(value: Any, policy: Policy, device: torch.device) -> float | torch.Tensor | None:
    """Check num_sequences_in_batch (verl's global_batch_size: the sequences of the whole batch over
    the data-parallel ranks): a positive number or a one-element tensor (inputs.count_value), for a
    loss type that is a mean over sequences. The mean's denominator becomes it / num_processes
    (verl's dp_size)."""
    if value is None:
        return None
    name = "num_sequences_in_batch"
    over_sequences = lambda kind: LOSS_TYPES[kind].over == "sequences" and not (  # noqa: E731
        kind == "seq-mean-token-sum-norm" and policy.convention != "verl")
    if not over_sequences(policy.loss_type) and not (
            separate_kl_entropy(policy) and over_sequences(policy.kl_entropy_loss_type or policy.loss_type)):
        raise ValueError(f"{name}: only for a mean over sequences (loss_type grpo, seq-mean-token-mean, "
                         f"seq-mean-token-sum, or seq-mean-token-sum-norm with convention='verl'), the spec has "
                         f"loss_type={policy.loss_type!r} and convention={policy.convention!r}")
    if policy.objective == "gmpo":
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
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    return group


