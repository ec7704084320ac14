"""Shared ``@triton.jit`` building blocks of the head kernels.

Every kernel in this package is these pieces glued together:

* :func:`transform`        x = softcap(logit_scale * z) * inv_temperature, returned in base-2
                           units (x2 = x * log2 e) with dx/dz
* :func:`online_stats`     phase 1 -- one read of a row: running max, sum of exponentials, and
                           only the sums the variant needs (sum x, sum e*x, argmax)
* :func:`row_coefficients` phase 2 -- per-row coefficients of the combined gradient
* :func:`gradient_pass`    phase 3 -- second read, one write: g = (p * (A + B*x) + C + D*[i=y]) * dx/dz

The online-softmax update is written once, here. A new loss term adds its statistic to
:func:`online_stats`, its value to the kernel epilogue and its share of A, B, C, D to
:func:`row_coefficients`.

Cost notes (the full variant is ALU-bound at 128K vocab if written naively):
* base-2 units: exp(x - m) = exp2(x2 - m2), one subtraction and one ex2 per element;
* the sums are per-lane vectors rescaled by the block's scalar alpha and reduced once per row,
  so a block does one cross-warp reduction (its max), not one per statistic;
* the argmax costs a scalar select per block (which block holds the max) and one more block
  read per row to find the index inside it;
* an entropy that is only a metric is summed in the gradient pass, from the p it computes anyway;
* full blocks load without masks, one block ahead of their use; only the tail block is masked;
* the target column of the gradient is written once after the loop, not selected per element.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# stands in for -inf where 0 * x must stay 0 (exp of a -inf logit is 0, its product with x is not)
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def tanh(a):
    """tanh through exp2: stable for any |a|, and the same code under the interpreter."""
    e = tl.exp2(-2.0 * LOG2E * tl.abs(a))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.0, -t, t)


@triton.jit
def log1p(x):
    """log(1 + x), accurate near 0 where 1 + x would drop the digits of x."""
    series = x * (1.0 - x * (0.5 - x * (1.0 / 3.0)))
    return tl.where(tl.abs(x) < 1e-3, series, tl.log(1.0 + x))


@triton.jit
def transform(z, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """x2 = log2(e) * softcap(logit_scale * z) * inv_temperature (fp32), and dx/dz (natural x)."""
    if HAS_SOFTCAP:
        t = tanh(z * (logit_scale / softcap))
        x2 = t * (softcap * inv_temperature * LOG2E)
        slope = (logit_scale * inv_temperature) * (1.0 - t * t)
    else:
        x2 = z * (logit_scale * inv_temperature * LOG2E)
        slope = logit_scale * inv_temperature
    return x2, slope


@triton.jit
def _to_x2(z, cols, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """Raw logits block -> (x2, slope); masked-off columns of the tail block become -inf."""
    x2, slope = transform(z.to(tl.float32), logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    if MASKED:
        x2 = tl.where(cols < V, x2, float("-inf"))
    return x2, slope


@triton.jit
def _stats_block(
    z, start, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUM_X: tl.constexpr,
    NEED_SUM_EX: tl.constexpr, NEED_ARGMAX: tl.constexpr, MASKED: tl.constexpr,
):
    """One loaded block z of the online softmax; d, sum_x, sum_ex are per-lane [BLOCK_V] vectors."""
    cols = start + tl.arange(0, BLOCK_V)
    x2, _ = _to_x2(z, cols, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, MASKED)
    block_max = tl.max(x2, axis=0)
    if NEED_ARGMAX:
        # only the block holding the first max is tracked here (a scalar select, no per-element
        # work); strict '>' keeps the earliest block on ties
        arg = tl.where(block_max > m, start, arg)
    m_new = tl.maximum(m, block_max)
    # a row that is all -inf so far keeps d = 0 instead of exp(-inf - -inf) = NaN
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    e = tl.exp2(x2 - m_ref)
    d = d * alpha + e
    if NEED_SUM_EX:
        sum_ex = sum_ex * alpha + e * tl.maximum(x2, NEG_BIG)
    if NEED_SUM_X:
        if MASKED:
            sum_x += tl.where(cols < V, x2, 0.0)
        else:
            sum_x += x2
    return m_new, d, sum_x, sum_ex, arg, x2, e, alpha


@triton.jit
def _teacher_block(
    zt, x2, e, alpha, start, V, mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg, inv_distill_temp,
    BLOCK_V: tl.constexpr, DISTILL_KIND: tl.constexpr, OWN_TEMP: tl.constexpr, MASKED: tl.constexpr,
):
    """The teacher's share of one block: its online softmax and the cross sums of the divergence.

    s2 = x2 / T_d is the student and t2 = zt / T_d (base 2) the teacher at the distillation
    temperature. Teacher sums are rescaled by the teacher's alpha, student ones by the student's.
    """
    cols = start + tl.arange(0, BLOCK_V)
    t2 = zt.to(tl.float32) * (inv_distill_temp * LOG2E)
    if MASKED:
        t2 = tl.where(cols < V, t2, float("-inf"))
    t_max = tl.max(t2, axis=0)
    t_arg = tl.where(t_max > mt, start, t_arg)
    mt_new = tl.maximum(mt, t_max)
    mt_ref = tl.where(mt_new == float("-inf"), 0.0, mt_new)
    alpha_t = tl.exp2(mt - mt_ref)
    et = tl.exp2(t2 - mt_ref)
    dt = dt * alpha_t + et
    sum_t = sum_t * alpha_t + et * tl.maximum(t2, NEG_BIG)
    if OWN_TEMP:
        s2 = x2 * inv_distill_temp
        s_max = tl.max(s2, axis=0)
        ms_new = tl.maximum(ms, s_max)
        ms_ref = tl.where(ms_new == float("-inf"), 0.0, ms_new)
        alpha_s = tl.exp2(ms - ms_ref)
        es = tl.exp2(s2 - ms_ref)
        ds = ds * alpha_s + es
        ms = ms_new
    else:
        s2 = x2
        alpha_s = alpha
        es = e
    if DISTILL_KIND == 0:  # forward KL: sum q * (t - s), the difference taken per element
        sum_ts = sum_ts * alpha_t + et * (tl.maximum(t2, NEG_BIG) - tl.maximum(s2, NEG_BIG))
    if DISTILL_KIND == 1:  # reverse KL: sum p * (s - t)
        sum_st = sum_st * alpha_s + es * (tl.maximum(s2, NEG_BIG) - tl.maximum(t2, NEG_BIG))
    return mt_new, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg


@triton.jit
def online_stats(
    row_ptr,  # (V,) one row of logits, any float dtype
    t_row_ptr,  # (V,) the teacher's row, HAS_TEACHER
    V,
    logit_scale,
    softcap,
    inv_temperature,
    inv_distill_temp,
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_SUM_X: tl.constexpr,
    NEED_SUM_EX: tl.constexpr,
    NEED_ARGMAX: tl.constexpr,
    HAS_TEACHER: tl.constexpr,
    DISTILL_KIND: tl.constexpr,
    OWN_TEMP: tl.constexpr,
):
    """Phase 1: one read of a row (and of the teacher's), online softmax, in base-2 units.

    Student: (m2, d, sum_x2, sum_ex2, argmax) with m2 = max x2, d = sum 2^(x2 - m2),
    sum_x2 = sum x2, sum_ex2 = sum 2^(x2 - m2) * x2, argmax = first index of the max.
    So lse = (m2 + log2 d) * ln 2, mean_p(x) = ln 2 * sum_ex2 / d, sum x = ln 2 * sum_x2.
    Teacher (t2 = teacher / T_d, s2 = x2 / T_d): (mt2, dt, sum_t = sum et * t2,
    sum_ts = sum et * (t2 - s2), ms2, ds (the student at T_d, when T_d != 1),
    sum_st = sum es * (s2 - t2), teacher argmax). Divergences are sums of per-element
    differences, so a teacher close to the student does not cancel two O(|x|) sums.
    -inf logits (a masked vocabulary) are allowed; NaN and +inf propagate to NaN.
    """
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_V], tl.float32)
    sum_x = tl.zeros([BLOCK_V], tl.float32)
    sum_ex = tl.zeros([BLOCK_V], tl.float32)
    arg = tl.zeros([], tl.int32)
    mt = tl.full([], float("-inf"), tl.float32)
    dt = tl.zeros([BLOCK_V], tl.float32)
    sum_t = tl.zeros([BLOCK_V], tl.float32)
    sum_ts = tl.zeros([BLOCK_V], tl.float32)
    ms = tl.full([], float("-inf"), tl.float32)
    ds = tl.zeros([BLOCK_V], tl.float32)
    sum_st = tl.zeros([BLOCK_V], tl.float32)
    t_arg = tl.zeros([], tl.int32)
    offs = tl.arange(0, BLOCK_V)
    v_full = (V // BLOCK_V) * BLOCK_V
    if v_full > 0:
        # full blocks, unmasked, each load issued one block ahead of its use
        z = tl.load(row_ptr + offs)
        zt = z
        if HAS_TEACHER:
            zt = tl.load(t_row_ptr + offs)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            z_next = tl.load(row_ptr + start + offs)
            zt_next = z_next
            if HAS_TEACHER:
                zt_next = tl.load(t_row_ptr + start + offs)
            m, d, sum_x, sum_ex, arg, x2, e, alpha = _stats_block(
                z, start - BLOCK_V, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
                BLOCK_V, HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, False,
            )
            if HAS_TEACHER:
                mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = _teacher_block(
                    zt, x2, e, alpha, start - BLOCK_V, V, mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg,
                    inv_distill_temp, BLOCK_V, DISTILL_KIND, OWN_TEMP, False,
                )
            z = z_next
            zt = zt_next
        m, d, sum_x, sum_ex, arg, x2, e, alpha = _stats_block(
            z, v_full - BLOCK_V, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
            BLOCK_V, HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, False,
        )
        if HAS_TEACHER:
            mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = _teacher_block(
                zt, x2, e, alpha, v_full - BLOCK_V, V, mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg,
                inv_distill_temp, BLOCK_V, DISTILL_KIND, OWN_TEMP, False,
            )
    if v_full < V:
        mask = v_full + offs < V
        z = tl.load(row_ptr + v_full + offs, mask=mask, other=0.0)
        m, d, sum_x, sum_ex, arg, x2, e, alpha = _stats_block(
            z, v_full, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
            BLOCK_V, HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, True,
        )
        if HAS_TEACHER:
            zt = tl.load(t_row_ptr + v_full + offs, mask=mask, other=0.0)
            mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = _teacher_block(
                zt, x2, e, alpha, v_full, V, mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg,
                inv_distill_temp, BLOCK_V, DISTILL_KIND, OWN_TEMP, True,
            )
    if NEED_ARGMAX:
        # the index inside that block: one more block read per row, first index of the max
        cols = arg + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
        x2, _ = _to_x2(z, cols, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, True)
        arg = arg + tl.argmax(x2, axis=0)
    if HAS_TEACHER:
        cols = t_arg + offs
        zt = tl.load(t_row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        t_arg = t_arg + tl.argmax(tl.where(cols < V, zt, float("-inf")), axis=0)
    if not OWN_TEMP:
        ms = m
        ds = d
    return (
        m, tl.sum(d, axis=0), tl.sum(sum_x, axis=0), tl.sum(sum_ex, axis=0), arg,
        mt, tl.sum(dt, axis=0), tl.sum(sum_t, axis=0), tl.sum(sum_ts, axis=0),
        ms, tl.sum(ds, axis=0), tl.sum(sum_st, axis=0), t_arg,
    )


@triton.jit
def row_coefficients(
    u,  # d loss / d token_loss for this row (0 for an ignored row)
    d_logp,  # upstream gradient of the logprob output (0 when none)
    d_entropy,  # upstream gradient of the entropy output (0 when none)
    d_lse,  # upstream gradient of the lse output (0 when none)
    lse,
    entropy,
    V,
    w_ce,
    smoothing,
    w_z,
    w_entropy,
    HAS_CE: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
):
    """Phase 2: the row's gradient w.r.t. x as g_i = p_i * (A + B * x_i) + C + D * [i = y].

    Term by term (p = softmax(x), H = entropy):
      ce (smoothing eps)  w_ce * (p_i - (1 - eps) [i=y] - eps / V)
      z-loss              w_z * 2 lse * p_i
      entropy             w_H * -p_i (x_i - lse + H)
      logprob output      d_logp * ([i=y] - p_i)
      lse output          d_lse * p_i
    """
    A = d_lse - d_logp
    B = tl.zeros([], tl.float32)
    C = tl.zeros([], tl.float32)
    D = d_logp
    if HAS_CE:
        A += u * w_ce
        C -= u * w_ce * smoothing / V
        D -= u * w_ce * (1.0 - smoothing)
    if HAS_Z:
        A += u * w_z * 2.0 * lse
    if HAS_ENTROPY_GRAD:
        w = u * w_entropy + d_entropy
        A += w * (lse - entropy)
        B -= w
    return A, B, C, D


@triton.jit
def distill_grad(
    p, x2, zt, cols, V, lse_s2, lse_t2, kl, jsd_s, wd, jsd_beta, inv_distill_temp,
    DISTILL_KIND: tl.constexpr, OWN_TEMP: tl.constexpr, MASKED: tl.constexpr,
):
    """wd * dD/ds for the divergence D between student s = x / T_d and teacher t (per element).

      forward KL(q || p_s)   p_s - q
      reverse KL(p_s || q)   p_s * (log p_s - log q - KL)
      JSD_beta (mixture)     (1 - beta) * p_s * (log(p_s / M) - S),  M = beta q + (1 - beta) p_s,
                             S = sum p_s log(p_s / M)
    ``wd`` carries the weight, d loss / d token_loss, 1 / T_d and (without softcap) dx/dz.
    """
    t2 = zt.to(tl.float32) * (inv_distill_temp * LOG2E)
    if MASKED:
        t2 = tl.where(cols < V, t2, float("-inf"))
    q = tl.exp2(t2 - lse_t2)
    if OWN_TEMP:
        s2 = x2 * inv_distill_temp
        ps = tl.exp2(s2 - lse_s2)
    else:
        s2 = x2
        ps = p
    if DISTILL_KIND == 0:
        g = wd * (ps - q)
    elif DISTILL_KIND == 1:
        g = wd * tl.where(ps > 0.0, ps * (LN2 * ((s2 - lse_s2) - (t2 - lse_t2)) - kl), 0.0)
    else:
        # log(p / M) = -log1p(beta (q / p - 1)), q / p from differences of logits
        q_over_p = tl.exp2((t2 - s2) - (lse_t2 - lse_s2))
        log_ratio = -log1p(jsd_beta * (q_over_p - 1.0))
        g = (wd * (1.0 - jsd_beta)) * tl.where(ps > 0.0, ps * (log_ratio - jsd_s), 0.0)
    return g


@triton.jit
def jsd_sums(
    row_ptr, t_row_ptr, V, lse_s2, lse_t2, t_minus_s, jsd_beta, logit_scale, softcap, inv_temperature,
    inv_distill_temp, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, OWN_TEMP: tl.constexpr,
):
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
        x2, _ = _to_x2(z, cols, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, True)
        s2 = x2 * inv_distill_temp if OWN_TEMP else x2
        t2 = tl.load(t_row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * (inv_distill_temp * LOG2E)
        t2 = tl.where(mask, t2, float("-inf"))
        ps = tl.exp2(s2 - lse_s2)
        q = tl.exp2(t2 - lse_t2)
        log2_q_over_p = (tl.maximum(t2, NEG_BIG) - tl.maximum(s2, NEG_BIG)) - t_minus_s
        log_p_over_m = -log1p(jsd_beta * (tl.exp2(log2_q_over_p) - 1.0))
        acc_s += tl.where(ps > 0.0, ps * log_p_over_m, 0.0)
        # where p = 0, M = beta q: log(q / M) = -log(beta)
        log_q_over_m = tl.where(ps > 0.0, LN2 * log2_q_over_p + log_p_over_m, -tl.log(jsd_beta))
        acc_t += tl.where(q > 0.0, q * log_q_over_m, 0.0)
    kl_s = tl.sum(acc_s, axis=0)
    kl_t = tl.sum(acc_t, axis=0)
    return jsd_beta * kl_t + (1.0 - jsd_beta) * kl_s, kl_s


@triton.jit
def _grad_block(
    z, zt, grad_row_ptr, start, V, lse2, A, B2, C, sum_px, logit_scale, softcap, inv_temperature,
    lse_s2, lse_t2, kl, jsd_s, wd, jsd_beta, inv_distill_temp,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr,
    NEED_SUM_PX: tl.constexpr, HAS_TEACHER: tl.constexpr, DISTILL_KIND: tl.constexpr, OWN_TEMP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Gradient of one loaded block z (teacher block zt), stored at grad_row_ptr[start:start + BLOCK_V];
    returns sum_px (per-lane) + p * (lse2 - x2) when NEED_SUM_PX."""
    cols = start + tl.arange(0, BLOCK_V)
    x2, slope = _to_x2(z, cols, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, MASKED)
    p = tl.exp2(x2 - lse2)
    if NEED_SUM_PX:
        # entropy as sum p * (lse - x): every term >= 0, so its error is relative to H itself
        # (lse - mean x would cancel two large numbers); -NEG_BIG keeps 0 * inf out at -inf logits
        sum_px += p * tl.minimum(lse2 - x2, -NEG_BIG)
    if HAS_B:
        g = p * (A + B2 * tl.maximum(x2, NEG_BIG))
    else:
        g = p * A
    if HAS_C:
        g += C
    if HAS_TEACHER:
        g += distill_grad(p, x2, zt, cols, V, lse_s2, lse_t2, kl, jsd_s, wd, jsd_beta, inv_distill_temp,
                          DISTILL_KIND, OWN_TEMP, MASKED)
    if HAS_SOFTCAP:
        g = g * slope
    g = g.to(grad_row_ptr.dtype.element_ty)
    if MASKED:
        tl.store(grad_row_ptr + cols, g, mask=cols < V)
    else:
        tl.store(grad_row_ptr + cols, g)
    return sum_px


@triton.jit
def gradient_pass(
    row_ptr,  # (V,) logits row
    t_row_ptr,  # (V,) teacher row, HAS_TEACHER
    grad_row_ptr,  # (V,) gradient row, may alias row_ptr (each block is read before written)
    V,
    y,  # target column; any value outside [0, V) matches no column
    x2_y,  # transformed target logit (base 2), read before the row may be overwritten
    slope_y,  # dx/dz at the target
    lse,
    A,
    B,
    C,
    D,
    logit_scale,
    softcap,
    inv_temperature,
    lse_s2,  # student log-normaliser at the distillation temperature (base 2)
    lse_t2,  # teacher log-normaliser (base 2)
    kl,  # the row's divergence (reverse KL uses it)
    jsd_s,  # KL(p_s || M) of the mixture JSD
    wd,  # d loss / d divergence / T_d
    jsd_beta,
    inv_distill_temp,
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_C: tl.constexpr,
    NEED_SUM_PX: tl.constexpr,
    HAS_TEACHER: tl.constexpr,
    DISTILL_KIND: tl.constexpr,
    OWN_TEMP: tl.constexpr,
):
    """Phase 3: second read of the row (and the teacher's), one write of d loss / d z.

    Returns sum_i p_i * (lse2 - x2_i) (so the entropy is ln 2 * that) when NEED_SUM_PX, else 0.
    """
    lse2 = lse * LOG2E
    # per-element form in base-2 units; without softcap the constant dx/dz folds into A, B, C, wd
    A_el = A
    B2_el = B * LN2
    C_el = C
    wd_el = wd
    if not HAS_SOFTCAP:
        s = logit_scale * inv_temperature
        A_el = A * s
        B2_el = B2_el * s
        C_el = C * s
        wd_el = wd * s
    sum_px = tl.zeros([BLOCK_V], tl.float32)
    offs = tl.arange(0, BLOCK_V)
    v_full = (V // BLOCK_V) * BLOCK_V
    if v_full > 0:
        # full blocks, unmasked, each load issued one block ahead (block k is read before
        # block k is written, so an aliased gradient row is safe)
        z = tl.load(row_ptr + offs)
        zt = z
        if HAS_TEACHER:
            zt = tl.load(t_row_ptr + offs)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            z_next = tl.load(row_ptr + start + offs)
            zt_next = z_next
            if HAS_TEACHER:
                zt_next = tl.load(t_row_ptr + start + offs)
            sum_px = _grad_block(
                z, zt, grad_row_ptr, start - BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px, logit_scale, softcap,
                inv_temperature, lse_s2, lse_t2, kl, jsd_s, wd_el, jsd_beta, inv_distill_temp,
                BLOCK_V, HAS_SOFTCAP, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, DISTILL_KIND, OWN_TEMP, False,
            )
            z = z_next
            zt = zt_next
        sum_px = _grad_block(
            z, zt, grad_row_ptr, v_full - BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px, logit_scale, softcap,
            inv_temperature, lse_s2, lse_t2, kl, jsd_s, wd_el, jsd_beta, inv_distill_temp,
            BLOCK_V, HAS_SOFTCAP, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, DISTILL_KIND, OWN_TEMP, False,
        )
    if v_full < V:
        mask = v_full + offs < V
        z = tl.load(row_ptr + v_full + offs, mask=mask, other=0.0)
        zt = z
        if HAS_TEACHER:
            zt = tl.load(t_row_ptr + v_full + offs, mask=mask, other=0.0)
        sum_px = _grad_block(
            z, zt, grad_row_ptr, v_full, V, lse2, A_el, B2_el, C_el, sum_px, logit_scale, softcap,
            inv_temperature, lse_s2, lse_t2, kl, jsd_s, wd_el, jsd_beta, inv_distill_temp,
            BLOCK_V, HAS_SOFTCAP, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, DISTILL_KIND, OWN_TEMP, True,
        )
    # the target column gets its [i = y] share: rewrite it whole, after every lane has stored
    in_range = (y >= 0) & (y < V)
    if in_range:
        tl.debug_barrier()
        p_y = tl.exp2(x2_y - lse2)
        g_y = p_y * (A + B * LN2 * x2_y)
        if HAS_C:
            g_y += C
        g_y += D
        if HAS_TEACHER:
            zt_y = tl.load(t_row_ptr + y)
            g_y += distill_grad(p_y, x2_y, zt_y, y, V, lse_s2, lse_t2, kl, jsd_s, wd, jsd_beta, inv_distill_temp,
                                DISTILL_KIND, OWN_TEMP, False)
        g_y = g_y * slope_y
        tl.store(grad_row_ptr + y, g_y.to(grad_row_ptr.dtype.element_ty))
    return tl.sum(sum_px, axis=0)


@triton.jit
def target_logit(row_ptr, y, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """(x2_y, slope_y) at the target; NaN when y is outside [0, V) (never an out-of-bounds read)."""
    in_range = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=in_range, other=0.0).to(tl.float32)
    x2_y, slope_y = transform(z_y, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    return tl.where(in_range, x2_y, float("nan")), slope_y


@triton.jit
def zero_row(grad_row_ptr, V, BLOCK_V: tl.constexpr):
    """Gradient of an ignored row."""
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        tl.store(grad_row_ptr + cols, tl.zeros([BLOCK_V], grad_row_ptr.dtype.element_ty), mask=cols < V)
