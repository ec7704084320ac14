"""Constants and elementwise ``@triton.jit`` helpers shared by every kernel piece.

Base-2 units throughout: a logit x is carried as x2 = x * log2(e), so exp(x - m) is one ex2.
"""

import triton
import triton.language as tl

from .. import env

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# stands in for -inf where 0 * x must stay 0 (exp of a -inf logit is 0, its product with x is not)
NEG_BIG = tl.constexpr(-1.0e30)


# the interpreter runs no inline assembly: it takes tl.log2 (numpy's)
INTERPRETED = tl.constexpr(env.INTERPRETER)


@triton.jit
def fast_log2(x):
    """log2 of fp32 x in one MUFU op, lg2.approx.ftz.f32 (about 2^-22 relative error; 0 and subnormals
    give -inf, a negative or NaN x NaN), where tl.log2 compiles to libdevice's exact log2f, a dozen
    instructions per entry. The counterpart of tl.exp2, which is ex2.approx.ftz already. A subnormal
    probability q (below 2^-126) gets the log of a 0, clamped to NEG_BIG where a sum takes it: q * NEG_BIG
    * ln 2, under 1e-8, in place of q log q (forward KL, JSD, the teacher's entropy); a reverse KL is as
    infinite there as at a 0."""
    if INTERPRETED:
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def tanh(a):
    """tanh through exp2: stable for any |a|, and the same code under the interpreter."""
    e = tl.exp2(tl.abs(a) * (-2.0 * LOG2E))  # tensor first: Triton >= 3.7's interpreter refuses constexpr * tensor here
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.0, -t, t)


@triton.jit
def fast_log1p(x):
    """log(1 + x) for x > -1, accurate near 0 where 1 + x would drop the digits of x, in one MUFU op per entry
    (:func:`fast_log2`) where tl.log is libdevice's exact logf, a dozen and more instructions: the mixture
    JSD takes one per vocabulary entry in two passes. Below |x| = 1/16 the Taylor series to x^6 (truncation
    under 1e-8 relative); above, log2(1 + x) is at least 0.087 in size, so lg2.approx's error (about 2^-22)
    and the rounding of 1 + x stay under 5e-6 relative (tests: fast_log1p_error)."""
    series = x * (1.0 - x * (0.5 - x * (1.0 / 3.0 - x * (0.25 - x * (0.2 - x * (1.0 / 6.0))))))
    return tl.where(tl.abs(x) < 0.0625, series, fast_log2(1.0 + x) * LN2)


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


# the least reference max of :func:`scaled_update`: 2^-m stays finite (entries below it are denormal)
SCALED_MIN = tl.constexpr(-126.0)


@triton.jit
def scaled_update(m, d, q, block_max):
    """:func:`softmax_update` for entries given as q = 2^x2 (a teacher's probabilities; block_max =
    log2 of the block's largest): e = q * 2^-m_new, one exponential per block where softmax_update
    takes one per entry. The reference max is at least SCALED_MIN, so 2^-m_new is finite. A negative
    or NaN q gives e = NaN, as 2^log2(q) would."""
    m_new = tl.maximum(tl.maximum(m, block_max), SCALED_MIN)
    alpha = tl.exp2(m - m_new)
    e = tl.where(q >= 0.0, q * tl.exp2(-m_new), float("nan"))
    return m_new, d * alpha + e, e, alpha
