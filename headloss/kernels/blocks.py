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
    return m_new, d, sum_x, sum_ex, arg


@triton.jit
def online_stats(
    row_ptr,  # (V,) one row of logits, any float dtype
    V,
    logit_scale,
    softcap,
    inv_temperature,
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEED_SUM_X: tl.constexpr,
    NEED_SUM_EX: tl.constexpr,
    NEED_ARGMAX: tl.constexpr,
):
    """Phase 1: one read of a row, online softmax, in base-2 units.

    Returns (m2, d, sum_x2, sum_ex2, argmax): m2 = max x2, d = sum 2^(x2 - m2),
    sum_x2 = sum x2, sum_ex2 = sum 2^(x2 - m2) * x2, argmax = first index of the max.
    So lse = (m2 + log2 d) * ln 2, mean_p(x) = ln 2 * sum_ex2 / d, sum x = ln 2 * sum_x2.
    -inf logits (a masked vocabulary) are allowed; NaN and +inf propagate to NaN.
    """
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_V], tl.float32)
    sum_x = tl.zeros([BLOCK_V], tl.float32)
    sum_ex = tl.zeros([BLOCK_V], tl.float32)
    arg = tl.zeros([], tl.int32)
    offs = tl.arange(0, BLOCK_V)
    v_full = (V // BLOCK_V) * BLOCK_V
    if v_full > 0:
        # full blocks, unmasked, each load issued one block ahead of its use
        z = tl.load(row_ptr + offs)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            z_next = tl.load(row_ptr + start + offs)
            m, d, sum_x, sum_ex, arg = _stats_block(
                z, start - BLOCK_V, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
                BLOCK_V, HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, False,
            )
            z = z_next
        m, d, sum_x, sum_ex, arg = _stats_block(
            z, v_full - BLOCK_V, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
            BLOCK_V, HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, False,
        )
    if v_full < V:
        z = tl.load(row_ptr + v_full + offs, mask=v_full + offs < V, other=0.0)
        m, d, sum_x, sum_ex, arg = _stats_block(
            z, v_full, V, m, d, sum_x, sum_ex, arg, logit_scale, softcap, inv_temperature,
            BLOCK_V, HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, True,
        )
    if NEED_ARGMAX:
        # the index inside that block: one more block read per row, first index of the max
        cols = arg + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
        x2, _ = _to_x2(z, cols, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, True)
        arg = arg + tl.argmax(x2, axis=0)
    return m, tl.sum(d, axis=0), tl.sum(sum_x, axis=0), tl.sum(sum_ex, axis=0), arg


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
def _grad_block(
    z, grad_row_ptr, start, V, lse2, A, B2, C, sum_px, logit_scale, softcap, inv_temperature,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr,
    NEED_SUM_PX: tl.constexpr, MASKED: tl.constexpr,
):
    """Gradient of one loaded block z, stored at grad_row_ptr[start:start + BLOCK_V];
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
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_C: tl.constexpr,
    NEED_SUM_PX: tl.constexpr,
):
    """Phase 3: second read of the row, one write of d loss / d z in the gradient's dtype.

    Returns sum_i p_i * (lse2 - x2_i) (so the entropy is ln 2 * that) when NEED_SUM_PX, else 0.
    """
    lse2 = lse * LOG2E
    # per-element form in base-2 units; without softcap the constant dx/dz folds into A, B, C
    A_el = A
    B2_el = B * LN2
    C_el = C
    if not HAS_SOFTCAP:
        s = logit_scale * inv_temperature
        A_el = A * s
        B2_el = B2_el * s
        C_el = C * s
    sum_px = tl.zeros([BLOCK_V], tl.float32)
    offs = tl.arange(0, BLOCK_V)
    v_full = (V // BLOCK_V) * BLOCK_V
    if v_full > 0:
        # full blocks, unmasked, each load issued one block ahead (block k is read before
        # block k is written, so an aliased gradient row is safe)
        z = tl.load(row_ptr + offs)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            z_next = tl.load(row_ptr + start + offs)
            sum_px = _grad_block(z, grad_row_ptr, start - BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px, logit_scale,
                                 softcap, inv_temperature, BLOCK_V, HAS_SOFTCAP, HAS_B, HAS_C, NEED_SUM_PX, False)
            z = z_next
        sum_px = _grad_block(z, grad_row_ptr, v_full - BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px, logit_scale,
                             softcap, inv_temperature, BLOCK_V, HAS_SOFTCAP, HAS_B, HAS_C, NEED_SUM_PX, False)
    if v_full < V:
        z = tl.load(row_ptr + v_full + offs, mask=v_full + offs < V, other=0.0)
        sum_px = _grad_block(z, grad_row_ptr, v_full, V, lse2, A_el, B2_el, C_el, sum_px, logit_scale,
                             softcap, inv_temperature, BLOCK_V, HAS_SOFTCAP, HAS_B, HAS_C, NEED_SUM_PX, True)
    # the target column gets its [i = y] share: rewrite it whole, after every lane has stored
    in_range = (y >= 0) & (y < V)
    if in_range:
        tl.debug_barrier()
        p_y = tl.exp2(x2_y - lse2)
        g_y = p_y * (A + B * LN2 * x2_y)
        if HAS_C:
            g_y += C
        g_y = (g_y + D) * slope_y
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
