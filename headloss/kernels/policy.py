"""The policy term's kernels over [B, T] sequences: one program per sequence, then one finishing program.

``policy_sequence_kernel`` + ``policy_objective_finish_kernel``
    deferred mode's policy objective (sequence-level ratios, TRL's off-policy mask, or a row-local
    objective deferred for its outputs' gradient): the loss, every metric and d loss / d rows in two
    launches, where torch took about 100 small ops (policy.objectives has the same formulas).
``sequence_extremes_kernel`` + ``extremes_finish_kernel``
    the token-level policy term's per-sequence clip fractions and ratio extremes, from its columns.

The per-token objective is kernels/terms.py's ``_objective`` and ``kl_estimator``, shared with the fused
epilogue. What each program writes is a named layout (layouts.ObjectivePart, SequenceExtremes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layouts import (
    EXTREMES,
    EXTREMES_AT,
    OBJECTIVE_OUT,
    OBJECTIVE_PART,
    OUT_AT,
    PART_AT,
    SEQUENCE_EXTREMES,
    SEQUENCE_EXTREMES_AT,
)
from ..policy_tables import IMPORTANCE_SAMPLING
from ..registry import Scalars
from .launch import launch
from .terms import _objective, kl_estimator

IS_TOKEN = tl.constexpr(IMPORTANCE_SAMPLING["token"].kernel)
IS_SEQUENCE = tl.constexpr(IMPORTANCE_SAMPLING["sequence"].kernel)
IS_SEQUENCE_TOKEN = tl.constexpr(IMPORTANCE_SAMPLING["sequence_token"].kernel)


@triton.jit
def _extremes_step(r_min, r_max, nan, ratio, keep):
    """Running extremes of the kept ratios; a kept NaN is flagged in ``nan`` (it wins, as torch's amin)."""
    nan |= (keep & (ratio != ratio)).to(tl.int32)
    ok = keep & (ratio == ratio)
    return tl.where(ok, tl.minimum(r_min, ratio), r_min), tl.where(ok, tl.maximum(r_max, ratio), r_max), nan


@triton.jit
def sequence_extremes_kernel(
    ratio, low, high,  # (n_seq * seq_len,) fp32 columns (strided), 0/1 indicators for low and high
    mask,  # (n_seq * seq_len,) fp32, 1 where a token counts
    part,  # (n_seq, SEQUENCE_EXTREMES.N) fp32 out (layouts.SequenceExtremes)
    stride_r, stride_l, stride_h, seq_len,
    BLOCK: tl.constexpr,
):
    """One program per sequence of ``seq_len`` rows: its clipped fractions and its counted tokens'
    ratio extremes (NaN if a counted ratio is NaN, as torch's amin), for extremes_finish_kernel."""
    s = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    n_low = tl.zeros([BLOCK], tl.float32)
    n_high = tl.zeros([BLOCK], tl.float32)
    n_tok = tl.zeros([BLOCK], tl.float32)
    r_min = tl.full([BLOCK], float("inf"), tl.float32)
    r_max = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, seq_len, BLOCK):
        t = start + offs
        inside = t < seq_len
        i = s * seq_len + t
        m = tl.load(mask + i, mask=inside, other=0.0).to(tl.float32)
        n_low += tl.load(low + i * stride_l, mask=inside, other=0.0).to(tl.float32) * m
        n_high += tl.load(high + i * stride_h, mask=inside, other=0.0).to(tl.float32) * m
        n_tok += m
        r = tl.load(ratio + i * stride_r, mask=inside, other=1.0).to(tl.float32)
        r_min, r_max, nan = _extremes_step(r_min, r_max, nan, r, m > 0)
    tokens = tl.sum(n_tok, axis=0)
    # correctly rounded, as torch divides (the GPU's default fp32 division is within 2 ulp)
    low_frac = tl.math.div_rn(tl.sum(n_low, axis=0), tl.maximum(tokens, 1.0))
    high_frac = tl.math.div_rn(tl.sum(n_high, axis=0), tl.maximum(tokens, 1.0))
    has_nan = tl.max(nan, axis=0) != 0
    lowest = tl.where(has_nan, float("nan"), tl.min(r_min, axis=0))
    highest = tl.where(has_nan, float("nan"), tl.max(r_max, axis=0))
    out = part + s * SEQUENCE_EXTREMES_AT.N
    tl.store(out + SEQUENCE_EXTREMES_AT.low_frac, tl.where(tokens > 0, low_frac, float("inf")))
    tl.store(out + SEQUENCE_EXTREMES_AT.neg_high_frac, tl.where(tokens > 0, -high_frac, float("inf")))
    tl.store(out + SEQUENCE_EXTREMES_AT.ratio_min, lowest)
    tl.store(out + SEQUENCE_EXTREMES_AT.neg_ratio_max, -highest)


@triton.jit
def _column_minima(part, n_seq, N: tl.constexpr, BLOCK: tl.constexpr):
    """Each column's minimum over the n_seq rows of a (n_seq, N) fp32 table (NaN wins, as torch's amin),
    and each column's sum; ``N`` a power of two."""
    offs = tl.arange(0, BLOCK)
    cols = tl.arange(0, N)
    sums = tl.zeros([BLOCK, N], tl.float32)
    mins = tl.full([BLOCK, N], float("inf"), tl.float32)
    nan = tl.zeros([BLOCK, N], tl.int32)
    for start in range(0, n_seq, BLOCK):
        i = start + offs
        valid = (i < n_seq)[:, None] & (cols[None, :] < N)
        v = tl.load(part + i[:, None] * N + cols[None, :], mask=valid, other=0.0)
        sums += v
        v = tl.where(valid, v, float("inf"))
        nan |= (v != v).to(tl.int32)
        mins = tl.where(v == v, tl.minimum(mins, v), mins)
    lowest = tl.where(tl.max(nan, axis=0) != 0, float("nan"), tl.min(mins, axis=0))
    return lowest, tl.sum(sums, axis=0)


@triton.jit
def _pick(values, k):
    """values[k] of a vector indexed by tl.arange (a register read by its position)."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == k, values, 0.0), axis=0)


@triton.jit
def extremes_finish_kernel(
    part,  # (n_seq, SEQUENCE_EXTREMES.N) fp32 from sequence_extremes_kernel
    count,  # (1,) counted tokens, any dtype
    low_mean, high_mean, ratio_mean,  # () fp32 token means
    out,  # (EXTREMES.N,) fp32 out (layouts.Extremes)
    n_seq,
    BLOCK: tl.constexpr,
):
    """The minima over sequences (NaN wins), and the values of a call with no counted token:
    clipped fractions 0, ratios 1."""
    lowest, _ = _column_minima(part, n_seq, SEQUENCE_EXTREMES_AT.N, BLOCK)
    counted = tl.load(count).to(tl.float32) > 0
    tl.store(out + EXTREMES_AT.low_min, tl.where(counted, _pick(lowest, SEQUENCE_EXTREMES_AT.low_frac), 0.0))
    tl.store(out + EXTREMES_AT.high_max, tl.where(counted, -_pick(lowest, SEQUENCE_EXTREMES_AT.neg_high_frac), 0.0))
    tl.store(out + EXTREMES_AT.ratio_min, tl.where(counted, _pick(lowest, SEQUENCE_EXTREMES_AT.ratio_min), 1.0))
    tl.store(out + EXTREMES_AT.ratio_max, tl.where(counted, -_pick(lowest, SEQUENCE_EXTREMES_AT.neg_ratio_max), 1.0))
    tl.store(out + EXTREMES_AT.region_mean, tl.load(low_mean).to(tl.float32) + tl.load(high_mean).to(tl.float32))
    tl.store(out + EXTREMES_AT.ratio_mean, tl.where(counted, tl.load(ratio_mean).to(tl.float32), 1.0))


_FP32_MAX = tl.constexpr(3.4028234663852886e38)
OBJECTIVE_BLOCK = 512
"""Tokens per step of policy_sequence_kernel's passes over a sequence (its program loops over longer ones)."""


@triton.jit
def _objective_token(lp, o, r, a, iwv, keepf, L, g_self, S, F: tl.constexpr):
    """One token of the deferred mode's policy objective, the ratio exp(L) given (L: the token's own
    log-ratio, or its sequence's; ``g_self`` = d L / d logp of this token alone): (per_token,
    d per_token / d logp through this token alone, d per_token / d L, ratio, kl, low, high, dual).
    policy.objective_of and policy_objective have the same formulas in torch."""
    ratio = tl.exp(L)
    obj, d_obj, low, high, dual = _objective(lp, o, a, ratio, ratio * g_self, S, F)
    d_L = tl.zeros_like(lp)
    if F.IS_MODE == IS_SEQUENCE:  # (g_self = 0: d_obj is the part that does not go through the ratio)
        _, d_both, _, _, _ = _objective(lp, o, a, ratio, ratio, S, F)
        d_L = (d_both - d_obj) * iwv * keepf
    per_token = obj * iwv * keepf
    d_self = d_obj * iwv * keepf
    kl = tl.zeros_like(lp)
    if F.KL_EST != 0:
        kl, d_kl = kl_estimator(lp, r, F.KL_EST, F.KL_CLAMP, F.KL_K2_GRAD)
        if F.KL_IS_CORR:
            d_kl = d_kl * ratio + kl * ratio * g_self
            if F.IS_MODE == IS_SEQUENCE:
                d_L += S.kl_beta * kl * ratio
            kl = kl * ratio
        per_token += S.kl_beta * kl
        d_self += S.kl_beta * d_kl
    return per_token, d_self, d_L, ratio, kl, low, high, dual


@triton.jit
def _tokens(first, start, seq_len, BLOCK: tl.constexpr):
    """Tokens [start, start + BLOCK) of the sequence of ``seq_len`` tokens from ``first``: (inside it, index)."""
    t = start + tl.arange(0, BLOCK)
    return t < seq_len, first + t


@triton.jit
def _objective_at(logp, entropy, old, ref, adv, iw, mask, weight, bonus, first, start, seq_len, stride_l, stride_e,
                  adv_span, mean, mean_drift, off_policy, n_counted, S, F: tl.constexpr, BLOCK: tl.constexpr):
    """The sequence's tokens [start, start + BLOCK) (_tokens: inside, i; old = logp when None, no rollout
    weight = 1; advantages by index ``i // adv_span``): (inside, i, mask, logp, entropy, weight, the entropy
    bonus's weight, the token's log-ratio, and _objective_token's values) -- ``mean`` / ``mean_drift``: the
    sequence's mean log-ratio and off-policy drift."""
    inside, i = _tokens(first, start, seq_len, BLOCK)
    m = tl.load(mask + i, mask=inside, other=0.0)
    counted = inside & (m > 0)  # the inputs are read at counted tokens only; 0 elsewhere (as torch's copies)
    lp = tl.load(logp + i * stride_l, mask=inside, other=0.0)
    o = lp
    if old is not None:
        o = tl.load(old + i, mask=counted, other=0.0).to(tl.float32)
    r = lp
    if F.KL_EST != 0:
        r = tl.load(ref + i, mask=counted, other=0.0).to(tl.float32)
    iwv = tl.full(lp.shape, 1.0, tl.float32)
    if iw is not None:
        iwv = tl.load(iw + i, mask=counted, other=0.0).to(tl.float32)
    ent = tl.zeros_like(lp)
    if entropy is not None:
        ent = tl.load(entropy + i * stride_e, mask=inside, other=0.0)
    a = tl.load(adv + i // adv_span, mask=counted, other=0.0).to(tl.float32)
    w = tl.load(weight + i, mask=inside, other=0.0)
    keepf = tl.full(lp.shape, 1.0, tl.float32)
    if F.OFF_POLICY:  # TRL: keep a sequence if A >= 0 or its mean drift is at most the threshold
        keepf = tl.where((a >= 0) | (tl.zeros_like(a) + mean_drift <= off_policy), 1.0, 0.0)
    log_ratio, L, g = _log_ratio_of(lp, o, mean, F)
    L = tl.where(inside, L, 0.0)  # lanes past the sequence: ratio 1 (its ratio there is inf * 0 = NaN in the sums)
    per_token, d_self, d_L, ratio, kl, low, high, dual = _objective_token(lp, o, r, a, iwv, keepf, L, g, S, F)
    bonus_w = w  # verl: the entropy aggregated like the loss; TRL: a mean over the call's counted tokens
    if F.ENT_TOKEN_MEAN:
        if bonus is not None:  # (by the token weights)
            bonus_w = tl.load(bonus + i, mask=inside, other=0.0)
        else:
            bonus_w = tl.math.div_rn(m, n_counted)
    return inside, i, m, lp, ent, w, bonus_w, log_ratio, per_token, d_self, d_L, ratio, kl, low, high, dual


@triton.jit
def _log_ratio_of(lp, o, mean, F: tl.constexpr):
    """(the token's log-ratio as ppo_kl reads it, L, d L / d logp of the token alone) by the
    importance-sampling mode (``mean``: the sequence's mean log-ratio)."""
    log_ratio = lp - o
    g = tl.full(lp.shape, 1.0, tl.float32)
    if F.LOG_RATIO_CLAMP:
        g = tl.where((log_ratio >= -20.0) & (log_ratio <= 20.0), g, 0.0)
        log_ratio = tl.minimum(tl.maximum(log_ratio, -20.0), 20.0)
    if F.IS_MODE == IS_TOKEN:
        L = log_ratio
    elif F.IS_MODE == IS_SEQUENCE:  # TRL's GSPO: the sequence's ratio, the gradient through every token of it
        L = tl.zeros_like(lp) + mean
        g = tl.zeros_like(lp)
    elif F.IS_MODE == IS_SEQUENCE_TOKEN:  # verl's gspo: the sequence's value (at most 10), each token's own gradient
        L = tl.zeros_like(lp) + tl.where(mean > 10.0, 10.0, mean)
        g = tl.where(mean <= 10.0, 1.0, 0.0) + tl.zeros_like(lp)
    else:
        tl.static_assert(False, "an importance-sampling level of policy_tables has no kernel piece here")
    return log_ratio, L, g


@triton.jit
def policy_sequence_kernel(
    logp, entropy,  # (N,) columns of the deferred mode's packed rows (any stride); entropy None without one
    old, ref, adv, iw, mask, weight, sampled,  # (N,) flat policy inputs, any float dtype, read at counted tokens
    # only (mask > 0; fp32 mask and weight); advantages (N / adv_span,); old, ref, iw, sampled may be None
    # (sampled: the off-policy mask's rollout log-probs, else old)
    bonus,  # (N,) fp32 TRL's token-mean entropy bonus's per-token weights (with token weights), or None
    count,  # (1,) the call's counted tokens (TRL's token-mean entropy bonus), else None
    part,  # (n_seq, OBJECTIVE_PART.N) fp32 out (layouts.ObjectivePart), or None (gradient only)
    d_rows,  # (N, D_COLS) fp32 out: d loss / d logp and d loss / d entropy in their columns, 0 elsewhere; or None
    stride_l, stride_e, seq_len, adv_span, off_policy,
    S, F: tl.constexpr, D_COLS: tl.constexpr, COL_LOGP: tl.constexpr, COL_ENT: tl.constexpr,
    COLS_P2: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per sequence of ``seq_len`` rows: the policy objective of deferred mode (sequence-level
    ratios, the off-policy mask), its sums and extremes for the metrics, and d loss / d rows -- two launches
    where torch took about 100 small ops (policy.policy_objective, forward and backward)."""
    s = tl.program_id(0).to(tl.int64)
    first = s * seq_len
    zero = tl.zeros([BLOCK], tl.float32)
    # 1. the sequence's mean log-ratio and the off-policy mask's mean drift
    mean = tl.zeros([], tl.float32)
    mean_drift = tl.zeros([], tl.float32)
    if F.IS_MODE != IS_TOKEN or F.OFF_POLICY:
        acc_r = zero
        acc_d = zero
        acc_n = zero
        for start in range(0, seq_len, BLOCK):
            inside, i = _tokens(first, start, seq_len, BLOCK)
            m = tl.load(mask + i, mask=inside, other=0.0)
            counted = inside & (m > 0)
            lp = tl.load(logp + i * stride_l, mask=inside, other=0.0)
            o = lp
            if old is not None:
                o = tl.load(old + i, mask=counted, other=0.0).to(tl.float32)
            acc_r += (lp - o) * m
            acc_n += m
            if F.OFF_POLICY:
                smp = o
                if sampled is not None:
                    smp = tl.load(sampled + i, mask=counted, other=0.0).to(tl.float32)
                drift = smp - lp  # torch.nan_to_num: NaN -> 0, +-inf -> fp32's extremes
                drift = tl.where(drift != drift, 0.0, tl.minimum(tl.maximum(drift, -_FP32_MAX), _FP32_MAX))
                acc_d += drift * m
        per = tl.maximum(tl.sum(acc_n, axis=0), 1.0)
        mean = tl.math.div_rn(tl.sum(acc_r, axis=0), per)
        mean_drift = tl.math.div_rn(tl.sum(acc_d, axis=0), per)
    n_counted = tl.full([], 1.0, tl.float32)
    if F.ENT_TOKEN_MEAN:
        n_counted = tl.maximum(tl.load(count).to(tl.float32), 1.0)
    # 2. the objective: the sequence's share of the loss and of the metrics, d loss / d L
    loss_acc = zero
    d_seq = zero
    s_low = zero
    s_high = zero
    s_ratio = zero
    s_lp = zero
    s_dual = zero
    s_pkl = zero
    s_ent = zero
    s_kl = zero
    n_tok = zero
    r_min = tl.full([BLOCK], float("inf"), tl.float32)
    r_max = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, seq_len, BLOCK):
        _, _, m, lp, ent, w, bonus_w, log_ratio, per_token, d_self, d_L, ratio, kl, low, high, dual = _objective_at(
            logp, entropy, old, ref, adv, iw, mask, weight, bonus, first, start, seq_len, stride_l, stride_e, adv_span,
            mean, mean_drift, off_policy, n_counted, S, F, BLOCK)
        loss_acc += w * per_token
        d_seq += w * d_L
        if F.ENT_BONUS:
            loss_acc -= S.entropy_coef * (ent * bonus_w)
        s_low += low.to(tl.float32) * m
        s_high += high.to(tl.float32) * m
        s_ratio += ratio * m
        s_lp += lp * m
        s_dual += dual.to(tl.float32) * m
        s_pkl += -log_ratio * m
        s_ent += ent * m
        s_kl += kl * m
        n_tok += m
        r_min, r_max, nan = _extremes_step(r_min, r_max, nan, ratio, m > 0)
    tokens = tl.sum(n_tok, axis=0)
    per = tl.maximum(tokens, 1.0)
    if part is not None:
        out = part + s * PART_AT.N
        tl.store(out + PART_AT.loss, tl.sum(loss_acc, axis=0))
        tl.store(out + PART_AT.low, tl.sum(s_low, axis=0))
        tl.store(out + PART_AT.high, tl.sum(s_high, axis=0))
        tl.store(out + PART_AT.ratio, tl.sum(s_ratio, axis=0))
        tl.store(out + PART_AT.logp, tl.sum(s_lp, axis=0))
        tl.store(out + PART_AT.dual, tl.sum(s_dual, axis=0))
        tl.store(out + PART_AT.ppo_kl, tl.sum(s_pkl, axis=0))
        tl.store(out + PART_AT.entropy, tl.sum(s_ent, axis=0))
        tl.store(out + PART_AT.kl, tl.sum(s_kl, axis=0))
        tl.store(out + PART_AT.tokens, tokens)
        low_frac = tl.math.div_rn(tl.sum(s_low, axis=0), per)
        high_frac = tl.math.div_rn(tl.sum(s_high, axis=0), per)
        # TRL's sequence-level clip fractions count a sequence without tokens as 0 (masked_seq_mean's x.squeeze(1))
        tl.store(out + PART_AT.low_frac, tl.where((tokens > 0) | F.SEQ_CLIP_MEANS, low_frac, float("inf")))
        tl.store(out + PART_AT.neg_high_frac, tl.where(tokens > 0, -high_frac, float("inf")))
        has_nan = tl.max(nan, axis=0) != 0
        tl.store(out + PART_AT.ratio_min, tl.where(has_nan, float("nan"), tl.min(r_min, axis=0)))
        tl.store(out + PART_AT.neg_ratio_max, tl.where(has_nan, float("nan"), -tl.max(r_max, axis=0)))
        tl.store(out + PART_AT.low_share, low_frac)
        tl.store(out + PART_AT.high_share, high_frac)
    # 3. d loss / d logp (its own share, and through the sequence's ratio) and d loss / d entropy
    if d_rows is not None:
        through = tl.zeros([], tl.float32)
        if F.IS_MODE == IS_SEQUENCE:  # d L / d logp_t = mask_t / tokens
            through = tl.math.div_rn(tl.sum(d_seq, axis=0), per)
        cols = tl.arange(0, COLS_P2)
        for start in range(0, seq_len, BLOCK):
            inside, i, m, _, _, w, bonus_w, _, _, d_self, _, _, _, _, _, _ = _objective_at(
                logp, entropy, old, ref, adv, iw, mask, weight, bonus, first, start, seq_len, stride_l, stride_e,
                adv_span, mean, mean_drift, off_policy, n_counted, S, F, BLOCK)
            d_logp = w * d_self
            if F.IS_MODE == IS_SEQUENCE:
                d_logp += through * m
            d_ent = tl.zeros([BLOCK], tl.float32)
            if F.ENT_BONUS:
                d_ent = -S.entropy_coef * bonus_w
            tile = tl.where(cols[None, :] == COL_LOGP, d_logp[:, None],
                            tl.where(cols[None, :] == COL_ENT, d_ent[:, None], 0.0))
            tl.store(d_rows + i[:, None] * D_COLS + cols[None, :], tile,
                     mask=inside[:, None] & (cols[None, :] < D_COLS))


@triton.jit
def policy_objective_finish_kernel(
    part,  # (n_seq, OBJECTIVE_PART.N) fp32 from policy_sequence_kernel
    base_loss,  # () fp32: the other terms' loss (the policy term is added to it), or None
    total,  # () fp32 out: the loss
    out,  # (OBJECTIVE_OUT.N,) fp32 out: the metrics (layouts.OBJECTIVE_METRICS)
    n_seq, n_seq_div,  # sequences, and what the sequence means divide by (max(n_seq, 1), a float)
    F: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sums over sequences, the extremes (NaN wins), and the metrics: token means, TRL's sequence-level
    clip fractions, and with no counted token clipped fractions 0 and ratios 1 (policy.metrics)."""
    lowest, summed = _column_minima(part, n_seq, PART_AT.N, BLOCK)
    tokens = _pick(summed, PART_AT.tokens)
    per = tl.maximum(tokens, 1.0)
    counted = tokens > 0
    loss = _pick(summed, PART_AT.loss)
    if base_loss is not None:
        loss = tl.load(base_loss) + loss
    tl.store(total, loss)
    tl.store(out + OUT_AT.loss, loss)
    low_mean = tl.math.div_rn(_pick(summed, PART_AT.low), per)
    high_mean = tl.math.div_rn(_pick(summed, PART_AT.high), per)
    if F.SEQ_CLIP_MEANS:
        low_mean = tl.math.div_rn(_pick(summed, PART_AT.low_share), n_seq_div)
        high_mean = tl.math.div_rn(_pick(summed, PART_AT.high_share), n_seq_div)
    tl.store(out + OUT_AT.clip_ratio_low_mean, low_mean)
    tl.store(out + OUT_AT.clip_ratio_high_mean, high_mean)
    tl.store(out + OUT_AT.ratio_mean, tl.where(counted, tl.math.div_rn(_pick(summed, PART_AT.ratio), per), 1.0))
    tl.store(out + OUT_AT.logprob_mean, tl.math.div_rn(_pick(summed, PART_AT.logp), per))
    tl.store(out + OUT_AT.pg_clipfrac_lower, tl.math.div_rn(_pick(summed, PART_AT.dual), per))
    tl.store(out + OUT_AT.ppo_kl, tl.math.div_rn(_pick(summed, PART_AT.ppo_kl), per))
    tl.store(out + OUT_AT.entropy, tl.math.div_rn(_pick(summed, PART_AT.entropy), per))
    tl.store(out + OUT_AT.kl, tl.math.div_rn(_pick(summed, PART_AT.kl), per))
    tl.store(out + OUT_AT.clip_ratio_low_min, tl.where(counted, _pick(lowest, PART_AT.low_frac), 0.0))
    tl.store(out + OUT_AT.clip_ratio_high_max, tl.where(counted, -_pick(lowest, PART_AT.neg_high_frac), 0.0))
    tl.store(out + OUT_AT.ratio_min, tl.where(counted, _pick(lowest, PART_AT.ratio_min), 1.0))
    tl.store(out + OUT_AT.ratio_max, tl.where(counted, -_pick(lowest, PART_AT.neg_ratio_max), 1.0))
    tl.store(out + OUT_AT.clip_ratio_region_mean, low_mean + high_mean)


def launch_sequence_extremes(ratio: torch.Tensor, low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor,
                             count: torch.Tensor, low_mean: torch.Tensor, high_mean: torch.Tensor,
                             ratio_mean: torch.Tensor, n_seq: int, seq_len: int) -> torch.Tensor:
    """(EXTREMES.N,) fp32 (layouts.Extremes) of tokens in ``n_seq`` sequences of ``seq_len`` rows (1-D
    columns of any stride, ``mask`` contiguous): two launches where torch took about 30 small ops
    (policy.metrics.extremes)."""
    part = torch.empty(n_seq, SEQUENCE_EXTREMES.N, dtype=torch.float32, device=mask.device)
    out = torch.empty(EXTREMES.N, dtype=torch.float32, device=mask.device)
    block = min(1024, max(16, triton.next_power_of_2(seq_len)))
    launch(sequence_extremes_kernel, n_seq, 4, ratio=ratio, low=low, high=high, mask=mask, part=part,
           stride_r=ratio.stride(0), stride_l=low.stride(0), stride_h=high.stride(0), seq_len=seq_len, BLOCK=block)
    launch(extremes_finish_kernel, 1, 4, part=part, count=count, low_mean=low_mean, high_mean=high_mean,
           ratio_mean=ratio_mean, out=out, n_seq=n_seq, BLOCK=256)
    return out


def launch_policy_objective(flags, scalars: Scalars, *, logp: torch.Tensor, entropy: torch.Tensor | None,
                            old, ref, adv, iw, mask, weight, sampled, count, n_seq: int, seq_len: int,
                            bonus: torch.Tensor | None = None,
                            adv_span: int, off_policy: float, d_cols: int, col_logp: int, col_ent: int,
                            base_loss: torch.Tensor | None = None, metrics: bool = True, grad: bool = True,
                            total: torch.Tensor | None = None, out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss, metrics (OBJECTIVE_OUT.N,), d_rows (N, d_cols)) of the deferred mode's policy term on
    ``n_seq`` sequences of ``seq_len`` rows (registry.ObjectiveFlags ``flags``; inputs as
    policy_sequence_kernel takes them): two launches, or one without ``metrics`` (loss and metrics
    None). The loss is ``base_loss`` plus the policy term; d_rows (``grad``, else None) is d loss / d rows
    for one unit of upstream gradient. ``total`` / ``out``: where to write the loss (it may be
    ``base_loss`` itself) and the metrics, instead of new tensors."""
    device = mask.device
    f32 = dict(dtype=torch.float32, device=device)
    part = torch.empty(n_seq, OBJECTIVE_PART.N, **f32) if metrics else None
    d_rows = torch.empty(n_seq * seq_len, d_cols, **f32) if grad else None
    block = min(OBJECTIVE_BLOCK, max(16, triton.next_power_of_2(seq_len)))
    launch(policy_sequence_kernel, n_seq, 4, logp=logp, entropy=entropy, old=old, ref=ref, adv=adv, iw=iw,
           mask=mask, weight=weight, sampled=sampled, bonus=bonus, count=count, part=part, d_rows=d_rows,
           stride_l=logp.stride(0), stride_e=0 if entropy is None else entropy.stride(0), seq_len=seq_len,
           adv_span=adv_span, off_policy=float(off_policy), S=scalars, F=flags, D_COLS=d_cols, COL_LOGP=col_logp,
           COL_ENT=col_ent, COLS_P2=triton.next_power_of_2(max(d_cols, 1)), BLOCK=block)
    if not metrics:
        return None, None, d_rows
    total = torch.empty((), **f32) if total is None else total
    out = torch.empty(OBJECTIVE_OUT.N, **f32) if out is None else out
    launch(policy_objective_finish_kernel, 1, 4, part=part, base_loss=base_loss, total=total, out=out, n_seq=n_seq,
           n_seq_div=float(max(n_seq, 1)), F=flags, BLOCK=64)
    return total, out, d_rows
