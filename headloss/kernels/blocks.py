"""The passes every head kernel is made of, written once.

* :func:`online_stats`   phase 1 -- one read of a row: running max, sum of exponentials, and only
                         the sums the variant needs (sum x, sum e*x, argmax, the teacher's)
* :func:`gradient_pass`  phase 3 -- second read, one write: g = (p (A + B x) + C + D [i=y]) dx/dz
                         (+ the distillation's per-element share, + the selected ids' h at their columns)
* :func:`reduce_rows`    the packed per-row buffer -> column means and the reduced loss
* :func:`row_start` / :func:`row_slot`  where a program's row lives in each tensor

Phase 2 (per-token values and gradient coefficients) is one piece per term, in ``terms.py``.

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

from ..layouts import EXTREMES_AT, SCRATCH_AT, SEQUENCE_AT
from ..registry import Scalars
from .primitives import LN2, LOG2E, NEG_BIG, softmax_update, to_x2, transform
from .sparse import selected_add, selected_first
from .terms import distill_grad, teacher_block
from .topk import bound_block, bound_finish, bound_start, topk_reread


@triton.jit
def _stats_block(z, start, V, m, d, sum_x, sum_ex, arg, S, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 NEED_SUM_X: tl.constexpr, NEED_SUM_EX: tl.constexpr, NEED_ARGMAX: tl.constexpr,
                 MASKED: tl.constexpr):
    """One loaded block z of the online softmax; d, sum_x, sum_ex are per-lane [BLOCK_V] vectors."""
    cols = start + tl.arange(0, BLOCK_V)
    x2, _ = to_x2(z, cols, V, S, HAS_SOFTCAP, MASKED)
    block_max = tl.max(x2, axis=0)
    if NEED_ARGMAX:
        # only the block holding the first max is tracked here (a scalar select, no per-element
        # work); strict '>' keeps the earliest block on ties
        arg = tl.where(block_max > m, start, arg)
    m_new, d, e, alpha = softmax_update(m, d, x2, block_max)
    if NEED_SUM_EX:
        sum_ex = sum_ex * alpha + e * tl.maximum(x2, NEG_BIG)
    if NEED_SUM_X:
        if MASKED:
            sum_x += tl.where(cols < V, x2, 0.0)
        else:
            sum_x += x2
    return m_new, d, sum_x, sum_ex, arg, x2, e, alpha


@triton.jit
def _off_max(x2, e, alpha, m, off, BLOCK_V: tl.constexpr):
    """A block's share of the top-k ``rest`` form's statistics against the running max m (before the
    block): (per-lane sum of 2^(x2 - m2) without the row's max elements, how many elements hold the
    max). A tail far below the max then keeps its digits, and the max's own term (2 to a rounding
    residual where the compiler fuses x2 - m2, not always exactly 1) never enters it."""
    d_off, count = off
    block_max = tl.max(x2, axis=0)
    at_max = x2 == block_max
    n_at = tl.sum(at_max.to(tl.float32), axis=0)
    top = block_max >= m  # the block's max is the row's so far
    # a new max makes the old max's elements ordinary: 2^(m - m_new) = alpha each (on lane 0)
    old_max = tl.where(block_max > m, count * alpha, 0.0)
    d_off = d_off * alpha + tl.where(at_max & (x2 >= m), 0.0, e) + \
        tl.where(tl.arange(0, BLOCK_V) == 0, old_max, 0.0)
    count = tl.where(block_max > m, n_at, tl.where(top, count + n_at, count))
    return d_off, count


@triton.jit
def _pair(row_ptr, t_row_ptr, at, offs, HAS_TEACHER: tl.constexpr):
    """One full block of the row and of the teacher's row (the row again without one)."""
    z = tl.load(row_ptr + at + offs)
    zt = z
    if HAS_TEACHER:
        zt = tl.load(t_row_ptr + at + offs)
    return z, zt


@triton.jit
def _full_block(z, zt, start, V, student, off, tstats, top, S, F: tl.constexpr, BLOCK_V: tl.constexpr,
                NEED_SUM_EX: tl.constexpr, HAS_TEACHER: tl.constexpr, TOPK_NB: tl.constexpr):
    """One full (unmasked) block of online_stats: the student's running statistics ``student`` = (m, d,
    sum_x, sum_ex, arg), the rest form's ``off``, the teacher's ``tstats`` (zt: its block) and the student's
    top-k bound ``top`` (kernels.topk.bound_block; TOPK_NB 0: none), updated."""
    m, d, sum_x, sum_ex, arg = student
    m_before = m
    m, d, sum_x, sum_ex, arg, x2, e, alpha = _stats_block(
        z, start, V, m, d, sum_x, sum_ex, arg, S,
        BLOCK_V, F.HAS_SOFTCAP, F.HAS_SMOOTHING, NEED_SUM_EX, F.HAS_ARGMAX, False,
    )
    if F.TOPK_FORM == 2:
        off = _off_max(x2, e, alpha, m_before, off, BLOCK_V)
    if HAS_TEACHER:
        tstats = teacher_block(zt, x2, e, alpha, start, V, tstats, S, BLOCK_V, F, False)
    if TOPK_NB > 0:
        top = bound_block(x2, start, top, BLOCK_V, TOPK_NB)
    return m, d, sum_x, sum_ex, arg, off, tstats, top


@triton.jit
def online_stats(row_ptr, t_row_ptr, V, S, F: tl.constexpr, BLOCK_V: tl.constexpr, NEED_SUM_EX: tl.constexpr,
                 TOPK_BLOCK: tl.constexpr = 0, first=0, TOPK_NB: tl.constexpr = 0, topk_buf=None):
    """Phase 1: one read of a row (and of the teacher's, when t_row_ptr is not None), in base 2.

    Student: (m2, d, sum_x2, sum_ex2, argmax) with m2 = max x2, d = sum 2^(x2 - m2),
    sum_x2 = sum x2 (with label smoothing), sum_ex2 = sum 2^(x2 - m2) * x2 (when NEED_SUM_EX),
    argmax = first index of the max. So lse = (m2 + log2 d) ln 2, mean_p(x) = ln 2 sum_ex2 / d,
    sum x = ln 2 sum_x2. tstats: the teacher's statistics (terms.teacher_block). off: for a top-k
    teacher's ``rest`` form (F.TOPK_FORM == 2) the sum of 2^(x2 - m2) without the max's elements and
    their count (:func:`_off_max`; kernels.sparse.rest_sum), else zeros. top: with TOPK_BLOCK > 0 the
    student's top-F.STUDENT_TOPK (kernels.topk: keys and threshold; the row's ids from ``first`` on; TOPK_NB:
    the blocks its bound keeps, kernels.topk.bound_blocks; ``topk_buf``: the row's buffer of
    kernels.topk.collect_words(TOPK_BLOCK, BLOCK_V, TOPK_NB) int64 words), else a placeholder.
    -inf logits (a masked vocabulary) are allowed; NaN and +inf propagate to NaN.
    """
    HAS_TEACHER: tl.constexpr = t_row_ptr is not None
    NEED_SUM_X: tl.constexpr = F.HAS_SMOOTHING
    NEED_ARGMAX: tl.constexpr = F.HAS_ARGMAX
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_V], tl.float32)
    REST: tl.constexpr = F.TOPK_FORM == 2
    off = (tl.zeros([BLOCK_V], tl.float32), tl.zeros([], tl.float32))
    sum_x = tl.zeros([BLOCK_V], tl.float32)
    sum_ex = tl.zeros([BLOCK_V], tl.float32)
    arg = tl.zeros([], tl.int32)
    neg_inf = tl.full([], float("-inf"), tl.float32)
    lanes = tl.zeros([BLOCK_V], tl.float32)
    tstats = (neg_inf, lanes, lanes, lanes, neg_inf, lanes, lanes, tl.zeros([], tl.int32))
    offs = tl.arange(0, BLOCK_V)
    top = (tl.zeros([1], tl.int64), tl.zeros([], tl.int64))
    if TOPK_BLOCK > 0:
        top = bound_start(BLOCK_V, TOPK_NB)
    v_full = (V // BLOCK_V) * BLOCK_V
    if v_full > 0:
        # full blocks, unmasked, each load issued one block ahead of its use
        z, zt = _pair(row_ptr, t_row_ptr, 0, offs, HAS_TEACHER)
        for start in range(BLOCK_V, v_full, BLOCK_V):
            z_next, zt_next = _pair(row_ptr, t_row_ptr, start, offs, HAS_TEACHER)
            m, d, sum_x, sum_ex, arg, off, tstats, top = _full_block(
                z, zt, start - BLOCK_V, V, (m, d, sum_x, sum_ex, arg), off, tstats, top, S, F, BLOCK_V,
                NEED_SUM_EX, HAS_TEACHER, TOPK_NB)
            z = z_next
            zt = zt_next
        m, d, sum_x, sum_ex, arg, off, tstats, top = _full_block(
            z, zt, v_full - BLOCK_V, V, (m, d, sum_x, sum_ex, arg), off, tstats, top, S, F, BLOCK_V,
            NEED_SUM_EX, HAS_TEACHER, TOPK_NB)
    if v_full < V:
        mask = v_full + offs < V
        z = tl.load(row_ptr + v_full + offs, mask=mask, other=0.0)
        m_before = m
        m, d, sum_x, sum_ex, arg, x2, e, alpha = _stats_block(
            z, v_full, V, m, d, sum_x, sum_ex, arg, S,
            BLOCK_V, F.HAS_SOFTCAP, NEED_SUM_X, NEED_SUM_EX, NEED_ARGMAX, True,
        )
        if REST:
            off = _off_max(x2, e, alpha, m_before, off, BLOCK_V)
        if HAS_TEACHER:
            zt = tl.load(t_row_ptr + v_full + offs, mask=mask, other=0.0)
            tstats = teacher_block(zt, x2, e, alpha, v_full, V, tstats, S, BLOCK_V, F, True)
        if TOPK_BLOCK > 0:
            top = bound_block(x2, v_full, top, BLOCK_V, TOPK_NB)
    if NEED_ARGMAX:
        # the index inside that block: one more block read per row, first index of the max
        cols = arg + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
        x2, _ = to_x2(z, cols, V, S, F.HAS_SOFTCAP, True)
        arg = arg + tl.argmax(x2, axis=0)
    mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = tstats
    if HAS_TEACHER:
        cols = t_arg + offs
        zt = tl.load(t_row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        t_arg = t_arg + tl.argmax(tl.where(cols < V, zt, float("-inf")), axis=0)
    tstats = (mt, tl.sum(dt, axis=0), tl.sum(sum_t, axis=0), tl.sum(sum_ts, axis=0), ms, tl.sum(ds, axis=0),
              tl.sum(sum_st, axis=0), t_arg)
    off = (tl.sum(off[0], axis=0), off[1])
    d = tl.sum(d, axis=0)
    if TOPK_BLOCK > 0:  # what can hold the top k read again (kernels.topk)
        top = topk_reread(row_ptr, V, S, F.HAS_SOFTCAP, BLOCK_V, first, TOPK_BLOCK, TOPK_NB,
                          bound_finish(top, d == d, F.STUDENT_TOPK, TOPK_BLOCK, BLOCK_V, TOPK_NB), topk_buf)
    return m, d, tl.sum(sum_x, axis=0), tl.sum(sum_ex, axis=0), arg, tstats, off, top


@triton.jit
def _grad_block(z, zt, grad_row_ptr, start, V, lse2, A, B2, C, sum_px, dstate, wd, S, F: tl.constexpr,
                BLOCK_V: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr, NEED_SUM_PX: tl.constexpr,
                HAS_TEACHER: tl.constexpr, MASKED: tl.constexpr, sel, walk):
    """Gradient of one loaded block z (teacher block zt), stored at grad_row_ptr[start:start + BLOCK_V];
    returns (sum_px (per-lane) + p * (lse2 - x2) when NEED_SUM_PX, ``walk``): with the selected ids' list
    ``sel``, their h added at the block's columns and ``walk`` moved past them (kernels.sparse)."""
    cols = start + tl.arange(0, BLOCK_V)
    x2, slope = to_x2(z, cols, V, S, F.HAS_SOFTCAP, MASKED)
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
        g += distill_grad(p, x2, zt, cols, V, dstate, wd, S, F, MASKED)
    if sel is not None:  # (without softcap g carries dx/dz already, a constant)
        scale = 1.0
        if not F.HAS_SOFTCAP:
            scale = S.logit_scale * S.inv_temperature
        g, walk = selected_add(g, cols, start, sel, walk, scale, BLOCK_V, not HAS_TEACHER)
    if F.HAS_SOFTCAP:
        g = g * slope
    g = g.to(grad_row_ptr.dtype.element_ty)
    if MASKED:
        tl.store(grad_row_ptr + cols, g, mask=cols < V)
    else:
        tl.store(grad_row_ptr + cols, g)
    return sum_px, walk


@triton.jit
def gradient_pass(row_ptr, t_row_ptr, grad_row_ptr, V, y, x2_y, slope_y, lse, A, B, C, D, dstate, wd, S,
                  F: tl.constexpr, BLOCK_V: tl.constexpr, NEED_SUM_PX: tl.constexpr, sel=None):
    """Phase 3: second read of the row (and the teacher's), one write of d loss / d z.

    grad_row_ptr may alias row_ptr: each block is read before it is written. ``dstate`` and
    ``wd`` (d loss / d divergence / T_d) drive the distillation's share when there is a teacher.
    ``sel``: the selected ids' list (kernels.sparse.selected_grads: (its row of the list, its entries)),
    each one's h added at its column as the pass walks the row, or None.
    Returns sum_i p_i (lse2 - x2_i) (the entropy is ln 2 times that) when NEED_SUM_PX, else 0.

    Without a teacher the row is walked last block first: the blocks phase 1 read last are the
    likeliest to be in L2 still. With a teacher (two rows per program) first block first, which
    was faster there (docs/performance.md, "Launch settings").
    """
    HAS_TEACHER: tl.constexpr = t_row_ptr is not None
    HAS_B: tl.constexpr = F.ENTROPY_GRAD
    HAS_C: tl.constexpr = F.HAS_SMOOTHING
    lse2 = lse * LOG2E
    # per-element form in base-2 units; without softcap the constant dx/dz folds into A, B, C, wd
    A_el = A
    B2_el = B * LN2
    C_el = C
    wd_el = wd
    if not F.HAS_SOFTCAP:
        s = S.logit_scale * S.inv_temperature
        A_el = A * s
        B2_el = B2_el * s
        C_el = C * s
        wd_el = wd * s
    sum_px = tl.zeros([BLOCK_V], tl.float32)
    offs = tl.arange(0, BLOCK_V)
    v_full = (V // BLOCK_V) * BLOCK_V
    walk = 0
    if sel is not None:
        walk = selected_first(sel, not HAS_TEACHER)
    if not HAS_TEACHER:  # last block first
        if v_full < V:
            mask = v_full + offs < V
            z = tl.load(row_ptr + v_full + offs, mask=mask, other=0.0)
            sum_px, walk = _grad_block(z, z, grad_row_ptr, v_full, V, lse2, A_el, B2_el, C_el, sum_px, dstate, wd_el, S,
                                       F, BLOCK_V, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, True, sel, walk)
        if v_full > 0:
            z = tl.load(row_ptr + v_full - BLOCK_V + offs)
            for back in range(2 * BLOCK_V, v_full + BLOCK_V, BLOCK_V):
                start = v_full - back  # the block after this one is in z
                z_next = tl.load(row_ptr + start + offs)
                sum_px, walk = _grad_block(z, z, grad_row_ptr, start + BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px,
                                           dstate, wd_el, S, F, BLOCK_V, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, False,
                                           sel, walk)
                z = z_next
            sum_px, walk = _grad_block(z, z, grad_row_ptr, 0, V, lse2, A_el, B2_el, C_el, sum_px, dstate, wd_el, S, F,
                                       BLOCK_V, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, False, sel, walk)
    else:
        if v_full > 0:
            z, zt = _pair(row_ptr, t_row_ptr, 0, offs, HAS_TEACHER)
            for start in range(BLOCK_V, v_full, BLOCK_V):
                z_next, zt_next = _pair(row_ptr, t_row_ptr, start, offs, HAS_TEACHER)
                sum_px, walk = _grad_block(z, zt, grad_row_ptr, start - BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px,
                                           dstate, wd_el, S, F, BLOCK_V, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, False,
                                           sel, walk)
                z = z_next
                zt = zt_next
            sum_px, walk = _grad_block(z, zt, grad_row_ptr, v_full - BLOCK_V, V, lse2, A_el, B2_el, C_el, sum_px,
                                       dstate, wd_el, S, F, BLOCK_V, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, False, sel,
                                       walk)
        if v_full < V:
            mask = v_full + offs < V
            z = tl.load(row_ptr + v_full + offs, mask=mask, other=0.0)
            zt = z
            if HAS_TEACHER:
                zt = tl.load(t_row_ptr + v_full + offs, mask=mask, other=0.0)
            sum_px, walk = _grad_block(z, zt, grad_row_ptr, v_full, V, lse2, A_el, B2_el, C_el, sum_px, dstate, wd_el,
                                       S, F, BLOCK_V, HAS_B, HAS_C, NEED_SUM_PX, HAS_TEACHER, True, sel, walk)
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
            g_y += distill_grad(p_y, x2_y, zt_y, y, V, dstate, wd, S, F, False)
        g_y = g_y * slope_y
        tl.store(grad_row_ptr + y, g_y.to(grad_row_ptr.dtype.element_ty))
    return tl.sum(sum_px, axis=0)


@triton.jit
def target_logit(row_ptr, y, V, S, HAS_SOFTCAP: tl.constexpr):
    """(x2_y, slope_y) at the target; NaN when y is outside [0, V) (never an out-of-bounds read)."""
    in_range = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=in_range, other=0.0).to(tl.float32)
    x2_y, slope_y = transform(z_y, S, HAS_SOFTCAP)
    return tl.where(in_range, x2_y, float("nan")), slope_y


@triton.jit
def zero_row(grad_row_ptr, V, BLOCK_V: tl.constexpr):
    """Gradient of a row that is not scored."""
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        tl.store(grad_row_ptr + cols, tl.zeros([BLOCK_V], grad_row_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def row_start(base, row, T, stride_b, stride_t):
    """Where logits row ``row`` (= b * T + t) starts in ``base``, a [B, T, V] tensor of strides
    (stride_b, stride_t); None for None (an absent teacher or gradient buffer)."""
    start = base
    if base is not None:
        start = base + (row // T) * stride_b + (row % T) * stride_t
    return start


@triton.jit
def row_slot(targets, row, geo):
    """Where logits row ``row`` lands: (slot, has_slot, y, counted).

    Rows are (b, t) with t < T; slots (per-token outputs, per-token inputs, targets) are b * K + t
    for t < K. The target of row (b, t) is targets[b * K + t + shift]: shift = 1 scores HF labels
    (row t predicts token t + 1), shift = 0 everything else. A row counts when it has a target
    inside its sequence that is not ignore_index (every slot counts without targets).
    """
    b = row // geo.T
    t = row % geo.T
    slot = b * geo.K + t
    has_slot = t < geo.K
    if targets is None:
        y = tl.full([], -1, tl.int64)
        counted = has_slot
    else:
        scored = t + geo.shift < geo.K
        y = tl.load(targets + slot + geo.shift, mask=scored, other=geo.ignore_index).to(tl.int64)
        counted = scored & (y != geo.ignore_index)
    return slot, has_slot, y, counted


INV_TEMPERATURE_AT = tl.constexpr(Scalars._fields.index("inv_temperature"))


@triton.jit
def row_temperature(S, temperature, slot, has_slot):
    """The scalars of one row: with a per-row temperature (spec.LogitTransform.per_row_temperature; fp32
    [n_out] by slot, or None) its inverse replaces ``S.inv_temperature``, so every use of the transform
    in the row (stats, gradient, target, sparse teacher) takes it."""
    if temperature is not None:
        t = tl.load(temperature + slot, mask=has_slot, other=1.0)
        S = Scalars(*(S[:INV_TEMPERATURE_AT] + (1.0 / t,) + S[INV_TEMPERATURE_AT + 1:]))
    return S


@triton.jit
def token_scale(scratch, num_items, geo, F: tl.constexpr):
    """d loss / d token_loss of a mean (1 / num_items_in_batch, 1 / the counted rows' summed token weights
    (F.WEIGHT_NORM; 1 where they sum to 0), or 1 / counted rows) or a sum (1)."""
    if F.REDUCTION == 0:
        if num_items is not None:
            denom = tl.load(num_items).to(tl.float32)
        elif geo.norm > 0:
            denom = tl.full([], 1.0, tl.float32) * geo.norm
        elif F.WEIGHT_NORM:
            denom = tl.load(scratch + SCRATCH_AT.weight_sum).to(tl.int32).to(tl.float32, bitcast=True)
            denom = tl.where(denom > 0.0, denom, 1.0)
        else:
            denom = tl.maximum(tl.load(scratch + SCRATCH_AT.counted), 1).to(tl.float32)
        return 1.0 / denom
    return tl.full([], 1.0, tl.float32)


@triton.jit
def reduce_rows(rows, loss, means, scratch, num_items, policy, geo, F: tl.constexpr, C: tl.constexpr,
                R: tl.constexpr):
    """Column sums of the packed row buffer in a fixed order (deterministic), then
    means[c] = sum / max(counted rows, 1) for c < C.N (the metrics) and
    means[C.N] = sum(token_loss) * token_scale + sum(policy_loss) (the policy term is already
    weighted): the loss, also stored in ``loss`` for a mean or sum reduction. With a token-level
    policy term, means[C.N + 1 ...] hold its metrics that are not token means (policy_metrics).
    Reads with .cg: the rows were written by other programs (L1 is not coherent). The selected ids'
    log-probs and the student's top-k (the columns from C.N_REDUCED on) are outputs, not metrics: not read,
    their means not written."""
    COLS_P2: tl.constexpr = R.COLS_P2
    BLOCK_R: tl.constexpr = R.BLOCK_R
    REDUCED: tl.constexpr = C.N_REDUCED
    cols = tl.arange(0, COLS_P2)[None, :]
    acc = tl.zeros([BLOCK_R, COLS_P2], tl.float32)
    for start in range(0, geo.n_out, BLOCK_R):
        r = (start + tl.arange(0, BLOCK_R))[:, None].to(tl.int64)
        acc += tl.load(rows + r * C.N + cols, mask=(r < geo.n_out) & (cols < REDUCED), other=0.0,
                       cache_modifier=".cg")
    sums = tl.sum(acc, axis=0)
    counted = tl.load(scratch + SCRATCH_AT.counted, cache_modifier=".cg")
    count = tl.maximum(counted, 1).to(tl.float32)
    col = tl.arange(0, COLS_P2)
    tl.store(means + col, sums / count, mask=col < REDUCED)
    total = tl.sum(tl.where(col == C.token_loss, sums, 0.0), axis=0) * token_scale(scratch, num_items, geo, F)
    if C.policy_loss >= 0:
        total += tl.sum(tl.where(col == C.policy_loss, sums, 0.0), axis=0)
        policy_metrics(rows, means, sums, scratch, counted, count, policy, geo, C, R)
    tl.store(means + C.N, total)
    if F.REDUCTION != 2:
        tl.store(loss, total)


@triton.jit
def policy_metrics(rows, means, sums, scratch, counted, count, policy, geo, C: tl.constexpr, R: tl.constexpr):
    """TRL's policy metrics that are not token means, into means[C.N + 1 ...]: the smallest and the
    largest of each sequence's clipped fraction (low / high), the ratio's min and max over counted
    tokens, the clipped region, and the ratio's mean (1, not 0, when nothing counts). Sequences are
    the rows of [B, K] (policy.seq_len = K), whose counters the row programs summed in ``scratch``
    (head.SEQ_SCRATCH); with sequence_ids (seq_len 0) the first four are left to torch."""
    COLS_P2: tl.constexpr = R.COLS_P2
    SEQ_BLOCK: tl.constexpr = R.SEQ_BLOCK
    col = tl.arange(0, COLS_P2)
    low_mean = tl.sum(tl.where(col == C.clip_low, sums, 0.0), axis=0) / count
    high_mean = tl.sum(tl.where(col == C.clip_high, sums, 0.0), axis=0) / count
    ratio_mean = tl.sum(tl.where(col == C.ratio, sums, 0.0), axis=0) / count
    low_min = tl.full([], float("inf"), tl.float32)
    high_max = tl.full([], float("-inf"), tl.float32)
    ratio_min = tl.full([], float("inf"), tl.float32)
    ratio_max = tl.full([], float("-inf"), tl.float32)
    seq_len = policy.seq_len
    if seq_len > 0:
        n_seq = geo.n_out // seq_len
        for b0 in range(0, n_seq, SEQ_BLOCK):
            b = b0 + tl.arange(0, SEQ_BLOCK)
            inside = b < n_seq
            at = scratch + SCRATCH_AT.sequences + b.to(tl.int64) * SEQUENCE_AT.N
            tokens = tl.load(at + SEQUENCE_AT.tokens, mask=inside, other=0, cache_modifier=".cg").to(tl.float32)
            low = tl.load(at + SEQUENCE_AT.low, mask=inside, other=0, cache_modifier=".cg").to(tl.float32)
            high = tl.load(at + SEQUENCE_AT.high, mask=inside, other=0, cache_modifier=".cg").to(tl.float32)
            has = tokens > 0
            per = tl.maximum(tokens, 1.0)
            low_min = tl.minimum(low_min, tl.min(tl.where(has, low / per, float("inf")), axis=0))
            high_max = tl.maximum(high_max, tl.max(tl.where(has, high / per, float("-inf")), axis=0))
        lo_bits = tl.load(scratch + SCRATCH_AT.ratio_min, cache_modifier=".cg")
        hi_bits = tl.load(scratch + SCRATCH_AT.ratio_max, cache_modifier=".cg")
        lo = lo_bits.to(tl.int32).to(tl.float32, bitcast=True)
        hi = hi_bits.to(tl.int32).to(tl.float32, bitcast=True)
        ratio_min = tl.where(lo_bits == 0x7FFFFFFF, float("inf"), lo)
        ratio_max = tl.where(hi_bits < 0, float("-inf"), hi)
    some = counted > 0
    extremes = means + C.N + 1  # after the loss
    tl.store(extremes + EXTREMES_AT.low_min, tl.where(some, low_min, 0.0))
    tl.store(extremes + EXTREMES_AT.high_max, tl.where(some, high_max, 0.0))
    tl.store(extremes + EXTREMES_AT.ratio_min, tl.where(some, ratio_min, 1.0))
    tl.store(extremes + EXTREMES_AT.ratio_max, tl.where(some, ratio_max, 1.0))
    tl.store(extremes + EXTREMES_AT.region_mean, low_mean + high_mean)
    tl.store(extremes + EXTREMES_AT.ratio_mean, tl.where(some, ratio_mean, 1.0))
