"""Constants and elementwise ``@triton.jit`` helpers shared by every kernel piece.

Base-2 units throughout: a logit x is carried as x2 = x * log2(e), so exp(x - m) is one ex2.
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
    e = tl.exp2(tl.abs(a) * (-2.0 * LOG2E))  # tensor first: Triton >= 3.7's interpreter refuses constexpr * tensor here
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.0, -t, t)


@triton.jit
def log1p(x):
    """log(1 + x), accurate near 0 where 1 + x would drop the digits of x."""
    series = x * (1.0 - x * (0.5 - x * (1.0 / 3.0)))
    return tl.where(tl.abs(x) < 1e-3, series, tl.log(1.0 + x))


@triton.jit
def transform(z, S, HAS_SOFTCAP: tl.constexpr):
    """x2 = log2(e) * softcap(logit_scale * z) * inv_temperature (fp32), and dx/dz (natural x)."""
    if HAS_SOFTCAP:
        t = tanh(z * (S.logit_scale / S.softcap))
        x2 = t * (S.softcap * S.inv_temperature * LOG2E)
        slope = (S.logit_scale * S.inv_temperature) * (1.0 - t * t)
    else:
        x2 = z * (S.logit_scale * S.inv_temperature * LOG2E)
        slope = S.logit_scale * S.inv_temperature
    return x2, slope


@triton.jit
def to_x2(z, cols, V, S, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """Raw logits block -> (x2, slope); masked-off columns of the tail block become -inf."""
    x2, slope = transform(z.to(tl.float32), S, HAS_SOFTCAP)
    if MASKED:
        x2 = tl.where(cols < V, x2, float("-inf"))
    return x2, slope


@triton.jit
def softmax_update(m, d, x2, block_max):
    """One block of the online softmax in base 2, written once for the student, the teacher and the
    student at the distillation temperature: the running max m and per-lane sum d take the block
    x2 (whose max is block_max). Returns (m_new, d_new, e = 2^(x2 - m_new), alpha = 2^(m - m_new)),
    alpha rescaling every other per-lane sum kept against the same max. A row that is all -inf so
    far keeps d = 0 instead of exp(-inf - -inf) = NaN."""
    m_new = tl.maximum(m, block_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    e = tl.exp2(x2 - m_ref)
    return m_new, d * alpha + e, e, alpha
