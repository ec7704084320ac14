"""One ``@triton.jit`` piece per loss term: its per-token value and its share of the gradient.

Every term's gradient with respect to the transformed logits x of a row has the form

    g_i = p_i * (A + B * x_i) + C + D * [i = y]      (+ the distillation's per-element share)

so a term is two small functions of per-row statistics: its value (stored in its column of the
packed row buffer, ``cols.<name>``, and weighted into the token loss) and its share of A, B, C, D.
``u`` is d loss / d token_loss of the row (1 / tokens for a mean).

Adding a term: its fields in ``spec.py``; its flag, column and scalars in ``plan.py``; its value
in :func:`row_values` and its share in :func:`row_coefficients` here (a term that needs a new
per-row statistic adds it to ``blocks.online_stats``); the reference and the tests.
"""

import triton
import triton.language as tl

from ..layouts import JSD_AT, SCRATCH_AT, SEQUENCE_AT
from ..policy_tables import KL_ESTIMATORS, OBJECTIVES
from .primitives import LN2, LOG2E, NEG_BIG, fast_log1p, fast_log2, scaled_update, softmax_update, to_x2

# the kernels' codes of the policy term's values (policy_tables, the one list of each)
CLIP, CISPO, SAPO, GPG, DRO, DPPO_TV, DPPO_KL, REINFORCE = (
    tl.constexpr(OBJECTIVES[name].kernel) for name in ("clip", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl",
                                                       "reinforce"))
KL_K1, KL_K2, KL_K3, KL_ABS = (tl.constexpr(KL_ESTIMATORS[name].kernel) for name in ("k1", "k2", "k3", "abs"))


@triton.jit
def put(row_out, COL: tl.constexpr, value):
    """Store a per-row value in its column of the packed row buffer (compiled out when absent)."""
    if COL >= 0:
        tl.store(row_out + COL, value)


@triton.jit
def row_values(row_out, lse, logp, sum_x2, entropy, V, S, F: tl.constexpr, C: tl.constexpr):
    """Phase 2 values of the row-local terms, each stored in its column; returns their weighted sum.

      ce       (1 - eps) * (lse - x_y) + eps * (lse - mean x)
      nll      -log p_y                            (with smoothing, where it differs from ce)
      z_loss   lse ** 2
      dft      -sg(p_y) * log p_y
      entropy  H = lse - sum p x  (weighted in only when it carries a weight)
    """
    token_loss = tl.zeros([], tl.float32)
    if F.HAS_CE:
        ce = -logp
        if F.HAS_SMOOTHING:
            ce = (1.0 - S.smoothing) * ce + S.smoothing * (lse - sum_x2 * LN2 / V)
            put(row_out, C.nll, -logp)
        put(row_out, C.ce, ce)
        token_loss += S.w_ce * ce
    if F.HAS_Z:
        z = lse * lse
        put(row_out, C.z_loss, z)
        token_loss += S.w_z * z
    if F.HAS_DFT:
        dft = -tl.exp(logp) * logp
        put(row_out, C.dft, dft)
        token_loss += S.w_dft * dft
    if F.ENTROPY_GRAD:
        token_loss += S.w_entropy * entropy
    return token_loss


@triton.jit
def row_coefficients(u, d_logp, d_entropy, d_lse, lse, logp, entropy, V, S, F: tl.constexpr):
    """Phase 2 gradient: (A, B, C, D) of g_i = p_i (A + B x_i) + C + D [i = y], term by term:

      ce (smoothing eps)  w_ce * (p_i - (1 - eps) [i=y] - eps / V)
      z-loss              w_z * 2 lse * p_i
      dft                 w_dft * p_y * (p_i - [i=y])         (p_y held constant)
      entropy             w_H * -p_i (x_i - lse + H)
      logprob output      d_logp * ([i=y] - p_i)     (also the policy objective's d loss / d logp)
      lse output          d_lse * p_i
    """
    A = d_lse - d_logp
    B = tl.zeros([], tl.float32)
    C = tl.zeros([], tl.float32)
    D = d_logp
    if F.HAS_CE:
        A += u * S.w_ce
        C -= u * S.w_ce * S.smoothing / V
        D -= u * S.w_ce * (1.0 - S.smoothing)
    if F.HAS_Z:
        A += u * S.w_z * 2.0 * lse
    if F.HAS_DFT:
        w = u * S.w_dft * tl.exp(logp)
        A += w
        D -= w
    if F.ENTROPY_GRAD:
        w = u * S.w_entropy + d_entropy
        A += w * (lse - entropy)
        B -= w
    return A, B, C, D


# --- distillation -----------------------------------------------------------------------------


@triton.jit
def teacher_x2(zt, cols, V, S, F: tl.constexpr, MASKED: tl.constexpr):
    """The teacher in base-2 units at the distillation temperature: its logits zt / T_d * log2(e), or
    (a teacher given as probabilities, F.TEACHER_PROBS; T_d is 1) log2 of them -- 0 gives -inf, no
    entry; a negative or NaN one NaN, which the row's mass check reports. Masked-off columns: -inf."""
    if F.TEACHER_PROBS:
        t2 = fast_log2(zt.to(tl.float32))
    else:
        t2 = zt.to(tl.float32) * (S.inv_distill_temp * LOG2E)
    if MASKED:
        t2 = tl.where(cols < V, t2, float("-inf"))
    return t2


@triton.jit
def teacher_q(zt, t2, cols, V, lse_t2, F: tl.constexpr, MASKED: tl.constexpr):
    """The teacher's normalised probabilities q = 2^(t2 - lse_t2); given as probabilities, the entries
    scaled by 2^-lse_t2 (one exponential per block, none per entry)."""
    if F.TEACHER_PROBS:
        q = zt.to(tl.float32) * tl.exp2(-lse_t2)
        if MASKED:
            q = tl.where(cols < V, q, 0.0)
    else:
        q = tl.exp2(t2 - lse_t2)
    return q


@triton.jit
def teacher_block(zt, x2, e, alpha, start, V, tstats, S, BLOCK_V: tl.constexpr, F: tl.constexpr,
                  MASKED: tl.constexpr):
    """The teacher's share of one block of the stats pass: its online softmax and the cross sums.

    s2 = x2 / T_d is the student and t2 = zt / T_d (base 2) the teacher at the distillation
    temperature. tstats = (mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg): teacher max, per-lane
    sum of exponentials, sum et * t2, the divergence's cross sum, the student's max and sum at
    T_d (when T_d != 1), and the block holding the teacher's max. Teacher sums are rescaled by the
    teacher's alpha, student ones by the student's.
    """
    mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = tstats
    cols = start + tl.arange(0, BLOCK_V)
    if F.TEACHER_PROBS:  # q is 2^t2 already: no exponential per entry; its log2 for the sums, taken after
        q = zt.to(tl.float32)  # the block's max (only q is live across that reduction, not q and t2)
        if MASKED:
            q = tl.where(cols < V, q, 0.0)
        t_max = fast_log2(tl.max(q, axis=0))
    else:
        t2 = teacher_x2(zt, cols, V, S, F, MASKED)
        t_max = tl.max(t2, axis=0)
    t_arg = tl.where(t_max > mt, start, t_arg)
    if F.TEACHER_PROBS:
        mt_new, dt, et, alpha_t = scaled_update(mt, dt, q, t_max)
        t2 = teacher_x2(zt, cols, V, S, F, MASKED)
    else:
        mt_new, dt, et, alpha_t = softmax_update(mt, dt, t2, t_max)
    sum_t = sum_t * alpha_t + et * tl.maximum(t2, NEG_BIG)
    if F.OWN_TEMP:
        s2 = x2 * S.inv_distill_temp
        ms, ds, es, alpha_s = softmax_update(ms, ds, s2, tl.max(s2, axis=0))
    else:
        s2 = x2
        alpha_s = alpha
        es = e
    if F.DISTILL_KIND == 0:  # forward KL: sum q * (t - s), the difference taken per element
        sum_ts = sum_ts * alpha_t + et * (tl.maximum(t2, NEG_BIG) - tl.maximum(s2, NEG_BIG))
    if F.DISTILL_KIND == 1:  # reverse KL: sum p * (s - t)
        sum_st = sum_st * alpha_s + es * (tl.maximum(s2, NEG_BIG) - tl.maximum(t2, NEG_BIG))
    return mt_new, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg


@triton.jit
def distill_lse(m2, d, tstats, F: tl.constexpr):
    """(lse_s2, lse_t2, t_minus_s) of the student at T_d and the teacher (base 2). lse_t2 - lse_s2
    comes from the maxima and the ratio of the sums: no cancellation of two O(|x|) normalisers when
    the teacher is close."""
    mt2, dt, sum_t, sum_ts, ms2, ds, sum_st, t_arg = tstats
    if not F.OWN_TEMP:
        ms2 = m2
        ds = d
    return ms2 + tl.log2(ds), mt2 + tl.log2(dt), (mt2 - ms2) + tl.log2(dt / ds)


@triton.jit
def distill_values(row_out, row_ptr, t_row_ptr, m2, d, arg, tstats, V, S, F: tl.constexpr, C: tl.constexpr,
                   BLOCK_V: tl.constexpr, jsd_row):
    """The divergence and the teacher metrics of a row, stored in their columns.

    Returns (weighted divergence, dstate) with dstate = (lse_s2, lse_t2, divergence, jsd_s), what
    the gradient pass's :func:`distill_grad` needs. ``jsd_row``: a vocab-parallel row's (JSD,
    KL(p_s || M)) summed over the shards, or None (the mixture JSD's extra pass runs here).
    """
    mt2, dt, sum_t, sum_ts, ms2, ds, sum_st, t_arg = tstats
    if not F.OWN_TEMP:
        ds = d
    lse_s2, lse_t2, t_minus_s = distill_lse(m2, d, tstats, F)
    jsd_s = tl.zeros([], tl.float32)
    if F.DISTILL_KIND == 0:
        divergence = LN2 * (sum_ts / dt - t_minus_s)
    elif F.DISTILL_KIND == 1:
        divergence = LN2 * (sum_st / ds + t_minus_s)
    elif jsd_row is not None:
        divergence = tl.load(jsd_row + JSD_AT.value)
        jsd_s = tl.load(jsd_row + JSD_AT.kl_s)
    else:
        divergence, jsd_s = jsd_sums(row_ptr, t_row_ptr, V, lse_s2, lse_t2, t_minus_s, S, BLOCK_V, F)
    put(row_out, C.divergence, divergence)
    put(row_out, C.teacher_entropy, (lse_t2 - sum_t / dt) * LN2)
    put(row_out, C.agreement, (arg == t_arg).to(tl.float32))
    put(row_out, C.lse_s2, lse_s2)
    put(row_out, C.lse_t2, lse_t2)
    put(row_out, C.jsd_s, jsd_s)
    return S.w_distill * divergence, (lse_s2, lse_t2, divergence, jsd_s)


@triton.jit
def distill_grad(p, x2, zt, cols, V, dstate, wd, S, F: tl.constexpr, MASKED: tl.constexpr):
    """wd * dD/ds for the divergence D between student s = x / T_d and teacher t (per element).

      forward KL(q || p_s)   p_s - q
      reverse KL(p_s || q)   p_s * (log p_s - log q - KL)
      JSD_beta (mixture)     (1 - beta) * p_s * (log(p_s / M) - S),  M = beta q + (1 - beta) p_s,
                             S = sum p_s log(p_s / M)
    ``wd`` carries the weight, d loss / d token_loss, 1 / T_d and (without softcap) dx/dz.
    """
    lse_s2, lse_t2, kl, jsd_s = dstate
    t2 = zt  # (forward KL with probabilities given never reads their log)
    if not (F.TEACHER_PROBS and F.DISTILL_KIND == 0):
        t2 = teacher_x2(zt, cols, V, S, F, MASKED)
    q = teacher_q(zt, t2, cols, V, lse_t2, F, MASKED)
    if F.OWN_TEMP:
        s2 = x2 * S.inv_distill_temp
        ps = tl.exp2(s2 - lse_s2)
    else:
        s2 = x2
        ps = p
    if F.DISTILL_KIND == 0:
        g = wd * (ps - q)
    elif F.DISTILL_KIND == 1:
        # log(p / q) only where p > 0 (there the student logit is finite); elsewhere the term is 0
        log_ratio = LN2 * ((tl.maximum(s2, NEG_BIG) - lse_s2) - (t2 - lse_t2))
        g = wd * (ps * (tl.where(ps > 0.0, log_ratio, 0.0) - kl))
    else:
        # log(p / M) = -log1p(beta (q / p - 1)), q / p from differences of logits
        q_over_p = tl.exp2((tl.maximum(t2, NEG_BIG) - tl.maximum(s2, NEG_BIG)) - (lse_t2 - lse_s2))
        log_ratio = -fast_log1p(S.jsd_beta * (q_over_p - 1.0))
        g = (wd * (1.0 - S.jsd_beta)) * tl.where(ps > 0.0, ps * (log_ratio - jsd_s), 0.0)
    return g


@triton.jit
def jsd_sums(row_ptr, t_row_ptr, V, lse_s2, lse_t2, t_minus_s, S, BLOCK_V: tl.constexpr, F: tl.constexpr):
    """Extra pass of the mixture JSD: (JSD, S = KL(p_s || M)); log M needs both final lse's.

    log(p / M) = -log1p(beta (q / p - 1)) and log(q / M) = log(q / p) + log(p / M), with
    log2(q / p) = (t2 - s2) - t_minus_s: no log of a tiny mixture, no cancellation when q ~ p.
    """
    offs = tl.arange(0, BLOCK_V)
    acc_s = tl.zeros([BLOCK_V], tl.float32)
    acc_t = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0)
        x2, _ = to_x2(z, cols, V, S, F.HAS_SOFTCAP, True)
        s2 = x2 * S.inv_distill_temp if F.OWN_TEMP else x2
        zt = tl.load(t_row_ptr + cols, mask=mask, other=0.0)
        t2 = teacher_x2(zt, cols, V, S, F, True)
        ps = tl.exp2(s2 - lse_s2)
        q = teacher_q(zt, t2, cols, V, lse_t2, F, True)
        log2_q_over_p = (tl.maximum(t2, NEG_BIG) - tl.maximum(s2, NEG_BIG)) - t_minus_s
        log_p_over_m = -fast_log1p(S.jsd_beta * (tl.exp2(log2_q_over_p) - 1.0))
        acc_s += tl.where(ps > 0.0, ps * log_p_over_m, 0.0)
        # where p = 0, M = beta q: log(q / M) = -log(beta)
        log_q_over_m = tl.where(ps > 0.0, log2_q_over_p * LN2 + log_p_over_m, -tl.log(S.jsd_beta))
        acc_t += tl.where(q > 0.0, q * log_q_over_m, 0.0)
    kl_s = tl.sum(acc_s, axis=0)
    kl_t = tl.sum(acc_t, axis=0)
    return S.jsd_beta * kl_t + (1.0 - S.jsd_beta) * kl_s, kl_s


# --- policy (GRPO family, token-level ratios) --------------------------------------------------


@triton.jit
def _min_with_grad(a, da, b, db):
    """min(a, b) and its derivative (ties split evenly, as torch.minimum)."""
    value = tl.minimum(a, b)
    grad = tl.where(a < b, da, tl.where(a > b, db, 0.5 * (da + db)))
    return value, grad


@triton.jit
def kl_estimator(logp, ref, EST: tl.constexpr, CLAMP: tl.constexpr, K2_GRAD: tl.constexpr):
    """(kl, d kl / d logp) of a per-token KL(pi || ref) estimate (policy.kl_estimate's formulas, verl's
    kl_penalty): EST is the estimator's code (policy_tables.KL_ESTIMATORS), CLAMP verl's k3 clamps,
    K2_GRAD the value with the k2 gradient. The policy's KL penalty and a per-token teacher's
    distillation (kernels.sparse) read it."""
    gap = logp - ref
    if EST == KL_K1:
        kl = gap
        d_kl = tl.full(logp.shape, 1.0, tl.float32)
    elif EST == KL_K2:
        kl = 0.5 * gap * gap
        d_kl = gap
    elif EST == KL_ABS:
        kl = tl.abs(gap)
        d_kl = tl.where(gap > 0, 1.0, tl.where(gap < 0, -1.0, 0.0))
    elif EST == KL_K3:
        delta = ref - logp
        d_delta = tl.full(logp.shape, -1.0, tl.float32)
        if CLAMP:
            d_delta = tl.where((delta >= -20.0) & (delta <= 20.0), d_delta, 0.0)
            delta = tl.minimum(tl.maximum(delta, -20.0), 20.0)
        kl = tl.exp(delta) - delta - 1.0
        d_kl = (tl.exp(delta) - 1.0) * d_delta
        if CLAMP:
            d_kl = tl.where((kl >= -10.0) & (kl <= 10.0), d_kl, 0.0)
            kl = tl.minimum(tl.maximum(kl, -10.0), 10.0)
    else:
        tl.static_assert(False, "a KL estimator of policy_tables has no kernel piece in terms.kl_estimator")
    if K2_GRAD:
        d_kl = gap
    return kl, d_kl


@triton.jit
def _objective(logp, old, adv, ratio, d_ratio, S, F: tl.constexpr):
    """(per_token, d per_token / d logp, low, high, dual) of the spec's objective (F.OBJECTIVE is its
    code in policy_tables; one branch per row-local objective, and a code without one does not
    compile); policy.objectives.ROW_LOCAL has the same formulas in torch."""
    lo = 1.0 - S.eps_low
    hi = 1.0 + S.eps_high
    no = (adv > 0) & (adv <= 0)  # False, shaped like the values (also for a NaN advantage)
    low, high, dual = no, no, no
    if F.OBJECTIVE == CLIP:
        clipped = tl.minimum(tl.maximum(ratio, lo), hi)
        d_clipped = tl.where((ratio >= lo) & (ratio <= hi), d_ratio, 0.0)
        capped = tl.minimum(ratio, S.pol_delta)
        d_capped = tl.where(ratio <= S.pol_delta, d_ratio, 0.0)
        surrogate, d_surrogate = _min_with_grad(capped * adv, d_capped * adv, clipped * adv, d_clipped * adv)
        per_token = -surrogate
        d_per_token = -d_surrogate
        floor = -adv * S.dual_c
        dual = (adv < 0) & (per_token > floor)
        dualled, d_dualled = _min_with_grad(per_token, d_per_token, floor, 0.0)
        per_token = tl.where(adv < 0, dualled, per_token)
        d_per_token = tl.where(adv < 0, d_dualled, d_per_token)
        low = (ratio < lo) & (adv < 0)
        high = (capped > hi) & (adv > 0)  # TRL counts on the ratio capped at delta
    elif F.OBJECTIVE == CISPO:  # -sg(c) A logp
        if F.CISPO_VERL:
            coef = tl.minimum(tl.maximum(ratio, lo), hi)
            low = ratio < lo
            high = ratio > hi
        else:
            coef = tl.minimum(ratio, S.eps_high)
            high = (ratio > S.eps_high) & (adv > 0)
        per_token = -coef * adv * logp
        d_per_token = -coef * adv
    elif F.OBJECTIVE == SAPO:  # -(4 / tau) sigmoid(tau (r - 1)) A
        tau = tl.where(adv > 0, S.sapo_tau_pos, S.sapo_tau_neg)
        gate = tl.sigmoid(tau * (ratio - 1.0))
        per_token = -gate * (4.0 / tau) * adv
        d_per_token = -4.0 * adv * gate * (1.0 - gate) * d_ratio
    elif F.OBJECTIVE == GPG:  # -A logp
        per_token = -adv * logp
        d_per_token = -adv
    elif F.OBJECTIVE == DRO:  # -(A logp - beta (logp - old)^2 / 2)
        gap = logp - old
        per_token = -(logp * adv - 0.5 * S.dro_beta * gap * gap)
        d_per_token = -adv + S.dro_beta * gap
    elif (F.OBJECTIVE == DPPO_TV) or (F.OBJECTIVE == DPPO_KL):  # -A sg(min(r, cap)) logp on the kept tokens
        prob = tl.exp(logp)
        old_prob = tl.exp(old)
        if F.OBJECTIVE == DPPO_TV:
            keep_pos = prob - old_prob <= S.eps_high
            keep_neg = prob - old_prob >= -S.eps_low
        else:
            # verl's old_p (old - logp) + (1 - old_p) log((1 - old_p + 1e-8) / (1 - p + 1e-8)), with the
            # log as log1p(u), u = (p - old_p) / (1 - p + 1e-8): the two terms are first-order small
            # and cancel to second order, which a log of a ratio near 1 loses in fp32
            u = (prob - old_prob) / (1.0 - prob + 1e-8)
            w = 1.0 + u
            log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
            binary_kl = old_prob * (old - logp) + (1.0 - old_prob) * log1p_u
            keep_pos = (binary_kl <= S.eps_high) | (prob <= old_prob)
            keep_neg = (binary_kl <= S.eps_low) | (prob >= old_prob)
        keep = tl.where(adv > 0, keep_pos, keep_neg)
        truncated = tl.minimum(ratio, S.dppo_ratio_cap)
        kept = keep.to(tl.float32)
        per_token = -adv * truncated * logp * kept
        d_per_token = -adv * truncated * kept
        low = (kept == 0.0) & (adv <= 0)
        high = (kept == 0.0) & (adv > 0)
        dual = (ratio > S.dppo_ratio_cap) & keep
    elif F.OBJECTIVE == REINFORCE:  # -A sg(min(exp(clamp(logp - old, +-20)), cap)) logp
        weight = tl.minimum(tl.exp(tl.minimum(tl.maximum(logp - old, -20.0), 20.0)), S.reinforce_is_max)
        per_token = -adv * weight * logp
        d_per_token = -adv * weight
    else:
        tl.static_assert(False, "an objective of policy_tables has no kernel piece in terms._objective")
    return per_token, d_per_token, low, high, dual


@triton.jit
def policy_token(logp, old, ref, adv, iw, S, F: tl.constexpr):
    """(per_token_loss, d per_token_loss / d logp, ratio, kl, low, high, dual, old - logp) of one token.

    ratio = exp(logp - old) (verl's convention clamps the log-ratio to +-20 first); the objective
    (:func:`_objective`); times the rollout importance weight; plus kl_beta times the KL estimate
    (times the ratio with the importance correction). Derivatives follow torch's autograd
    conventions, so both paths agree at the kinks: clamp passes the gradient on its closed interval,
    minimum splits it on ties.
    """
    log_ratio = logp - old
    d_log_ratio = tl.full(logp.shape, 1.0, tl.float32)
    if F.LOG_RATIO_CLAMP:
        d_log_ratio = tl.where((log_ratio >= -20.0) & (log_ratio <= 20.0), d_log_ratio, 0.0)
        log_ratio = tl.minimum(tl.maximum(log_ratio, -20.0), 20.0)
    ratio = tl.exp(log_ratio)
    d_ratio = ratio * d_log_ratio
    per_token, d_per_token, low, high, dual = _objective(logp, old, adv, ratio, d_ratio, S, F)
    per_token = per_token * iw
    d_per_token = d_per_token * iw
    kl = tl.zeros_like(logp)
    if F.KL_EST != 0:
        kl, d_kl = kl_estimator(logp, ref, F.KL_EST, F.KL_CLAMP, F.KL_K2_GRAD)
        if F.KL_IS_CORR:
            d_kl = d_kl * ratio + kl * d_ratio
            kl = kl * ratio
        per_token += S.kl_beta * kl
        d_per_token += S.kl_beta * d_kl
    return per_token, d_per_token, ratio, kl, low, high, dual, -log_ratio


@triton.jit
def policy_values(row_out, scratch, logp, entropy, policy, o, token_weight, S, F: tl.constexpr, C: tl.constexpr):
    """The token-level policy objective of slot ``o`` (weighted by its aggregation weight), stored
    in its columns with the ratio, the KL and the clip indicators; returns (d_logp, d_entropy).

    ``policy`` holds per-slot pointers (old, ref, adv, iw, weight: the aggregation's, with the token weights in
    it); old / iw may be None; ``token_weight``: the slot's token weight (1.0 without), for TRL's entropy mean
    (on-policy: ratio 1 with gradient; no rollout weights). verl's entropy bonus
    ``-entropy_coef * H`` is aggregated like the loss (or, ENTROPY_TOKEN_MEAN, as TRL's token mean).
    With sequences of ``policy.seq_len`` slots, the slot's sequence counters and the ratio's
    extremes in ``scratch`` (layouts.Scratch, SequenceCounters) take its share, for the last program's per-sequence
    metrics.
    """
    old = logp
    if policy.old is not None:
        old = tl.load(policy.old + o).to(tl.float32)
    ref = logp
    if F.KL_EST != 0:
        ref = tl.load(policy.ref + o).to(tl.float32)
    iw = tl.full([], 1.0, tl.float32)
    if policy.iw is not None:
        iw = tl.load(policy.iw + o).to(tl.float32)
    adv = tl.load(policy.adv + o // policy.adv_span).to(tl.float32)
    w = tl.load(policy.weight + o).to(tl.float32)
    per_token, d_per_token, ratio, kl, low, high, dual, neg_log_ratio = policy_token(logp, old, ref, adv, iw, S, F)
    policy_loss = w * per_token
    d_entropy = tl.zeros([], tl.float32)
    if F.ENTROPY_GRAD:
        bonus_w = w
        if F.ENTROPY_TOKEN_MEAN:  # TRL: a mean over the call's counted tokens (by weight, with token weights)
            if F.WEIGHT_NORM:
                total = tl.load(scratch + SCRATCH_AT.weight_sum).to(tl.int32).to(tl.float32, bitcast=True)
                bonus_w = token_weight / tl.where(total > 0.0, total, 1.0)
            else:
                bonus_w = token_weight / tl.maximum(tl.load(scratch + SCRATCH_AT.counted).to(tl.float32), 1.0)
        policy_loss -= S.entropy_coef * bonus_w * entropy
        d_entropy = -S.entropy_coef * bonus_w
    put(row_out, C.policy_loss, policy_loss)
    put(row_out, C.counted, 1.0)
    put(row_out, C.ratio, ratio)
    put(row_out, C.kl, kl)
    put(row_out, C.clip_low, low.to(tl.float32))
    put(row_out, C.clip_high, high.to(tl.float32))
    put(row_out, C.clip_dual, dual.to(tl.float32))
    put(row_out, C.ppo_kl, neg_log_ratio)
    if policy.seq_len > 0:
        at = scratch + SCRATCH_AT.sequences + (o // policy.seq_len) * SEQUENCE_AT.N
        tl.atomic_add(at + SEQUENCE_AT.tokens, 1, sem="relaxed")
        if low:
            tl.atomic_add(at + SEQUENCE_AT.low, 1, sem="relaxed")
        if high:
            tl.atomic_add(at + SEQUENCE_AT.high, 1, sem="relaxed")
        if ratio == ratio:  # NaN ratios are left out of the extremes, as tl.minimum leaves them
            bits = ratio.to(tl.int32, bitcast=True).to(tl.int64)
            tl.atomic_min(scratch + SCRATCH_AT.ratio_min, bits, sem="relaxed")
            tl.atomic_max(scratch + SCRATCH_AT.ratio_max, bits, sem="relaxed")
    return w * d_per_token, d_entropy
