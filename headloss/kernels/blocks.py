"""Shared ``@triton.jit`` building blocks of the head kernels.

Every kernel in this package is these pieces glued together:

* :func:`transform`        x = softcap(logit_scale * z) * inv_temperature, and dx/dz
* :func:`online_stats`     phase 1 -- one read of a row: running max m, d = sum exp(x - m), and
                           only the sums the variant needs (sum x, sum e*x, argmax)
* :func:`row_coefficients` phase 2 -- per-row coefficients of the combined gradient
* :func:`gradient_pass`    phase 3 -- second read, one write: g = (p * (A + B*x) + C + D*[i=y]) * dx/dz

The online-softmax update is written once, here. A new loss term adds its statistic to
:func:`online_stats`, its value to the kernel epilogue and its share of A, B, C, D to
:func:`row_coefficients`.
"""

import triton
import triton.language as tl


@triton.jit
def tanh(a):
    """tanh through exp: stable for any |a|, and the same code under the interpreter."""
    e = tl.exp(-2.0 * tl.abs(a))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.0, -t, t)


@triton.jit
def transform(z, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """x = softcap(logit_scale * z) * inv_temperature (fp32) and the chain factor dx/dz."""
    u = z * logit_scale
    if HAS_SOFTCAP:
        t = tanh(u / softcap)
        x = softcap * inv_temperature * t
        slope = logit_scale * inv_temperature * (1.0 - t * t)
    else:
        x = u * inv_temperature
        slope = logit_scale * inv_temperature
    return x, slope


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
    """Phase 1: one read of a row, online softmax.

    Returns (m, d, sum_x, sum_ex, argmax) with m = max x, d = sum exp(x - m),
    sum_x = sum x, sum_ex = sum exp(x - m) * x, argmax = first index of m.
    -inf logits (masked vocabulary) are allowed; NaN and +inf propagate to NaN.
    """
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.zeros([], tl.float32)
    sum_x = tl.zeros([], tl.float32)
    sum_ex = tl.zeros([], tl.float32)
    arg = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x, _ = transform(z, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        x = tl.where(mask, x, float("-inf"))
        block_max = tl.max(x, axis=0)
        if NEED_ARGMAX:
            # strict '>' keeps the earliest block on ties; tl.argmax keeps the earliest index
            arg = tl.where(block_max > m, start + tl.argmax(x, axis=0), arg)
        m_new = tl.maximum(m, block_max)
        # a row that is all -inf so far keeps d = 0 instead of exp(-inf - -inf) = NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        e = tl.exp(x - m_ref)
        d = d * alpha + tl.sum(e, axis=0)
        if NEED_SUM_EX:
            sum_ex = sum_ex * alpha + tl.sum(tl.where(e > 0.0, e * x, 0.0), axis=0)
        if NEED_SUM_X:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    return m, d, sum_x, sum_ex, arg


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
    """Phase 2: the row's gradient as g_i = p_i * (A + B * x_i) + C + D * [i = y].

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
def gradient_pass(
    row_ptr,  # (V,) logits row
    grad_row_ptr,  # (V,) gradient row, may alias row_ptr (each block is read before written)
    V,
    y,  # target column; any value outside [0, V) matches no column
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
):
    """Phase 3: second read of the row, one write of d loss / d z in the gradient's dtype."""
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x, slope = transform(z, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        p = tl.exp(x - lse)
        if HAS_B:
            # p = 0 at -inf logits, where B * x would make 0 * inf
            g = tl.where(p > 0.0, p * (A + B * x), 0.0)
        else:
            g = p * A
        if HAS_C:
            g += C
        g = tl.where(cols == y, g + D, g)
        g = g * slope
        tl.store(grad_row_ptr + cols, g.to(grad_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def zero_row(grad_row_ptr, V, BLOCK_V: tl.constexpr):
    """Gradient of an ignored row."""
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        tl.store(grad_row_ptr + cols, tl.zeros([BLOCK_V], grad_row_ptr.dtype.element_ty), mask=cols < V)
