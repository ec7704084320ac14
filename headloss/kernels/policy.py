"""Token-level GRPO-family objective as a per-row epilogue of the head kernel (fused mode).

With token-level importance ratios every policy quantity is a function of the row's own
log p(target): the kernel computes it, the per-token surrogate and its derivative, and folds
d loss / d logp into the gradient pass like any other term (A -= v, D += v). The aggregation
(TRL / verl loss types) arrives as a per-row weight w (headloss.policy.aggregation_weights), so
loss = sum_rows w * per_token. Sequence-level ratios (GSPO) need other rows: they run in torch
on the deferred mode's log-probs instead (headloss.policy.policy_objective), written from the
same formulas; both are tested against the trainers' fp64 reference.

Derivatives follow torch's autograd conventions, so both paths agree at the kinks: clamp passes
the gradient on its closed interval, minimum splits it evenly on ties.
"""

import triton
import triton.language as tl


@triton.jit
def _min_with_grad(a, da, b, db):
    """min(a, b) and its derivative (ties split evenly, as torch.minimum)."""
    value = tl.minimum(a, b)
    grad = tl.where(a < b, da, tl.where(a > b, db, 0.5 * (da + db)))
    return value, grad


@triton.jit
def policy_token(
    logp,  # log p(target) of the row, natural units
    old,  # the rollout policy's log-prob (logp itself when on-policy)
    ref,  # the reference policy's log-prob (KL_EST > 0)
    adv,  # advantage of the row
    iw,  # rollout importance weight (1 when absent)
    eps_low,
    eps_high,
    delta,  # two-sided clip cap (inf when off)
    dual_c,  # dual clip constant (inf when off)
    kl_beta,
    KL_EST: tl.constexpr,  # 0 none, 1 k1, 2 k2, 3 k3
    KL_IS_CORR: tl.constexpr,
):
    """(per_token_loss, d per_token_loss / d logp, ratio, kl) of one token."""
    ratio = tl.exp(logp - old)
    d_ratio = ratio
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    clipped = tl.minimum(tl.maximum(ratio, lo), hi)
    d_clipped = tl.where((ratio >= lo) & (ratio <= hi), d_ratio, 0.0)
    capped = tl.minimum(ratio, delta)
    d_capped = tl.where(ratio <= delta, d_ratio, 0.0)
    surrogate, d_surrogate = _min_with_grad(capped * adv, d_capped * adv, clipped * adv, d_clipped * adv)
    per_token = -surrogate
    d_per_token = -d_surrogate
    # verl's dual clip bounds the loss of negative advantages by -adv * c
    dual, d_dual = _min_with_grad(per_token, d_per_token, -adv * dual_c, 0.0)
    per_token = tl.where(adv < 0, dual, per_token)
    d_per_token = tl.where(adv < 0, d_dual, d_per_token)
    per_token = per_token * iw
    d_per_token = d_per_token * iw
    kl = tl.zeros_like(logp)
    if KL_EST != 0:
        if KL_EST == 1:
            kl = logp - ref
            d_kl = tl.full(logp.shape, 1.0, tl.float32)
        elif KL_EST == 2:
            kl = 0.5 * (logp - ref) * (logp - ref)
            d_kl = logp - ref
        else:
            gap = ref - logp
            kl = tl.exp(gap) - gap - 1.0
            d_kl = 1.0 - tl.exp(gap)
        if KL_IS_CORR:
            d_kl = d_kl * ratio + kl * d_ratio
            kl = kl * ratio
        per_token += kl_beta * kl
        d_per_token += kl_beta * d_kl
    return per_token, d_per_token, ratio, kl
