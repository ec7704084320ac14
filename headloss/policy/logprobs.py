"""The policy term on per-token log-probs computed elsewhere (an engine's own fused head, a
framework's policy-loss hook): the same torch formulas as the ``deferred+torch`` route, without
a head pass."""

from __future__ import annotations

from typing import Unpack

import torch

from ..batch import PolicyBatch, PolicyInputs, check_keywords
from ..output import HeadLossOutput
from ..plan import in_metric_order
from ..row_inputs import flat_token_weights
from ..spec import LossSpec, Policy
from ..validation import check_row_input, count_value
from .inputs import policy_inputs
from .objectives import policy_objective
from .weights import weigh_tokens

_IGNORE = -100


def policy_loss(
    logprobs: torch.Tensor,
    policy: Policy | LossSpec,
    *,
    entropy: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    norm_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    **inputs: Unpack[PolicyInputs],
) -> HeadLossOutput:
    """``Policy``'s loss and metrics from per-token log-probs ``logprobs`` ([B, T], or [N] with
    ``sequence_ids``), with gradient to them (and to ``entropy`` when the policy has an entropy
    bonus). Inputs (:class:`headloss.batch.PolicyInputs`; ``advantages`` required) as
    :func:`headloss.head_loss` takes them; ``norm_length`` replaces T in
    seq-mean-token-sum-norm (verl's ``loss_scale_factor``); ``token_weights`` (like ``logprobs``, or one
    per sequence) with a LossSpec whose ``token_weights`` is set, in the aggregation as head_loss takes them.

    No host read for a bool ``loss_mask``; another dtype is checked to hold only 0 and 1 on the
    host (one read; the error names ``loss_mask``)."""
    check_keywords(inputs, PolicyInputs, "policy_loss")
    if inputs.get("advantages") is None:
        raise TypeError("policy_loss() missing required keyword argument: 'advantages'")
    loss_mask = inputs.get("loss_mask")
    spec = policy if isinstance(policy, LossSpec) else LossSpec(cross_entropy=None, policy=policy) \
        if isinstance(policy, Policy) else None
    if isinstance(policy, LossSpec):
        policy = policy.policy
    if not isinstance(policy, Policy):
        raise TypeError(f"policy: expected a headloss Policy (or a LossSpec with one), got {type(policy).__name__}")
    if not isinstance(logprobs, torch.Tensor) or not logprobs.is_floating_point() or logprobs.dim() not in (1, 2):
        got = f"{logprobs.dtype} {tuple(logprobs.shape)}" if isinstance(logprobs, torch.Tensor) else \
            type(logprobs).__name__
        raise ValueError(f"logprobs: expected a floating-point [B, T] or [N] tensor, got {got}")
    shape = tuple(logprobs.shape)
    if entropy is not None and (not isinstance(entropy, torch.Tensor) or tuple(entropy.shape) != shape):
        raise ValueError(f"entropy: expected shape {shape} (like logprobs), got {tuple(getattr(entropy, 'shape', ()))}")
    if policy.top_entropy_quantile < 1.0 or policy.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy: required by policy.top_entropy_quantile / entropy_coef but not given")
    if (isinstance(loss_mask, torch.Tensor) and loss_mask.dtype != torch.bool
            and bool(((loss_mask != 0) & (loss_mask != 1)).any())):
        raise ValueError("loss_mask: holds a value that is neither 0 nor 1 (the mask says which tokens count; a "
                         "token's weight goes in importance_weights)")
    targets = torch.zeros(shape, dtype=torch.long, device=logprobs.device)
    given = PolicyBatch.of(inputs).by_name()
    if num_items_in_batch is not None:
        num_items_in_batch = count_value(num_items_in_batch, "num_items_in_batch", logprobs.device)
    weights = flat_token_weights(token_weights, spec, shape, logprobs.device)
    if weights is not None:
        check_row_input("token_weights", weights, shape)
    inp, _ = policy_inputs(policy, targets, _IGNORE, num_items_in_batch, "off", given, norm_length=norm_length)
    weigh_tokens(inp, spec, weights)
    mask = inp.mask > 0
    # a masked token's log-prob (padding) reaches nothing, even when it is not finite
    logp = torch.where(mask, logprobs.reshape(-1).float(), 0.0)
    ent = None if entropy is None else torch.where(mask, entropy.reshape(-1).float(), 0.0)
    loss, metrics = policy_objective(logp, ent, inp.mask, policy, inp)
    metrics["loss"] = loss.detach().clone()
    metrics["n_tokens"] = inp.mask.sum()
    return HeadLossOutput(loss=loss, metrics=in_metric_order(metrics))
